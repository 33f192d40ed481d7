"""Credit assignment: per-turn advantages from scored trajectories (docs/algorithms.md §3–7).

Framework-independent: estimators read the rollout's trajectories (:mod:`turnstile.rollout.trajectory`; a
turn-record file, :mod:`turnstile.learner.credit.records`, is read into the same type), look each
other up by name (:mod:`turnstile.learner.credit.registry`) and share one normalisation
(:mod:`turnstile.learner.credit.normalize`). Run one on a file with::

    turnstile credit --estimator igpo --in scored.jsonl --out credited.jsonl norm=joint
"""

from turnstile.learner.credit import estimators as _estimators  # noqa: F401  (registers grpo, abc_grpo, gspo_round)
from turnstile.learner.credit import igpo as _igpo  # noqa: F401  (registers igpo)
from turnstile.learner.credit.estimators import AbcGrpoOptions, GrpoOptions, GspoRoundOptions, abc_sft_weight
from turnstile.learner.credit.igpo import IgpoOptions, IgType, assign_information_gain
from turnstile.learner.credit.normalize import EPS, Norm, discount_over_boundaries, group_normalize, ig_scale
from turnstile.learner.credit.records import (
    CreditInputError,
    Group,
    GroupCredit,
    Record,
    TrajectoryCredit,
    TurnCredit,
    credited_records,
    group_by_uid,
    read_trajectories,
    trajectory_from_object,
    write_records,
)
from turnstile.learner.credit.registry import (
    ESTIMATORS,
    CreditResult,
    Estimator,
    build_estimator,
    estimator_class,
    estimator_from_options,
    option_names,
    register,
)

__all__ = [
    "EPS",
    "ESTIMATORS",
    "AbcGrpoOptions",
    "CreditInputError",
    "CreditResult",
    "Estimator",
    "Group",
    "GroupCredit",
    "GrpoOptions",
    "GspoRoundOptions",
    "IgType",
    "IgpoOptions",
    "Norm",
    "Record",
    "TrajectoryCredit",
    "TurnCredit",
    "abc_sft_weight",
    "assign_information_gain",
    "build_estimator",
    "credited_records",
    "discount_over_boundaries",
    "estimator_class",
    "estimator_from_options",
    "group_by_uid",
    "group_normalize",
    "ig_scale",
    "option_names",
    "read_trajectories",
    "register",
    "trajectory_from_object",
    "write_records",
]

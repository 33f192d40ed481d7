"""Outcome and step-score estimators: ``grpo``, ``abc_grpo`` and ``gspo_round`` (docs/algorithms.md §6–7).

The information-gain estimator ``igpo`` has its own module (:mod:`turnstile.learner.credit.igpo`); what these
three share is that every turn is credited from one kind of reward normalised within its group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from turnstile.envs.protocol import StopReason
from turnstile.learner.credit.normalize import (
    Norm,
    discount_over_boundaries,
    group_normalize,
    join_separate,
    member,
    normalize_pooled,
    normalize_separately,
)
from turnstile.learner.credit.records import CreditInputError, Group, GroupCredit, TurnCredit, origin, turn_numbers
from turnstile.learner.credit.registry import CreditResult, Estimator, register
from turnstile.rollout.trajectory import Trajectory


def abc_sft_weight(score: float) -> float:
    """ABC-SFT token weight ``w(r) = 2·σ(2(r − 1))`` of a turn with step score ``r`` (§6).

    ``w(1) = 1``: a turn that neither helped nor hurt keeps plain cross-entropy; the weight rises
    towards 2 for turns that established clues and falls towards 0 for turns that lost them.
    """
    return 2.0 / (1.0 + math.exp(-2.0 * (score - 1.0)))


def check_format_penalty(value: float) -> None:
    """Options validation shared by the estimators that apply the §3 outcome rule."""
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"format_penalty={value}: must be a finite number >= 0 (0 turns the penalty off)")


def check_gamma(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"gamma={value}: the discount must be in [0, 1]")


def outcome_reward(trajectory: Trajectory, format_penalty: float, penalise_unanswered: bool = True) -> float:
    """The outcome as trained on (docs/algorithms.md §3).

    An unanswered trajectory, or one whose answer turn failed the format check, gets
    ``−format_penalty`` whatever its recorded outcome; ``format_penalty = 0`` turns the penalty off
    and keeps the recorded outcome. With ``penalise_unanswered`` off only a malformed answer attempt
    (``stop_reason: malformed_answer``) pays it; an episode a limit ended before it answered scores
    0, as a wrong answer does.
    """
    outcome = trajectory.outcome
    if outcome is None:
        raise CreditInputError(f"{origin(trajectory)} has no outcome yet: run an outcome reward plugin "
                               "before credit assignment")
    if format_penalty <= 0 or (trajectory.answered and trajectory.turns[-1].format_ok):
        return outcome
    if penalise_unanswered or trajectory.stop_reason is StopReason.MALFORMED_ANSWER:
        return -format_penalty
    return 0.0


@dataclass
class GrpoOptions:
    format_penalty: float = 1.0  # λ_fmt: outcome of an unanswered or badly formatted answer (§3)
    penalise_unanswered: bool = True  # false: only a malformed answer pays λ_fmt; a cut episode scores 0

    def __post_init__(self) -> None:
        check_format_penalty(self.format_penalty)


@register
class Grpo(Estimator):
    """Trajectory-level GRPO: the outcome normalised within the group; every turn gets it.

    The outcome is the reward of the last turn (the trajectory's only boundary).
    """

    name = "grpo"
    Options = GrpoOptions

    def __init__(self, options: GrpoOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        credit: list[GroupCredit] = []
        for group in batch:
            outcomes = [outcome_reward(t, self.options.format_penalty, self.options.penalise_unanswered)
                        for t in group.trajectories]
            normalized = group_normalize(outcomes)
            group_credit: GroupCredit = []
            for trajectory, outcome, advantage in zip(group.trajectories, outcomes, normalized, strict=True):
                last = len(trajectory.turns) - 1
                group_credit.append([
                    TurnCredit(advantage=advantage, reward=outcome if turn.index == last else None)
                    for turn in trajectory.turns
                ])
            credit.append(group_credit)
        return CreditResult(groups=credit)


@dataclass
class AbcGrpoOptions:
    gamma: float = 0.25  # discount of later step scores
    # separate: answer turns' scores among answer turns, the other turns' among the other turns;
    # joint: every score of the group in one pool, as ABSeeker writes it (a length bias: §6)
    norm: Norm = Norm.separate

    def __post_init__(self) -> None:
        check_gamma(self.gamma)
        self.norm = member(Norm, self.norm, "norm")
        if self.norm is Norm.scaled_separate:
            raise ValueError("norm=scaled_separate: IG-Scale is igpo's; abc_grpo takes joint or separate")


@register
class AbcGrpo(Estimator):
    """ABC-GRPO (§6): step scores normalised within the group, then discounted
    ``A_t = Σ_{k≥t} γ^{k−t} R̂_k``. No separate outcome term: the answer turn's score holds it.

    ``norm=separate`` (default) normalises the last turns' scores (the answer events) among the
    group's last turns and the other turns' among the other turns, so that a turn that established
    nothing (score 1) is worth nothing whatever the answers were. ``norm=joint`` pools them all, as
    ABSeeker writes it: in a group whose answers were wrong, the pool's mean sinks below 1, every
    empty turn is credited above it, and a longer trajectory earns more (docs/algorithms.md §6).

    Each turn also gets ``sft_weight`` = :func:`abc_sft_weight` of its score, so that one scored
    file serves both stages of ABC (SFT, then GRPO).
    """

    name = "abc_grpo"
    Options = AbcGrpoOptions

    def __init__(self, options: AbcGrpoOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        credit: list[GroupCredit] = []
        for group in batch:
            scores = [_step_scores(t) for t in group.trajectories]
            rows: list[list[float | None]] = [list(row) for row in scores]
            normalized = normalize_pooled(rows) if self.options.norm is Norm.joint \
                else join_separate(*normalize_separately(rows))
            group_credit: GroupCredit = []
            for trajectory_scores, normalized_turns in zip(scores, normalized, strict=True):
                advantages = discount_over_boundaries(normalized_turns, self.options.gamma)
                group_credit.append([
                    TurnCredit(advantage=a, reward=score, extras={"sft_weight": abc_sft_weight(score)})
                    for score, a in zip(trajectory_scores, advantages, strict=True)
                ])
            credit.append(group_credit)
        return CreditResult(groups=credit)


def _step_scores(trajectory: Trajectory) -> list[float]:
    values = turn_numbers(trajectory, "step_score", why="abc_grpo needs the clue step score of every turn; run "
                          "the step-score reward first")
    scores = [value for value in values if value is not None]
    if len(scores) != len(values):
        raise CreditInputError(f"{origin(trajectory)}: 'score' is null; abc_grpo has no reward without "
                               f"step scores (score every turn, or use grpo)")
    return scores


@dataclass
class GspoRoundOptions:
    format_penalty: float = 1.0  # λ_fmt: outcome of an unanswered or badly formatted answer (§3)
    penalise_unanswered: bool = True  # false: only a malformed answer pays λ_fmt; a cut episode scores 0

    def __post_init__(self) -> None:
        check_format_penalty(self.format_penalty)


@register
class GspoRound(Estimator):
    """Round-level GSPO (§7): every round (here: turn) inherits its trajectory's outcome and is one
    sample; the group is all rounds of the group's trajectories, normalised over rounds, so a longer
    trajectory weighs more in the group's mean.
    """

    name = "gspo_round"
    Options = GspoRoundOptions

    def __init__(self, options: GspoRoundOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        credit: list[GroupCredit] = []
        for group in batch:
            outcomes = [outcome_reward(t, self.options.format_penalty, self.options.penalise_unanswered)
                        for t in group.trajectories]
            rounds = [outcome for t, outcome in zip(group.trajectories, outcomes, strict=True)
                      for _ in t.turns]
            normalized = iter(group_normalize(rounds))
            credit.append([
                [TurnCredit(advantage=next(normalized), reward=outcome) for _ in t.turns]
                for t, outcome in zip(group.trajectories, outcomes, strict=True)
            ])
        return CreditResult(groups=credit)

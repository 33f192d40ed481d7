"""Credit assignment on the rollout's own trajectories, and the broadcast to tokens.

The estimators read :class:`turnstile.rollout.trajectory.Trajectory` objects, the rollout's own (a turn-record
file is read into the same type: ``records.py``). This module writes the estimator's per-turn credit
onto the trajectories' turns, and turns a segment's turn advantages
into per-token advantages: every response token carries its turn's advantage, prompt and observation
tokens carry 0 (and are masked out of the loss).
"""

from __future__ import annotations

from collections.abc import Sequence

from turnstile.learner.credit.records import group_by_uid
from turnstile.learner.credit.registry import CreditResult, Estimator
from turnstile.rollout.trajectory import Segment, Trajectory


def assign_credit(trajectories: Sequence[Trajectory], estimator: Estimator) -> CreditResult:
    """Run ``estimator`` over the batch and write ``advantage``, ``reward`` and ``ig`` onto the turns."""
    for trajectory in trajectories:
        if trajectory.outcome is None:
            raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample} has no outcome yet: run "
                             "an outcome reward plugin before credit assignment")
    groups = group_by_uid(trajectories)
    result = estimator.assign(groups)
    for group, group_credit in zip(groups, result.groups, strict=True):
        for trajectory, turn_credits in zip(group.trajectories, group_credit, strict=True):
            for turn, credit in zip(trajectory.turns, turn_credits, strict=True):
                turn.advantage = credit.advantage
                turn.reward = credit.reward
                if "ig" in credit.extras:
                    turn.ig = credit.extras["ig"]
    return result


def token_advantages(segment: Segment) -> list[float]:
    """One advantage per token of ``segment.flat_ids()``: the turn's on its response tokens, 0 on
    the prompt and on observations. A turn without an advantage is an error (credit not assigned)."""
    values = [0.0] * len(segment.prompt_ids)
    for turn in segment.turns:
        if turn.advantage is None:
            raise ValueError(f"turn {turn.index} has no advantage: assign credit before building samples")
        values.extend([turn.advantage] * len(turn.response_ids))
        values.extend([0.0] * len(turn.observation_ids))
    return values


def response_mask(segment: Segment) -> list[int]:
    """1 on the tokens the policy generated (trained on), 0 on prompt and observation tokens."""
    mask = [0] * len(segment.prompt_ids)
    for turn in segment.turns:
        mask.extend([1] * len(turn.response_ids))
        mask.extend([0] * len(turn.observation_ids))
    return mask

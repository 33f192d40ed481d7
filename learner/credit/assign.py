"""Credit assignment on the rollout's own trajectories, and the broadcast to tokens.

The estimators read framework-independent turn records (``records.py``). This module makes those
records from :class:`rollout.trajectory.Trajectory` objects (the same field names), writes the
estimator's per-turn credit back onto the trajectories' turns, and turns a segment's turn advantages
into per-token advantages: every response token carries its turn's advantage, prompt and observation
tokens carry 0 (and are masked out of the loss).
"""

from __future__ import annotations

from collections.abc import Sequence

from learner.credit.records import Group, group_by_uid, trajectory_from_object
from learner.credit.registry import CreditResult, Estimator
from rollout.trajectory import Segment, Trajectory


def turn_record(trajectory: Trajectory, line: int) -> dict[str, object]:
    """The turn-record form of one trajectory (see ``records.py``)."""
    if trajectory.outcome is None:
        raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample} has no outcome yet: run "
                         "an outcome reward plugin before credit assignment")
    turns = []
    for turn in trajectory.turns:
        record: dict[str, object] = {"tool": turn.tool if turn.action == "tool_call" else None,
                                     "format_ok": turn.format_ok, "ig_value": turn.ig_value}
        if turn.step_score is not None:
            record["step_score"] = turn.step_score
        turns.append(record)
    return {"uid": trajectory.uid, "outcome": trajectory.outcome, "answered": trajectory.answered,
            "turns": turns, "line": line}


def assign_credit(trajectories: Sequence[Trajectory], estimator: Estimator) -> CreditResult:
    """Run ``estimator`` over the batch and write ``advantage``, ``reward`` and ``ig`` onto the turns."""
    records = [trajectory_from_object(turn_record(t, i + 1), i + 1) for i, t in enumerate(trajectories)]
    groups: list[Group] = group_by_uid(records)
    result = estimator.assign(groups)
    for group, group_credit in zip(groups, result.groups, strict=True):
        for record, turn_credits in zip(group.trajectories, group_credit, strict=True):
            trajectory = trajectories[record.line - 1]
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

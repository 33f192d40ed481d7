"""The format penalty (docs/algorithms.md §3, §5): malformed turns cost ``λ_fmt``.

Two rules, one per place the penalty lands:

- **Turn level** (the ``format`` plugin): a non-final turn that failed the format check
  (``turn.format_ok`` is false, as the environment recorded it) gets ``turn.reward = −λ_fmt``. The
  estimators treat such a turn as a boundary whose reward replaces any information gain there.
- **Answer turn**: the last turn never gets a turn-level penalty; its format is folded into the outcome
  instead. :func:`final_turn_penalty` says when: the episode did not end with a well-formed answer
  (a malformed answer attempt, or no answer at all). The outcome plugins apply it.

The environment's recorded ``format_ok`` is the truth here: re-parsing the text would need the
protocol variant the episode ran under (``iter_research`` turns carry a report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardPlugin, last_turn
from turnstile.rollout.trajectory import StopReason, Trajectory

DEFAULT_LAMBDA_FMT = 1.0


@dataclass
class FormatConfig:
    lambda_fmt: float = DEFAULT_LAMBDA_FMT  # the penalty; turn.reward = -lambda_fmt

    def __post_init__(self) -> None:
        if self.lambda_fmt < 0:
            raise ValueError("format.lambda_fmt must be >= 0 (it is subtracted)")


def well_formed_answer(trajectory: Trajectory) -> bool:
    """Whether the episode ended with an answer turn that passed the format check."""
    final = last_turn(trajectory)
    return (trajectory.stop_reason is StopReason.ANSWERED and final is not None
            and final.action == "answer" and final.format_ok)


def final_turn_penalty(trajectory: Trajectory, lambda_fmt: float = DEFAULT_LAMBDA_FMT) -> float | None:
    """``−λ_fmt`` when the answer turn failed the format check or the trajectory is unanswered;
    None when it ended with a well-formed answer (the outcome is then the answer's score).

    Episodes cut by an engine error or a timeout count as unanswered: the reward cannot tell whose
    fault that was, so dropping them is the learner's choice, not the scorer's.
    """
    return None if well_formed_answer(trajectory) else -lambda_fmt


class FormatPenalty(RewardPlugin):
    """Writes ``turn.reward = −λ_fmt`` on every malformed non-final turn (and nothing elsewhere)."""

    Options = FormatConfig
    writes: ClassVar[frozenset[str]] = frozenset({"turn.reward"})

    def __init__(self, config: FormatConfig) -> None:
        self.config = config

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        for turn in trajectory.turns[:-1]:
            if not turn.format_ok:
                turn.reward = -self.config.lambda_fmt

"""What a batch of trajectories amounts to: the numbers a rollout prints when it ends."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from turnstile.envs.answers import answer_matches
from turnstile.rollout.trajectory import StopReason, Trajectory


def is_correct(trajectory: Trajectory) -> bool:
    """Whether an episode got the question right: the judge's verdict when an ``llm_judge`` outcome
    left one; else a well-formed answer that matches a gold alternative exactly. The one rule of the
    rollout summary, the training metrics and the held-out evaluation.

    ``trajectory.outcome`` is not used: an F1 outcome gives partial credit and a format penalty is
    negative, so ``outcome > 0`` does not mean right.
    """
    verdict = trajectory.metadata.get("llm_judge")
    if isinstance(verdict, dict) and isinstance(verdict.get("correct"), bool):
        return bool(verdict["correct"])
    return trajectory.answered and answer_matches(trajectory.answer, trajectory.answers)


def well_formed_share(trajectories: Sequence[Trajectory]) -> tuple[float, int]:
    """Share of generated turns whose format is valid (docs/algorithms.md §1), and the number of turns."""
    turns = [turn for trajectory in trajectories for turn in trajectory.turns]
    if not turns:
        return 0.0, 0
    return sum(turn.format_ok for turn in turns) / len(turns), len(turns)


@dataclass
class RolloutSummary:
    episodes: int
    failed: int  # episodes that could not be run (their worker died too often)
    turns: int
    response_tokens: int
    observation_tokens: int
    answered: int
    correct: int
    tool_calls: int
    tool_errors: int
    wall_s: float
    stop_reasons: Counter[str] = field(default_factory=Counter)
    rerun: int = 0  # episodes started again after their worker died
    errors: int = 0  # episodes that ended in engine_error or error (failed ones included)
    first_error: str = ""  # what the first of them says (metadata["error"])

    @property
    def all_failed(self) -> bool:
        """Nothing ran: every episode ended in an error (or none was written)."""
        return self.errors == self.episodes

    @property
    def answer_rate(self) -> float:
        return self.answered / self.episodes if self.episodes else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.episodes if self.episodes else 0.0

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.wall_s if self.wall_s > 0 else 0.0

    def render(self) -> str:
        reasons = ", ".join(f"{name} {count}" for name, count in self.stop_reasons.most_common())
        return "\n".join([
            f"episodes      {self.episodes} written, {self.failed} failed, {self.rerun} rerun",
            f"turns         {self.turns} ({self.turns / max(self.episodes, 1):.1f} per episode)",
            f"tokens        {self.response_tokens} generated, {self.observation_tokens} observed",
            f"answer rate   {self.answer_rate:.1%}",
            f"accuracy      {self.accuracy:.1%} (exact match)",
            f"tool calls    {self.tool_calls}, {self.tool_errors} errors",
            f"throughput    {self.turns_per_s:.2f} turns/s over {self.wall_s:.1f} s",
            f"ended by      {reasons or '-'}",
            *([f"first error   {self.first_error}"] if self.first_error else []),
        ])


FAILED = (StopReason.ENGINE_ERROR, StopReason.ERROR)


def nothing_ran(trajectories: Sequence[Trajectory], what: str = "episode") -> str:
    """"every <what> failed; the first said: ..." when every one of ``trajectories`` ended in an
    error (a command stops on it instead of reporting 0% or training on nothing), else ""."""
    failed = [t for t in trajectories if t.stop_reason in FAILED]
    if not failed or len(failed) < len(trajectories):
        return ""
    return f"every {what} failed; the first said: {failed[0].metadata.get('error') or '?'}"


def summarize(trajectories: Sequence[Trajectory], wall_s: float, failed: int = 0,
              rerun: int = 0) -> RolloutSummary:
    turns = [turn for trajectory in trajectories for turn in trajectory.turns]
    errors = [t for t in trajectories if t.stop_reason in FAILED]
    return RolloutSummary(
        episodes=len(trajectories),
        failed=failed,
        turns=len(turns),
        response_tokens=sum(len(turn.response_ids) for turn in turns),
        observation_tokens=sum(len(turn.observation_ids) for turn in turns),
        answered=sum(t.answered for t in trajectories),
        correct=sum(is_correct(t) for t in trajectories),
        tool_calls=sum(turn.tool is not None for turn in turns),
        tool_errors=sum(turn.tool_ok is False for turn in turns),
        wall_s=wall_s,
        stop_reasons=Counter(t.stop_reason.value for t in trajectories),
        rerun=rerun,
        errors=len(errors),
        first_error=str(errors[0].metadata.get("error", "")) if errors else "",
    )

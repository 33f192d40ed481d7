"""Whose doing an episode's result was: the policy's, or the environment's.

Every failed tool call is classed when it fails (``envs.tools.base.Fault``, recorded on its turn as
``tool_fault``): the policy's (bad arguments, a made-up or refused address, a spent budget) or the
environment's (a time-out, a refused connection, HTTP 5xx or 429, a search API, extractor or
browser that failed, our own bug). An episode's *result* is the environment's when the environment
decided it: an environment failure on its last tool calls (``final_calls``: the answer that
followed was given without what the call should have returned), on more than ``max_share`` of its
tool calls, or an episode the engine, the loop or the wall clock ended (``engine_error``,
``error``, ``timeout``).
:func:`environment_verdict` says why, and the episode loop writes it into the trajectory's
``metadata["environment_fault"]``; the trainer leaves such episodes out of the loss and out of their
group's statistics (``TrainJob.environment_faults``), so that an outage is never trained as a wrong
answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.envs.protocol import StopReason
from turnstile.envs.tools.base import Fault
from turnstile.rollout.trajectory import Trajectory

VERDICT_KEY = "environment_fault"  # the trajectory's metadata key that holds the verdict
# Episodes the engine, the loop or the wall clock ended before the policy did (``timeout``: an
# engine or a tool that did not answer in time, ``episode.timeout_s``)
UNFINISHED = (StopReason.ENGINE_ERROR, StopReason.ERROR, StopReason.TIMEOUT)


@dataclass
class FaultConfig:
    final_calls: int = 1  # an environment failure on one of the episode's last N tool calls decides it
    max_share: float = 0.5  # ... or environment failures on more than this share of its tool calls

    def __post_init__(self) -> None:
        if self.final_calls < 0:
            raise ValueError(f"faults.final_calls={self.final_calls} must be >= 0 (0: the last calls "
                             f"decide nothing by themselves)")
        if not 0.0 <= self.max_share <= 1.0:
            raise ValueError(f"faults.max_share={self.max_share} must be in [0, 1] (1: never by share)")


def environment_verdict(trajectory: Trajectory, config: FaultConfig) -> str | None:
    """Why the environment decided ``trajectory``'s result, or None when the policy did."""
    if trajectory.stop_reason in UNFINISHED:
        return f"the episode ended with {trajectory.stop_reason.value}"
    calls = [turn for turn in trajectory.turns if turn.tool_ok is not None]
    failed = [turn for turn in calls if turn.tool_fault == Fault.environment]
    if not failed:
        return None
    last = [turn for turn in calls[len(calls) - config.final_calls:] if turn.tool_fault == Fault.environment] \
        if config.final_calls else []
    if last:
        return (f"the environment failed {'the last tool call' if config.final_calls == 1 else 'a last tool call'}"
                f" (turn {last[-1].index}, {last[-1].tool}: {last[-1].tool_error})")
    if len(failed) > config.max_share * len(calls):
        return f"the environment failed {len(failed)} of its {len(calls)} tool calls"
    return None

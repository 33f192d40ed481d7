"""Whose doing an episode's result was (rollout/faults.py), and what training does with an episode
the environment decided (cluster.jobs.run.trainable: mask, keep, drop_group)."""

from __future__ import annotations

import pytest

from turnstile.cluster.jobs.run import TrainJob, trainable
from turnstile.envs.tools.base import Fault
from turnstile.rollout.faults import VERDICT_KEY, FaultConfig, environment_verdict
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn


def turn(index: int, fault: Fault | None = None, *, tool: str | None = "search", error: str = "timeout") -> Turn:
    """A tool call that worked (``fault`` None), failed as ``fault``, or (``tool`` None) an answer."""
    return Turn(index=index, response_ids=[5], response_logprobs=[-0.1], weights_version=0, context_len=4,
                finish_reason="stop", tool=tool, tool_ok=None if tool is None else fault is None,
                tool_error=None if fault is None else error, tool_fault=None if fault is None else fault.value)


def episode(faults: list[Fault | None], *, uid: str = "g", sample: int = 0,
            stop: StopReason = StopReason.ANSWERED) -> Trajectory:
    """Tool calls failing as ``faults`` say, then an answer."""
    turns = [turn(i, fault) for i, fault in enumerate(faults)] + [turn(len(faults), tool=None)]
    return Trajectory(uid=uid, sample=sample, task_id="t", question="q?", answers=["a"],
                      segments=[Segment(prompt_ids=[1], turns=turns)], stop_reason=stop, outcome=0.0)


ENV, POLICY = Fault.environment, Fault.policy


@pytest.mark.parametrize(("faults", "verdict"), [
    ([None, None, ENV], "the environment failed the last tool call (turn 2, search: timeout)"),
    ([ENV, None, None], None),  # an early outage the agent worked around: its own result
    ([ENV, ENV, None], "the environment failed 2 of its 3 tool calls"),  # > half of its calls
    ([ENV, None], None),  # half is not more than half
    ([None, None, POLICY], None),  # its own mistake, however late
    ([POLICY, POLICY, POLICY], None),
    ([], None),  # answered without a call
])
def test_the_environment_decided_when_it_failed_the_last_call_or_most_calls(
        faults: list[Fault | None], verdict: str | None) -> None:
    assert environment_verdict(episode(faults), FaultConfig()) == verdict


def test_the_settings_move_the_line_and_an_unfinished_episode_is_the_environments() -> None:
    late = episode([None, ENV, None])
    assert environment_verdict(late, FaultConfig()) is None
    assert "a last tool call (turn 1" in str(environment_verdict(late, FaultConfig(final_calls=2)))
    assert environment_verdict(episode([ENV, None, None, None]), FaultConfig(final_calls=0, max_share=0.2))
    assert environment_verdict(episode([ENV, ENV, ENV]), FaultConfig(final_calls=0, max_share=1.0)) is None
    assert environment_verdict(episode([None], stop=StopReason.STALLED), FaultConfig()) is None  # its own loop
    for stop in (StopReason.ENGINE_ERROR, StopReason.ERROR, StopReason.TIMEOUT):
        assert stop.value in str(environment_verdict(episode([], stop=stop), FaultConfig()))
    with pytest.raises(ValueError, match="final_calls"):
        FaultConfig(final_calls=-1)
    with pytest.raises(ValueError, match="max_share"):
        FaultConfig(max_share=1.5)


def marked(trajectory: Trajectory) -> Trajectory:
    trajectory.metadata[VERDICT_KEY] = "the environment failed the last tool call"
    return trajectory


def test_training_masks_keeps_or_drops_the_group_of_an_environment_decided_episode() -> None:
    batch = [marked(episode([ENV], uid="a", sample=0)), episode([None], uid="a", sample=1),
             episode([None], uid="a", sample=2), episode([POLICY], uid="b", sample=0)]
    masked, left_out = trainable(batch, version=0, staleness=1, environment_faults="mask")
    assert [(t.uid, t.sample) for t in masked] == [("a", 1), ("a", 2), ("b", 0)]  # its group trains on the rest
    assert left_out["environment"] == 1
    kept, left_out = trainable(batch, version=0, staleness=1, environment_faults="keep")
    assert len(kept) == 4 and left_out["environment"] == 0
    dropped, left_out = trainable(batch, version=0, staleness=1, environment_faults="drop_group")
    assert [(t.uid, t.sample) for t in dropped] == [("b", 0)] and left_out["environment"] == 3
    with pytest.raises(ValueError, match="environment_faults='ignore' is not one of mask, keep, drop_group"):
        TrainJob(environment_faults="ignore")

"""Applying reward plugins (rewards/apply.py), the one way every driver scores: plugins in order,
each within its time, and a group a plugin fails on put back as rolled out, unscored and counted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.apply import score_groups
from turnstile.rewards.base import RewardPlugin
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn


@dataclass
class BoomOptions:
    fail_on: str = ""  # the uid of the group it fails on
    sleep_s: float = 0.0


class Boom(RewardPlugin):
    """Reads the outcome an earlier plugin wrote; raises, or sleeps, on one group."""

    Options: ClassVar[type] = BoomOptions
    writes: ClassVar[frozenset[str]] = frozenset({"turn.reward"})

    def __init__(self, options: BoomOptions) -> None:
        self.options = options

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        if trajectory.uid == self.options.fail_on:
            await asyncio.sleep(self.options.sleep_s)
            if not self.options.sleep_s:
                raise RuntimeError("the judge is down")
        trajectory.turns[-1].reward = trajectory.outcome


TASKS = {f"t{i}": Task(id=f"t{i}", question=f"q{i}?", answers=("a",)) for i in range(3)}


def rollout() -> list[Trajectory]:
    return [Trajectory(uid=f"g{i}", sample=s, task_id=f"t{i}", question=f"q{i}?", answers=["a"],
                       segments=[Segment(prompt_ids=[1], turns=[Turn(
                           index=0, response_ids=[2], response_logprobs=[-0.5], weights_version=0, context_len=1,
                           finish_reason="stop", action="answer", format_ok=True, answer="a" if s else "b")])],
                       answer="a" if s else "b", stop_reason=StopReason.ANSWERED)
            for i in range(3) for s in range(2)]


def test_a_failing_plugin_leaves_its_group_as_rolled_out_and_unscored() -> None:
    trajectories = rollout()
    specs = [PluginSpec("exact_match"), PluginSpec("tests.test_rewards_apply:Boom", {"fail_on": "g1"})]
    assert asyncio.run(score_groups(specs, trajectories, TASKS)) == 2
    failed = [t for t in trajectories if t.uid == "g1"]
    assert all(t.outcome is None and t.turns[-1].reward is None for t in failed)  # exact_match's outcome undone
    assert {t.metadata["reward_error"]["plugin"] for t in failed} == {"tests.test_rewards_apply:Boom"}
    assert "RuntimeError: the judge is down" in failed[0].metadata["reward_error"]["error"]
    scored = [t for t in trajectories if t.uid != "g1"]
    assert [t.outcome for t in scored] == [0.0, 1.0, 0.0, 1.0]  # wrong, right (exact match: 0 or 1)
    assert [t.turns[-1].reward for t in scored] == [t.outcome for t in scored]  # in order: Boom read it


def test_a_plugin_past_its_time_is_a_failure_not_a_hang() -> None:
    trajectories = rollout()
    specs = [PluginSpec("exact_match"), PluginSpec("tests.test_rewards_apply:Boom", {"fail_on": "g2", "sleep_s": 30})]
    assert asyncio.run(score_groups(specs, trajectories, TASKS, timeout_s=0.2)) == 2
    late = [t for t in trajectories if t.uid == "g2"]
    assert all("TimeoutError: no result within score_timeout_s=0.2" in t.metadata["reward_error"]["error"]
               for t in late)


def test_turnstile_score_writes_an_unscored_group_and_credits_the_rest(tmp_path) -> None:  # noqa: ANN001
    from turnstile.cluster.jobs.score import ScoreJob, score_file
    from turnstile.envs.datasets.registry import DatasetConfig
    from turnstile.envs.plugins import PluginSpec
    from turnstile.rollout.trajectory import load_trajectories, save_trajectories

    source, out = tmp_path / "rollout.jsonl", tmp_path / "scored.jsonl"
    save_trajectories(rollout(), source)
    config = ScoreJob(data=DatasetConfig(kind="tests.user_plugins:three_questions", path="t"),
                         rewards=[PluginSpec("exact_match"),
                                  PluginSpec("tests.test_rewards_apply:Boom", {"fail_on": "g0"})],
                         estimator=PluginSpec(kind="grpo"))
    report = score_file(config, source, out)
    assert (report.trajectories, report.unscored) == (6, 2)  # (the file's tasks answer "0", "1", "2")
    written = load_trajectories(out)
    assert [t.outcome for t in written if t.uid == "g0"] == [None, None]
    assert all(turn.advantage is None for t in written if t.uid == "g0" for turn in t.turns)
    assert all(turn.advantage is not None for t in written if t.uid != "g0" for turn in t.turns)

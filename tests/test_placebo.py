"""The placebo control of learning runs (benchmarks/placebo.py): a group's outcomes, shuffled."""

from __future__ import annotations

from benchmarks.placebo import TRUE_OUTCOME
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.base import build_reward
from turnstile.rollout.trajectory import Trajectory

PLACEBO = "benchmarks.placebo:ShuffledOutcomes"


def group(task: Task, outcomes: list[float]) -> list[Trajectory]:
    return [Trajectory(uid=f"g-{task.id}", sample=k, task_id=task.id, question=task.question,
                       answers=list(task.answers), outcome=outcome) for k, outcome in enumerate(outcomes)]


async def test_outcomes_are_permuted_within_the_group_and_scoring_twice_changes_nothing() -> None:
    plugin = build_reward(PluginSpec(PLACEBO))
    outcomes = [1.0, 0.0, 0.0, -1.0]
    moved = 0
    for k in range(40):
        task = Task(id=f"t{k}", question="Who?", answers=("Ann",))
        trajectories = group(task, outcomes)
        await plugin.score_group(trajectories, task)
        shuffled = [trajectory.outcome for trajectory in trajectories]
        assert sorted(shuffled) == sorted(outcomes)  # the group's outcomes, no other
        assert [trajectory.metadata[TRUE_OUTCOME] for trajectory in trajectories] == outcomes
        await plugin.score_group(list(reversed(trajectories)), task)  # scored again, in another order
        assert [trajectory.outcome for trajectory in trajectories] == shuffled
        moved += shuffled != outcomes
    # three distinct values (two 0s): 12 orders, one of them the identity; about 37 of 40 groups move
    assert moved >= 20

"""Applying reward plugins: the one way every driver scores trajectories.

The reward service's workers (each trajectory as it arrives, a group of one), the synchronous
training loop and ``turnstile score`` (whole groups of G samples) all call :func:`apply_rewards`, so
a plugin meets the same order, the same time limit and the same failure policy everywhere:

- the plugins run in the configured order (a later plugin may read what an earlier one wrote), each
  on the whole group it is given (``score_group``), each within ``timeout_s``;
- the first plugin that raises or passes its time stops the group's scoring, and the failure comes
  back as ``(plugin kind, error)``. :func:`mark_unscored` then puts the trajectory back as rollout
  left it, with ``outcome = None`` and ``metadata["reward_error"]``: the learner leaves it out and
  counts it (``rewards/unscored``), and the run goes on.

The service adds redelivery on top (a failure is retried on another delivery before it is marked);
a synchronous driver marks at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardPlugin, build_reward
from turnstile.rollout.trajectory import Trajectory

DEFAULT_SCORE_TIMEOUT_S = 600.0  # one plugin on one group


async def apply_rewards(plugins: Sequence[tuple[str, RewardPlugin]], group: Sequence[Trajectory],
                        task: Task, timeout_s: float = DEFAULT_SCORE_TIMEOUT_S) -> tuple[str, str] | None:
    """Score ``group`` (samples of ``task``) with every ``(kind, plugin)`` in order; the first
    failure as ``(kind, error)``, or None when every plugin scored it."""
    for kind, plugin in plugins:
        try:
            await asyncio.wait_for(plugin.score_group(group, task), timeout_s)
        except TimeoutError:
            return kind, f"TimeoutError: no result within score_timeout_s={timeout_s:g}"
        except Exception as error:  # noqa: BLE001 - a plugin's failure must not stop the run
            return kind, f"{type(error).__name__}: {error}"
    return None


def mark_unscored(trajectory: Trajectory, as_rolled_out: Trajectory, failure: tuple[str, str],
                  deliveries: int = 1) -> None:
    """Make ``trajectory`` the rollout's ``as_rolled_out`` again (no half-written reward field),
    unscored (``outcome = None``), with the failure in ``metadata["reward_error"]``."""
    trajectory.__dict__.update(as_rolled_out.__dict__)
    trajectory.outcome = None
    trajectory.metadata["reward_error"] = {"plugin": failure[0], "error": failure[1], "deliveries": deliveries}


async def score_groups(specs: Sequence[PluginSpec], trajectories: Sequence[Trajectory],
                       tasks: dict[str, Task], timeout_s: float = DEFAULT_SCORE_TIMEOUT_S) -> int:
    """Score ``trajectories`` group by group (a group: the samples of one ``uid``), concurrently,
    with plugins built from ``specs`` and closed after; a group a plugin fails on is marked
    unscored. Returns how many trajectories are unscored."""
    plugins = [(spec.kind, build_reward(spec)) for spec in specs]
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory.uid, []).append(trajectory)

    async def score(group: list[Trajectory]) -> int:
        saved = [Trajectory.from_json(t.to_json()) for t in group]
        failure = await apply_rewards(plugins, group, tasks[group[0].task_id], timeout_s)
        if failure is None:
            return 0
        for trajectory, rolled_out in zip(group, saved, strict=True):
            mark_unscored(trajectory, rolled_out, failure)
        return len(group)

    try:
        return sum(await asyncio.gather(*(score(group) for group in groups.values())))
    finally:
        for _, plugin in plugins:
            await plugin.aclose()

"""The asynchronous form of ``turnstile train``: rollout never waits for the learner.

One asyncio loop in the driver does four things, none of which blocks the others:

1. **Admission** (staleness bound η): a new group (G episodes of one task) starts only while
   ``accepted + running + G <= (η + steps + 1) × batch``, where ``accepted`` counts finished
   samples since the run began, ``steps`` the learner's steps so far and ``batch`` is
   ``tasks_per_step × G``. Rollout runs ahead of the learner by at most η steps' worth. While every
   step trains, ``steps`` is the weights version the engines serve; a step that trained nothing
   (its samples all left out, say as environment-decided) used up its batch all the same, and
   admission must not wait for a version that step will never publish.
2. **Harvest**: a finished episode goes to the trajectory store (``finished``). Episodes are placed
   by the run's one dispatcher policy (:mod:`turnstile.cluster.fleet.dispatch`, shared with rollout and evaluation):
   an episode whose worker died runs again elsewhere (the store keeps each item once), and an
   evaluation started by the learner thread counts against the same workers' capacity.
3. **Rewards**: reward workers (Ray actors, :mod:`turnstile.rewards.service`) score what the store holds while
   rollout continues; the collector releases a group only when all its G samples are scored.
4. **Learning**: when ``tasks_per_step`` complete groups are ready and no update is running, an
   update starts in a thread (:meth:`turnstile.cluster.jobs.run.Run.learn`): samples generated more than η
   versions ago are dropped and counted, the rest get credit and one veRL update, and the new
   weights are published. Episodes still running continue on the new weights (partial rollouts);
   every turn records the version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from turnstile.cluster.fleet.dispatch import NoWorkersLeft
from turnstile.cluster.jobs.run import Run
from turnstile.rewards.service import RewardService
from turnstile.rollout.store import FINISHED, build_store
from turnstile.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


def admits(accepted: int, in_flight: int, group_size: int, steps: int, staleness: int, batch: int) -> bool:
    """The staleness bound η on admission: whether one more group of ``group_size`` may start,
    ``steps`` steps into the run."""
    return accepted + in_flight + group_size <= (staleness + steps + 1) * batch


async def async_loop(run: Run) -> None:
    job, state = run.job, run.state
    group_size = job.rollout.group_size
    batch = job.tasks_per_step * group_size
    episodes = run.session.dispatcher()
    rerun, failed = run.rerun, run.failed
    ready: list[list[Trajectory]] = []
    learning: asyncio.Future[None] | None = None
    last_step_at = time.monotonic()
    specs = run.reward_specs()
    store = build_store(run.store_config)
    service = replace(job.reward_service, name_prefix=job.reward_service.name_prefix or f"{run.name}-reward")
    async with RewardService(run.store_config, specs, service, tasks={task.id: task for task in run.tasks}) as rewards:
        run.console.stage("rollout")  # the whole time; an update's stages show while it runs
        while state.step < job.steps:
            # Admission waits on the bound only: groups beyond the workers' room wait in the
            # dispatcher, where the fleet sees them as demand (and grows, when it autoscales).
            while admits(state.accepted, len(episodes.running) + len(episodes.waiting), group_size,
                         state.step, job.staleness, batch):
                task = run.task(state.cursor)
                uid = f"a{state.cursor}-{task.id}"
                state.cursor += 1
                episodes.submit((task, uid, sample) for sample in range(group_size))
            if not run.session.fleet.pool.alive():
                raise NoWorkersLeft("every rollout worker is gone (each died more often than "
                                    "fleet.worker_restarts allows); see the workers' logs")
            for trajectory in episodes.wait(timeout=0):
                await store.put(FINISHED, f"{trajectory.uid}/{trajectory.sample}", trajectory.to_json())
                state.accepted += 1
            run.rerun, run.failed = rerun + episodes.rerun, failed + episodes.failed
            ready.extend(await rewards.release_groups(group_size, wait_s=0))
            if learning is None and len(ready) >= job.tasks_per_step:
                groups, ready[:] = ready[:job.tasks_per_step], ready[job.tasks_per_step:]
                trajectories = [t for group in groups for t in group]
                # The step's wall time is the run's time since the previous update started (the
                # update, its publish and evaluation, and the wait for this batch): throughput per
                # second of the run, as rollout never stops for the learner.
                started = time.monotonic()
                wall, last_step_at = started - last_step_at, started
                learning = asyncio.ensure_future(asyncio.to_thread(run.learn, trajectories, wall))
            if learning is not None and learning.done():
                learning.result()
                learning = None
                run.console.stage("rollout")
                run.set_queue_depths({"running": len(episodes.running), "ready_groups": len(ready),
                                      "buffered": rewards.collector.buffered})
            await asyncio.sleep(0.05)
        if learning is not None:
            await learning
        episodes.cancel()
    await store.close()

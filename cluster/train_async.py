"""The asynchronous form of ``turnstile train``: rollout never waits for the learner.

One asyncio loop in the driver does four things, none of which blocks the others:

1. **Admission** (staleness bound η): a new group (G episodes of one task) starts only while
   ``accepted + running + G <= (η + version + 1) × batch``, where ``accepted`` counts finished
   samples since the run began, ``version`` is the weights version the engines serve and ``batch``
   is ``tasks_per_step × G``. Rollout runs ahead of the learner by at most η updates' worth.
2. **Harvest**: a finished episode goes to the trajectory store (``finished``); an episode whose
   worker died is run again elsewhere (the store keeps each item once).
3. **Rewards**: reward workers (Ray actors, :mod:`rewards.service`) score what the store holds while
   rollout continues; the collector releases a group only when all its G samples are scored.
4. **Learning**: when ``tasks_per_step`` complete groups are ready and no update is running, an
   update starts in a thread (:meth:`cluster.train.Run.learn`): samples generated more than η
   versions ago are dropped and counted, the rest get credit and one veRL update, and the new
   weights are published. Episodes still running continue on the new weights (partial rollouts);
   every turn records the version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError

from cluster.rollout import episode_raised, failed_trajectory
from rewards.service import RewardService
from rollout.store import FINISHED, build_store
from rollout.trajectory import Trajectory

if TYPE_CHECKING:  # annotations only: cluster.train imports this module, not the other way round
    from cluster.train import Run

log = logging.getLogger(__name__)


async def async_loop(run: Run) -> None:
    job, state = run.job, run.state
    group_size = job.rollout.group_size
    batch = job.tasks_per_step * group_size
    capacity = job.rollout.fleet.episodes_per_worker
    workers = run.workers
    load = [0] * len(workers)
    running: dict[ray.ObjectRef, tuple[int, tuple[object, str, int]]] = {}
    attempts: dict[tuple[str, int], int] = {}
    ready: list[list[Trajectory]] = []
    learning: asyncio.Future[None] | None = None
    last_step_at = time.monotonic()
    specs = run.reward_specs()
    store = build_store(run.store_config)
    service = replace(job.reward_service, name_prefix=job.reward_service.name_prefix or f"{run.name}-reward")
    async with RewardService(run.store_config, specs, service, tasks={task.id: task for task in run.tasks}) as rewards:
        while state.step < job.steps:
            bound = (job.staleness + state.weights_version + 1) * batch
            while (state.accepted + len(running) + group_size <= bound
                   and sum(capacity - n for n in load) >= group_size):
                task = run.task(state.cursor)
                uid = f"a{state.cursor}-{task.id}"
                state.cursor += 1
                for sample in range(group_size):
                    _submit(workers, load, running, attempts, (task, uid, sample))
            if running:
                done, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
                for ref in done:
                    worker, episode = running.pop(ref)
                    load[worker] -= 1
                    try:
                        trajectory: Trajectory = await ref
                    except RayActorError as error:
                        key = (episode[1], episode[2])
                        if attempts[key] < job.rollout.fleet.max_episode_attempts:
                            log.warning("rollout worker %d died running %s/%d; rerunning it", worker, *key)
                            run.rerun += 1
                            _submit(workers, load, running, attempts, episode, avoid=worker)
                            continue
                        log.error("episode %s/%d failed %d times; recording it as failed", *key, attempts[key])
                        trajectory = failed_trajectory(episode, f"its worker died {attempts[key]} times "
                                                                f"running it ({type(error).__name__})")
                        run.failed += 1
                    except Exception as error:  # noqa: BLE001 - one episode's failure must not end the run
                        trajectory = episode_raised(episode, error)
                        run.failed += 1
                    await store.put(FINISHED, f"{trajectory.uid}/{trajectory.sample}", trajectory.to_json())
                    state.accepted += 1
            ready.extend(await rewards.release_groups(group_size, wait_s=0))
            if learning is None and len(ready) >= job.tasks_per_step:
                groups, ready[:] = ready[:job.tasks_per_step], ready[job.tasks_per_step:]
                trajectories = [t for group in groups for t in group]
                wall = time.monotonic() - last_step_at
                learning = asyncio.ensure_future(asyncio.to_thread(run.learn, trajectories, wall))
            if learning is not None and learning.done():
                learning.result()
                learning = None
                last_step_at = time.monotonic()
                run.set_queue_depths({"running": len(running), "ready_groups": len(ready),
                                      "buffered": rewards.collector.buffered})
            await asyncio.sleep(0.05)
        if learning is not None:
            await learning
        for ref in running:
            ray.cancel(ref)
    await store.close()


def _submit(workers: list[ray.actor.ActorHandle], load: list[int],
            running: dict[ray.ObjectRef, tuple[int, tuple[object, str, int]]],
            attempts: dict[tuple[str, int], int], episode: tuple[object, str, int],
            avoid: int | None = None) -> None:
    choices = [i for i in range(len(workers)) if i != avoid] or list(range(len(workers)))
    worker = min(choices, key=lambda i: load[i])
    task, uid, sample = episode
    attempts[(uid, sample)] = attempts.get((uid, sample), 0) + 1
    running[workers[worker].run.remote(task, uid, sample)] = (worker, episode)
    load[worker] += 1

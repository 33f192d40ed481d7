"""The one dispatcher (cluster/fleet/dispatch.py) on real Ray actors: capacity, a dead worker's episodes
run again, an episode that raises is recorded, a fleet with no worker left fails what waits, and
two dispatchers on one pool share its capacity."""

from __future__ import annotations

import os
import time

import pytest
import ray

from turnstile.cluster.fleet.dispatch import Dispatcher, WorkerPool
from turnstile.envs.tasks import Task
from turnstile.rollout.trajectory import StopReason, Trajectory

pytestmark = pytest.mark.integration


class Worker:
    """Runs an episode by sleeping; dies (the process exits) on the episodes named ``die``, and raises
    on those named ``raise``; remembers the most episodes it ran at once."""

    def __init__(self) -> None:
        self.running = self.most = 0

    async def run(self, task: Task, uid: str, sample: int) -> Trajectory:
        import asyncio

        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.05)
            if task.question == "die":
                os._exit(1)
            if task.question == "raise":
                raise ValueError("this episode is broken")
            return Trajectory(uid=uid, sample=sample, task_id=task.id, question=task.question,
                              answers=list(task.answers), stop_reason=StopReason.ANSWERED)
        finally:
            self.running -= 1

    async def ping(self) -> int:
        return 0

    async def most_at_once(self) -> int:
        return self.most


def pool(workers: int, per_worker: int, restarts: int = 0) -> WorkerPool:
    actor = ray.remote(Worker).options(num_cpus=0, max_concurrency=8, max_restarts=restarts)
    return WorkerPool([actor.remote() for _ in range(workers)], per_worker)


def episodes(count: int, question: str = "q", first: int = 0) -> list[tuple[Task, str, int]]:
    return [(Task(id=f"t{i}", question=question, answers=("a",)), f"u{i}", 0) for i in range(first, first + count)]


def run_all(dispatcher: Dispatcher) -> list[Trajectory]:
    done = []
    deadline = time.monotonic() + 60
    while dispatcher.busy and time.monotonic() < deadline:
        done.extend(dispatcher.wait(timeout=5))
    return done


def test_every_episode_runs_once_within_each_workers_capacity(ray_local: None) -> None:
    workers = pool(2, per_worker=2)
    dispatcher = Dispatcher(workers, max_attempts=2)
    dispatcher.submit(episodes(10))
    done = run_all(dispatcher)
    assert sorted(t.uid for t in done) == sorted(f"u{i}" for i in range(10))
    assert (dispatcher.failed, dispatcher.rerun) == (0, 0) and workers.load == [0, 0]
    assert max(ray.get([w.most_at_once.remote() for w in workers.workers])) == 2


def test_a_dead_workers_episode_runs_again_and_a_raising_one_is_recorded(ray_local: None) -> None:
    workers = pool(2, per_worker=1)  # no restarts: the dying worker is gone for good
    dispatcher = Dispatcher(workers, max_attempts=2)
    dispatcher.submit([*episodes(1, "raise"), *episodes(3, first=1), *episodes(1, "die", first=4)])
    done = {t.uid: t for t in run_all(dispatcher)}
    assert sorted(done) == ["u0", "u1", "u2", "u3", "u4"]
    assert done["u0"].stop_reason is StopReason.ERROR and "this episode is broken" in done["u0"].metadata["error"]
    # "die" kills whichever worker runs it; it runs again on the other, which dies too: recorded.
    assert done["u4"].stop_reason is StopReason.ERROR and "died 2 times" in done["u4"].metadata["error"]
    assert dispatcher.rerun == 1 and dispatcher.failed == 2
    assert all(done[uid].stop_reason is StopReason.ANSWERED for uid in ("u1", "u2", "u3"))


def test_with_no_worker_left_the_waiting_episodes_are_recorded_failed(ray_local: None) -> None:
    workers = pool(1, per_worker=1)
    dispatcher = Dispatcher(workers, max_attempts=3)
    dispatcher.submit([*episodes(1, "die"), *episodes(2, first=1)])
    done = run_all(dispatcher)
    assert not dispatcher.busy and not workers.alive()
    assert len(done) == 3 and all(t.stop_reason is StopReason.ERROR for t in done)
    assert {t.metadata["error"] for t in done if t.uid != "u0"} == {"no rollout worker is left"}


def test_dispatchers_on_one_pool_share_its_capacity(ray_local: None) -> None:
    workers = pool(1, per_worker=3)
    training, evaluation = Dispatcher(workers, 2), Dispatcher(workers, 2)
    training.submit(episodes(2))
    assert workers.free() == 1
    evaluation.submit(episodes(2, first=2))  # one starts, one waits for room
    assert workers.free() == 0 and len(evaluation.waiting) == 1
    assert len(run_all(training)) == 2 and len(run_all(evaluation)) == 2 and workers.free() == 3

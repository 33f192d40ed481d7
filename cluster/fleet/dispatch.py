"""Episodes onto rollout workers: the one dispatcher of rollout, sync and async training and evaluation.

:class:`WorkerPool` is what a run knows of its rollout workers: the episodes running on each, and
which answer. Every :class:`Dispatcher` of a run shares it (the async loop's and an evaluation's,
from another thread), so all their episodes count against the same capacity:
``fleet.episodes_per_worker`` on each worker.

The policy, the same everywhere:

- an episode goes to the least loaded worker that answers and has room; the rest wait in order;
- a worker whose call failed with ``RayActorError`` (it died) gets no new episode until a ping shows
  it back (Ray restarts it up to ``fleet.worker_restarts`` times, then the fleet replaces it); a
  draining worker (the fleet shrinks) gets none either; a dead worker's episodes run again on other
  workers, at most ``fleet.max_episode_attempts`` times each, after which the episode is recorded as
  failed (a trajectory with stop reason ``error``) instead of lost;
- an episode whose call raised anything else is recorded as failed at once (rerunning would fail the
  same way), except that a store that lost the run's data stops the run (:func:`episode_raised`);
- when no worker is left at all, the waiting episodes are recorded as failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

import ray
from ray.exceptions import RayActorError

from turnstile.envs.tasks import Task
from turnstile.rollout.context import ContextConfig
from turnstile.rollout.errors import describe_error
from turnstile.rollout.store import StoreDataLostError
from turnstile.rollout.trajectory import StopReason, Trajectory

log = logging.getLogger(__name__)

# The task, the group's uid, the sample index, then optionally the context manager when not the
# fleet's own (an evaluation's benchmark with its own; None: the fleet's) and whether the episode may
# probe its boundaries for information gain when the fleet does (False: a held-out evaluation).
Episode = (tuple[Task, str, int] | tuple[Task, str, int, ContextConfig | None]
           | tuple[Task, str, int, ContextConfig | None, bool])


class NoWorkersLeft(RuntimeError):
    """Every rollout worker died more often than Ray restarts it: the run cannot go on."""


class WorkerPool:
    """The run's rollout workers, their load and their health (thread-safe).

    A worker is ``ready`` (takes episodes), ``lost`` (its call failed; a ping is out), ``draining``
    (the fleet is shrinking: it finishes what it runs and takes nothing new) or ``gone`` (dead for
    good, or released). Workers join with :meth:`add` as the fleet grows or replaces one; indices
    never change. ``waiting`` and ``finished`` count the episodes of every dispatcher on the pool
    that no worker has room for yet and that are done: the fleet sizes itself by them.
    """

    READY, LOST, DRAINING, GONE = "ready", "lost", "draining", "gone"

    def __init__(self, workers: list[ray.actor.ActorHandle], per_worker: int) -> None:
        self.workers, self.per_worker = list(workers), per_worker
        self.load = [0] * len(self.workers)
        self.state = [self.READY] * len(self.workers)
        self.probes: dict[ray.ObjectRef, int] = {}  # pings of workers that died, by worker
        self.revived: set[int] = set()  # workers back after a restart (their router needs the membership)
        self.starting = 0  # workers the fleet is starting: the pool is not empty while there are some
        self.replacing = False  # a fleet replaces workers that die (until its starts keep failing)
        self.waiting = self.finished = 0
        self._lock = threading.Lock()

    def add(self, worker: ray.actor.ActorHandle) -> int:
        with self._lock:
            self.workers.append(worker)
            self.load.append(0)
            self.state.append(self.READY)
            return len(self.workers) - 1

    def count(self, *states: str) -> int:
        with self._lock:
            return sum(state in states for state in self.state)

    def indices(self, *states: str) -> list[int]:
        with self._lock:
            return [i for i, state in enumerate(self.state) if state in states]

    def free(self) -> int:
        """Episodes the ready workers can take now."""
        with self._lock:
            return sum(self.per_worker - self.load[i] for i, state in enumerate(self.state) if state == self.READY)

    def take(self) -> int | None:
        """The least loaded ready worker with room, its load counted; None when there is none."""
        with self._lock:
            usable = [i for i, state in enumerate(self.state) if state == self.READY and self.load[i] < self.per_worker]
            if not usable:
                return None
            worker = min(usable, key=lambda i: self.load[i])
            self.load[worker] += 1
            return worker

    def release(self, worker: int) -> None:
        with self._lock:
            self.load[worker] -= 1

    def drain(self, worker: int) -> None:
        """No new episode for ``worker``; what it runs finishes."""
        with self._lock:
            if self.state[worker] == self.READY:
                self.state[worker] = self.DRAINING

    def remove(self, worker: int) -> None:
        """``worker`` is released (drained, or dead for good): never used again."""
        with self._lock:
            self.state[worker] = self.GONE
            self.revived.discard(worker)

    def lost(self, worker: int) -> None:
        """``worker`` died: no new episode until it answers a ping (a draining one is not asked back)."""
        with self._lock:
            if self.state[worker] == self.READY:
                self.state[worker] = self.LOST
                self.probes[self.workers[worker].ping.remote()] = worker
            elif self.state[worker] == self.DRAINING:
                self.state[worker] = self.GONE

    def answered(self, probe: ray.ObjectRef) -> None:
        """A ping came back: the worker is usable again, or gone for good."""
        with self._lock:
            worker = self.probes.pop(probe, None)
        if worker is None:
            return
        try:
            ray.get(probe)
        except RayActorError:
            log.error("rollout worker %d is gone for good", worker)
            self.remove(worker)
            return
        with self._lock:
            if self.state[worker] == self.LOST:
                self.state[worker] = self.READY
                self.revived.add(worker)

    def alive(self) -> bool:
        """Whether any worker takes episodes, or may soon (a ping is out, or the fleet starts or will
        start one)."""
        with self._lock:
            return self.READY in self.state or bool(self.probes) or self.starting > 0 or self.replacing

    def queued(self, change: int) -> None:
        with self._lock:
            self.waiting += change

    def done(self) -> None:
        with self._lock:
            self.finished += 1


class Dispatcher:
    """Runs episodes on a :class:`WorkerPool` (see the module docstring); ``rerun`` and ``failed``
    count episodes run again after their worker died and episodes recorded as failed."""

    def __init__(self, pool: WorkerPool, max_attempts: int) -> None:
        self.pool, self.max_attempts = pool, max_attempts
        self.waiting: deque[Episode] = deque()
        self.running: dict[ray.ObjectRef, tuple[int, Episode]] = {}
        self.attempts: dict[tuple[str, int], int] = {}
        self.rerun = self.failed = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, episodes: Iterable[Episode]) -> None:
        before = len(self.waiting)
        self.waiting.extend(episodes)
        self.pool.queued(len(self.waiting) - before)
        self._start()

    def wait(self, timeout: float | None = None) -> list[Trajectory]:
        """The episodes that finished (at least one unless ``timeout`` passes first; none when not
        ``busy``), failed ones included as their records."""
        self._start()
        if not self.running:
            if self.waiting and not self.pool.alive():
                log.error("every rollout worker is gone; %d episodes cannot run", len(self.waiting))
                given_up = [self._give_up(self.waiting.popleft(), "no rollout worker is left")
                            for _ in range(len(self.waiting))]
                self.pool.queued(-len(given_up))
                return given_up
            if not self.waiting:
                return []
        probes = list(self.pool.probes)
        if not self.running and not probes:  # only workers on their way (the fleet starts them)
            time.sleep(min(timeout if timeout is not None else 0.5, 0.5))
            self._start()
            return []
        ready, _ = ray.wait([*self.running, *probes], num_returns=1, timeout=timeout)
        if ready:  # and whatever else finished meanwhile
            more, _ = ray.wait([*self.running, *probes], num_returns=len(self.running) + len(probes), timeout=0)
            ready = list(dict.fromkeys([*ready, *more]))
        finished = []
        for ref in ready:
            if ref in self.running:
                trajectory = self._finish(ref)
                if trajectory is not None:
                    finished.append(trajectory)
            else:
                self.pool.answered(ref)
        self._start()
        return finished

    def cancel(self) -> None:
        """Stop every running episode (the end of a run); waiting ones are dropped."""
        for ref, (worker, _) in self.running.items():
            ray.cancel(ref)
            self.pool.release(worker)
        self.running.clear()
        self.pool.queued(-len(self.waiting))
        self.waiting.clear()

    def _start(self) -> None:
        while self.waiting:
            worker = self.pool.take()
            if worker is None:
                return
            episode = self.waiting.popleft()
            _, uid, sample = episode[:3]
            self.pool.queued(-1)
            self.attempts[(uid, sample)] = self.attempts.get((uid, sample), 0) + 1
            self.running[self.pool.workers[worker].run.remote(*episode)] = (worker, episode)

    def _finish(self, ref: ray.ObjectRef) -> Trajectory | None:
        worker, episode = self.running.pop(ref)
        self.pool.release(worker)
        try:
            trajectory = ray.get(ref)
            self.pool.done()
            return trajectory
        except RayActorError as error:
            self.pool.lost(worker)
            key = (episode[1], episode[2])
            if self.attempts[key] < self.max_attempts:
                log.warning("worker %d died running %s/%d (%s); rerunning it", worker, *key, type(error).__name__)
                self.waiting.appendleft(episode)
                self.pool.queued(1)
                self.rerun += 1
                return None
            log.error("episode %s/%d failed %d times; giving up on it", *key, self.attempts[key])
            return self._give_up(episode, f"its worker died {self.attempts[key]} times running it "
                                          f"({type(error).__name__})")
        except Exception as error:  # noqa: BLE001 - one episode's failure must not end the run
            self.failed += 1
            return episode_raised(episode, error)

    def _give_up(self, episode: Episode, why: str) -> Trajectory:
        self.failed += 1
        return failed_trajectory(episode, why)


def episode_raised(episode: Episode, error: Exception) -> Trajectory:
    """What a driver records for an episode whose call raised (not a dead worker): a failed
    trajectory, unless the store lost the run's data, which stops the run with its own message."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, StoreDataLostError):
        raise cause from None
    log.error("episode %s/%d failed: %s", episode[1], episode[2], describe_error(error))
    return failed_trajectory(episode, describe_error(error))


def failed_trajectory(episode: Episode, error: str) -> Trajectory:
    """The record of an episode that produced no trajectory of its own: stop reason ``error``."""
    task, uid, sample = episode[:3]
    return Trajectory(uid=uid, sample=sample, task_id=task.id, question=task.question,
                      answers=list(task.answers), stop_reason=StopReason.ERROR, metadata={"error": error})

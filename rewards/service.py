"""The reward service: Ray actors that score finished trajectories off the store, and the driver side
that hands complete groups to the learner.

The rewards step of the asynchronous loop (docs/design.md §1). The driver puts each finished
trajectory on the ``finished`` stream under an item id (``"<uid>/<sample>"`` by convention).
:class:`RewardWorker` actors claim them as the consumer group ``reward``, run the configured
plugins, put each scored trajectory on ``scored`` under the *same* item id, then ack.
:class:`GroupCollector` claims ``scored`` as the group ``learner`` and releases a group (all G
samples of one ``uid``) only once every member is scored.
:class:`RewardService` starts the workers, keeps them running, and holds the collector::

    async with RewardService(store_config, [PluginSpec("exact_match"), PluginSpec("format")],
                             RewardServiceConfig(workers=2), tasks=tasks_by_id) as rewards:
        ...                                           # rollout puts trajectories on "finished"
        groups = await rewards.release_groups(group_size=8, wait_s=60)

Scoring is per trajectory. Items arrive one at a time and every plugin in ``rewards/`` scores each
trajectory on its own (outcome, format, clue steps; information gain only overrides
``score_group`` to run one model call at a time), so a worker calls ``score_group([trajectory],
task)`` for each plugin, in the configured order, and never waits for the rest of the group.
Limitation: a group-relative plugin (one whose score of a trajectory depends on its siblings) would
get one-element groups here; the plugin contract has no way to say so yet, and this service would
have to buffer each ``uid`` until its G members are claimed.

Delivery is at least once, made exactly once on ``scored`` by the store: an item claimed by a worker
that dies (or takes longer than ``reclaim_idle_ms``) is reclaimed by a live worker, scored again and
put again under the same id, which the store ignores as a duplicate. Plugins are idempotent, so a
rescored trajectory carries the same fields.

Plugins are applied by :func:`turnstile.rewards.apply.apply_rewards`, as everywhere else. Failures are
bounded. A plugin that raises (or passes ``score_timeout_s``) on a trajectory leaves
the item unacked, so it is delivered again after ``reclaim_idle_ms``; on its ``max_deliveries``-th
delivery a failure puts the trajectory on ``scored`` *unscored* (outcome None, the reward fields as
rollout left them) with ``metadata["reward_error"] = {"plugin", "error", "deliveries"}``. Its group
still completes; the learner trains on the others and counts it (``rewards/unscored``). A task
the workers do not know (``add_tasks`` was not called for it) fails the same way, as
``"missing_task"``, so a driver that adds it late still gets it scored.

Tests: ``pytest tests/test_reward_service.py`` (both store backends).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import TracebackType
from typing import Self

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.apply import DEFAULT_SCORE_TIMEOUT_S, apply_rewards, mark_unscored
from turnstile.rewards.base import build_reward, reward_options
from turnstile.rollout.errors import describe_error
from turnstile.rollout.store import (
    FINISHED,
    SCORED,
    Claimed,
    StoreConfig,
    StoreError,
    TrajectoryStore,
    build_store,
)
from turnstile.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

# What Trajectory.from_json raises on a payload that is not a trajectory: TrajectoryError (a
# ValueError), and KeyError for a record without "stop_reason" (a bug in rollout/trajectory.py).
_UNREADABLE = (ValueError, KeyError, TypeError)
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)  # an actor died or is restarting

REWARD_GROUP = "reward"  # the consumer group of reward workers on "finished"
LEARNER_GROUP = "learner"  # the consumer group of the collector on "scored"
MISSING_TASK = "missing_task"  # the failure source of a trajectory whose task a worker lacks


class RewardServiceError(RuntimeError):
    """The reward service cannot go on; the message says why and what to do."""


@dataclass
class RewardWorkerConfig:
    """How one reward worker claims and scores.

    ``reclaim_idle_ms`` must exceed the slowest scoring of one trajectory (all plugins): an item
    claimed longer than that is taken over by another worker and scored twice (harmless, since the
    second put is ignored, but wasted work, and each takeover counts as a delivery). It is also the
    delay before a failed try is retried.
    """

    concurrency: int = 8  # trajectories one worker scores at once
    claim_block_ms: int = 1000  # how long an idle worker waits on the store for new items
    reclaim_idle_ms: int = 300_000  # unacked this long: the holder died or failed; take it over
    max_deliveries: int = 3  # a failure on this delivery puts the item with metadata["reward_error"]
    score_timeout_s: float = DEFAULT_SCORE_TIMEOUT_S  # one plugin on one trajectory

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_deliveries"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.worker.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("claim_block_ms", "reclaim_idle_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"reward.worker.{name} must be >= 0, got {getattr(self, name)}")
        if self.score_timeout_s <= 0:
            raise ValueError(f"reward.worker.score_timeout_s must be > 0, got {self.score_timeout_s}")


@dataclass
class RewardServiceConfig:
    """The reward worker fleet. Ray restarts a dead worker up to ``worker_restarts`` times; the
    service then hands it the tasks again and restarts its loop (on its next ``release_groups``)."""

    workers: int = 2
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0  # e.g. for information_gain's model on a GPU
    worker_restarts: int = 3
    start_timeout_s: float = 300.0  # for a worker to start, or to answer after a restart
    stop_timeout_s: float = 60.0  # close(): for workers to finish the items they hold
    name_prefix: str = ""  # workers are named actors "<prefix>-<i>"; "" = "reward-<random>"
    worker: RewardWorkerConfig = field(default_factory=RewardWorkerConfig)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"reward.workers must be >= 1, got {self.workers}")
        if min(self.worker_cpus, self.worker_gpus, self.worker_restarts) < 0:
            raise ValueError("reward.worker_cpus, reward.worker_gpus and reward.worker_restarts must "
                             "be >= 0")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("reward.start_timeout_s and reward.stop_timeout_s must be > 0")


@dataclass
class WorkerCounts:
    """What one life of a worker did (a restarted worker starts again from zero)."""

    incarnation: str = ""  # which life of the actor these counts come from
    scored: int = 0  # put on "scored" with their rewards
    rescored: int = 0  # of those, scored on a later delivery (a worker died, or a try failed)
    failed: int = 0  # put on "scored" unscored, with metadata["reward_error"]
    unreadable: int = 0  # payloads that are not trajectories: logged, acked and dropped
    in_flight: int = 0  # being scored now
    failures: dict[str, int] = field(default_factory=dict)  # failed tries by plugin kind

    def plus(self, other: WorkerCounts) -> WorkerCounts:
        failures = dict(self.failures)
        for source, count in other.failures.items():
            failures[source] = failures.get(source, 0) + count
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                if f.name not in ("incarnation", "failures")}
        return WorkerCounts(failures=failures, **sums)


@dataclass(frozen=True)
class RewardMetrics:
    """A snapshot of the service: worker counts and the depths of its queues."""

    workers: WorkerCounts  # summed over workers and their earlier lives (as last read)
    workers_alive: int
    worker_restarts: int  # restarted workers whose loop the service started again
    finished_length: int  # trajectories ever put on "finished"
    finished_pending: int  # claimed by reward workers, not yet acked
    scored_length: int  # trajectories ever put on "scored" (each item once)
    scored_pending: int  # claimed by the collector, not yet released
    buffered: int  # trajectories the collector holds in incomplete groups
    released_groups: int
    released: int  # trajectories released in those groups
    duplicate_samples: int  # a second item for a (uid, sample) already held: acked, dropped


# ---- the worker (a Ray actor) --------------------------------------------------------------------

class RewardWorker:
    """Claims finished trajectories, scores them, puts them on ``scored``; wrapped with
    ``ray.remote`` by :class:`RewardService`. Built from small picklable parts: the store client and
    the plugins are built here, inside the actor. Its name is its consumer name in the store."""

    def __init__(self, name: str, store: StoreConfig, rewards: Sequence[PluginSpec],
                 config: RewardWorkerConfig, tasks: Mapping[str, Task] | None = None) -> None:
        self.name = name
        self.config = config
        self._store = build_store(store)
        self._plugins = [(spec.kind, build_reward(spec)) for spec in rewards]
        self._tasks: dict[str, Task] = dict(tasks or {})
        self._counts = WorkerCounts(incarnation=uuid.uuid4().hex)
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._running = False
        self._stopping = False

    async def ping(self) -> str:
        return self.name

    async def set_tasks(self, tasks: Mapping[str, Task], replace_all: bool = False) -> int:
        """Add (or replace) tasks by id, or with ``replace_all`` know exactly these; returns how
        many tasks the worker knows."""
        if replace_all:
            self._tasks = {}
        self._tasks.update(tasks)
        return len(self._tasks)

    async def forget_tasks(self, task_ids: Sequence[str]) -> int:
        for task_id in task_ids:
            self._tasks.pop(task_id, None)
        return len(self._tasks)

    async def counts(self) -> WorkerCounts:
        return replace(self._counts, in_flight=len(self._in_flight), failures=dict(self._counts.failures))

    async def run(self) -> WorkerCounts:
        """Claim, score and put until :meth:`stop`; returns this life's counts. Ends with the
        store's error if the store fails (the items held stay pending for another worker)."""
        if self._running:
            raise RuntimeError(f"reward worker {self.name} is already running")
        self._running, self._stopping = True, False
        try:
            while not self._stopping:
                await self._step()
        finally:
            # Finish what was claimed, so a stop does not leave items waiting for a reclaim.
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
            self._running = False
        self._raise_failed()
        return await self.counts()

    async def stop(self) -> None:
        self._stopping = True

    async def aclose(self) -> None:
        for _, plugin in self._plugins:
            await plugin.aclose()
        await self._store.close()

    async def _step(self) -> None:
        self._raise_failed()
        free = self.config.concurrency - len(self._in_flight)
        if free <= 0:
            await asyncio.wait(list(self._in_flight.values()), return_when=asyncio.FIRST_COMPLETED)
            return
        # Items of dead workers (and failed tries) first, so they do not wait behind new ones. Items
        # this worker is still scoring come back too when they take longer than reclaim_idle_ms:
        # ask for enough that they cannot crowd the others out, and skip them. Reclaimed items
        # beyond ``free`` wait for a later reclaim.
        reclaimed = await self._store.reclaim(FINISHED, REWARD_GROUP, self.name,
                                              self.config.reclaim_idle_ms,
                                              count=free + len(self._in_flight))
        items = [item for item in reclaimed if item.id not in self._in_flight][:free]
        if not items:
            items = await self._store.claim(FINISHED, REWARD_GROUP, self.name, count=free,
                                            block_ms=self.config.claim_block_ms)
        for item in items:
            self._in_flight[item.id] = asyncio.create_task(self._process(item))

    def _raise_failed(self) -> None:
        """Forget finished items; a store error raised while putting or acking one ends the loop."""
        for item_id, task in list(self._in_flight.items()):
            if task.done():
                del self._in_flight[item_id]
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]

    async def _process(self, item: Claimed) -> None:
        try:
            trajectory = Trajectory.from_json(item.payload)
        except _UNREADABLE as error:
            log.error("reward worker %s: item %r on %r is not a trajectory (%s); dropping it",
                      self.name, item.id, FINISHED, error)
            self._counts.unreadable += 1
            await self._store.ack(FINISHED, REWARD_GROUP, [item.id])
            return
        failure = await self._score(trajectory)
        if failure is None:
            await self._store.put(SCORED, item.id, trajectory.to_json())
            await self._store.ack(FINISHED, REWARD_GROUP, [item.id], release=True)  # the scored copy goes on
            self._counts.scored += 1
            self._counts.rescored += int(item.deliveries > 1)
            return
        source, reason = failure
        self._counts.failures[source] = self._counts.failures.get(source, 0) + 1
        if item.deliveries < self.config.max_deliveries:
            log.warning("reward worker %s: %s failed on %r (delivery %d of %d): %s; it is retried "
                        "after reclaim_idle_ms=%d", self.name, source, item.id, item.deliveries,
                        self.config.max_deliveries, reason, self.config.reclaim_idle_ms)
            return  # left unacked: a reclaim delivers it again
        log.error("reward worker %s: %s failed on %r on its last delivery (%d): %s; it goes to %r "
                  "unscored, with metadata['reward_error']", self.name, source, item.id,
                  item.deliveries, reason, SCORED)
        mark_unscored(trajectory, Trajectory.from_json(item.payload), failure, item.deliveries)
        await self._store.put(SCORED, item.id, trajectory.to_json())
        await self._store.ack(FINISHED, REWARD_GROUP, [item.id], release=True)
        self._counts.failed += 1

    async def _score(self, trajectory: Trajectory) -> tuple[str, str] | None:
        """Run every plugin on ``trajectory`` in order; the first failure as (source, error)."""
        task = self._tasks.get(trajectory.task_id)
        if task is None:
            return MISSING_TASK, (f"task {trajectory.task_id!r} is unknown to reward worker "
                                  f"{self.name}: the driver must add_tasks before its trajectories "
                                  "are scored")
        return await apply_rewards(self._plugins, [trajectory], task, self.config.score_timeout_s)


# ---- the driver side -----------------------------------------------------------------------------

class GroupCollector:
    """Claims scored trajectories and releases complete groups, acking them once handed over.

    A group is the trajectories of one ``uid``; it is complete when it holds ``group_size``
    distinct samples. Members of incomplete groups stay pending in the store, so a driver that
    restarts on a Redis store gets them back: the first ``release`` reclaims every pending item of
    the ``learner`` group (one collector per run). An item delivered again is held once; a second
    item for a ``(uid, sample)`` already held is acked and dropped (``duplicate_samples``).
    """

    def __init__(self, store: TrajectoryStore, consumer: str = "learner", claim_count: int = 256) -> None:
        if claim_count < 1:
            raise ValueError(f"claim_count must be >= 1, got {claim_count}")
        self.store = store
        self.consumer = consumer
        self.claim_count = claim_count
        self.released_groups = 0
        self.released = 0
        self.duplicate_samples = 0
        self.unreadable = 0
        self._groups: dict[str, dict[int, tuple[str, Trajectory]]] = {}  # uid -> sample -> item
        self._recovered = False

    @property
    def buffered(self) -> int:
        return sum(len(members) for members in self._groups.values())

    async def release(self, group_size: int, *, wait_s: float = 0.0,
                      max_groups: int | None = None) -> list[list[Trajectory]]:
        """The complete groups (members in sample order, groups in order of first arrival), at most
        ``max_groups``; waits up to ``wait_s`` for one when there is none. Released members are
        acked, so they are never released again."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_groups is not None and max_groups < 1:
            raise ValueError(f"max_groups must be >= 1 (or None for all), got {max_groups}")
        if not self._recovered:
            pending = await self.store.pending(SCORED, LEARNER_GROUP)
            if pending:
                await self._hold(await self.store.reclaim(SCORED, LEARNER_GROUP, self.consumer,
                                                          min_idle_ms=0, count=pending))
            self._recovered = True
        deadline = time.monotonic() + wait_s
        while True:
            while len(batch := await self.store.claim(SCORED, LEARNER_GROUP, self.consumer,
                                                      count=self.claim_count)) > 0:
                await self._hold(batch)
                if len(batch) < self.claim_count:
                    break
            complete = [uid for uid, members in self._groups.items() if len(members) >= group_size]
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if complete or remaining_ms <= 0:
                break
            await self._hold(await self.store.claim(SCORED, LEARNER_GROUP, self.consumer,
                                                    count=self.claim_count, block_ms=remaining_ms))
        released = complete[:max_groups] if max_groups is not None else complete
        groups: list[list[Trajectory]] = []
        for uid in released:
            members = self._groups[uid]
            # Released: the learner has them now (and OUT/scored/ once it trains on them).
            await self.store.ack(SCORED, LEARNER_GROUP, [item_id for item_id, _ in members.values()], release=True)
            del self._groups[uid]
            groups.append([members[sample][1] for sample in sorted(members)])
        self.released_groups += len(groups)
        self.released += sum(len(group) for group in groups)
        return groups

    async def _hold(self, items: Iterable[Claimed]) -> None:
        for item in items:
            try:
                trajectory = Trajectory.from_json(item.payload)
            except _UNREADABLE as error:
                log.error("item %r on %r is not a trajectory (%s); dropping it", item.id, SCORED, error)
                self.unreadable += 1
                await self.store.ack(SCORED, LEARNER_GROUP, [item.id])
                continue
            members = self._groups.setdefault(trajectory.uid, {})
            held = members.get(trajectory.sample)
            if held is None:
                members[trajectory.sample] = (item.id, trajectory)
            elif held[0] != item.id:
                log.warning("items %r and %r are both sample %d of group %r; keeping the first",
                            held[0], item.id, trajectory.sample, trajectory.uid)
                self.duplicate_samples += 1
                await self.store.ack(SCORED, LEARNER_GROUP, [item.id])


class RewardService:
    """Starts and keeps the reward workers, and releases complete groups to the learner.

    Build it in the driver after Ray is initialised; it builds the store client first, so a memory
    store's actor belongs to the driver and outlives the workers. ``start`` (or ``async with``)
    starts the workers; ``add_tasks`` tells them the tasks of trajectories to come (before those
    trajectories are put); ``release_groups`` also restarts the loop of a worker Ray restarted.
    """

    def __init__(self, store: StoreConfig, rewards: Sequence[PluginSpec],
                 config: RewardServiceConfig | None = None,
                 tasks: Mapping[str, Task] | None = None) -> None:
        if not rewards:
            raise ValueError("reward: configure at least one reward plugin")
        for spec in rewards:  # fail here, with the plugin's message, not inside an actor
            reward_options(spec)
        self.config = config if config is not None else RewardServiceConfig()
        self._store_config = store
        self._rewards = list(rewards)
        self._store = build_store(store)
        self.collector = GroupCollector(self._store)
        self._tasks: dict[str, Task] = dict(tasks or {})
        self._prefix = self.config.name_prefix or f"reward-{uuid.uuid4().hex[:8]}"
        self.workers: list[ray.actor.ActorHandle] = []
        self._runs: list[ray.ObjectRef | None] = []  # None: waiting to be restarted
        self._gone: set[int] = set()
        self._seen: dict[tuple[int, str], WorkerCounts] = {}  # (worker, incarnation) -> last counts
        self._restarts = 0
        self._closed = False

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        if self.workers:
            raise RewardServiceError("the reward service is already started")
        await self._store.ready()
        actor = ray.remote(RewardWorker)
        names = [f"{self._prefix}-{i}" for i in range(self.config.workers)]
        # Ray types .remote() as ActorHandle | type[RewardWorker]; it is the handle.
        self.workers = [actor.options(name=name, num_cpus=self.config.worker_cpus,  # type: ignore[misc]
                                      num_gpus=self.config.worker_gpus,
                                      max_restarts=self.config.worker_restarts, max_concurrency=1000)
                        .remote(name, self._store_config, self._rewards, self.config.worker, self._tasks)
                        for name in names]
        for name, worker in zip(names, self.workers, strict=True):
            try:
                await asyncio.wait_for(worker.ping.remote(), self.config.start_timeout_s)
            except (TimeoutError, *_DEAD) as error:
                await self.close()
                raise RewardServiceError(f"reward worker {name} did not start within "
                                         f"start_timeout_s={self.config.start_timeout_s}: {error}") from None
        self._runs = [worker.run.remote() for worker in self.workers]

    async def add_tasks(self, tasks: Iterable[Task]) -> None:
        """Tell every worker these tasks (by id). A worker that is restarting gets all the tasks
        again when its loop is restarted."""
        added = {task.id: task for task in tasks}
        self._tasks.update(added)
        await self._tell("set_tasks", added)

    async def forget_tasks(self, task_ids: Iterable[str]) -> None:
        """Drop tasks no trajectory to come will need (memory); a trajectory of a forgotten task
        fails as ``missing_task``."""
        ids = list(task_ids)
        for task_id in ids:
            self._tasks.pop(task_id, None)
        await self._tell("forget_tasks", ids)

    async def release_groups(self, group_size: int, *, wait_s: float = 0.0,
                             max_groups: int | None = None) -> list[list[Trajectory]]:
        """Complete groups of ``group_size`` scored samples (see :meth:`GroupCollector.release`),
        waiting up to ``wait_s`` for one; restarts the loops of restarted workers meanwhile."""
        deadline = time.monotonic() + wait_s
        while True:
            await self._supervise()
            remaining = deadline - time.monotonic()
            groups = await self.collector.release(group_size, wait_s=max(0.0, min(remaining, 1.0)),
                                                  max_groups=max_groups)
            if groups or time.monotonic() >= deadline:
                return groups

    async def metrics(self) -> RewardMetrics:
        for index, worker in enumerate(self.workers):
            if index in self._gone:
                continue
            try:
                counts: WorkerCounts = await asyncio.wait_for(worker.counts.remote(), self.config.start_timeout_s)
            except (TimeoutError, *_DEAD):
                continue  # restarting: its last counts stand
            for (seen_index, incarnation), earlier in self._seen.items():
                if seen_index == index and incarnation != counts.incarnation:
                    earlier.in_flight = 0  # an earlier life holds nothing now
            self._seen[(index, counts.incarnation)] = counts
        total = WorkerCounts()
        for counts in self._seen.values():
            total = total.plus(counts)
        store = self._store
        return RewardMetrics(
            workers=total, workers_alive=len(self.workers) - len(self._gone),
            worker_restarts=self._restarts,
            finished_length=await store.length(FINISHED),
            finished_pending=await store.pending(FINISHED, REWARD_GROUP),
            scored_length=await store.length(SCORED),
            scored_pending=await store.pending(SCORED, LEARNER_GROUP),
            buffered=self.collector.buffered, released_groups=self.collector.released_groups,
            released=self.collector.released, duplicate_samples=self.collector.duplicate_samples,
        )

    async def close(self) -> None:
        """Stop the workers (they finish the items they hold, up to ``stop_timeout_s``) and end
        them. Groups not released stay pending in the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        live = [worker for index, worker in enumerate(self.workers) if index not in self._gone]
        await asyncio.gather(*(worker.stop.remote() for worker in live), return_exceptions=True)
        runs = [run for run in self._runs if run is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True),
                                   self.config.stop_timeout_s)
            await asyncio.wait_for(asyncio.gather(*(worker.aclose.remote() for worker in live),
                                                  return_exceptions=True), self.config.stop_timeout_s)
        except TimeoutError:
            log.warning("reward workers did not stop within stop_timeout_s=%s; killing them (their "
                        "items stay pending in the store)", self.config.stop_timeout_s)
        for worker in self.workers:
            ray.kill(worker)
        await self._store.close()

    async def _tell(self, method: str, argument: object) -> None:
        calls = [(index, getattr(worker, method).remote(argument))
                 for index, worker in enumerate(self.workers)
                 if index not in self._gone and self._runs[index] is not None]
        for index, call in calls:
            try:
                await asyncio.wait_for(call, self.config.start_timeout_s)
            except (TimeoutError, *_DEAD):
                # It died or is restarting: its loop's end is noticed by _supervise, which hands
                # it every task again before restarting the loop.
                log.warning("reward worker %d did not take %s; it gets them when restarted", index, method)

    async def _supervise(self) -> None:
        """Notice loops that ended; restart those of workers Ray restarted."""
        if self._closed:
            raise RewardServiceError("the reward service is closed")
        for index, run in enumerate(self._runs):
            if run is None or not ray.wait([run], timeout=0)[0]:
                continue
            try:
                await run
                log.warning("reward worker %d stopped without being asked to; restarting its loop", index)
            except _DEAD as error:
                log.warning("reward worker %d died (%s); restarting its loop once Ray has restarted "
                            "it", index, type(error).__name__)
            except Exception as error:  # the loop itself failed (the store is unreachable or lost)
                cause = getattr(error, "cause", None)
                if isinstance(cause, StoreError):
                    raise cause from None  # its own message says what happened and what to do
                raise RewardServiceError(f"reward worker {index} stopped: {describe_error(error)}") from error
            self._runs[index] = None
        for index, run in enumerate(self._runs):
            if run is None and index not in self._gone:
                await self._resume(index)
        if len(self._gone) == len(self.workers):
            raise RewardServiceError(
                f"every reward worker is gone (each restarted {self.config.worker_restarts} times); "
                "see their errors in the Ray logs, and raise reward.worker_restarts if the failures "
                "were transient")

    async def _resume(self, index: int) -> None:
        worker = self.workers[index]
        try:
            await asyncio.wait_for(worker.set_tasks.remote(self._tasks, replace_all=True),
                                   self.config.start_timeout_s)
        except ActorDiedError:
            log.error("reward worker %d is gone for good", index)
            self._gone.add(index)
            return
        except (TimeoutError, ActorUnavailableError, RayActorError):
            return  # still restarting: try again on the next call
        self._runs[index] = worker.run.remote()
        self._restarts += 1

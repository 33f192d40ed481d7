"""The reward service: trajectories put on "finished" come out scored, in complete groups, exactly
once, even when a reward worker is killed mid-item or a plugin fails.

The trajectories are real episodes of the synthetic world (two scripted-expert solutions and a
policy that never answers). Plugins are the cheap real ones (exact_match, format, clue_steps with
the heuristic judge) plus two test plugins defined here and loaded by import path inside the
workers: :class:`GatedPlugin` holds every trajectory until the test opens a gate (so a worker can
be killed while it certainly holds claimed, unacked items) and :class:`FailingPlugin` raises on one
sample. Tests that need a store run on both backends, as ``tests/test_store.py`` does. Nothing
asserts on durations: waits poll with generous deadlines, and only ever make a slow machine slower.

Run: ``pytest tests/test_reward_service.py``; the tests that start Ray or Redis are marked
``integration``.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import pytest_asyncio
import ray

from tests.test_episode import Stubborn, chain, episode
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rewards.apply import score_groups
from turnstile.rewards.base import RewardError, RewardPlugin
from turnstile.rewards.service import (
    LEARNER_GROUP,
    MISSING_TASK,
    REWARD_GROUP,
    GroupCollector,
    RewardMetrics,
    RewardService,
    RewardServiceConfig,
    RewardWorkerConfig,
)
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.store import FINISHED, SCORED, StoreConfig, TrajectoryStore, build_store
from turnstile.rollout.trajectory import Trajectory

MEMORY_ACTOR = "turnstile-store-reward-tests"
BACKENDS = [pytest.param(kind, id=kind, marks=pytest.mark.integration) for kind in ("memory", "redis")]
DEADLINE_S = 300.0  # an upper bound for anything to arrive, however loaded the machine is


# ---- test plugins (loaded by the workers as tests.test_reward_service:<Name>) --------------------

@dataclass
class GateOptions:
    gate: str = ""  # a file path: every trajectory waits until it exists
    poll_s: float = 0.05


class GatedPlugin(RewardPlugin):
    """Writes nothing; holds each trajectory until the gate file exists."""

    Options = GateOptions
    writes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: GateOptions) -> None:
        self.config = config

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        while not Path(self.config.gate).exists():  # noqa: ASYNC110, ASYNC240 - another process writes the gate
            await asyncio.sleep(self.config.poll_s)


@dataclass
class FailOptions:
    sample: int = 1  # raise on the trajectories of this sample index


class FailingPlugin(RewardPlugin):
    Options = FailOptions
    writes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: FailOptions) -> None:
        self.config = config

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        if trajectory.sample == self.config.sample:
            raise RuntimeError(f"no score for sample {trajectory.sample}")


GATED = f"{__name__}:GatedPlugin"
FAILING = f"{__name__}:FailingPlugin"
CHEAP = [PluginSpec("exact_match"), PluginSpec("format"),
         PluginSpec("clue_steps", {"judge": "heuristic"})]


# ---- fixtures and helpers ------------------------------------------------------------------------

@dataclass(frozen=True)
class Episodes:
    task: Task
    good: tuple[Trajectory, Trajectory]  # the scripted expert: answered right
    bad: Trajectory  # never answers: outcome -lambda_fmt


@pytest_asyncio.fixture(scope="module")
async def episodes(tasks: list[Task], expert: ScriptedEngine, toolbox: Toolbox, chat: ChatFormat) -> Episodes:
    task = chain(tasks, hops=2)
    good = [await episode(task, expert, toolbox, chat, sample=s) for s in (0, 1)]
    bad = await episode(task, Stubborn(chat), toolbox, chat, sample=2, max_turns=3)
    return Episodes(task, (good[0], good[1]), bad)


@pytest.fixture(params=BACKENDS)
def store_config(request: pytest.FixtureRequest, ray_local: None) -> StoreConfig:
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    if request.param == "memory":
        return StoreConfig(kind="memory", namespace=namespace, actor_name=MEMORY_ACTOR)
    return StoreConfig(kind="redis", url=request.getfixturevalue("redis_url"), namespace=namespace,
                       timeout_s=2.0)


@pytest.fixture
def memory_config(ray_local: None) -> StoreConfig:
    return StoreConfig(kind="memory", namespace=f"test-{uuid.uuid4().hex[:12]}", actor_name=MEMORY_ACTOR)


def fleet(workers: int = 1, **worker: int) -> RewardServiceConfig:
    return RewardServiceConfig(workers=workers, worker_cpus=0, worker_restarts=2,
                               worker=RewardWorkerConfig(**worker))


def member(source: Trajectory, uid: str, sample: int) -> Trajectory:
    """A copy of ``source`` as sample ``sample`` of group ``uid``."""
    copy = Trajectory.from_json(source.to_json())
    copy.uid, copy.sample = uid, sample
    return copy


def item_id(trajectory: Trajectory) -> str:
    return f"{trajectory.uid}/{trajectory.sample}"


async def put_finished(store: TrajectoryStore, trajectories: list[Trajectory]) -> None:
    for trajectory in trajectories:
        await store.put(FINISHED, item_id(trajectory), trajectory.to_json())


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.2)


async def collect(service: RewardService, group_size: int, groups: int) -> list[list[Trajectory]]:
    released: list[list[Trajectory]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(released) < groups:
        assert time.monotonic() < deadline, (f"{len(released)} of {groups} groups came out; "
                                             f"{await service.metrics()}")
        released += await service.release_groups(group_size, wait_s=2)
    return released


async def settled(service: RewardService, check: Callable[[RewardMetrics], bool], what: str) -> RewardMetrics:
    """The metrics once ``check`` holds: a worker counts an item just after acking it, which may be
    after the learner has it."""
    async def holds() -> bool:
        return check(await service.metrics())

    await until(holds, what)
    return await service.metrics()


def without(record: dict, *keys: str) -> dict:
    return {key: value for key, value in record.items() if key not in keys}


# ---- scoring, on both backends -------------------------------------------------------------------

async def test_finished_trajectories_come_out_scored(store_config: StoreConfig, episodes: Episodes) -> None:
    rollout = [member(episodes.good[0], "g-a", 0), member(episodes.good[1], "g-a", 1),
               member(episodes.bad, "g-a", 2)]
    store = build_store(store_config)
    async with RewardService(store_config, CHEAP, fleet(workers=2, concurrency=4),
                             tasks={episodes.task.id: episodes.task}) as service:
        await put_finished(store, rollout)
        (group,) = await collect(service, group_size=3, groups=1)
        assert await service.release_groups(3) == []
        metrics = await settled(service, lambda m: m.workers.scored >= 3, "the workers' counts")
        # Each stream's last reader released what it took: the store holds nothing of a done group.
        assert (await store.held(FINISHED), await store.held(SCORED)) == (0, 0)
    await store.close()

    assert [(t.uid, t.sample) for t in group] == [("g-a", 0), ("g-a", 1), ("g-a", 2)]
    assert [t.outcome for t in group] == [1.0, 1.0, -1.0]
    events = [event for turn in group[0].turns for event in turn.events]
    assert "answer_correct" in events and all(turn.step_score is not None for turn in group[0].turns)
    # One trajectory at a time gives what the offline scorer gives on the whole group, and the
    # rollout's own fields (weights versions included) come back untouched.
    offline = [Trajectory.from_json(t.to_json()) for t in rollout]
    assert await score_groups(CHEAP, offline, {episodes.task.id: episodes.task}) == 0
    assert [t.to_json() for t in group] == [t.to_json() for t in offline]
    assert [[turn.weights_version for turn in t.turns] for t in group] == \
        [[turn.weights_version for turn in t.turns] for t in rollout]

    assert (metrics.workers.scored, metrics.workers.rescored, metrics.workers.failed) == (3, 0, 0)
    assert metrics.workers.failures == {}
    assert (metrics.finished_length, metrics.finished_pending) == (3, 0)
    assert (metrics.scored_length, metrics.scored_pending) == (3, 0)
    assert (metrics.buffered, metrics.released_groups, metrics.released) == (0, 1, 3)


async def test_a_group_is_released_only_when_complete(store_config: StoreConfig,
                                                      episodes: Episodes) -> None:
    store = build_store(store_config)
    async with RewardService(store_config, CHEAP[:1], fleet(),
                             tasks={episodes.task.id: episodes.task}) as service:
        await put_finished(store, [member(episodes.good[0], "late", 0), member(episodes.good[0], "full", 0),
                                   member(episodes.bad, "full", 1)])
        (full,) = await collect(service, group_size=2, groups=1)
        assert [(t.uid, t.sample, t.outcome) for t in full] == [("full", 0, 1.0), ("full", 1, -1.0)]

        async def late_member_is_held() -> bool:  # scored and held, but its group is incomplete
            assert await service.release_groups(2) == []
            return (await service.metrics()).buffered == 1

        await until(late_member_is_held, "the scored member of the incomplete group")
        assert await store.pending(SCORED, LEARNER_GROUP) == 1  # held, not acked
        await put_finished(store, [member(episodes.bad, "late", 1)])
        (late,) = await collect(service, group_size=2, groups=1)
        assert [(t.uid, t.sample, t.outcome) for t in late] == [("late", 0, 1.0), ("late", 1, -1.0)]
        assert await store.pending(SCORED, LEARNER_GROUP) == 0
        assert (await service.metrics()).buffered == 0
    await store.close()


async def test_a_killed_worker_loses_nothing_and_duplicates_nothing(
        store_config: StoreConfig, episodes: Episodes, tmp_path: Path) -> None:
    gate = tmp_path / "open"
    groups = 5
    rollout = [member(source, f"k-{g}", sample)
               for g in range(groups) for sample, source in enumerate((episodes.good[0], episodes.bad))]
    store = build_store(store_config)
    rewards = [PluginSpec("exact_match"), PluginSpec(GATED, {"gate": str(gate)})]
    config = fleet(workers=2, concurrency=3, reclaim_idle_ms=2000, max_deliveries=100)
    async with RewardService(store_config, rewards, config,
                             tasks={episodes.task.id: episodes.task}) as service:
        await put_finished(store, rollout)
        doomed = service.workers[0]

        async def doomed_holds_items() -> bool:
            return (await doomed.counts.remote()).in_flight > 0

        await until(doomed_holds_items, "worker 0 to claim items")  # claimed, unacked: the gate is shut
        ray.kill(doomed, no_restart=False)  # Ray restarts it
        gate.touch()
        released = await collect(service, group_size=2, groups=groups)
        assert await service.release_groups(2) == []

        async def restarted_and_drained() -> bool:
            await service.release_groups(2)  # restarts the loop of the restarted worker
            metrics = await service.metrics()
            return (metrics.worker_restarts == 1 and metrics.finished_pending == 0
                    and metrics.workers.rescored >= 1)  # the killed worker's items came again

        await until(restarted_and_drained, "worker 0 to come back and every item to be acked")
        metrics = await service.metrics()
    await store.close()

    received = Counter((t.uid, t.sample) for group in released for t in group)
    assert set(received) == {(t.uid, t.sample) for t in rollout}
    assert max(received.values()) == 1  # exactly once on the learner side
    assert all([t.outcome for t in group] == [1.0, -1.0] for group in released)
    assert metrics.scored_length == len(rollout)  # exactly once on "scored" too
    assert metrics.workers.failed == 0 and metrics.workers_alive == 2


async def test_items_scored_twice_reach_the_learner_once(store_config: StoreConfig, episodes: Episodes,
                                                        tmp_path: Path) -> None:
    """Scoring slower than reclaim_idle_ms: each worker takes over the other's held items, so every
    item is scored and put by both; the store keeps the first put of each id."""
    gate = tmp_path / "open"
    rollout = [member(source, f"d-{g}", sample)
               for g in range(2) for sample, source in enumerate((episodes.good[0], episodes.bad))]
    store = build_store(store_config)
    rewards = [PluginSpec("exact_match"), PluginSpec(GATED, {"gate": str(gate)})]
    config = fleet(workers=2, concurrency=len(rollout), reclaim_idle_ms=300, max_deliveries=10_000)
    async with RewardService(store_config, rewards, config,
                             tasks={episodes.task.id: episodes.task}) as service:
        await put_finished(store, rollout)

        async def both_hold_everything() -> bool:
            counts = [await worker.counts.remote() for worker in service.workers]
            return all(c.in_flight == len(rollout) for c in counts)

        await until(both_hold_everything, "both workers to hold every item")
        gate.touch()
        released = await collect(service, group_size=2, groups=2)

        async def all_acked() -> bool:  # the slower worker's put and ack follow the release
            return await store.pending(FINISHED, REWARD_GROUP) == 0 and \
                (await service.metrics()).workers.scored == 2 * len(rollout)

        await until(all_acked, "both workers to finish every item")
        metrics = await service.metrics()
        duplicates = await store.duplicates(SCORED)
    await store.close()

    received = Counter((t.uid, t.sample) for group in released for t in group)
    assert set(received) == {(t.uid, t.sample) for t in rollout} and max(received.values()) == 1
    assert all([t.outcome for t in group] == [1.0, -1.0] for group in released)
    assert metrics.scored_length == len(rollout) and duplicates == len(rollout)


async def test_a_failing_plugin_is_retried_then_recorded(store_config: StoreConfig,
                                                         episodes: Episodes) -> None:
    rollout = [member(episodes.good[0], "f", 0), member(episodes.good[1], "f", 1)]
    store = build_store(store_config)
    rewards = [PluginSpec("exact_match"), PluginSpec(FAILING, {"sample": 1})]
    config = fleet(workers=1, reclaim_idle_ms=200, max_deliveries=2)
    async with RewardService(store_config, rewards, config,
                             tasks={episodes.task.id: episodes.task}) as service:
        await put_finished(store, rollout)
        (group,) = await collect(service, group_size=2, groups=1)  # the group still completes
        metrics = await settled(service, lambda m: m.workers.scored + m.workers.failed >= 2,
                                "the workers' counts")
    await store.close()

    scored, failed = group
    assert scored.outcome == 1.0 and "reward_error" not in scored.metadata
    error = failed.metadata["reward_error"]
    assert error["plugin"] == FAILING and error["error"] == "RuntimeError: no score for sample 1"
    assert error["deliveries"] >= 2
    # Put unscored: exact_match's outcome from the failed try is not kept, nothing else changed.
    assert failed.outcome is None
    assert without(failed.to_json(), "metadata") == without(rollout[1].to_json(), "metadata")
    assert metrics.workers.failures == {FAILING: 2}  # one failed try per delivery, two deliveries
    assert (metrics.workers.scored, metrics.workers.failed) == (1, 1)
    assert metrics.finished_pending == 0


# ---- tasks and junk (one backend: nothing here depends on it) ------------------------------------

@pytest.mark.integration
async def test_a_task_added_late_is_still_scored_and_junk_is_dropped(memory_config: StoreConfig,
                                                                      episodes: Episodes) -> None:
    store = build_store(memory_config)
    async with RewardService(memory_config, CHEAP[:1],
                             fleet(reclaim_idle_ms=200, max_deliveries=1000)) as service:
        await store.put(FINISHED, "junk", {"not": "a trajectory"})
        await put_finished(store, [member(episodes.good[0], "t", 0)])

        async def task_missed() -> bool:
            counts = (await service.metrics()).workers
            return counts.failures.get(MISSING_TASK, 0) >= 1 and counts.unreadable == 1

        await until(task_missed, "the worker to miss the task")
        await service.add_tasks([episodes.task])
        (group,) = await collect(service, group_size=1, groups=1)
        metrics = await settled(service, lambda m: m.workers.scored >= 1, "the workers' counts")
        assert await store.pending(FINISHED, REWARD_GROUP) == 0
    await store.close()

    assert group[0].outcome == 1.0 and "reward_error" not in group[0].metadata
    assert metrics.workers.scored == metrics.workers.rescored == 1
    assert set(metrics.workers.failures) == {MISSING_TASK}


# ---- the collector alone, on both backends -------------------------------------------------------

async def test_collector_dedupes_and_recovers_after_a_driver_restart(store_config: StoreConfig,
                                                                      episodes: Episodes) -> None:
    first_store = build_store(store_config)
    scored = {f"{uid}/{s}": member(episodes.good[0], uid, s) for uid in ("a", "b", "c") for s in (0, 1)}
    for name in ("a/0", "b/0", "b/1", "c/0", "c/1"):
        await first_store.put(SCORED, name, scored[name].to_json())
    await first_store.put(SCORED, "b/1-rerun", scored["b/1"].to_json())  # a second item for b/1
    await first_store.put(SCORED, "junk", {"schema": 1})
    first = GroupCollector(first_store)
    with pytest.raises(ValueError, match="group_size"):
        await first.release(0)
    (b,) = await first.release(2, max_groups=1)
    assert [(t.uid, t.sample) for t in b] == [("b", 0), ("b", 1)]
    assert (first.buffered, first.duplicate_samples, first.unreadable) == (3, 1, 1)  # a/0, c/0, c/1
    await first_store.close()  # the driver dies holding a/0 and c

    second_store = build_store(store_config)
    second = GroupCollector(second_store)
    await second_store.put(SCORED, "a/1", scored["a/1"].to_json())
    released = await second.release(2, wait_s=DEADLINE_S)
    assert sorted((t.uid, t.sample) for group in released for t in group) == \
        [("a", 0), ("a", 1), ("c", 0), ("c", 1)]
    assert await second_store.pending(SCORED, LEARNER_GROUP) == 0
    assert await second.release(2) == []
    await second_store.close()


# ---- configuration and what travels to the actors ------------------------------------------------

def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match=r"reward.worker.concurrency"):
        RewardWorkerConfig(concurrency=0)
    with pytest.raises(ValueError, match=r"reward.workers"):
        RewardServiceConfig(workers=0)
    # Plugins are checked in the driver, before any store or actor exists.
    config = StoreConfig(kind="redis", url="redis://127.0.0.1:1/0")
    with pytest.raises(RewardError, match="unknown option 'gama'"):
        RewardService(config, [PluginSpec("exact_match", {"gama": 1})])
    with pytest.raises(RewardError, match="unknown reward kind 'no_such_reward'"):
        RewardService(config, [PluginSpec("no_such_reward")])
    with pytest.raises(ValueError, match="at least one reward plugin"):
        RewardService(config, [])


def test_what_the_workers_get_pickles(tasks: list[Task]) -> None:
    task = chain(tasks, hops=2)
    assert task.clues
    sent = (StoreConfig(kind="redis", url="redis://h:1/0", namespace="run"), CHEAP,
            fleet(workers=3, concurrency=2).worker, {task.id: task})
    assert pickle.loads(pickle.dumps(sent)) == sent

"""The TrajectoryStore contract, checked by the same tests on both backends.

Every test taking ``store`` runs twice: on the memory backend (a named Ray actor, on the session's
``ray_local`` cluster) and on the redis backend (the session's real ``redis-server``). Each test gets
its own namespace, so tests never see each other's items. Then a few tests that only make sense for
one backend: what the memory store loses with its actor, what Redis keeps across clients, and how an
unreachable Redis fails. No test depends on how fast the machine is: waits only ever make idle times
longer, and time limits are generous upper bounds.

Run: ``pytest tests/test_store.py``; the tests that start Ray or Redis are marked ``integration``.
"""

from __future__ import annotations

import asyncio
import pickle
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import ray

from tests.conftest import free_port
from turnstile.rollout.store import (
    FINISHED,
    SCORED,
    Claimed,
    StoreConfig,
    StoreUnavailableError,
    TrajectoryStore,
    build_store,
)
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn

MEMORY_ACTOR = "turnstile-store-tests"
BACKENDS = [pytest.param(kind, id=kind, marks=pytest.mark.integration) for kind in ("memory", "redis")]


def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=BACKENDS)
def store_config(request: pytest.FixtureRequest) -> StoreConfig:
    if request.param == "memory":
        request.getfixturevalue("ray_local")
        return StoreConfig(kind="memory", namespace=namespace(), actor_name=MEMORY_ACTOR)
    # timeout_s=2: a blocking claim of more than a second waits in several slices.
    return StoreConfig(kind="redis", url=request.getfixturevalue("redis_url"), namespace=namespace(),
                       timeout_s=2.0)


@pytest_asyncio.fixture(loop_scope="function")  # the loop of the test that uses the client
async def store(store_config: StoreConfig) -> AsyncIterator[TrajectoryStore]:
    client = build_store(store_config)
    yield client
    await client.close()


def ids(claimed: list[Claimed]) -> list[str]:
    return [item.id for item in claimed]


async def fill(store: TrajectoryStore, stream: str, count: int) -> list[str]:
    names = [f"item-{i}" for i in range(count)]
    for i, name in enumerate(names):
        await store.put(stream, name, {"n": i, "name": name})
    return names


# ---- the contract, on both backends --------------------------------------------------------------

async def test_put_claim_ack_round_trip(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 3)
    assert await store.length(FINISHED) == 3
    claimed = await store.claim(FINISHED, "rewards", "w0", count=10)
    assert ids(claimed) == names  # in the order they were put
    assert [item.payload for item in claimed] == [{"n": i, "name": n} for i, n in enumerate(names)]
    assert all(item.deliveries == 1 for item in claimed)
    assert await store.pending(FINISHED, "rewards") == 3
    assert await store.claim(FINISHED, "rewards", "w0", count=10) == []  # nothing new
    assert await store.ack(FINISHED, "rewards", names) == 3
    assert await store.pending(FINISHED, "rewards") == 0
    assert await store.ack(FINISHED, "rewards", names) == 0  # acking twice is harmless
    assert await store.length(FINISHED) == 3  # acks do not delete items
    assert await store.length(SCORED) == 0


async def test_an_ack_that_releases_drops_the_payloads_for_good_and_keeps_the_counts(
        store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 4)
    claimed = await store.claim(FINISHED, "rewards", "w0", count=3)
    assert await store.ack(FINISHED, "rewards", names[:2], release=True) == 2
    assert await store.pending(FINISHED, "rewards") == 1
    assert (await store.length(FINISHED), await store.held(FINISHED)) == (4, 2)
    # Released twice, or acked again: nothing more happens.
    assert await store.ack(FINISHED, "rewards", names[:2], release=True) == 0
    assert await store.held(FINISHED) == 2
    # Its id is still known: a producer's retry is a duplicate, not a new item.
    await store.put(FINISHED, names[0], {"n": 0, "name": names[0]})
    assert await store.duplicates(FINISHED) == 1 and await store.held(FINISHED) == 2
    # A group that had not read them skips them; the group's own unread item still comes.
    assert ids(await store.claim(FINISHED, "audit", "a0", count=10)) == names[2:]
    assert ids(await store.claim(FINISHED, "rewards", "w0", count=10)) == names[3:]
    # What is left pending is still reclaimed, with its payload.
    await asyncio.sleep(0.3)
    taken = await store.reclaim(FINISHED, "rewards", "rescuer", min_idle_ms=200, count=10)
    assert ids(taken) == names[2:] and taken[0].payload == claimed[2].payload
    assert await store.ack(FINISHED, "rewards", names[2:], release=True) == 2
    assert await store.held(FINISHED) == 0 and await store.length(FINISHED) == 4


async def test_a_blocking_claim_waits_past_released_items_for_a_new_one(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 2)
    await store.claim(FINISHED, "rewards", "w0", count=2)
    await store.ack(FINISHED, "rewards", names, release=True)
    waiting = asyncio.create_task(store.claim(FINISHED, "audit", "a0", count=5, block_ms=60_000))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await store.put(FINISHED, "late", {"n": 9})
    assert ids(await asyncio.wait_for(waiting, 10)) == ["late"]


async def test_put_is_idempotent_per_item_id(store: TrajectoryStore) -> None:
    await store.put(FINISHED, "traj-1", {"attempt": 1})
    await store.put(FINISHED, "traj-1", {"attempt": 2})  # a producer retrying after an error
    await store.put(FINISHED, "traj-1", {"attempt": 3})
    assert await store.length(FINISHED) == 1
    assert await store.duplicates(FINISHED) == 2
    claimed = await store.claim(FINISHED, "rewards", "w0", count=10)
    assert [(c.id, c.payload) for c in claimed] == [("traj-1", {"attempt": 1})]
    # The same id on another stream is another item (a scored trajectory keeps its id).
    await store.put(SCORED, "traj-1", {"attempt": 1, "outcome": 1.0})
    assert await store.length(SCORED) == 1 and await store.duplicates(SCORED) == 0


async def test_claim_waits_for_an_item_when_asked_to_block(store: TrajectoryStore) -> None:
    waiting = asyncio.create_task(store.claim(FINISHED, "rewards", "w0", count=5, block_ms=60_000))
    await asyncio.sleep(0.2)
    await store.put(FINISHED, "late", {"n": 1})
    claimed = await asyncio.wait_for(waiting, timeout=60)
    assert ids(claimed) == ["late"]
    # Nothing arrives: an empty list once block_ms has passed (slower machines only wait longer).
    started = time.monotonic()
    assert await store.claim(FINISHED, "rewards", "w0", count=5, block_ms=1500) == []
    assert time.monotonic() - started >= 1.4
    assert await store.claim(FINISHED, "rewards", "w0", count=5, block_ms=0) == []


async def test_consumers_of_one_group_never_share_an_item(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 10)
    first = await store.claim(FINISHED, "rewards", "w0", count=4)
    second = await store.claim(FINISHED, "rewards", "w1", count=100)
    assert len(first) == 4 and len(second) == 6
    assert set(ids(first)).isdisjoint(ids(second))
    assert sorted(ids(first) + ids(second)) == sorted(names)
    assert await store.claim(FINISHED, "rewards", "w0", count=100) == []
    assert await store.claim(FINISHED, "rewards", "w2", count=100) == []


async def test_every_group_gets_every_item(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 5)
    rewards = await store.claim(FINISHED, "rewards", "w0", count=100)
    await store.ack(FINISHED, "rewards", ids(rewards))
    # A group that starts later still reads from the first item, and the other group's acks
    # do not touch its pending list.
    audit = await store.claim(FINISHED, "audit", "a0", count=100)
    assert ids(rewards) == ids(audit) == names
    assert await store.pending(FINISHED, "rewards") == 0
    assert await store.pending(FINISHED, "audit") == 5


async def test_dead_consumers_items_are_reclaimed_after_min_idle(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 3)
    held = await store.claim(FINISHED, "rewards", "doomed", count=2)  # then "doomed" dies
    assert ids(held) == names[:2]
    # Not idle long enough yet (a minute): nothing moves.
    assert await store.reclaim(FINISHED, "rewards", "rescuer", min_idle_ms=60_000) == []
    await asyncio.sleep(0.3)
    taken = await store.reclaim(FINISHED, "rewards", "rescuer", min_idle_ms=200, count=10)
    assert ids(taken) == names[:2]
    assert [c.payload for c in taken] == [c.payload for c in held]
    assert [c.deliveries for c in taken] == [2, 2]
    assert await store.pending(FINISHED, "rewards") == 2  # still pending, now owned by "rescuer"
    # Reclaiming resets the idle time, so a second rescuer must wait again ...
    assert await store.reclaim(FINISHED, "rewards", "second", min_idle_ms=60_000) == []
    # ... and takes the oldest first when asked for fewer than there are.
    await asyncio.sleep(0.3)
    again = await store.reclaim(FINISHED, "rewards", "second", min_idle_ms=200, count=1)
    assert ids(again) == names[:1] and again[0].deliveries == 3
    # The item nobody claimed is still new to the group.
    fresh = await store.claim(FINISHED, "rewards", "rescuer", count=10)
    assert ids(fresh) == names[2:] and fresh[0].deliveries == 1
    assert await store.ack(FINISHED, "rewards", names) == 3
    assert await store.pending(FINISHED, "rewards") == 0
    await asyncio.sleep(0.3)
    assert await store.reclaim(FINISHED, "rewards", "late", min_idle_ms=0) == []  # acked: gone


async def test_ack_removes_only_acked_items_from_pending(store: TrajectoryStore) -> None:
    names = await fill(store, FINISHED, 3)
    await store.claim(FINISHED, "rewards", "w0", count=3)
    assert await store.pending(FINISHED, "rewards") == 3
    assert await store.ack(FINISHED, "rewards", [names[1]]) == 1
    assert await store.pending(FINISHED, "rewards") == 2
    assert await store.ack(FINISHED, "rewards", ["never-put"]) == 0
    assert await store.ack(FINISHED, "other-group", [names[0]]) == 0
    assert await store.ack(FINISHED, "rewards", []) == 0
    assert await store.pending(FINISHED, "rewards") == 2
    assert await store.pending(FINISHED, "never-claimed") == 0
    await asyncio.sleep(0.3)
    assert sorted(ids(await store.reclaim(FINISHED, "rewards", "w1", min_idle_ms=0))) == [names[0],
                                                                                          names[2]]


async def test_checkpoint_save_load_drop(store: TrajectoryStore, store_config: StoreConfig) -> None:
    assert await store.load_checkpoint("episode/uid-7/0") is None
    await store.checkpoint("episode/uid-7/0", {"turn": 4, "ids": [1, 2, 3]})
    assert await store.load_checkpoint("episode/uid-7/0") == {"turn": 4, "ids": [1, 2, 3]}
    await store.checkpoint("episode/uid-7/0", {"turn": 8, "ids": [1, 2, 3, 4]})  # overwritten
    assert await store.load_checkpoint("episode/uid-7/0") == {"turn": 8, "ids": [1, 2, 3, 4]}
    # Another run (namespace) on the same backend does not see it.
    other = build_store(StoreConfig(kind=store_config.kind, url=store_config.url,
                                    namespace=namespace(), actor_name=store_config.actor_name))
    try:
        assert await other.load_checkpoint("episode/uid-7/0") is None
        assert await other.length(FINISHED) == 0
        await other.checkpoint("episode/other/0", {"turn": 1})
        assert await other.checkpoint_keys() == ["episode/other/0"]
    finally:
        await other.close()
    await store.checkpoint("episode:a*[1]:2", {"turn": 2})  # glob characters are only characters
    assert await store.checkpoint_keys() == ["episode/uid-7/0", "episode:a*[1]:2"]
    await store.drop_checkpoint("episode/uid-7/0")
    assert await store.load_checkpoint("episode/uid-7/0") is None
    await store.drop_checkpoint("episode/uid-7/0")  # dropping twice is harmless
    assert await store.checkpoint_keys() == ["episode:a*[1]:2"]


def long_trajectory(turns: int, rng: random.Random) -> Trajectory:
    """A real trajectory record: two segments, many turns, every field filled."""
    def turn(index: int) -> Turn:
        response = [rng.randrange(50_000) for _ in range(rng.randint(20, 300))]
        return Turn(index=index, response_ids=response,
                    response_logprobs=[-rng.random() * 5 for _ in response], weights_version=3,
                    context_len=1000 + index, finish_reason="stop", response_text="<search>q</search>",
                    action="tool_call", tool="search", arguments={"query": f"q{index} é 中"},
                    format_ok=True, observation_text="result \u00e9 \u4e2d \"quoted\"\n",
                    observation_ids=[rng.randrange(50_000) for _ in range(200)], tool_ok=True,
                    generate_s=0.25, tool_s=0.5, ig_value=0.1, ig=-0.02, reward=0.3,
                    step_score=1.0, events=["clue:1"], advantage=0.7)

    half = turns // 2
    return Trajectory(uid="task-9", sample=3, task_id="hotpot-9", question="Who?", answers=["A", "B"],
                      segments=[Segment(prompt_ids=list(range(100)), turns=[turn(i) for i in range(half)]),
                                Segment(prompt_ids=list(range(50)),
                                        turns=[turn(i) for i in range(half, turns)])],
                      stop_reason=StopReason.ANSWERED, answer="A", context_manager="summary",
                      policy="tiny-qwen3", wall_s=812.5, outcome=1.0, metadata={"seed": 3, "k": [1]})


async def test_trajectory_record_round_trips(store: TrajectoryStore) -> None:
    trajectory = long_trajectory(turns=200, rng=random.Random(0))  # a few MB of JSON
    await store.put(FINISHED, "task-9/3", trajectory.to_json())
    (claimed,) = await store.claim(FINISHED, "rewards", "w0", count=1)
    assert Trajectory.from_json(claimed.payload) == trajectory
    await store.checkpoint("task-9/3", trajectory.to_json())
    assert Trajectory.from_json(await store.load_checkpoint("task-9/3")) == trajectory


async def test_payloads_and_names_are_checked(store: TrajectoryStore) -> None:
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        await store.put(FINISHED, "bad", {"ids": {1, 2}})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        await store.put(FINISHED, "nan", {"logprob": float("nan")})
    with pytest.raises(ValueError, match="JSON object"):
        await store.put(FINISHED, "list", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream name"):
        await store.put("finished stream", "x", {})
    with pytest.raises(ValueError, match="item id"):
        await store.put(FINISHED, "", {})
    with pytest.raises(ValueError, match="count"):
        await store.claim(FINISHED, "rewards", "w0", count=0)
    assert await store.length(FINISHED) == 0  # nothing half-written


async def test_client_pickles_and_works_where_it_lands(store: TrajectoryStore, ray_local: None) -> None:
    await store.put(FINISHED, "before", {"n": 0})
    copy = pickle.loads(pickle.dumps(store))
    try:
        assert await copy.length(FINISHED) == 1
        await copy.put(FINISHED, "from-copy", {"n": 1})
    finally:
        await copy.close()
    via_ray = ray.get(ray.put(store))
    try:
        assert await via_ray.length(FINISHED) == 2
    finally:
        await via_ray.close()

    @ray.remote(num_cpus=0)
    def produce(client: TrajectoryStore) -> int:  # runs in another process, as a worker would
        async def run() -> int:
            try:
                await client.put(FINISHED, "from-task", {"n": 2})
                return await client.length(FINISHED)
            finally:
                await client.close()

        return asyncio.run(run())

    assert ray.get(produce.remote(store), timeout=300) == 3
    claimed = await store.claim(FINISHED, "rewards", "w0", count=10)
    assert ids(claimed) == ["before", "from-copy", "from-task"]


async def test_concurrent_producers_and_consumers_get_each_item_once(store: TrajectoryStore) -> None:
    producers, per_producer, consumers = 4, 30, 3
    expected = {f"p{p}-{i}" for p in range(producers) for i in range(per_producer)}
    received: list[str] = []
    done = asyncio.Event()

    async def produce(p: int) -> None:
        for i in range(per_producer):
            await store.put(FINISHED, f"p{p}-{i}", {"producer": p, "i": i})
            if i % 6 == 0:  # a retry after a lost reply: must not duplicate
                await store.put(FINISHED, f"p{p}-{i}", {"producer": p, "i": i})
            await asyncio.sleep(0)

    async def consume(c: int) -> None:
        while not done.is_set():
            claimed = await store.claim(FINISHED, "rewards", f"c{c}", count=4, block_ms=100)
            for item in claimed:
                assert item.payload == {"producer": int(item.id[1:].split("-")[0]),
                                        "i": int(item.id.split("-")[1])}
                received.append(item.id)
            await store.ack(FINISHED, "rewards", ids(claimed))
            if len(received) >= len(expected):
                done.set()

    await asyncio.wait_for(asyncio.gather(*(produce(p) for p in range(producers)),
                                          *(consume(c) for c in range(consumers))), timeout=300)
    counts = Counter(received)
    assert set(counts) == expected
    assert max(counts.values()) == 1  # exactly once
    assert await store.length(FINISHED) == len(expected)
    assert await store.duplicates(FINISHED) == producers * 5
    assert await store.pending(FINISHED, "rewards") == 0


# ---- configuration -------------------------------------------------------------------------------

def test_unknown_kind_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown store.kind 'kafka'; known: memory, redis"):
        build_store(StoreConfig(kind="kafka"))


def test_redis_needs_a_url() -> None:
    with pytest.raises(ValueError, match=r"store.url is required.*redis://"):
        build_store(StoreConfig(kind="redis"))


# ---- what each backend survives ------------------------------------------------------------------

@pytest.mark.integration
async def test_memory_store_loses_everything_with_its_actor(ray_local: None) -> None:
    config = StoreConfig(kind="memory", namespace=namespace(), actor_name=f"store-{uuid.uuid4().hex[:8]}")
    store = build_store(config)
    await store.put(FINISHED, "a", {"n": 1})
    await store.checkpoint("episode", {"turn": 3})
    shared = build_store(config)  # a second client finds the same actor by name
    assert await shared.length(FINISHED) == 1
    ray.kill(ray.get_actor(config.actor_name))
    # ray.kill only sends the kill: a call that reaches the actor first is still answered. Within
    # seconds every call must fail, saying the data is lost.
    with pytest.raises(StoreUnavailableError, match="lost"):
        for _ in range(100):
            await store.length(FINISHED)
            await asyncio.sleep(0.1)
    # The name is free again: a new store starts empty. Nothing came back.
    await asyncio.sleep(0.5)
    reborn = build_store(config)
    assert await reborn.length(FINISHED) == 0
    assert await reborn.load_checkpoint("episode") is None
    ray.kill(ray.get_actor(config.actor_name))


@pytest.mark.integration
async def test_redis_store_outlives_its_clients(redis_url: str) -> None:
    config = StoreConfig(kind="redis", url=redis_url, namespace=namespace())
    first = build_store(config)
    await fill(first, FINISHED, 2)
    await first.claim(FINISHED, "rewards", "w0", count=2)  # then w0 and its process die
    await first.checkpoint("episode", {"turn": 3})
    await first.close()
    await first.close()  # safe twice
    second = build_store(config)
    try:
        assert await second.length(FINISHED) == 2
        assert await second.pending(FINISHED, "rewards") == 2
        assert await second.load_checkpoint("episode") == {"turn": 3}
        await second.put(FINISHED, "item-0", {"again": True})  # still deduplicated
        assert await second.length(FINISHED) == 2
        await asyncio.sleep(0.3)
        taken = await second.reclaim(FINISHED, "rewards", "w1", min_idle_ms=200)
        assert ids(taken) == ["item-0", "item-1"] and {c.deliveries for c in taken} == {2}
    finally:
        await second.close()


@pytest.mark.integration
async def test_unreachable_redis_is_a_clear_error_not_a_hang() -> None:
    port = free_port()  # nothing listens there
    store = build_store(StoreConfig(kind="redis", url=f"redis://127.0.0.1:{port}/0", timeout_s=1.0))
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=rf"127\.0\.0\.1:{port}.*redis-server --port {port}"):
        await store.put(FINISHED, "a", {"n": 1})
    with pytest.raises(StoreUnavailableError):
        await store.claim(FINISHED, "rewards", "w0", block_ms=60_000)
    assert time.monotonic() - started < 60  # refused at once; retries are few and short
    await store.close()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung or firewalled server)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield server.getsockname()[1]


@pytest.mark.integration
async def test_silent_redis_times_out(silent_server: int) -> None:
    store = build_store(StoreConfig(kind="redis", url=f"redis://:hunter2@127.0.0.1:{silent_server}/0",
                                    timeout_s=0.5, retries=1))
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"Timeout") as raised:
        await store.ready()
    assert "hunter2" not in str(raised.value)  # the password never reaches a log
    assert time.monotonic() - started < 60
    await store.close()

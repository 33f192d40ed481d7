"""The memory trajectory store: every stream and checkpoint lives in one named Ray actor.

The default, for one-machine runs and tests: nothing to install, and every process of the Ray job
(driver, rollout workers, reward workers, learner) shares the same actor through the client, which
pickles as the actor's handle. Semantics match the Redis backend: consumer groups, pending lists,
delivery counts, idle times and reclaim.

What it cannot survive: the actor's death loses everything (streams, pending lists, checkpoints),
because it is only in memory. The actor dies with the Ray job, with the process that created it (a
non-detached actor shares its owner's fate: build the store in the driver first, then hand the
client to actors), with its node, or when killed. It is started with ``max_restarts=0`` on purpose: a
restarted actor would be empty, and an empty store that answers is worse than calls that fail with
:class:`~turnstile.rollout.store.base.StoreUnavailableError`. Use ``kind=redis`` when a run must outlive
those failures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from turnstile.envs.tools.base import JsonObject
from turnstile.rollout.store.base import (
    Claimed,
    StoreConfig,
    StoreUnavailableError,
    TrajectoryStore,
    check_count,
    check_id,
    check_name,
    decode_payload,
    encode_payload,
)

T = TypeVar("T")
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)
# What the actor hands back for one claimed item: (item id, payload JSON, delivery count).
_Delivery = tuple[str, str, int]


@dataclass
class _Pending:
    consumer: str
    delivered_at: float  # time.monotonic() of the last delivery: idle time counts from here
    deliveries: int


@dataclass
class _Group:
    delivered: int = 0  # entries[:delivered] have been handed to some consumer of the group
    # Keyed by entry index. Items enter in index order and reclaim updates them in place, so the
    # dict's order is the stream's order, as in Redis' pending entries list.
    pending: dict[int, _Pending] = field(default_factory=dict)


@dataclass
class _Stream:
    entries: list[tuple[str, str | None]] = field(default_factory=list)  # (item id, payload JSON; None: released)
    index: dict[str, int] = field(default_factory=dict)  # item id -> position in entries
    groups: dict[str, _Group] = field(default_factory=dict)
    duplicates: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) by each put


class MemoryStoreActor:
    """The state of every memory store sharing one actor name. Wrapped with ``ray.remote`` by
    :class:`MemoryTrajectoryStore`. Its methods are async and never await while changing state, so
    the actor's single event loop makes each of them atomic, as a Redis command is."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._checkpoints: dict[str, str] = {}

    def _stream(self, name: str) -> _Stream:
        return self._streams.setdefault(name, _Stream())

    async def ping(self) -> bool:
        return True

    async def put(self, stream: str, item_id: str, payload: str) -> bool:
        state = self._stream(stream)
        if item_id in state.index:
            state.duplicates += 1
            return False
        state.index[item_id] = len(state.entries)
        state.entries.append((item_id, payload))
        state.arrived.set()  # wake blocked claims
        state.arrived = asyncio.Event()
        return True

    async def claim(self, stream: str, group: str, consumer: str, count: int,
                    block_ms: int) -> list[_Delivery]:
        state = self._stream(stream)
        members = state.groups.setdefault(group, _Group())
        deadline = time.monotonic() + block_ms / 1000
        claimed: list[_Delivery] = []
        while True:
            while members.delivered < len(state.entries) and len(claimed) < count:
                position = members.delivered
                members.delivered += 1
                item_id, payload = state.entries[position]
                if payload is not None:  # a released item is skipped
                    members.pending[position] = _Pending(consumer, time.monotonic(), 1)
                    claimed.append((item_id, payload, 1))
            remaining = deadline - time.monotonic()
            if claimed or remaining <= 0:
                return claimed
            try:
                await asyncio.wait_for(state.arrived.wait(), remaining)
            except TimeoutError:
                return []

    async def ack(self, stream: str, group: str, ids: list[str], release: bool) -> int:
        state = self._streams.get(stream)
        members = state.groups.get(group) if state else None
        if state is None or members is None:
            return 0
        acked = 0
        for item_id in ids:
            position = state.index.get(item_id)
            if position is not None and members.pending.pop(position, None) is not None:
                acked += 1
            if release and position is not None and state.entries[position][1] is not None:
                state.entries[position] = (item_id, None)
                for other in state.groups.values():  # as Redis' XDEL: nobody can reclaim it now
                    other.pending.pop(position, None)
        return acked

    async def reclaim(self, stream: str, group: str, consumer: str, min_idle_ms: int,
                      count: int) -> list[_Delivery]:
        state = self._stream(stream)
        members = state.groups.setdefault(group, _Group())
        now = time.monotonic()
        claimed: list[_Delivery] = []
        for position, entry in members.pending.items():
            if len(claimed) >= count:
                break
            if (now - entry.delivered_at) * 1000 < min_idle_ms:
                continue
            entry.consumer, entry.delivered_at, entry.deliveries = consumer, now, entry.deliveries + 1
            item_id, payload = state.entries[position]
            assert payload is not None  # releasing an item takes it off every pending list
            claimed.append((item_id, payload, entry.deliveries))
        return claimed

    async def pending(self, stream: str, group: str) -> int:
        state = self._streams.get(stream)
        members = state.groups.get(group) if state else None
        return len(members.pending) if members else 0

    async def length(self, stream: str) -> int:
        state = self._streams.get(stream)
        return len(state.entries) if state else 0

    async def held(self, stream: str) -> int:
        state = self._streams.get(stream)
        return sum(payload is not None for _, payload in state.entries) if state else 0

    async def duplicates(self, stream: str) -> int:
        state = self._streams.get(stream)
        return state.duplicates if state else 0

    async def checkpoint(self, key: str, payload: str) -> None:
        self._checkpoints[key] = payload

    async def load_checkpoint(self, key: str) -> str | None:
        return self._checkpoints.get(key)

    async def drop_checkpoint(self, key: str) -> None:
        self._checkpoints.pop(key, None)

    async def checkpoint_keys(self, prefix: str) -> list[str]:
        return sorted(key[len(prefix):] for key in self._checkpoints if key.startswith(prefix))


class MemoryTrajectoryStore(TrajectoryStore):
    """Client of a :class:`MemoryStoreActor`: finds the actor named ``config.actor_name`` in the
    current Ray namespace, or starts it. Pickles as the actor handle plus the namespace."""

    def __init__(self, config: StoreConfig) -> None:
        if not ray.is_initialized():
            raise StoreUnavailableError("the memory store lives in a Ray actor, and Ray is not "
                                        "initialised: call ray.init() first (the driver does)")
        self._namespace = check_name("store namespace", config.namespace)
        self._actor_name = check_name("store actor", config.actor_name)
        # num_cpus=0: bookkeeping only, it must not take a CPU slot from rollout workers. Ray types
        # .remote() as ActorHandle | type[MemoryStoreActor]; it is the handle.
        self._actor: ray.actor.ActorHandle = ray.remote(MemoryStoreActor).options(  # type: ignore[assignment]
            name=self._actor_name, get_if_exists=True, num_cpus=0, max_concurrency=1000,
            max_restarts=0,
        ).remote()

    @classmethod
    def check_durability(cls, config: StoreConfig) -> None:
        """Nothing to check: choosing the memory store is choosing a store that lives and dies with
        its actor (see the module docstring); ``require_durable`` concerns servers (redis)."""

    def _key(self, what: str, name: str) -> str:
        return f"{self._namespace}/{check_name(what, name)}"

    async def _call(self, reply: Awaitable[T]) -> T:
        try:
            return await reply
        except _DEAD as error:
            raise StoreUnavailableError(
                f"the memory store's actor {self._actor_name!r} is dead, and everything it held "
                f"(streams, pending items, checkpoints) is lost with it ({type(error).__name__}). "
                "Restart the run; use store.kind=redis for a store that survives this."
            ) from None

    async def ready(self) -> None:
        await self._call(self._actor.ping.remote())

    async def put(self, stream: str, item_id: str, payload: JsonObject) -> None:
        text = encode_payload(check_id("item id", item_id), payload)
        await self._call(self._actor.put.remote(self._key("stream", stream), item_id, text))

    async def claim(self, stream: str, group: str, consumer: str, count: int = 1,
                    block_ms: int = 0) -> list[Claimed]:
        check_name("group", group)
        check_name("consumer", consumer)
        check_count("count", count, 1)
        check_count("block_ms", block_ms, 0)
        delivered: list[_Delivery] = await self._call(self._actor.claim.remote(
            self._key("stream", stream), group, consumer, count, block_ms))
        return [Claimed(item_id, decode_payload(text), n) for item_id, text, n in delivered]

    async def ack(self, stream: str, group: str, ids: list[str], *, release: bool = False) -> int:
        check_name("group", group)
        return await self._call(self._actor.ack.remote(self._key("stream", stream), group, list(ids), release))

    async def reclaim(self, stream: str, group: str, consumer: str, min_idle_ms: int,
                      count: int = 100) -> list[Claimed]:
        check_name("group", group)
        check_name("consumer", consumer)
        check_count("min_idle_ms", min_idle_ms, 0)
        check_count("count", count, 1)
        delivered: list[_Delivery] = await self._call(self._actor.reclaim.remote(
            self._key("stream", stream), group, consumer, min_idle_ms, count))
        return [Claimed(item_id, decode_payload(text), n) for item_id, text, n in delivered]

    async def pending(self, stream: str, group: str) -> int:
        check_name("group", group)
        return await self._call(self._actor.pending.remote(self._key("stream", stream), group))

    async def length(self, stream: str) -> int:
        return await self._call(self._actor.length.remote(self._key("stream", stream)))

    async def held(self, stream: str) -> int:
        return await self._call(self._actor.held.remote(self._key("stream", stream)))

    async def duplicates(self, stream: str) -> int:
        return await self._call(self._actor.duplicates.remote(self._key("stream", stream)))

    async def checkpoint(self, key: str, payload: JsonObject) -> None:
        text = encode_payload(check_id("checkpoint key", key), payload)
        await self._call(self._actor.checkpoint.remote(f"{self._namespace}/{key}", text))

    async def load_checkpoint(self, key: str) -> JsonObject | None:
        check_id("checkpoint key", key)
        text: str | None = await self._call(self._actor.load_checkpoint.remote(f"{self._namespace}/{key}"))
        return None if text is None else decode_payload(text)

    async def drop_checkpoint(self, key: str) -> None:
        check_id("checkpoint key", key)
        await self._call(self._actor.drop_checkpoint.remote(f"{self._namespace}/{key}"))

    async def checkpoint_keys(self) -> list[str]:
        return await self._call(self._actor.checkpoint_keys.remote(f"{self._namespace}/"))

    async def close(self) -> None:
        """Nothing to release: the actor is shared, and stays up for the other clients."""

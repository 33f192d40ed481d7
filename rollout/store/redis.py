"""The Redis trajectory store: Redis Streams with consumer groups (redis-py asyncio).

For runs that must survive the loss of any worker, the driver or a store client: the items, pending
lists and checkpoints live in Redis, as durable as the server's persistence (see "Durability").

Layout, under the run's namespace ``ns`` (one namespace per run, so runs sharing a server never
collide; ``{stream}`` is a hash tag, so all keys of a stream sit in one Redis Cluster slot, all but
the marker, which ``put`` and ``ack`` also read: this client talks to one server, not a Cluster):

- ``ns:stream:{s}`` — the stream; each entry holds the fields ``item`` (the producer's id) and
  ``payload`` (JSON).
- ``ns:stream:{s}:item:<id>`` — the entry id of item ``<id>``: what makes ``put`` idempotent, and
  what ``ack`` maps item ids to entry ids with.
- ``ns:stream:{s}:duplicates`` — how many puts were ignored as duplicates.
- ``ns:stream:{s}:added`` — how many items were ever put (``length``; released entries leave the
  stream, their item keys stay).
- ``ns:checkpoint:<key>`` — an episode checkpoint, as JSON.
- ``ns:marker`` — a random token written by the namespace's first client (see "Lost data").

``put`` is one Lua script (check the id key, XADD, record the entry id), so a producer killed half
way never leaves an item id recorded without its entry. Groups are created on first use at the start
of the stream (XGROUP CREATE ... 0 MKSTREAM, BUSYGROUP ignored). ``reclaim`` is XAUTOCLAIM plus
XPENDING in one script, to report delivery counts. Every command has a connect and read timeout
(``StoreConfig.timeout_s``); a blocking ``claim`` waits in slices shorter than the read timeout, so
an unreachable server is an error within seconds, never a hang.

Durability. :meth:`RedisTrajectoryStore.check_durability` (``turnstile train`` calls it before it
starts anything) refuses a server that would lose acknowledged items if it restarted: no
append-only file, ``appendfsync no``, keys it may evict, or settings it hides (the reasons are in
:mod:`turnstile.rollout.store.redis_persistence`), unless ``store.require_durable=false``.

Lost data. A server that restarted without persistence (or was flushed) answers as an empty store:
a duplicate put would be accepted, acks would count 0, pending items would be forgotten. The marker
turns that into :class:`~turnstile.rollout.store.base.StoreDataLostError`. A restart drops every connection and
redis-py reconnects, so each new connection reads the marker in its handshake (pipelined with the
first-client ``SET NX``: one round trip per connection, none per command); ``put``, ``ack`` and
``load_checkpoint`` also read it inside their own command (the script, the ``MGET``), which catches
a flush on a live connection at no cost, and so does a vanished consumer group. Once lost, every
call raises: the failed connection is dropped, and the next one checks again.

The password comes from ``url`` or, better, from the environment variable ``password_env`` in each
process that connects; URLs in messages are masked (:func:`~turnstile.rollout.store.base.without_password`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from turnstile.envs.tools.base import JsonObject
from turnstile.rollout.store.base import (
    Claimed,
    StoreConfig,
    StoreDataLostError,
    StoreNotDurableError,
    StoreUnavailableError,
    TrajectoryStore,
    check_count,
    check_id,
    check_name,
    decode_payload,
    encode_payload,
    without_password,
)
from turnstile.rollout.store.redis_persistence import persistence_problems

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection
    from redis.commands.core import AsyncScript

T = TypeVar("T")
log = logging.getLogger(__name__)

# KEYS: stream, item key, duplicates counter, marker, added counter. ARGV: item id, payload, the marker this client
# knows ("" before its first connection). Returns 1 if added, 0 if a duplicate, -1 if the marker is
# not the one this client knows (the server lost the run's data: nothing is written).
_PUT = """
if ARGV[3] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[3] then
  return -1
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('INCR', KEYS[3])
  return 0
end
local entry = redis.call('XADD', KEYS[1], '*', 'item', ARGV[1], 'payload', ARGV[2])
redis.call('SET', KEYS[2], entry)
redis.call('INCR', KEYS[5])
return 1
"""

# KEYS: stream. ARGV: group, consumer, min idle ms, count. Returns {entry id, fields, deliveries}
# for each item taken over. XAUTOCLAIM scans the pending list in chunks; loop until it has been
# scanned to the end or ``count`` items were found.
_RECLAIM = """
local group, consumer, min_idle, count = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local cursor, out = '0-0', {}
repeat
  local reply = redis.call('XAUTOCLAIM', KEYS[1], group, consumer, min_idle, cursor,
                           'COUNT', count - #out)
  cursor = reply[1]
  for _, entry in ipairs(reply[2]) do
    if entry then
      local info = redis.call('XPENDING', KEYS[1], group, entry[1], entry[1], 1)
      out[#out + 1] = {entry[1], entry[2], info[1][4]}
    end
  end
until cursor == '0-0' or #out >= count
return out
"""


@dataclass
class _Connection:
    client: Redis
    put: AsyncScript
    reclaim: AsyncScript


class RedisTrajectoryStore(TrajectoryStore):
    """Client of a Redis server. Pickles as its config and the namespace's marker (once known); the
    connection pool is built lazily, on first use in the process (and event loop) that uses it."""

    def __init__(self, config: StoreConfig) -> None:
        if not config.url:
            raise ValueError("store.url is required for store.kind=redis, e.g. "
                             "store.url=redis://127.0.0.1:6379/0")
        if config.timeout_s <= 0:
            raise ValueError(f"store.timeout_s must be > 0, got {config.timeout_s}")
        if config.password_env and urlsplit(config.url).password is not None:
            raise ValueError(f"store.url ({without_password(config.url)}) holds a password and "
                             f"store.password_env={config.password_env} names another: keep one "
                             "(password_env keeps the secret out of config files)")
        check_count("store.retries", config.retries, 0)
        check_name("store namespace", config.namespace)
        self._config = replace(config)
        self._connection: _Connection | None = None
        self._groups: set[tuple[str, str]] = set()  # (stream key, group) known to exist
        self._marker: str | None = None  # the namespace's marker, as first seen by this client

    def __getstate__(self) -> dict[str, StoreConfig | str | None]:
        return {"config": self._config, "marker": self._marker}

    def __setstate__(self, state: dict[str, StoreConfig | str | None]) -> None:
        config, marker = state["config"], state.get("marker")
        assert isinstance(config, StoreConfig)
        type(self).__init__(self, config)
        self._marker = marker if isinstance(marker, str) else None  # a copy checks what it was sent

    # ---- durability ------------------------------------------------------------------------------

    @classmethod
    def check_durability(cls, config: StoreConfig) -> None:
        """Raise :class:`StoreNotDurableError` naming the setting to change if the server would lose
        acknowledged items on a restart (see the module docstring), unless
        ``config.require_durable`` is false. From async code: ``await store.persistence_problems()``."""
        url = without_password(config.url)
        if not config.require_durable:
            log.warning("store.require_durable=false: not checking that Redis at %s persists writes; "
                        "if it restarts without them the run stops with StoreDataLostError", url)
            return
        store = cls(config)

        async def problems() -> list[str]:
            try:
                return await store.persistence_problems()
            finally:
                await store.close()

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the driver, before anything started: no loop
            found = asyncio.run(problems())
        else:  # called from async code: a loop of its own, in a thread (a start-up check, once)
            with ThreadPoolExecutor(1) as thread:
                found = thread.submit(asyncio.run, problems()).result()
        if found:
            raise StoreNotDurableError(
                f"Redis at {url} would lose acknowledged items if it restarted: {'; '.join(found)}. "
                "Or set store.require_durable=false to run on it anyway.")

    async def persistence_problems(self) -> list[str]:
        """What in the server's settings would lose acknowledged items, each as the setting to
        change; empty when it keeps them (:mod:`turnstile.rollout.store.redis_persistence`)."""
        with self._reachable():
            return await persistence_problems(self._redis())

    # ---- connection and errors -------------------------------------------------------------------

    def _connect(self) -> _Connection:
        if self._connection is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff

            config = self._config
            client = aioredis.Redis.from_url(
                config.url, password=self._password(), decode_responses=True, protocol=2,
                socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), config.retries),
                redis_connect_func=self._handshake,
            )
            self._connection = _Connection(client, client.register_script(_PUT),
                                           client.register_script(_RECLAIM))
        return self._connection

    def _redis(self) -> Redis:
        return self._connect().client

    def _password(self) -> str | None:
        """The password named by ``password_env``, read in this process (the url's own, if any, is
        applied by redis-py)."""
        name = self._config.password_env
        if not name:
            return None
        value = os.environ.get(name)
        if not value:
            raise StoreUnavailableError(
                f"store.password_env={name}, but ${name} is not set in this process (host "
                f"{socket.gethostname()}, pid {os.getpid()}): export it on every node before "
                "`ray start` (Ray's actors inherit their node's environment), or before a local run")
        return value

    def _password_hint(self) -> str:
        if self._config.password_env:
            return f"check ${self._config.password_env} (store.password_env) in this process"
        if urlsplit(self._config.url).password is not None:
            return "check the password in store.url"
        return ("it wants a password: export it (e.g. as REDIS_PASSWORD) on every node and set "
                "store.password_env=REDIS_PASSWORD")

    async def _handshake(self, connection: AbstractConnection) -> None:
        """A new connection: redis-py's own handshake (AUTH, SELECT), then the marker. The first
        connection of this client writes the marker if the namespace has none and remembers it;
        every later one (a reconnect after a restart) checks that it is still there."""
        await connection.on_connect()
        key = self._marker_key()
        commands: list[tuple[str, ...]] = [("GET", key)]
        if self._marker is None:
            commands.insert(0, ("SET", key, uuid.uuid4().hex, "NX"))
        await connection.send_packed_command(connection.pack_commands(commands))
        replies = [await connection.read_response() for _ in commands]
        if self._marker is None:
            self._marker = replies[-1]
        elif replies[-1] != self._marker:
            await connection.disconnect()  # so that the next call checks again and fails again
            raise self._lost(replies[-1])

    def _check_marker(self, found: str | None) -> None:
        if self._marker is not None and found != self._marker:
            raise self._lost(found)

    async def _verify_marker(self) -> None:
        self._check_marker(await self._redis().get(self._marker_key()))  # type: ignore[arg-type]  # decoded: str

    def _lost(self, found: str | None) -> StoreDataLostError:
        what = "gone" if found is None else f"replaced by another client's ({found})"
        return StoreDataLostError(
            f"Redis at {without_password(self._config.url)} lost this run's data: the marker "
            f"{self._marker_key()} its first client wrote ({self._marker}) is {what}, so the server "
            "restarted without persistence or was flushed, and the streams, pending items, "
            f"checkpoints and de-duplication keys of namespace {self._config.namespace} are gone. "
            "The run stops rather than go on with an empty store; resume it (resume=true) on a "
            "Redis started with `--appendonly yes`.")

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        """Turn network failures into one error that names the server and what to do."""
        from redis import exceptions

        url = without_password(self._config.url)
        try:
            yield
        except exceptions.AuthenticationError as error:
            reason = without_password(str(error))
            raise StoreUnavailableError(f"Redis at {url} refused the connection ({reason}): "
                                        f"{self._password_hint()}") from None
        except (exceptions.ConnectionError, exceptions.TimeoutError, OSError) as error:
            port = urlsplit(self._config.url).port or 6379
            raise StoreUnavailableError(
                f"Redis at {url} is unreachable ({type(error).__name__}: "
                f"{without_password(str(error)).rstrip('.')}; timeout {self._config.timeout_s} s, "
                f"{self._config.retries} retries). Start one with `redis-server --port {port} "
                "--appendonly yes` (Debian: apt-get install redis-server), or point store.url at a "
                "running server, or use store.kind=memory."
            ) from error

    async def _ensure_group(self, key: str, group: str) -> None:
        from redis.exceptions import ResponseError

        if (key, group) in self._groups:
            return
        try:
            await self._redis().xgroup_create(key, group, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._groups.add((key, group))

    # ---- keys ------------------------------------------------------------------------------------

    def _stream_key(self, stream: str) -> str:
        return f"{self._config.namespace}:stream:{{{check_name('stream', stream)}}}"

    def _item_key(self, stream_key: str, item_id: str) -> str:
        return f"{stream_key}:item:{item_id}"

    def _checkpoint_key(self, key: str) -> str:
        return f"{self._config.namespace}:checkpoint:{check_id('checkpoint key', key)}"

    def _marker_key(self) -> str:
        return f"{self._config.namespace}:marker"

    # ---- the store -------------------------------------------------------------------------------

    async def ready(self) -> None:
        """Raise :class:`StoreUnavailableError` unless the server answers, and
        :class:`StoreDataLostError` if it lost this client's namespace since it first connected."""
        with self._reachable():
            await self._verify_marker()

    async def put(self, stream: str, item_id: str, payload: JsonObject) -> None:
        key = self._stream_key(stream)
        text = encode_payload(check_id("item id", item_id), payload)
        with self._reachable():
            added = await self._connect().put(
                keys=[key, self._item_key(key, item_id), f"{key}:duplicates", self._marker_key(),
                      f"{key}:added"],
                args=[item_id, text, self._marker or ""])
        if added == -1:
            raise self._lost(None)

    async def claim(self, stream: str, group: str, consumer: str, count: int = 1,
                    block_ms: int = 0) -> list[Claimed]:
        key = self._stream_key(stream)
        check_name("group", group)
        check_name("consumer", consumer)
        check_count("count", count, 1)
        check_count("block_ms", block_ms, 0)
        # Block in slices shorter than the read timeout, so a blocking read never looks like a
        # dead server to redis-py, and a dead server is noticed within one timeout.
        slice_ms = max(1, int(self._config.timeout_s * 500))
        deadline = time.monotonic() + block_ms / 1000
        with self._reachable():
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                block = min(slice_ms, remaining_ms) if remaining_ms > 0 else None
                read = partial(self._redis().xreadgroup, group, consumer, {key: ">"}, count=count,
                               block=block)
                # protocol 2, decoded: [[stream, [(entry id, {field: value}), ...]]]
                reply: list[tuple[str, list[tuple[str, dict[str, str]]]]]
                reply = await self._with_group(key, group, read)  # type: ignore[arg-type]
                if reply:
                    return [_claimed(fields, 1) for _, entries in reply for _, fields in entries]
                if block is None or time.monotonic() >= deadline:
                    return []

    async def ack(self, stream: str, group: str, ids: list[str], *, release: bool = False) -> int:
        key = self._stream_key(stream)
        check_name("group", group)
        if not ids:
            return 0
        with self._reachable():
            # The marker rides along: an ack that finds its items gone says why.
            *entry_ids, marker = await self._redis().mget(
                [self._item_key(key, item_id) for item_id in ids] + [self._marker_key()])
            self._check_marker(marker)  # type: ignore[arg-type]  # decoded: str
            known = sorted({entry for entry in entry_ids if entry})
            if not known:
                return 0
            async with self._redis().pipeline(transaction=True) as commands:  # MULTI: XACK (, XDEL)
                commands.xack(key, group, *known)
                if release:
                    commands.xdel(key, *known)
                acked, *_ = await commands.execute()
            return int(acked)

    async def reclaim(self, stream: str, group: str, consumer: str, min_idle_ms: int,
                      count: int = 100) -> list[Claimed]:
        key = self._stream_key(stream)
        check_name("group", group)
        check_name("consumer", consumer)
        check_count("min_idle_ms", min_idle_ms, 0)
        check_count("count", count, 1)
        with self._reachable():
            run = partial(self._connect().reclaim, keys=[key], args=[group, consumer, min_idle_ms, count])
            reply = await self._with_group(key, group, run)
        return [_claimed(dict(zip(flat[::2], flat[1::2], strict=True)), int(deliveries))
                for _, flat, deliveries in reply]

    async def pending(self, stream: str, group: str) -> int:
        from redis.exceptions import ResponseError

        key = self._stream_key(stream)
        check_name("group", group)
        with self._reachable():
            try:
                summary = await self._redis().xpending(key, group)
            except ResponseError as error:
                if "NOGROUP" in str(error):
                    await self._verify_marker()  # a group that vanished with the data is an error
                    return 0
                raise
        return int(summary["pending"])

    async def length(self, stream: str) -> int:
        key = self._stream_key(stream)
        with self._reachable():
            return int(await self._redis().get(f"{key}:added") or 0)

    async def held(self, stream: str) -> int:
        key = self._stream_key(stream)
        with self._reachable():
            return int(await self._redis().xlen(key))

    async def duplicates(self, stream: str) -> int:
        key = self._stream_key(stream)
        with self._reachable():
            return int(await self._redis().get(f"{key}:duplicates") or 0)

    async def checkpoint(self, key: str, payload: JsonObject) -> None:
        name = self._checkpoint_key(key)
        text = encode_payload(key, payload)
        with self._reachable():
            await self._redis().set(name, text)

    async def load_checkpoint(self, key: str) -> JsonObject | None:
        name = self._checkpoint_key(key)
        with self._reachable():
            text, marker = await self._redis().mget([name, self._marker_key()])
            self._check_marker(marker)  # type: ignore[arg-type]  # decoded: str; a vanished checkpoint is an error
        return None if text is None else decode_payload(text)  # type: ignore[arg-type]  # decoded: str

    async def drop_checkpoint(self, key: str) -> None:
        name = self._checkpoint_key(key)
        with self._reachable():
            await self._redis().delete(name)

    async def checkpoint_keys(self) -> list[str]:
        prefix = f"{self._config.namespace}:checkpoint:"
        with self._reachable():
            names = [name async for name in self._redis().scan_iter(match=f"{_glob_escape(prefix)}*",
                                                                     count=1000)]
        return sorted(name[len(prefix):] for name in names)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        self._groups.clear()
        if connection is not None:
            await connection.client.aclose()

    async def _with_group(self, key: str, group: str, command: Callable[[], Awaitable[T]]) -> T:
        """Run a group command, creating the group first. If the group vanished, the server lost
        the run's data (:class:`StoreDataLostError`) unless the marker is still there (the group
        alone was destroyed): then create it again and retry once."""
        from redis.exceptions import ResponseError

        await self._ensure_group(key, group)
        try:
            return await command()
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
        await self._verify_marker()
        self._groups.discard((key, group))
        await self._ensure_group(key, group)
        return await command()


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _claimed(fields: dict[str, str], deliveries: int) -> Claimed:
    return Claimed(fields["item"], decode_payload(fields["payload"]), deliveries)

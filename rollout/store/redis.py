"""The Redis trajectory store: Redis Streams with consumer groups (redis-py asyncio).

For runs that must survive the loss of any worker, the driver or a store client: the items, pending
lists and checkpoints live in Redis (as durable as the server's own persistence settings).

Layout, under the run's namespace ``ns`` (one namespace per run, so runs sharing a server never
collide; ``{stream}`` is a hash tag, so all keys of a stream sit in one Redis Cluster slot):

- ``ns:stream:{s}`` — the stream; each entry holds the fields ``item`` (the producer's id) and
  ``payload`` (JSON).
- ``ns:stream:{s}:item:<id>`` — the entry id of item ``<id>``: what makes ``put`` idempotent, and
  what ``ack`` maps item ids to entry ids with.
- ``ns:stream:{s}:duplicates`` — how many puts were ignored as duplicates.
- ``ns:checkpoint:<key>`` — an episode checkpoint, as JSON.

``put`` is one Lua script (check the id key, XADD, record the entry id), so a producer killed half
way never leaves an item id recorded without its entry. Groups are created on first use at the start
of the stream (XGROUP CREATE ... 0 MKSTREAM, BUSYGROUP ignored). ``reclaim`` is XAUTOCLAIM plus
XPENDING in one script, to report delivery counts. Every command has a connect and read timeout
(``StoreConfig.timeout_s``); a blocking ``claim`` waits in slices shorter than the read timeout, so
an unreachable server is an error within seconds, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit, urlunsplit

from envs.tools.base import JsonObject
from rollout.store.base import (
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

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

T = TypeVar("T")

# KEYS: stream, item key, duplicates counter. ARGV: item id, payload. Returns 1 if added, 0 if not.
_PUT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('INCR', KEYS[3])
  return 0
end
local entry = redis.call('XADD', KEYS[1], '*', 'item', ARGV[1], 'payload', ARGV[2])
redis.call('SET', KEYS[2], entry)
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
    """Client of a Redis server. Pickles as its config; the connection pool is built lazily, on
    first use in the process (and event loop) that uses it."""

    def __init__(self, config: StoreConfig) -> None:
        if not config.url:
            raise ValueError("store.url is required for store.kind=redis, e.g. "
                             "store.url=redis://127.0.0.1:6379/0")
        if config.timeout_s <= 0:
            raise ValueError(f"store.timeout_s must be > 0, got {config.timeout_s}")
        check_count("store.retries", config.retries, 0)
        check_name("store namespace", config.namespace)
        self._config = replace(config)
        self._connection: _Connection | None = None
        self._groups: set[tuple[str, str]] = set()  # (stream key, group) known to exist

    def __getstate__(self) -> dict[str, StoreConfig]:
        return {"config": self._config}

    def __setstate__(self, state: dict[str, StoreConfig]) -> None:
        self.__init__(state["config"])

    # ---- connection and errors -------------------------------------------------------------------

    def _connect(self) -> _Connection:
        if self._connection is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff

            config = self._config
            client = aioredis.Redis.from_url(
                config.url, decode_responses=True, protocol=2,
                socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), config.retries),
            )
            self._connection = _Connection(client, client.register_script(_PUT),
                                           client.register_script(_RECLAIM))
        return self._connection

    def _redis(self) -> Redis:
        return self._connect().client

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        """Turn network failures into one error that names the server and what to do."""
        from redis import exceptions

        try:
            yield
        except (exceptions.ConnectionError, exceptions.TimeoutError, OSError) as error:
            url = _without_password(self._config.url)
            port = urlsplit(self._config.url).port or 6379
            raise StoreUnavailableError(
                f"Redis at {url} is unreachable ({type(error).__name__}: {str(error).rstrip('.')}; timeout "
                f"{self._config.timeout_s} s, {self._config.retries} retries). Start one with "
                f"`redis-server --port {port}` (Debian: apt-get install redis-server), or point "
                "store.url at a running server, or use store.kind=memory."
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

    # ---- the store -------------------------------------------------------------------------------

    async def ready(self) -> None:
        with self._reachable():
            await self._redis().ping()

    async def put(self, stream: str, item_id: str, payload: JsonObject) -> None:
        key = self._stream_key(stream)
        text = encode_payload(check_id("item id", item_id), payload)
        with self._reachable():
            await self._connect().put(keys=[key, self._item_key(key, item_id), f"{key}:duplicates"],
                                   args=[item_id, text])

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
                reply = await self._with_group(key, group, read)
                if reply:
                    return [_claimed(fields, 1) for _, entries in reply for _, fields in entries]
                if block is None or time.monotonic() >= deadline:
                    return []

    async def ack(self, stream: str, group: str, ids: list[str]) -> int:
        key = self._stream_key(stream)
        check_name("group", group)
        if not ids:
            return 0
        with self._reachable():
            entry_ids = await self._redis().mget([self._item_key(key, item_id) for item_id in ids])
            known = sorted({entry for entry in entry_ids if entry})
            return int(await self._redis().xack(key, group, *known)) if known else 0

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
                    return 0
                raise
        return int(summary["pending"])

    async def length(self, stream: str) -> int:
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
            text = await self._redis().get(name)
        return None if text is None else decode_payload(text)

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
        """Run a group command, creating the group first; if the group vanished (the server was
        flushed or restarted without persistence), create it again and retry once."""
        from redis.exceptions import ResponseError

        await self._ensure_group(key, group)
        try:
            return await command()
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
        self._groups.discard((key, group))
        await self._ensure_group(key, group)
        return await command()


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _claimed(fields: dict[str, str], deliveries: int) -> Claimed:
    return Claimed(fields["item"], decode_payload(fields["payload"]), deliveries)


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))

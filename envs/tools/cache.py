"""Tool result cache: in memory by default, Redis to share results across a rollout fleet.

Keys are the tool name plus its normalised arguments (the tool's own ``normalize``), hashed so any
argument size gives a short key. Only successful results are cached: a failure may be transient.
A cache that fails (Redis down) never fails the tool call; it counts the error and lets the call run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from turnstile.envs.tools.base import JsonObject

log = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    backend: str = "memory"  # "memory" | "redis" | "none"
    ttl_s: float = 7 * 24 * 3600.0
    max_entries: int = 100_000  # memory backend only
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "turnstile:tool:"
    redis_timeout_s: float = 2.0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def cache_key(tool: str, arguments: JsonObject) -> str:
    """Stable key for a call: tool name + canonical JSON of the normalised arguments."""
    canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    # surrogatepass: a lone surrogate in an argument still gives a stable key instead of raising
    return f"{tool}:{hashlib.sha256(canonical.encode('utf-8', 'surrogatepass')).hexdigest()}"


class ToolCache(Protocol):
    """Async get/put of tool results by key, with hit/miss counters in ``stats``."""

    stats: CacheStats

    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, value: str) -> None: ...

    async def aclose(self) -> None: ...


class MemoryCache:
    """LRU dictionary with a TTL per entry; one per process."""

    def __init__(self, config: CacheConfig) -> None:
        self._ttl = config.ttl_s
        self._max = config.max_entries
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.stats = CacheStats()

    async def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            if entry is not None:
                del self._entries[key]
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[1]

    async def put(self, key: str, value: str) -> None:
        self._entries[key] = (time.monotonic() + self._ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def aclose(self) -> None:
        self._entries.clear()


class RedisCache:
    """Results in Redis with ``SET ... EX``; fleet-wide hit/miss totals in a Redis hash too."""

    def __init__(self, config: CacheConfig) -> None:
        import redis.asyncio as aioredis  # built here so the spec stays picklable and light

        self._prefix = config.key_prefix
        self._ttl = max(1, int(config.ttl_s))
        self._client = aioredis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s, decode_responses=True,
        )
        self.stats = CacheStats()

    @property
    def stats_key(self) -> str:
        return f"{self._prefix}stats"

    async def get(self, key: str) -> str | None:
        try:
            value = await self._client.get(self._prefix + key)
            await self._client.hincrby(self.stats_key, "hits" if value is not None else "misses", 1)
        except Exception as error:  # noqa: BLE001 - any Redis failure degrades to a miss
            self._failed("get", error)
            self.stats.misses += 1
            return None
        if value is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return value  # type: ignore[return-value]  # decode_responses=True: a str

    async def put(self, key: str, value: str) -> None:
        try:
            await self._client.set(self._prefix + key, value, ex=self._ttl)
        except Exception as error:  # noqa: BLE001
            self._failed("put", error)

    async def shared_stats(self) -> CacheStats:
        """Hit/miss totals of every process sharing this Redis."""
        raw = await self._client.hgetall(self.stats_key)
        return CacheStats(hits=int(raw.get("hits", 0)), misses=int(raw.get("misses", 0)))

    def _failed(self, operation: str, error: Exception) -> None:
        self.stats.errors += 1
        if self.stats.errors == 1 or self.stats.errors % 100 == 0:
            log.warning("tool cache: Redis %s failed (%s); calls run uncached. %d errors so far.",
                        operation, error, self.stats.errors)

    async def aclose(self) -> None:
        await self._client.aclose()


class NoCache:
    """Caching switched off: every lookup is a miss."""

    def __init__(self, config: CacheConfig) -> None:
        self.stats = CacheStats()

    async def get(self, key: str) -> str | None:
        self.stats.misses += 1
        return None

    async def put(self, key: str, value: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


CACHE_BACKENDS: dict[str, type[MemoryCache] | type[RedisCache] | type[NoCache]] = {
    "memory": MemoryCache,
    "redis": RedisCache,
    "none": NoCache,
}


def build_cache(config: CacheConfig) -> ToolCache:
    try:
        backend = CACHE_BACKENDS[config.backend]
    except KeyError:
        known = ", ".join(sorted(CACHE_BACKENDS))
        raise ValueError(f"cache.backend={config.backend!r} is not known; use one of: {known}") from None
    return backend(config)

"""Toolbox: retries with a cap, timeouts, failures as observations, cache on both backends."""

from __future__ import annotations

import pytest

from tests.tools_for_tests import EchoTool, FlakyTool, SlowTool
from turnstile.envs.tools.base import Fault, ToolError
from turnstile.envs.tools.cache import CacheConfig, MemoryCache, RedisCache, build_cache, cache_key
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig

FAST = dict(backoff_s=0.001, backoff_max_s=0.002)


async def test_retryable_error_is_retried_until_success() -> None:
    tool = FlakyTool("search", failures=2, error=ToolError("http_status", "503", retryable=True))
    box = Toolbox([tool], ToolboxConfig(max_attempts=3, **FAST))
    outcome = await box.run("search", {"text": "x"})
    assert outcome.ok and outcome.text == "echo: x" and outcome.attempts == 3
    assert box.metrics.retries == 2


async def test_retries_are_capped_and_failure_is_readable() -> None:
    tool = FlakyTool("search", failures=99, error=ToolError("http_status", "HTTP 503", retryable=True))
    box = Toolbox([tool], ToolboxConfig(max_attempts=3, **FAST))
    outcome = await box.run("search", {"text": "x"})
    assert not outcome.ok and outcome.error == "http_status" and tool.calls == 3
    assert "failed after 3 attempts" in outcome.text and "HTTP 503" in outcome.text
    assert box.metrics.failures["search:http_status"] == 1


async def test_non_retryable_error_is_not_retried() -> None:
    tool = FlakyTool("visit", failures=99, error=ToolError("blocked", "private address"))
    box = Toolbox([tool], ToolboxConfig(max_attempts=5, **FAST))
    outcome = await box.run("visit", {"text": "x"})
    assert tool.calls == 1 and outcome.error == "blocked"


async def test_unexpected_exception_becomes_observation() -> None:
    tool = FlakyTool("visit", failures=1, error=KeyError("boom"))
    outcome = await Toolbox([tool], ToolboxConfig(**FAST)).run("visit", {"text": "x"})
    assert not outcome.ok and outcome.error == "internal" and "KeyError" in outcome.text


async def test_timeout_per_attempt() -> None:
    tool = SlowTool("visit", seconds=5)
    box = Toolbox([tool], ToolboxConfig(timeout_s=0.05, max_attempts=2, **FAST))
    outcome = await box.run("visit", {"text": "x"})
    assert outcome.error == "timeout" and tool.calls == 2 and outcome.seconds < 2


async def test_unknown_tool_and_bad_arguments() -> None:
    box = Toolbox([EchoTool("search")])
    unknown = await box.run("browse", {})
    assert unknown.error == "unknown_tool" and "Available tools: search" in unknown.text
    bad = await box.run("search", {"text": 3})
    assert bad.error == "bad_arguments" and "'text' must be a string" in bad.text


async def test_injected_failures_hit_the_configured_share_of_calls() -> None:
    tool = EchoTool("search")
    box = Toolbox([tool], ToolboxConfig(max_attempts=1, inject_failure_rate=0.3, inject_seed=7,
                                        cache=CacheConfig(backend="none"), **FAST))
    outcomes = [await box.run("search", {"text": str(i)}) for i in range(1000)]
    failed = [o for o in outcomes if not o.ok]
    assert 0.26 < len(failed) / 1000 < 0.34  # binomial(1000, 0.3): ±4 points is > 2.7 sigma
    assert {o.error for o in failed} == {"injected"} and "inject_failure_rate" in failed[0].text
    assert box.metrics.failures["search:injected"] == len(failed)
    assert tool.calls == 1000 - len(failed)  # an injected failure never reaches the tool
    # With retries, a flaky service mostly recovers: 0.3 ** 3 of calls fail for good.
    retrying = Toolbox([EchoTool("search")], ToolboxConfig(max_attempts=3, inject_failure_rate=0.3,
                                                           inject_seed=7, cache=CacheConfig(backend="none"),
                                                           **FAST))
    final = [await retrying.run("search", {"text": str(i)}) for i in range(1000)]
    assert sum(not o.ok for o in final) < 60 and retrying.metrics.retries > 250
    with pytest.raises(ValueError, match="inject_failure_rate must be in"):
        Toolbox([EchoTool("search")], ToolboxConfig(inject_failure_rate=1.5))


@pytest.mark.parametrize(("error", "fault"), [
    (ToolError("timeout", "no result"), Fault.environment),
    (ToolError("connect", "refused", retryable=True), Fault.environment),
    (ToolError("http_status", "HTTP 503", retryable=True, fault=Fault.environment), Fault.environment),
    (ToolError("http_status", "HTTP 404; check the URL"), Fault.policy),  # a made-up address
    (ToolError("blocked", "private address"), Fault.policy),
    (ToolError("dns", "cannot resolve host", retryable=True), Fault.policy),  # a made-up host
    (KeyError("boom"), Fault.environment),  # a tool's bug is ours, not the policy's
])
async def test_every_failure_says_whose_doing_it_was(error: Exception, fault: Fault) -> None:
    outcome = await Toolbox([FlakyTool("visit", failures=99, error=error)],
                            ToolboxConfig(max_attempts=1, **FAST)).run("visit", {"text": "x"})
    assert not outcome.ok and outcome.fault is fault


async def test_the_policy_owns_unknown_tools_and_bad_arguments_the_environment_time_outs_and_injections() -> None:
    box = Toolbox([EchoTool("search"), SlowTool("visit", seconds=5)],
                  ToolboxConfig(timeout_s=0.05, max_attempts=1, **FAST))
    assert (await box.run("browse", {})).fault is Fault.policy
    assert (await box.run("search", {"text": 3})).fault is Fault.policy
    assert (await box.run("visit", {"text": "x"})).fault is Fault.environment
    assert (await box.run("search", {"text": "fine"})).fault is None  # no failure, no fault
    injected = Toolbox([EchoTool("search")], ToolboxConfig(max_attempts=1, inject_failure_rate=1.0, **FAST))
    assert (await injected.run("search", {"text": "x"})).fault is Fault.environment


def test_duplicate_tool_names_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        Toolbox([EchoTool("search"), EchoTool("search")])


def test_unknown_cache_backend_is_named() -> None:
    with pytest.raises(ValueError, match=r"cache.backend='disk'"):
        build_cache(CacheConfig(backend="disk"))


def test_cache_key_depends_on_normalised_arguments_only() -> None:
    assert cache_key("search", {"a": 1, "b": [1, 2]}) == cache_key("search", {"b": [1, 2], "a": 1})
    assert cache_key("search", {"a": 1}) != cache_key("visit", {"a": 1})
    assert cache_key("search", {"b": [1, 2]}) != cache_key("search", {"b": [2, 1]})


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
async def cache_config(request: pytest.FixtureRequest) -> CacheConfig:
    if request.param == "memory":
        return CacheConfig(backend="memory")
    url = request.getfixturevalue("redis_url")
    prefix = f"test:{request.node.name}:"
    return CacheConfig(backend="redis", redis_url=url, key_prefix=prefix)


async def test_cached_results_are_reused(cache_config: CacheConfig) -> None:
    tool = EchoTool("search")
    box = Toolbox([tool], ToolboxConfig(cache=cache_config))
    first = await box.run("search", {"text": " x "})
    second = await box.run("search", {"text": "x"})  # same after normalisation
    assert first.text == second.text == "echo: x"
    assert not first.cached and second.cached and tool.calls == 1
    assert (box.cache.stats.hits, box.cache.stats.misses) == (1, 1)
    await box.aclose()


async def test_failures_are_not_cached(cache_config: CacheConfig) -> None:
    tool = FlakyTool("search", failures=1, error=ToolError("http_status", "503"))
    box = Toolbox([tool], ToolboxConfig(cache=cache_config, max_attempts=1))
    assert not (await box.run("search", {"text": "y"})).ok
    assert (await box.run("search", {"text": "y"})).ok
    assert tool.calls == 2
    await box.aclose()


async def test_ttl_expires(cache_config: CacheConfig) -> None:
    cache_config.ttl_s = 1
    cache = build_cache(cache_config)
    await cache.put("k", "v")
    assert await cache.get("k") == "v"
    if isinstance(cache, MemoryCache):
        cache._entries["k"] = (0.0, "v")  # expire without sleeping
    else:
        assert isinstance(cache, RedisCache)
        await cache._client.pexpire(cache_config.key_prefix + "k", 1)
        import asyncio
        await asyncio.sleep(0.05)
    assert await cache.get("k") is None
    await cache.aclose()


def test_memory_cache_is_bounded() -> None:
    import asyncio

    cache = MemoryCache(CacheConfig(max_entries=2))

    async def fill() -> None:
        for key in "abc":
            await cache.put(key, key)

    asyncio.run(fill())
    assert list(cache._entries) == ["b", "c"]


@pytest.mark.integration
async def test_redis_counts_are_shared_across_processes(redis_url: str) -> None:
    config = CacheConfig(backend="redis", redis_url=redis_url, key_prefix="test:shared:")
    one, two = RedisCache(config), RedisCache(config)
    await one.put("k", "v")
    assert await two.get("k") == "v"
    assert await one.get("missing") is None
    shared = await one.shared_stats()
    assert (shared.hits, shared.misses) == (1, 1)
    await one.aclose()
    await two.aclose()


async def test_redis_down_degrades_to_uncached_calls() -> None:
    config = CacheConfig(backend="redis", redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2)
    tool = EchoTool("search")
    box = Toolbox([tool], ToolboxConfig(cache=config))
    outcome = await box.run("search", {"text": "z"})
    assert outcome.ok and outcome.text == "echo: z" and box.cache.stats.errors >= 1
    await box.aclose()


def test_the_wait_between_attempts_doubles_up_to_its_cap_with_jitter() -> None:
    from turnstile.envs.retry import backoff_s, longest_backoff_s

    assert [longest_backoff_s(a, 0.5, 3.0) for a in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    waits = [backoff_s(3, 0.5, 3.0) for _ in range(200)]
    assert all(1.0 <= w <= 2.0 for w in waits) and len(set(waits)) > 100  # jittered within [½, 1] of it

"""Runs tool calls safely: argument checks, cache, per-call timeout, capped retries with backoff.

Every failure becomes a :class:`ToolOutcome` whose ``text`` the agent can read; nothing a tool does
raises out of :meth:`Toolbox.run`. One toolbox serves many concurrent episodes of a worker (it holds
the HTTP pools, the browser and the cache); per-episode budgets live in the environment.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from turnstile.envs.retry import backoff_s
from turnstile.envs.tools.base import Fault, JsonObject, Tool, ToolError, fault_of
from turnstile.envs.tools.cache import CacheConfig, ToolCache, build_cache, cache_key

log = logging.getLogger(__name__)


@dataclass
class ToolboxConfig:
    timeout_s: float = 60.0  # one attempt of one call
    max_attempts: int = 3  # first try included; only retryable errors are tried again
    backoff_s: float = 0.5  # first retry delay, doubled each time, with jitter
    backoff_max_s: float = 8.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Fault injection for drills and tests: each attempt of a call fails with this probability
    # (error kind "injected", retryable like a flaky service) before the tool runs. 0 = off.
    inject_failure_rate: float = 0.0
    inject_seed: int | None = None  # None = a different draw in every process


@dataclass(frozen=True)
class ToolOutcome:
    """What a call gave: the agent-readable text and how it went."""

    tool: str
    text: str
    ok: bool
    error: str | None = None  # ToolError.kind on failure
    attempts: int = 0
    cached: bool = False
    seconds: float = 0.0
    fault: Fault | None = None  # on failure, whose doing it was (ToolError.fault)


@dataclass
class ToolMetrics:
    calls: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)  # by "tool:kind"
    retries: int = 0
    seconds: float = 0.0


class Toolbox:
    """The tools of an environment, run with the same failure handling for all."""

    def __init__(self, tools: Sequence[Tool], config: ToolboxConfig | None = None,
                 cache: ToolCache | None = None) -> None:
        self.config = config or ToolboxConfig()
        names = [tool.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"two tools share the name(s) {duplicates}; tool names must be unique")
        if self.config.max_attempts < 1:
            raise ValueError("toolbox.max_attempts must be >= 1 (1 = no retries)")
        if not 0.0 <= self.config.inject_failure_rate <= 1.0:
            raise ValueError(f"toolbox.inject_failure_rate must be in [0, 1], got "
                             f"{self.config.inject_failure_rate}")
        self._inject = random.Random(self.config.inject_seed)
        self.tools: dict[str, Tool] = {tool.name: tool for tool in tools}
        self.cache = cache if cache is not None else build_cache(self.config.cache)
        self.metrics = ToolMetrics()
        self._closed = False

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[JsonObject]:
        """Function schemas for the system prompt."""
        return [
            {"type": "function",
             "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in self.tools.values()
        ]

    async def run(self, name: str, arguments: Mapping[str, object]) -> ToolOutcome:
        started = time.monotonic()
        self.metrics.calls[name] += 1
        outcome = await self._run(name, arguments)
        seconds = time.monotonic() - started
        self.metrics.seconds += seconds
        if not outcome.ok:
            self.metrics.failures[f"{name}:{outcome.error}"] += 1
        return replace(outcome, seconds=seconds)

    async def _run(self, name: str, arguments: Mapping[str, object]) -> ToolOutcome:
        tool = self.tools.get(name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return _failure(name, "unknown_tool",
                            f"There is no tool named '{name}'. Available tools: {available}.", 0)
        try:
            normalised = tool.normalize(arguments)
            key = cache_key(name, normalised)
        except ToolError as error:
            return _failure(name, error.kind, error.message, 0, error.fault)
        except Exception as error:  # a tool bug must still not escape
            log.exception("tool %s: normalize raised", name)
            return _failure(name, "internal", f"the arguments could not be read ({error})", 0)

        cached = await self.cache.get(key)
        if cached is not None:
            return ToolOutcome(name, cached, True, None, 0, True)

        attempt = 0
        while True:
            attempt += 1
            try:
                if self.config.inject_failure_rate and self._inject.random() < self.config.inject_failure_rate:
                    raise ToolError("injected", "the service did not answer (a failure injected by "
                                    "toolbox.inject_failure_rate)", retryable=True)
                text = await asyncio.wait_for(tool.call(normalised), self.config.timeout_s)
            except TimeoutError:
                failure = ToolError("timeout", f"no result within {self.config.timeout_s:g} s",
                                    retryable=True)
            except ToolError as raised:
                failure = raised
            except asyncio.CancelledError:
                raise
            except Exception as unexpected:
                log.exception("tool %s raised an unexpected error", name)
                failure = ToolError("internal", f"{type(unexpected).__name__}: {unexpected}")
            else:
                await self.cache.put(key, text)
                return ToolOutcome(name, text, True, None, attempt)
            if not failure.retryable or attempt >= self.config.max_attempts:
                return _failure(name, failure.kind, failure.message, attempt, failure.fault)
            self.metrics.retries += 1
            await asyncio.sleep(backoff_s(attempt, self.config.backoff_s, self.config.backoff_max_s))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tool in self.tools.values():
            try:
                await tool.aclose()
            except Exception:  # closing must go on for the other tools
                log.exception("closing tool %s failed", tool.name)
        await self.cache.aclose()


def _failure(tool: str, kind: str, message: str, attempts: int, fault: Fault | None = None) -> ToolOutcome:
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    text = f"[{tool}] failed{tries} ({kind}): {message}"
    return ToolOutcome(tool, text, False, kind, attempts, fault=fault if fault is not None else fault_of(kind))

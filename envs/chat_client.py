"""The one client for OpenAI-compatible ``/v1/chat/completions`` endpoints: LLM judges, clue
recovery, the SFT data judge and the visit tool's page extractor all call a model through it.

Reward scoring calls an LLM thousands of times per step, so the client bounds everything: at most
``max_concurrency`` requests in flight (the endpoint is shared by every user in the process), a
``timeout_s`` per attempt, ``max_attempts`` tries with exponential backoff on what retrying can fix
(timeouts, connection errors, 429 and 5xx), and an in-memory LRU cache of replies so that the same
request (same model, messages and sampling) is sent once. It is the only retry layer for these
calls: a caller does not retry what it raises. After the last attempt it raises
:class:`ChatUnavailable` (``kind="unavailable"``; ``"refused"`` at once for a 4xx, which retrying
cannot fix); it never returns a made-up reply, because a silent zero would train the policy on a
broken endpoint.

The API key is read from the environment variable the config names, never from the config itself.
This module sits in ``envs`` (the lowest layer) because the visit tool uses it as well as rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from turnstile.envs.retry import backoff_s
from turnstile.envs.tools.base import JsonValue

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass
class ChatClientConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # up to and including /v1
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the key; "" = send no key
    temperature: float = 0.0
    max_tokens: int = 1024
    timeout_s: float = 60.0  # one attempt
    max_attempts: int = 4  # first try included
    backoff_s: float = 0.5  # first retry delay, doubled each time, with jitter
    backoff_max_s: float = 8.0
    max_concurrency: int = 16
    cache_entries: int = 50_000  # replies kept in memory; 0 = no cache and no sharing of identical calls in flight
    proxy_from_env: bool = True  # honour HTTP(S)_PROXY / NO_PROXY (httpx's trust_env)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("client.max_attempts must be >= 1 (1 = no retries)")
        if self.max_concurrency < 1:
            raise ValueError("client.max_concurrency must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("client.timeout_s must be > 0")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass
class ClientStats:
    requests: int = 0  # HTTP attempts sent
    retries: int = 0
    cache_hits: int = 0
    failures: int = 0  # calls that raised ChatUnavailable
    errors: dict[str, int] = field(default_factory=dict)  # by kind: "timeout", "http_503", ...


class ChatUnavailable(RuntimeError):
    """The endpoint gave no usable reply; the message says what failed. ``kind`` is ``"unavailable"``
    (every attempt failed in a way a retry could fix) or ``"refused"`` (a 4xx: the request is wrong)."""

    def __init__(self, message: str, kind: str = "unavailable") -> None:
        super().__init__(message)
        self.kind = kind


class _Retryable(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class ChatClient:
    """See the module docstring. Build one per process and share it; close it with ``aclose``."""

    def __init__(self, config: ChatClientConfig, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        if not config.model:
            raise ValueError("client.model is empty: name the model the endpoint serves")
        self.config = config
        self.stats = ClientStats()
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[str, asyncio.Future[str]] = {}
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        # Built on first use so that a client can be created outside the event loop that uses it.
        if self._http is None:
            headers = {"Content-Type": "application/json"}
            key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
            if key:
                headers["Authorization"] = f"Bearer {key}"
            limits = httpx.Limits(max_connections=self.config.max_concurrency)
            self._http = httpx.AsyncClient(base_url=self.config.base_url.rstrip("/"), headers=headers,
                                           timeout=self.config.timeout_s, limits=limits,
                                           transport=self._transport, trust_env=self.config.proxy_from_env)
        return self._http

    async def complete(self, messages: Sequence[ChatMessage], *, temperature: float | None = None,
                       max_tokens: int | None = None) -> str:
        """The assistant's reply text to ``messages`` (from the cache when the same request was
        answered before or is in flight). Raises :class:`ChatUnavailable` after the last failed attempt."""
        body = {
            "model": self.config.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "temperature": self.config.temperature if temperature is None else temperature,
            "max_tokens": self.config.max_tokens if max_tokens is None else max_tokens,
        }
        if self.config.cache_entries == 0:  # no cache: every call is its own request (a sampled policy's k samples)
            return await self._send(body)
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return cached
        pending = self._pending.get(key)
        if pending is not None:  # the same request is in flight: share its reply
            self.stats.cache_hits += 1
            return await asyncio.shield(pending)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            reply = await self._send(body)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as error:
            future.set_exception(error)
            future.exception()  # retrieved here, so an unshared failure is not reported as lost
            raise
        finally:
            self._pending.pop(key, None)
        future.set_result(reply)
        self._cache[key] = reply
        while len(self._cache) > self.config.cache_entries:
            self._cache.popitem(last=False)
        return reply

    async def _send(self, body: dict[str, object]) -> str:
        last = "no attempt was made"
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                async with self._semaphore:
                    self.stats.requests += 1
                    return await self._attempt(body)
            except _Retryable as error:
                self.stats.errors[error.kind] = self.stats.errors.get(error.kind, 0) + 1
                last = f"{error.kind}: {error}"
            if attempt < self.config.max_attempts:
                self.stats.retries += 1
                # outside the semaphore
                await asyncio.sleep(backoff_s(attempt, self.config.backoff_s, self.config.backoff_max_s))
        self.stats.failures += 1
        raise ChatUnavailable(
            f"{self.config.base_url}: no reply from model {self.config.model!r} after "
            f"{self.config.max_attempts} attempts (last: {last}). Check that the endpoint is up, or "
            "raise client.max_attempts / client.timeout_s.")

    async def _attempt(self, body: dict[str, object]) -> str:
        try:
            response = await self._client().post("/chat/completions", json=body)
        except httpx.TimeoutException as error:
            raise _Retryable("timeout", f"no reply within {self.config.timeout_s:g} s") from error
        except httpx.TransportError as error:
            raise _Retryable("connection", f"{type(error).__name__}: {error}") from error
        if response.status_code in RETRYABLE_STATUS:
            raise _Retryable(f"http_{response.status_code}", response.text[:200])
        if response.status_code != 200:
            # 400/401/404...: the same request will fail again; say so at once.
            self.stats.failures += 1
            raise ChatUnavailable(f"{self.config.base_url}/chat/completions answered "
                                   f"{response.status_code}: {response.text[:300]}. Check "
                                   "client.base_url, client.model and the API key variable "
                                   f"{self.config.api_key_env!r}.", kind="refused")
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise _Retryable("bad_response", f"not a chat completion: {response.text[:200]}") from error
        return content if isinstance(content, str) else ""

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked when cut (prompts stay bounded)."""
    return text if len(text) <= limit else text[:limit] + " [...]"


def json_object_in(reply: str) -> dict[str, JsonValue] | None:
    """The outermost JSON object in a model reply (prose or code fences around it are ignored);
    None when there is none."""
    start, end = reply.find("{"), reply.rfind("}")
    if start == -1 or end <= start:
        return None
    try:
        value = json.loads(reply[start:end + 1])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

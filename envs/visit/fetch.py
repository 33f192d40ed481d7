"""Static page fetch: one bounded, guarded HTTP GET (plus redirects) per visit.

Bounded because the agent picks URLs: every fetch has connect/read timeouts and a total deadline, at
most ``max_redirects`` hops and at most ``max_bytes`` of body. Guarded twice: each hop's URL is checked
by the :class:`~turnstile.envs.visit.guard.SsrfGuard` before any request is made (that gives the agent a clear
"blocked" message), and the connection itself is opened by :class:`GuardedNetworkBackend`, which
resolves the host once, checks every address and connects to a checked address — so a DNS answer that
changes between the check and the connect (DNS rebinding) cannot reach a private address.

Oversized bodies are truncated by default (``oversize="truncate"``): the first ``max_bytes`` of an
HTML page almost always hold its main text, and a partial page is more useful to the agent than an
error. ``oversize="error"`` raises ``ToolError("too_large")`` instead. Non-text content (PDF, images,
archives) raises ``ToolError("unsupported_content")``; this tool reads HTML and plain text only.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import httpcore
import httpx

from turnstile.envs.tools.base import Fault, ToolError
from turnstile.envs.visit.guard import SsrfGuard

_HTML_TYPES = ("text/html", "application/xhtml+xml")
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


@dataclass
class FetchConfig:
    """Limits of one static fetch."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0
    total_timeout_s: float = 30.0
    max_redirects: int = 5
    max_bytes: int = 5_000_000
    oversize: Literal["truncate", "error"] = "truncate"
    user_agent: str = "Mozilla/5.0 (compatible; turnstile-visit/0.1)"


@dataclass(frozen=True)
class Page:
    """A fetched page: ``html`` holds the decoded body (HTML, or plain text when not ``is_html``)."""

    url: str
    final_url: str
    status: int
    content_type: str
    html: str
    truncated: bool = False

    @property
    def is_html(self) -> bool:
        return self.content_type in _HTML_TYPES or self.content_type == ""


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """httpcore backend that connects only to addresses the guard accepted for this very connect."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, guard: SsrfGuard) -> None:
        self._inner = inner
        self._guard = guard

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109 - httpcore's API
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        addresses = await self._guard.check_host(host, port)
        targets = [str(address) for address in addresses] or [host]  # allow-listed: connect by name
        last_error: Exception | None = None
        for target in targets:
            try:
                return await self._inner.connect_tcp(target, port, timeout=timeout,
                                                      local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                last_error = error
        assert last_error is not None
        raise last_error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109 - httpcore's API
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise ToolError("blocked", "unix sockets cannot be visited")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Fetcher:
    """Fetches pages with one pooled httpx client, created on first use (keeps the tool picklable)."""

    def __init__(self, config: FetchConfig, guard: SsrfGuard) -> None:
        self.config = config
        self.guard = guard
        self._client: httpx.AsyncClient | None = None

    def _client_now(self) -> httpx.AsyncClient:
        if self._client is None:
            transport = httpx.AsyncHTTPTransport(retries=0)
            # httpx does not expose httpcore's network_backend; wrapping the pool's backend is the one
            # place where the connect-time address check can live.
            pool = transport._pool  # noqa: SLF001
            pool._network_backend = GuardedNetworkBackend(pool._network_backend, self.guard)  # noqa: SLF001
            cfg = self.config
            self._client = httpx.AsyncClient(
                transport=transport,
                follow_redirects=False,
                trust_env=False,  # a proxy from the environment would bypass the address check
                timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
                headers={"User-Agent": cfg.user_agent,
                         "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"},
            )
        return self._client

    async def fetch(self, url: str) -> Page:
        """GET ``url`` following redirects by hand; raises :class:`ToolError` on every failure."""
        try:
            async with asyncio.timeout(self.config.total_timeout_s):
                return await self._follow(url)
        except TimeoutError:
            raise ToolError("timeout", f"visiting {url} took longer than the total deadline of "
                                       f"{self.config.total_timeout_s:g} s; try again later or "
                                       f"raise visit.fetch.total_timeout_s", retryable=True) from None
        except httpx.TimeoutException as error:
            raise ToolError("timeout", f"timed out visiting {url} ({type(error).__name__}); try "
                                       f"again later", retryable=True) from None
        except httpx.ConnectError as error:
            raise ToolError("connect", f"cannot connect to {url}: {error}; the site may be down",
                            retryable=True) from None
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as error:
            raise ToolError("bad_arguments", f"cannot visit {url!r}: {error}; fix the URL") from None
        except httpx.TransportError as error:
            raise ToolError("network", f"network error visiting {url}: {error}",
                            retryable=True) from None

    async def _follow(self, url: str) -> Page:
        client = self._client_now()
        current = url
        seen = {url}
        for _ in range(self.config.max_redirects + 1):
            await self.guard.check_url(current)
            async with client.stream("GET", current) as response:
                if response.is_redirect:
                    target = str(response.url.join(response.headers["location"]))
                    if target in seen:
                        raise ToolError("redirect_loop", f"{url} redirects in a loop (back to "
                                                         f"{target}); the page cannot be visited")
                    seen.add(target)
                    current = target
                    continue
                _check_status(response, url)
                content_type = _media_type(response)
                body, truncated = await self._read_limited(response, url)
                content_type = _check_content(content_type, body, url)
                return Page(url=url, final_url=str(response.url), status=response.status_code,
                            content_type=content_type, html=decode_body(body, response),
                            truncated=truncated)
        raise ToolError("too_many_redirects", f"{url} redirected more than "
                                              f"{self.config.max_redirects} times; the page cannot "
                                              f"be visited (limit: visit.fetch.max_redirects)")

    async def _read_limited(self, response: httpx.Response, url: str) -> tuple[bytes, bool]:
        limit = self.config.max_bytes
        declared = response.headers.get("content-length", "")
        if self.config.oversize == "error" and declared.isdigit() and int(declared) > limit:
            raise _too_large(url, limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                if self.config.oversize == "error":
                    raise _too_large(url, limit)
                return b"".join(chunks)[:limit], True
        return b"".join(chunks), False

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _too_large(url: str, limit: int) -> ToolError:
    return ToolError("too_large", f"{url} is larger than {limit} bytes; raise visit.fetch.max_bytes "
                                  f"or set visit.fetch.oversize=truncate")


def _check_status(response: httpx.Response, url: str) -> None:
    status = response.status_code
    if status < 400 and not 300 <= status < 400:
        return
    if status == 429 or status >= 500:
        raise ToolError("http_status", f"{url} answered HTTP {status}; try again later",
                        retryable=True, fault=Fault.environment)
    if 300 <= status < 400:
        raise ToolError("http_status", f"{url} answered HTTP {status} without a Location header")
    raise ToolError("http_status", f"{url} answered HTTP {status}; check the URL")


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _check_content(content_type: str, body: bytes, url: str) -> str:
    """Return the media type to treat the body as, or raise ``unsupported_content``."""
    if content_type in _HTML_TYPES or content_type.startswith("text/"):
        return content_type
    head = body[:1024]
    if not content_type and not head.startswith(b"%PDF") and b"\x00" not in head:
        return ""  # undeclared: looks like text, treat as HTML
    shown = content_type or ("application/pdf" if head.startswith(b"%PDF") else "binary data")
    raise ToolError("unsupported_content", f"{url} is {shown}, not an HTML or text page; visit "
                                           f"reads web pages only")


def decode_body(body: bytes, response: httpx.Response | None = None) -> str:
    """Decode with the declared charset, else a <meta> charset, else UTF-8, else a detected one."""
    candidates: list[str] = []
    if response is not None and response.charset_encoding:
        candidates.append(response.charset_encoding)
    meta = _META_CHARSET.search(body[:4096])
    if meta:
        candidates.append(meta.group(1).decode("ascii", "replace"))
    for encoding in candidates:
        try:
            return body.decode(encoding, errors="replace")
        except LookupError:
            continue  # an unknown charset name: try the next clue
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        pass
    detected = _detect_encoding(body)
    return body.decode(detected or "utf-8", errors="replace")


def _detect_encoding(body: bytes) -> str | None:
    try:
        from charset_normalizer import from_bytes
    except ImportError:
        return "cp1252"
    best = from_bytes(body[:65536]).best()
    return best.encoding if best is not None else None

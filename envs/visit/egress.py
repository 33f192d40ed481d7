"""The browser's egress proxy: every connection Chromium makes is decided by the SSRF guard.

Chromium connects on its own for redirects, scripts, forms, meta refreshes, iframes, prefetches,
WebSockets and WebRTC, some of them (preconnects, speculative sockets) before any request exists
that Playwright could intercept, and it resolves host names itself after any check (DNS
rebinding). So the renderer sends each browser context through one of these proxies and leaves
Chromium no DNS of its own: the proxy resolves each target once with the guard
(:meth:`~turnstile.envs.visit.guard.SsrfGuard.check_host`) and connects only to an address that check
returned, at connect time — the same rule as ``GuardedNetworkBackend`` in the static fetch.

It is ours, not an off-the-shelf proxy, because those (proxy.py, for one) connect by host name: the
name would be resolved again after any check, which reopens DNS rebinding. What it speaks is
small: ``CONNECT host:port`` (HTTPS and WebSocket tunnels, relayed without being read) and plain
HTTP requests in absolute form (``GET http://host:port/path``), one request per client connection
(``Connection: close``; Chromium may send requests for different hosts over one kept-alive proxy
connection, and each must get its own check). A refused target gets ``403`` with the header
``X-Turnstile-Egress-Refused: host:port`` and is kept in :attr:`EgressProxy.refusals`; the proxy's
other answers (a target that does not resolve or connect: 502) carry ``X-Turnstile-Egress-Failed``. Request
heads are size-limited, connects and every read have timeouts, and :meth:`EgressProxy.aclose`
ends all connections still open. It listens on 127.0.0.1 only; a local process that uses it gets
no more than the guard allows.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.guard import SsrfGuard

REFUSED_HEADER = "X-Turnstile-Egress-Refused"  # on a 403 for a target the guard refused
FAILED_HEADER = "X-Turnstile-Egress-Failed"  # on the proxy's other answers (502...): the reason
# Hop-by-hop headers (RFC 9110 §7.6.1) and the proxy's own; never forwarded to the origin.
_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te",
                "trailer", "transfer-encoding", "upgrade"}
_CHUNK = 65536


@dataclass
class EgressConfig:
    """Limits of the browser's egress proxy."""

    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0  # any read (head, body, tunnel) that waits longer ends the connection
    max_head_bytes: int = 65536
    max_lookups: int = 4  # name lookups at once per proxy: a page cannot pin the worker's DNS threads

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name, least in (("max_head_bytes", 1024), ("max_lookups", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {least}")


@dataclass(frozen=True)
class Refusal:
    """A target the guard refused: ``target`` is ``host:port``, ``url`` the request's URL if plain HTTP."""

    target: str
    reason: str
    url: str | None = None


def authority(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets; how refusals and navigations are compared."""
    host = host.lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_authority(url: str) -> str | None:
    """The ``host:port`` an http(s) or ws(s) URL connects to, or None for other URLs."""
    parts = urlsplit(url)
    default = {"http": 80, "ws": 80, "https": 443, "wss": 443}.get(parts.scheme.lower())
    try:
        port = parts.port or default
    except ValueError:
        return None
    if default is None or not parts.hostname or port is None:
        return None
    return authority(parts.hostname, port)


class _Reject(Exception):
    """Ends one client connection with an HTTP error answer."""

    def __init__(self, status: int, reason: str, message: str, target: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.target = status, reason, message, target


@dataclass
class _Request:
    method: str
    host: str
    port: int
    url: str | None  # None for CONNECT
    origin_form: str  # what the origin server gets in the request line
    version: str
    headers: list[tuple[str, str]] = field(default_factory=list)


class EgressProxy:
    """One HTTP forward proxy on 127.0.0.1 that lets through what the guard allows; use ``async with``."""

    def __init__(self, guard: SsrfGuard, config: EgressConfig | None = None) -> None:
        self.guard = guard
        self.config = config or EgressConfig()
        self.refusals: list[Refusal] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._lookups = asyncio.Semaphore(self.config.max_lookups)

    @property
    def port(self) -> int:
        """The port it listens on, on 127.0.0.1."""
        assert self._server is not None, "start() the proxy first"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0,
                                                  limit=self.config.max_head_bytes)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Our own task per connection (not asyncio's): Python 3.11 logs an error when a task it
        # created for a connection is cancelled, and aclose() cancels those still open.
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def aclose(self) -> None:
        """Stop listening and end every open connection; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> EgressProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- one client connection -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            request = _parse_head(await self._read_head(reader, "request"))
            upstream_reader, upstream = await self._connect(request)
            if request.url is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await self._tunnel(reader, writer, upstream_reader, upstream)
            else:
                await self._forward(request, reader, writer, upstream_reader, upstream)
        except _Reject as reject:
            await _answer(writer, reject)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass  # either side went away or went quiet: nothing more to do for this connection
        except ValueError as error:  # a request head no parser makes sense of (a broken URL)
            await _answer(writer, _Reject(400, "Bad Request", f"unreadable request: {error}"))
        finally:
            for stream in (upstream, writer):
                if stream is not None:
                    stream.close()

    async def _read_head(self, reader: asyncio.StreamReader, what: str) -> bytes:
        try:
            async with asyncio.timeout(self.config.idle_timeout_s):
                return await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, ValueError):
            status, reason = (431, "Request Header Fields Too Large") if what == "request" else \
                (502, "Bad Gateway")
            raise _Reject(status, reason, f"the {what} head is longer than "
                                          f"{self.config.max_head_bytes} bytes") from None

    async def _connect(self, request: _Request
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Check the target with the guard and connect to an address the check returned."""
        target = authority(request.host, request.port)
        try:
            # Bounded in time and in number: lookups run on the worker's shared executor.
            async with self._lookups, asyncio.timeout(self.config.connect_timeout_s):
                addresses = await self.guard.check_host(request.host, request.port)
        except TimeoutError:
            raise _Reject(502, "Bad Gateway", f"resolving {target} took longer than "
                                              f"{self.config.connect_timeout_s:g} s") from None
        except ToolError as error:
            if error.kind != "blocked":
                raise _Reject(502, "Bad Gateway", error.message) from None
            self.refusals.append(Refusal(target=target, reason=error.message, url=request.url))
            raise _Reject(403, "Forbidden", f"refused to connect to {target}: {error.message}",
                          target=target) from None
        hosts = [str(address) for address in addresses] or [request.host]  # allow-listed: by name
        failure = "no address"
        for host in hosts:
            try:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    return await asyncio.open_connection(host, request.port, limit=_CHUNK)
            except TimeoutError:
                failure = f"connecting to {host} timed out after {self.config.connect_timeout_s:g} s"
            except OSError as error:
                failure = f"cannot connect to {host}: {error}"
        raise _Reject(502, "Bad Gateway", f"{target}: {failure}")

    async def _forward(self, request: _Request, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, upstream_reader: asyncio.StreamReader,
                       upstream: asyncio.StreamWriter) -> None:
        """Send one plain HTTP request on and its answer back, then close both connections."""
        if any(name.lower() == "transfer-encoding" for name, _ in request.headers):
            raise _Reject(501, "Not Implemented", "chunked request bodies are not supported")
        length = _body_length(request.headers)
        lines = [f"{request.method} {request.origin_form} {request.version}"]
        lines += [f"{name}: {value}" for name, value in _end_to_end(request.headers)]
        upstream.write(("\r\n".join([*lines, "Connection: close", "", ""])).encode("latin-1"))
        await self._copy(reader, upstream, length)
        head = _parse_response_head(await self._read_head(upstream_reader, "response"))
        writer.write(head)
        await self._copy(upstream_reader, writer, None)

    async def _copy(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                    length: int | None) -> None:
        """Copy ``length`` bytes (None: until end of stream), each read bounded by the idle timeout."""
        left = length
        while left is None or left > 0:
            async with asyncio.timeout(self.config.idle_timeout_s):
                chunk = await source.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                if left is not None:
                    raise asyncio.IncompleteReadError(b"", left)
                return
            if left is not None:
                left -= len(chunk)
            sink.write(chunk)
            await sink.drain()

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      upstream_reader: asyncio.StreamReader, upstream: asyncio.StreamWriter) -> None:
        """Relay both ways until either side closes or goes quiet for the idle timeout."""
        directions = [asyncio.ensure_future(self._copy(reader, upstream, None)),
                      asyncio.ensure_future(self._copy(upstream_reader, writer, None))]
        try:
            done, _ = await asyncio.wait(directions, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                with contextlib.suppress(OSError, TimeoutError):
                    finished.result()
        finally:
            for direction in directions:
                direction.cancel()
            await asyncio.gather(*directions, return_exceptions=True)


def _parse_head(head: bytes) -> _Request:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _Reject(400, "Bad Request", f"not an HTTP/1 request line: {lines[0][:200]!r}")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                raise _Reject(400, "Bad Request", f"malformed header line {line[:200]!r}")
            headers.append((name.strip(), value.strip()))
    if method == "CONNECT":
        host, port = _split_authority(target)
        return _Request(method, host, port, None, target, version, headers)
    url = urlsplit(target)
    if url.scheme.lower() != "http" or not url.hostname:
        raise _Reject(400, "Bad Request", "a proxy request needs an absolute http:// URL or "
                                          f"CONNECT, not {target[:200]!r}")
    try:
        port = url.port or 80
    except ValueError:
        raise _Reject(400, "Bad Request", f"bad port in {target[:200]!r}") from None
    origin_form = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return _Request(method, url.hostname, port, target, origin_form, version, headers)


def _split_authority(target: str) -> tuple[str, int]:
    host, _, port_text = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = _number(port_text)
    if not host or port is None or not 0 < port < 65536:
        raise _Reject(400, "Bad Request", f"CONNECT needs host:port, not {target[:200]!r}")
    return host, port


def _number(text: str) -> int | None:
    """A decimal number written in ASCII digits only, or None."""
    return int(text) if text.isascii() and text.isdigit() else None


def _body_length(headers: list[tuple[str, str]]) -> int:
    """The request body's length: one Content-Length (several could disagree), or none for 0."""
    lengths = [value for name, value in headers if name.lower() == "content-length"]
    if not lengths:
        return 0
    length = _number(lengths[0]) if len(lengths) == 1 else None
    if length is None:
        raise _Reject(400, "Bad Request", f"bad Content-Length: {', '.join(lengths)[:100]!r}")
    return length


def _end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers without hop-by-hop ones, including those the Connection header names."""
    named = {token.strip().lower() for name, value in headers if name.lower() == "connection"
             for token in value.split(",")}
    return [(name, value) for name, value in headers
            if name.lower() not in _HOP_HEADERS and name.lower() not in named]


def _parse_response_head(head: bytes) -> bytes:
    """The origin's response head with its connection headers replaced by ``Connection: close``."""
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1."):
        raise _Reject(502, "Bad Gateway", f"the origin answered {lines[0][:200]!r}")
    kept = [line for line in lines[1:] if line and line.partition(":")[0].strip().lower()
            not in ("connection", "keep-alive", "proxy-connection")]
    return "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1")


async def _answer(writer: asyncio.StreamWriter, reject: _Reject) -> None:
    body = (reject.message + "\n").encode("utf-8", "replace")
    if reject.target:
        extra = f"{REFUSED_HEADER}: {reject.target}\r\n"
    else:  # the reason as one line of printable ASCII, as a header value must be
        reason = "".join(c if " " <= c <= "~" else "?" for c in reject.message)[:300]
        extra = f"{FAILED_HEADER}: {reason}\r\n"
    head = (f"HTTP/1.1 {reject.status} {reject.reason}\r\nContent-Type: text/plain; charset=utf-8"
            f"\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    with contextlib.suppress(OSError):
        writer.write(head.encode("latin-1") + body)
        await writer.drain()

"""The browser's egress proxy on its own, spoken to over raw sockets: what it lets through, what it
refuses (without ever connecting), and its limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import ClassVar
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from tests.loopback import AcceptCounter, QuietHandler, count_accepts, serve
from turnstile.envs.visit.egress import (
    FAILED_HEADER,
    REFUSED_HEADER,
    EgressConfig,
    EgressProxy,
    authority,
    url_authority,
)
from turnstile.envs.visit.guard import GuardConfig, Resolver, SsrfGuard

pytestmark = pytest.mark.integration


class Site(QuietHandler):
    seen: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).seen.append(("GET", self.path, dict(self.headers), b""))
        self.send_body(200, b"allowed page", content_type="text/plain")

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(("POST", self.path, dict(self.headers), body))
        self.send_body(200, b"posted " + body, content_type="text/plain")


@pytest.fixture(scope="module")
def site_base() -> Iterator[str]:
    with serve(Site) as base:
        yield base


@pytest.fixture
def site(site_base: str) -> str:
    Site.seen = []
    return site_base


@pytest.fixture
def refused() -> Iterator[AcceptCounter]:
    with count_accepts() as counter:
        yield counter


def resolver(answers: dict[str, list[str]]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"{host} does not resolve in this test")
        return answers[host]
    return resolve


@pytest_asyncio.fixture(loop_scope="function")  # the proxy must serve on the test's own loop
async def proxy(site: str) -> AsyncIterator[EgressProxy]:
    guard = SsrfGuard(GuardConfig(allow_hosts=[urlsplit(site).netloc]),
                      resolver({"named.test": ["127.0.0.1"], "private.test": ["127.0.0.2"],
                                "mixed.test": ["127.0.0.1", "127.0.0.2"]}))
    async with EgressProxy(guard, EgressConfig(idle_timeout_s=1.0, max_head_bytes=4096)) as egress:
        yield egress


async def exchange(proxy: EgressProxy, data: bytes, then: bytes = b"") -> bytes:
    """Send ``data`` to the proxy, then ``then`` after its first answer; return everything read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(data)
        await writer.drain()
        if then:
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(then)
            await writer.drain()
            return first + await asyncio.wait_for(reader.read(), 5)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def test_plain_http_is_forwarded_once_with_connection_close(proxy: EgressProxy,
                                                                  site: str) -> None:
    answer = await exchange(proxy, f"GET {site}/page?q=1 HTTP/1.1\r\nHost: {urlsplit(site).netloc}"
                                   f"\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: x\r\n"
                                   f"Connection: keep-alive, X-Drop\r\nX-Drop: 1\r\n\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Connection: close" in head and body == b"allowed page"
    method, path, headers, _ = Site.seen[0]
    assert (method, path) == ("GET", "/page?q=1")
    assert {"Proxy-Connection", "Proxy-Authorization", "X-Drop"}.isdisjoint(headers)
    assert headers["Connection"] == "close"


async def test_post_body_is_forwarded(proxy: EgressProxy, site: str) -> None:
    answer = await exchange(proxy, f"POST {site}/form HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                   f"\r\nq=abc".encode())
    assert answer.endswith(b"posted q=abc") and Site.seen[0][3] == b"q=abc"


async def test_second_request_on_one_connection_is_not_forwarded(
        proxy: EgressProxy, site: str, refused: AcceptCounter) -> None:
    first = f"GET {site}/one HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    second = f"GET {refused.url}/two HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    answer = await exchange(proxy, first + second)
    assert answer.endswith(b"allowed page") and [seen[1] for seen in Site.seen] == ["/one"]
    assert refused.accepts == 0 and proxy.refusals == []


@pytest.mark.parametrize("request_for", [
    lambda refused: f"GET {refused.url}/x HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda refused: f"CONNECT {refused.authority} HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda refused: f"GET http://private.test:{refused.port}/ HTTP/1.1\r\nHost: x\r\n\r\n",
    lambda refused: f"CONNECT mixed.test:{refused.port} HTTP/1.1\r\n\r\n",
    lambda refused: f"CONNECT 2130706434:{refused.port} HTTP/1.1\r\n\r\n",  # 127.0.0.2 as a number
], ids=["http", "connect", "name-to-private", "mixed-answer", "integer-literal"])
async def test_refused_target_gets_403_and_no_connection(
        proxy: EgressProxy, refused: AcceptCounter,
        request_for: Callable[[AcceptCounter], str]) -> None:
    answer = await exchange(proxy, request_for(refused).encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    target = proxy.refusals[0].target
    assert f"{REFUSED_HEADER}: {target}".encode() in head and str(refused.port) in target
    assert b"visit.guard.allow_hosts" in body
    assert refused.accepts == 0


async def test_connect_tunnels_to_the_checked_address(proxy: EgressProxy, site: str) -> None:
    # named.test exists only in the guard's resolver: connecting by name would fail.
    request = f"CONNECT named.test:{port_of(site)} HTTP/1.1\r\nHost: named.test\r\n\r\n".encode()
    answer = await exchange(proxy, request, then=b"GET /tunnelled HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\n")
    assert answer.endswith(b"allowed page") and Site.seen[0][1] == "/tunnelled"


@pytest.mark.parametrize(("data", "status"), [
    (b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET ftp://a.test/ HTTP/1.1\r\n\r\n", b"400"),
    (b"CONNECT nohost HTTP/1.1\r\n\r\n", b"400"),
    (b"GET http://nowhere.test/ HTTP/1.1\r\n\r\n", b"502"),  # does not resolve
    (b"GET http://a.test/ HTTP/1.1\r\nX: " + b"a" * 5000 + b"\r\n\r\n", b"431"),
])
async def test_bad_requests_are_answered(proxy: EgressProxy, data: bytes, status: bytes) -> None:
    answer = await exchange(proxy, data)
    assert answer.startswith(b"HTTP/1.1 " + status) and proxy.refusals == []
    assert f"{FAILED_HEADER}: ".encode() in answer.partition(b"\r\n\r\n")[0]


async def test_chunked_request_body_is_refused(proxy: EgressProxy, site: str) -> None:
    answer = await exchange(proxy, f"POST {site}/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   f"0\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 501") and Site.seen == []


async def test_quiet_client_is_dropped_after_the_idle_timeout(proxy: EgressProxy) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await exchange(proxy, b"GET http://a.test/ HTTP/1.1\r\n") == b""  # head never ends
    assert loop.time() - started < 4


async def test_aclose_ends_open_tunnels(site: str) -> None:
    guard = SsrfGuard(GuardConfig(allow_hosts=[urlsplit(site).netloc]))
    egress = EgressProxy(guard)
    await egress.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(f"CONNECT {urlsplit(site).netloc} HTTP/1.1\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await egress.aclose()
    await egress.aclose()  # safe twice
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


def test_authorities() -> None:
    assert authority("::1", 443) == "[::1]:443" and authority("A.Test", 80) == "a.test:80"
    assert url_authority("https://[::1]/x") == "[::1]:443"
    assert url_authority("ws://a.test:81/s") == "a.test:81"
    assert url_authority("http://a.test/") == "a.test:80"
    assert url_authority("data:text/plain,x") is None and url_authority("about:blank") is None

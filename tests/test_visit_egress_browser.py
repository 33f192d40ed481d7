"""Chromium must not reach a refused address by any route: each test counts the TCP connections a
refused server on 127.0.0.2 accepts (0 is the only passing number) and checks that its text never
reaches the agent. The allowed site lives on 127.0.0.1 and only its host:port is allow-listed.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from playwright.async_api import Error as PlaywrightError

from tests.loopback import AcceptCounter, QuietHandler, count_accepts, serve
from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.browser import BrowserConfig, BrowserRenderer
from turnstile.envs.visit.guard import GuardConfig, SsrfGuard
from turnstile.envs.visit.tool import VisitConfig, VisitTool

pytestmark = pytest.mark.integration

if not os.path.exists(BrowserConfig().executable_path):
    pytest.skip("Chromium is not installed at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)

SECRET = "The vault combination is seven four one, written on the refused server only."
REFUSED_PAGE = f"<html><body><article><p>{SECRET}</p>" * 3 + "</article></body></html>"
TEXT = "The harbour master logged every ship that entered the bay during the long winter months."
LONG_PAGE = f"<p>{TEXT}</p>" * 6


def make_site(refused: AcceptCounter, udp_port: int) -> type[QuietHandler]:
    target = refused.url
    pages = {
        "/redirect": None,
        "/redirect-https": None,
        "/script-nav": '<p>Loading</p><script>location.href = "/hop";</script>',
        "/meta": f'<meta http-equiv="refresh" content="0;url={target}/meta"><p>Loading</p>',
        "/form-post": f'<form id="f" method="post" action="{target}/form"><input name="q" '
                      f'value="1"></form><script>document.getElementById("f").submit()</script>',
        "/form-get": f'<form id="f" action="{target}/form"><input name="q" value="1"></form>'
                     f'<script>document.getElementById("f").submit()</script>',
        "/iframe": f'{LONG_PAGE}<iframe src="{target}/frame"></iframe>',
        "/subresources": f"""{LONG_PAGE}<p id="out">waiting</p>
<script src="{target}/script.js"></script><link rel="stylesheet" href="{target}/style.css">
<script>
const out = document.getElementById('out');
fetch("{target}/fetch").then(r => r.text()).then(t => out.textContent = 'got ' + t)
  .catch(() => out.textContent = 'fetch failed');
const xhr = new XMLHttpRequest(); xhr.open("GET", "{target}/xhr"); xhr.send();
navigator.sendBeacon("{target}/beacon", "x");
</script>""",
        "/websocket": f"""{LONG_PAGE}<p id="out">waiting</p><script>
const socket = new WebSocket("ws://{refused.authority}/socket");
socket.onopen = () => document.getElementById('out').textContent = 'socket open';
socket.onerror = () => document.getElementById('out').textContent = 'socket failed';
const secure = new WebSocket("wss://{refused.authority}/secure");
</script>""",
        "/prefetch": f"""<head><link rel="preconnect" href="{target}">
<link rel="dns-prefetch" href="//{refused.authority}"><link rel="prefetch" href="{target}/next">
<script type="speculationrules">{{"prefetch": [{{"source": "list", "urls": ["{target}/spec"]}}],
 "prerender": [{{"source": "list", "urls": ["{target}/prerender"]}}]}}</script></head>
<body>{LONG_PAGE}<a href="{target}/link">next</a></body>""",
        "/webrtc": f"""{LONG_PAGE}<script>
const pc = new RTCPeerConnection({{iceServers: [
  {{urls: "turn:{refused.authority}?transport=tcp", username: "u", credential: "p"}},
  {{urls: "stun:127.0.0.2:{udp_port}"}}]}});
pc.createDataChannel("x");
pc.createOffer().then(offer => pc.setLocalDescription(offer)).then(() => {{
  const remote = new RTCPeerConnection();
  remote.createDataChannel("y");
  return remote.createOffer();
}}).then(() => pc.addIceCandidate({{sdpMid: "0", sdpMLineIndex: 0, candidate:
  "candidate:1 1 tcp 2122260223 127.0.0.2 {refused.port} typ host tcptype passive"}})).catch(() => null);
</script>""",
    }

    class Site(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path == "/redirect" or path == "/hop":
                self.send_body(302, b"", headers={"Location": f"{target}/redirected"})
            elif path == "/redirect-https":
                self.send_body(302, b"", headers={"Location": f"https://{refused.authority}/tls"})
            elif path == "/cloak":  # a short page for the static fetch, a redirect for Chromium
                if "turnstile-visit" in self.headers.get("User-Agent", ""):
                    self.send_body(200, b"<html><body><p>Nothing here.</p></body></html>")
                else:
                    self.send_body(302, b"", headers={"Location": f"{target}/cloaked"})
            elif pages.get(path):
                self.send_body(200, f"<html><body>{pages[path]}</body></html>".encode())
            else:
                self.send_body(404, b"")

    return Site


@pytest.fixture
def udp_counter() -> Iterator[tuple[int, list[bytes]]]:
    """A UDP socket on 127.0.0.2 that keeps every datagram it gets (STUN would send some)."""
    received: list[bytes] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.2", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                received.append(sock.recv(2048))
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    yield sock.getsockname()[1], received
    stop.set()
    thread.join(timeout=2)
    sock.close()


@pytest.fixture
def refused() -> Iterator[AcceptCounter]:
    with count_accepts(body=REFUSED_PAGE.encode()) as counter:
        yield counter


@pytest.fixture
def site(refused: AcceptCounter, udp_counter: tuple[int, list[bytes]]) -> Iterator[str]:
    with serve(make_site(refused, udp_counter[0])) as base:
        yield base


def allow(site: str) -> GuardConfig:
    return GuardConfig(allow_hosts=[urlsplit(site).netloc])


@pytest.fixture
async def renderer(site: str) -> AsyncIterator[BrowserRenderer]:
    rendered = BrowserRenderer(BrowserConfig(network_idle_timeout_s=1.0), SsrfGuard(allow(site)))
    yield rendered
    await rendered.aclose()


async def visit(site: str, path: str, render: str) -> str:
    tool = VisitTool(VisitConfig(guard=allow(site), render=render,  # type: ignore[arg-type]
                                 browser=BrowserConfig(network_idle_timeout_s=1.0)))
    try:
        return await tool.call(tool.normalize({"url": f"{site}{path}", "goal": "g"}))
    finally:
        await tool.aclose()


@pytest.mark.parametrize("path", ["/redirect", "/redirect-https", "/script-nav", "/meta",
                                  "/form-post", "/form-get"])
async def test_main_frame_navigation_into_refused_space_is_blocked(
        renderer: BrowserRenderer, site: str, refused: AcceptCounter, path: str) -> None:
    with pytest.raises(ToolError) as caught:
        await renderer.render(f"{site}{path}")
    assert caught.value.kind == "blocked"
    assert refused.authority in caught.value.message
    assert "visit.guard.allow_hosts" in caught.value.message
    assert SECRET not in caught.value.message
    assert refused.accepts == 0


async def test_render_always_redirect_is_blocked(site: str, refused: AcceptCounter) -> None:
    with pytest.raises(ToolError) as caught:
        await visit(site, "/redirect", render="always")
    assert caught.value.kind == "blocked" and refused.authority in caught.value.message
    assert refused.accepts == 0


@pytest.mark.parametrize("path", ["/cloak", "/script-nav", "/meta"])
async def test_render_auto_never_shows_the_refused_page(site: str, refused: AcceptCounter,
                                                        path: str) -> None:
    # The static fetch sees a short harmless page (cloaking serves httpx and Chromium differently);
    # the render that auto mode then asks for is sent into refused space: the visit is refused.
    with pytest.raises(ToolError) as caught:
        await visit(site, path, render="auto")
    assert caught.value.kind == "blocked" and refused.authority in caught.value.message
    assert SECRET not in caught.value.message
    assert refused.accepts == 0


@pytest.mark.parametrize(("path", "blocked"), [
    ("/iframe", "/frame"), ("/subresources", "/fetch"), ("/websocket", None),
    ("/prefetch", None), ("/webrtc", None),
])
async def test_page_renders_but_refused_subresources_never_connect(
        renderer: BrowserRenderer, site: str, refused: AcceptCounter,
        udp_counter: tuple[int, list[bytes]], path: str, blocked: str | None) -> None:
    page = await renderer.render(f"{site}{path}")
    assert TEXT in page.html and SECRET not in page.html
    assert refused.accepts == 0
    assert udp_counter[1] == []  # WebRTC sent no STUN datagram to the refused address either
    if blocked is not None:
        assert f"{refused.url}{blocked}" in page.blocked_urls
    if path == "/subresources":
        assert "fetch failed" in page.html


async def test_redirect_to_an_allowed_but_dead_port_is_an_error_not_a_page() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]

    class Site(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_body(302, b"", headers={"Location": f"http://127.0.0.1:{dead}/gone"})

    with serve(Site) as site:
        guard = SsrfGuard(GuardConfig(allow_hosts=[urlsplit(site).netloc, f"127.0.0.1:{dead}"]))
        renderer = BrowserRenderer(BrowserConfig(network_idle_timeout_s=0.5), guard)
        try:
            with pytest.raises(ToolError) as caught:
                await renderer.render(f"{site}/")
        finally:
            await renderer.aclose()
    assert caught.value.kind == "connect" and caught.value.retryable
    assert f"127.0.0.1:{dead}" in caught.value.message


async def test_allowed_websocket_goes_through_the_tunnel() -> None:
    from websockets.asyncio.server import serve as serve_websocket  # a test extra in pyproject.toml

    async def echo(connection) -> None:  # noqa: ANN001 - a websockets ServerConnection
        async for message in connection:
            await connection.send(f"echo {message}")

    async with serve_websocket(echo, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        script = (f'<p id="out">waiting</p><script>const s = new WebSocket("ws://127.0.0.1:{port}/");'
                  f's.onopen = () => s.send("hello"); s.onmessage = e => '
                  f'document.getElementById("out").textContent = e.data;</script>')

        class Site(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_body(200, f"<html><body>{LONG_PAGE}{script}</body></html>".encode())

        with serve(Site) as site:
            guard = SsrfGuard(GuardConfig(allow_hosts=[urlsplit(site).netloc, f"127.0.0.1:{port}"]))
            renderer = BrowserRenderer(BrowserConfig(network_idle_timeout_s=1.0), guard)
            try:
                page = await renderer.render(f"{site}/")
            finally:
                await renderer.aclose()
    assert "echo hello" in page.html and page.blocked_urls == []


async def test_a_context_without_the_proxy_reaches_nothing(
        renderer: BrowserRenderer, site: str, refused: AcceptCounter) -> None:
    """Defence in depth: the launch-level proxy does not resolve, nor does any name or address."""
    browser = await renderer._browser_now()  # the browser the renders share
    context = await browser.new_context()
    try:
        page = await context.new_page()
        for url in (f"{site}/iframe", f"{refused.url}/direct"):
            with pytest.raises(PlaywrightError):
                await page.goto(url, timeout=10_000)
    finally:
        await context.close()
    assert refused.accepts == 0


class Rebinding:
    """A resolver stub for ``rebind.test``: the answer the site sets is the answer the guard gets."""

    answer = "127.0.0.1"
    calls = 0

    @classmethod
    async def resolve(cls, host: str, port: int) -> list[str]:
        if host != "rebind.test":
            raise OSError(f"{host} does not resolve in this test")
        cls.calls += 1
        return [cls.answer]


@pytest.fixture
def rebinding_site(refused: AcceptCounter) -> Iterator[str]:
    """A site on 127.0.0.1 at the refused server's port, so ``rebind.test:PORT`` can point at either.

    Serving ``/page`` switches the DNS answer to 127.0.0.2, as a rebinding attacker's DNS would.
    """

    class Site(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/page":
                script = ('<p id="out">waiting</p><script>fetch("/data").then(r => r.text())'
                          '.then(t => document.getElementById("out").textContent = "got " + t)'
                          '.catch(() => document.getElementById("out").textContent = "fetch failed")'
                          '</script>')
                self.send_body(200, f"<html><body>{LONG_PAGE}{script}</body></html>".encode())
                Rebinding.answer = "127.0.0.2"
            else:
                self.send_body(200, b"allowed data", content_type="text/plain")

    Rebinding.answer, Rebinding.calls = "127.0.0.1", 0
    server = ThreadingHTTPServer(("127.0.0.1", refused.port), Site)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://rebind.test:{refused.port}"
    finally:
        server.shutdown()
        server.server_close()


async def test_dns_rebinding_connects_only_to_the_checked_address(
        rebinding_site: str, refused: AcceptCounter) -> None:
    # Chromium's own DNS would send rebind.test to the refused server; it must not be asked.
    config = BrowserConfig(network_idle_timeout_s=1.0,
                           args=[*BrowserConfig().args, "--host-resolver-rules=MAP rebind.test 127.0.0.2"])
    guard = SsrfGuard(GuardConfig(allow_hosts=[f"127.0.0.1:{refused.port}"]), Rebinding.resolve)
    renderer = BrowserRenderer(config, guard)
    try:
        page = await renderer.render(f"{rebinding_site}/page")
    finally:
        await renderer.aclose()
    assert TEXT in page.html and SECRET not in page.html
    assert "fetch failed" in page.html  # after the answer changed, /data was refused
    assert refused.accepts == 0
    assert Rebinding.calls >= 2  # checked again for the second connection, not cached

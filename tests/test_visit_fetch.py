"""Static fetch against real HTTP servers on loopback: redirects, limits, statuses, SSRF on hops."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import urlsplit

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.tools.base import Fault, ToolError
from turnstile.envs.visit.fetch import FetchConfig, Fetcher
from turnstile.envs.visit.guard import GuardConfig, SsrfGuard

pytestmark = pytest.mark.integration

ARTICLE = b"<html><body><article><p>" + b"The quick brown fox jumps. " * 20 + b"</p></article></body></html>"


class Site(QuietHandler):
    """Paths: /page, /redirect?to=URL, /loop, /chain/N, /big, /slow, /trickle, /status/N, /pdf, /cp1251."""

    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        type(self).hits.append(self.path)
        path, _, query = self.path.partition("?")
        if path == "/page":
            self.send_body(200, ARTICLE)
        elif path == "/redirect":
            self.send_body(302, b"", headers={"Location": query.removeprefix("to=")})
        elif path == "/loop":
            self.send_body(301, b"", headers={"Location": "/loop2"})
        elif path == "/loop2":
            self.send_body(301, b"", headers={"Location": "/loop"})
        elif path.startswith("/chain/"):
            n = int(path.rsplit("/", 1)[1])
            target = "/page" if n == 0 else f"/chain/{n - 1}"
            self.send_body(302, b"", headers={"Location": target})
        elif path == "/big":
            self.send_body(200, b"<html><body><p>" + b"x" * 200_000 + b"</p></body></html>")
        elif path == "/slow":
            time.sleep(2)
            self.send_body(200, ARTICLE)
        elif path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"<p>a</p>")
                self.wfile.flush()
                time.sleep(0.1)
        elif path.startswith("/status/"):
            self.send_body(int(path.rsplit("/", 1)[1]), b"<html>nope</html>")
        elif path == "/pdf":
            self.send_body(200, b"%PDF-1.4 fake", content_type="application/pdf")
        elif path == "/cp1251":
            self.send_body(200, "<p>Привет, мир</p>".encode("cp1251"),
                           content_type="text/html; charset=windows-1251")
        elif path == "/meta-charset":
            self.send_body(200, '<meta charset="iso-8859-1"><p>café</p>'.encode("latin-1"),
                           content_type="text/html")
        elif path == "/plain":
            self.send_body(200, b"just text", content_type="text/plain")
        else:
            self.send_body(404, b"not found")


class Counter(QuietHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).hits.append(self.path)
        self.send_body(200, b"<p>secret</p>")


class V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


@contextlib.contextmanager
def serve_v6(handler: type[QuietHandler]) -> Iterator[str]:
    server = V6Server(("::1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://[::1]:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def site() -> Iterator[str]:
    Site.hits = []
    with serve(Site) as base:
        yield base


def fetcher_for(base: str, **config: object) -> Fetcher:
    netloc = urlsplit(base).netloc
    return Fetcher(FetchConfig(**config), SsrfGuard(GuardConfig(allow_hosts=[netloc])))  # type: ignore[arg-type]


async def fetch_error(fetcher: Fetcher, url: str) -> ToolError:
    try:
        with pytest.raises(ToolError) as caught:
            await fetcher.fetch(url)
    finally:
        await fetcher.aclose()
    return caught.value


async def test_fetches_allow_listed_page(site: str) -> None:
    fetcher = fetcher_for(site)
    page = await fetcher.fetch(f"{site}/page")
    await fetcher.aclose()
    await fetcher.aclose()  # safe twice
    assert page.status == 200 and page.content_type == "text/html" and page.is_html
    assert "quick brown fox" in page.html and not page.truncated


async def test_loopback_refused_without_allow_list(site: str) -> None:
    error = await fetch_error(Fetcher(FetchConfig(), SsrfGuard()), f"{site}/page")
    assert error.kind == "blocked" and "127.0.0.1" in error.message
    assert Site.hits == []


async def test_follows_redirects(site: str) -> None:
    fetcher = fetcher_for(site)
    page = await fetcher.fetch(f"{site}/chain/3")
    await fetcher.aclose()
    assert page.final_url == f"{site}/page" and page.url == f"{site}/chain/3"
    assert "quick brown fox" in page.html


async def test_too_many_redirects(site: str) -> None:
    error = await fetch_error(fetcher_for(site, max_redirects=2), f"{site}/chain/5")
    assert error.kind == "too_many_redirects" and not error.retryable
    assert len(Site.hits) == 3  # the first request and two hops, nothing more


async def test_redirect_loop(site: str) -> None:
    error = await fetch_error(fetcher_for(site), f"{site}/loop")
    assert error.kind == "redirect_loop" and not error.retryable


async def test_redirect_into_private_space_refused_before_connecting(site: str) -> None:
    error = await fetch_error(fetcher_for(site), f"{site}/redirect?to=http://10.0.0.1/")
    assert error.kind == "blocked" and "10.0.0.1" in error.message


async def test_redirect_to_ipv6_loopback_refused(site: str) -> None:
    Counter.hits = []
    with serve_v6(Counter) as other:
        error = await fetch_error(fetcher_for(site), f"{site}/redirect?to={other}/secret")
    assert error.kind == "blocked"
    assert Counter.hits == []


async def test_redirect_to_other_loopback_port_refused(site: str) -> None:
    Counter.hits = []
    with serve(Counter) as other:
        integer_form = other.replace("127.0.0.1", "2130706433")
        for target in (other, integer_form):
            error = await fetch_error(fetcher_for(site), f"{site}/redirect?to={target}/secret")
            assert error.kind == "blocked"
    assert Counter.hits == []


async def test_connect_checks_address_again_against_dns_rebinding(site: str) -> None:
    port = urlsplit(site).port
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])  # public for the check, loopback at connect

    async def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    fetcher = Fetcher(FetchConfig(), SsrfGuard(GuardConfig(), rebinding))
    error = await fetch_error(fetcher, f"http://rebind.test:{port}/page")
    assert error.kind == "blocked" and "127.0.0.1" in error.message
    assert Site.hits == []


async def test_connects_to_the_address_the_guard_resolved(site: str) -> None:
    port = urlsplit(site).port

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if host == "corpus.test" else []

    fetcher = Fetcher(FetchConfig(), SsrfGuard(GuardConfig(allow_hosts=["127.0.0.0/8"]), resolver))
    page = await fetcher.fetch(f"http://corpus.test:{port}/page")  # system DNS cannot resolve this
    await fetcher.aclose()
    assert "quick brown fox" in page.html


async def test_oversize_truncates_by_default(site: str) -> None:
    fetcher = fetcher_for(site, max_bytes=10_000)
    page = await fetcher.fetch(f"{site}/big")
    await fetcher.aclose()
    assert page.truncated and len(page.html) == 10_000


async def test_oversize_error_mode(site: str) -> None:
    error = await fetch_error(fetcher_for(site, max_bytes=10_000, oversize="error"), f"{site}/big")
    assert error.kind == "too_large" and not error.retryable


async def test_read_timeout_is_retryable(site: str) -> None:
    start = time.monotonic()
    error = await fetch_error(fetcher_for(site, read_timeout_s=0.3), f"{site}/slow")
    assert error.kind == "timeout" and error.retryable
    assert time.monotonic() - start < 1.5


async def test_total_deadline(site: str) -> None:
    start = time.monotonic()
    error = await fetch_error(fetcher_for(site, read_timeout_s=1.0, total_timeout_s=0.5),
                              f"{site}/trickle")
    assert error.kind == "timeout" and error.retryable and "total deadline" in error.message
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(("status", "retryable"), [(404, False), (403, False), (500, True),
                                                   (503, True), (429, True)])
async def test_http_status_errors(site: str, status: int, retryable: bool) -> None:
    error = await fetch_error(fetcher_for(site), f"{site}/status/{status}")
    assert error.kind == "http_status" and error.retryable is retryable
    assert str(status) in error.message
    # a refusal or a missing page is the address the policy chose; an overloaded or failing server is not
    assert error.fault is (Fault.environment if status in (429, 500, 503) else Fault.policy)


async def test_pdf_is_unsupported(site: str) -> None:
    error = await fetch_error(fetcher_for(site), f"{site}/pdf")
    assert error.kind == "unsupported_content" and "application/pdf" in error.message


async def test_connection_refused_is_retryable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fetcher = Fetcher(FetchConfig(), SsrfGuard(GuardConfig(allow_hosts=[f"127.0.0.1:{port}"])))
    error = await fetch_error(fetcher, f"http://127.0.0.1:{port}/")
    assert error.kind == "connect" and error.retryable


async def test_charsets_and_plain_text(site: str) -> None:
    fetcher = fetcher_for(site)
    assert "Привет, мир" in (await fetcher.fetch(f"{site}/cp1251")).html
    assert "café" in (await fetcher.fetch(f"{site}/meta-charset")).html
    plain = await fetcher.fetch(f"{site}/plain")
    await fetcher.aclose()
    assert plain.html == "just text" and not plain.is_html

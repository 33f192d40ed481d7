"""Rendering in real headless Chromium: JavaScript-only pages, and requests the guard must stop."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import ClassVar
from urllib.parse import urlsplit

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.browser import BrowserConfig, BrowserRenderer
from turnstile.envs.visit.guard import GuardConfig, SsrfGuard
from turnstile.envs.visit.tool import VisitConfig, VisitTool

pytestmark = pytest.mark.integration

if not os.path.exists(BrowserConfig().executable_path):
    pytest.skip("Chromium is not installed at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)

SENTENCE = "The lighthouse keeper counted forty-two ships passing the northern cape last winter."
JS_PAGE = f"""<html><head><title>js</title></head><body><div id="root"></div><script>
const root = document.getElementById('root');
for (let i = 0; i < 5; i++) {{
  const p = document.createElement('p');
  p.textContent = "{SENTENCE} Paragraph " + i + ".";
  root.appendChild(p);
}}
</script></body></html>""".encode()


class Secret(QuietHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).hits.append(self.path)
        self.send_body(200, b"secret", content_type="text/plain",
                       headers={"Access-Control-Allow-Origin": "*"})


def make_site(secret: str) -> type[QuietHandler]:
    class Site(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/js":
                self.send_body(200, JS_PAGE)
            elif self.path == "/leak":
                script = f"""<html><body><p id="out">waiting</p><script>
fetch("{secret}/data").then(r => r.text()).then(t => document.getElementById('out').textContent = 'got ' + t)
  .catch(e => document.getElementById('out').textContent = 'fetch failed');
fetch("/bounce").then(r => r.text()).catch(e => null);
</script></body></html>"""
                self.send_body(200, script.encode())
            elif self.path == "/to-js":
                self.send_body(302, b"", headers={"Location": "/js"})
            elif self.path == "/bounce":
                self.send_body(302, b"", headers={"Location": f"{secret}/via-redirect"})
            else:
                self.send_body(404, b"")
    return Site


@pytest.fixture
def servers() -> Iterator[tuple[str, str]]:
    Secret.hits = []
    with serve(Secret) as secret, serve(make_site(secret)) as site:
        yield site, secret


@pytest.fixture
async def renderer(servers: tuple[str, str]) -> AsyncIterator[BrowserRenderer]:
    site, _ = servers
    guard = SsrfGuard(GuardConfig(allow_hosts=[urlsplit(site).netloc]))
    rendered = BrowserRenderer(BrowserConfig(network_idle_timeout_s=1.0), guard)
    yield rendered
    await rendered.aclose()
    await rendered.aclose()  # safe twice


async def test_renders_javascript_page(renderer: BrowserRenderer, servers: tuple[str, str]) -> None:
    page = await renderer.render(f"{servers[0]}/js")
    assert SENTENCE in page.html and page.status == 200


async def test_follows_allowed_redirect(renderer: BrowserRenderer, servers: tuple[str, str]) -> None:
    page = await renderer.render(f"{servers[0]}/to-js")
    assert SENTENCE in page.html and page.final_url == f"{servers[0]}/js"


async def test_page_cannot_fetch_non_allowed_address(renderer: BrowserRenderer,
                                                     servers: tuple[str, str]) -> None:
    site, secret = servers
    page = await renderer.render(f"{site}/leak")
    assert "fetch failed" in page.html and "got secret" not in page.html
    assert Secret.hits == []
    assert f"{secret}/data" in page.blocked_urls
    assert f"{secret}/via-redirect" in page.blocked_urls  # the redirect hop was checked too


async def test_blocked_main_document(renderer: BrowserRenderer, servers: tuple[str, str]) -> None:
    with pytest.raises(ToolError) as caught:
        await renderer.render(f"{servers[1]}/data")
    assert caught.value.kind == "blocked"
    assert Secret.hits == []


async def test_visit_tool_falls_back_to_browser_for_js_page(servers: tuple[str, str]) -> None:
    site, _ = servers
    config = VisitConfig(guard=GuardConfig(allow_hosts=[urlsplit(site).netloc]))
    tool = VisitTool(config)
    static = VisitTool(VisitConfig(guard=config.guard, render="never"))
    try:
        args = tool.normalize({"url": f"{site}/js", "goal": "ships"})
        assert (await static.call(args)) == f"The page {site}/js has no readable text."
        text = await tool.call(args)
        assert text.startswith(f"Content of {site}/js (goal: ships):\n")
        assert SENTENCE in text
    finally:
        await tool.aclose()
        await static.aclose()
        await tool.aclose()

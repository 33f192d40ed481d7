"""Rendering with a real browser, for pages whose text only exists after JavaScript runs.

One headless Chromium (Debian's ``/usr/bin/chromium``; Playwright cannot download its own here) is
started lazily per renderer and shared by all visits; each visit gets a fresh browser context, so no
cookies or storage leak between episodes. Every request the page makes — the document, scripts,
``fetch``/XHR, iframes, each redirect hop — passes through ``context.route`` and the
:class:`~envs.visit.guard.SsrfGuard`, so a page cannot make the browser reach a private address.
Allowed requests are made by Playwright with redirects off (see ``_fetch_checked``), because a
plainly continued request would have its redirects followed by Chromium unchecked.
Service workers are blocked (they would bypass routing), WebSockets are checked the same way, and
images, media and fonts are not loaded (they carry no text and cost time).

Known gap: Chromium resolves host names itself after the guard's check, so a DNS answer that changes
in between (DNS rebinding) is not caught here as it is in the static fetch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urljoin

from playwright.async_api import APIResponse, Browser, Playwright, Route, WebSocketRoute, async_playwright
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeout

from envs.tools.base import ToolError
from envs.visit.guard import SsrfGuard

_REDIRECTS = (301, 302, 303, 307, 308)
DEFAULT_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@dataclass
class BrowserConfig:
    """How the browser is started and how long a render may take."""

    executable_path: str = "/usr/bin/chromium"
    args: list[str] = field(default_factory=lambda: list(DEFAULT_ARGS))
    navigation_timeout_s: float = 20.0
    wait_until: Literal["load", "domcontentloaded", "networkidle"] = "load"
    network_idle_timeout_s: float = 3.0  # after load, wait this long at most for the network to settle
    max_redirects: int = 5  # per subresource request
    skip_resource_types: list[str] = field(default_factory=lambda: ["image", "media", "font"])


@dataclass
class RenderedPage:
    """The DOM after rendering, as HTML, and the URLs the guard refused on the way."""

    url: str
    final_url: str
    status: int | None
    html: str
    blocked_urls: list[str] = field(default_factory=list)


class BrowserRenderer:
    """Renders URLs in headless Chromium with every request checked by the guard."""

    def __init__(self, config: BrowserConfig, guard: SsrfGuard) -> None:
        self.config = config
        self.guard = guard
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._lock = asyncio.Lock()

    async def _browser_now(self) -> Browser:
        async with self._lock:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._playwright is None:
                self._playwright = await async_playwright().start()
            try:
                self._browser = await self._playwright.chromium.launch(
                    executable_path=self.config.executable_path, headless=True,
                    args=list(self.config.args))
            except PlaywrightError as error:
                raise ToolError("browser", f"cannot start Chromium at "
                                           f"{self.config.executable_path!r}: {error}. Install it "
                                           f"(apt-get install chromium) or set "
                                           f"visit.browser.executable_path") from None
            return self._browser

    async def render(self, url: str) -> RenderedPage:
        """Load ``url``, let its scripts run, and return ``page.content()``."""
        await self.guard.check_url(url)
        browser = await self._browser_now()
        context = await browser.new_context(service_workers="block")
        blocked: list[str] = []

        async def check_request(route: Route) -> None:
            request = route.request
            if request.resource_type in self.config.skip_resource_types:
                await route.abort()
                return
            if request.url.startswith(("data:", "blob:", "about:")):
                await route.continue_()
                return
            try:
                await self.guard.check_url(request.url)
            except ToolError:
                blocked.append(request.url)
                await route.abort("blockedbyclient")
                return
            response = await self._fetch_checked(route, blocked)
            if response is None:
                await route.abort("blockedbyclient" if blocked else "failed")
                return
            await route.fulfill(response=response)

        async def check_websocket(socket: WebSocketRoute) -> None:
            as_http = "http" + socket.url[2:] if socket.url.startswith("ws") else socket.url
            try:
                await self.guard.check_url(as_http)
            except ToolError:
                blocked.append(socket.url)
                await socket.close(code=1008, reason="blocked by the SSRF guard")
                return
            socket.connect_to_server()

        try:
            await context.route("**/*", check_request)
            await context.route_web_socket("**/*", check_websocket)
            page = await context.new_page()
            timeout_ms = self.config.navigation_timeout_s * 1000
            response = await page.goto(url, wait_until=self.config.wait_until, timeout=timeout_ms)
            if self.config.network_idle_timeout_s > 0:
                try:
                    await page.wait_for_load_state(
                        "networkidle", timeout=self.config.network_idle_timeout_s * 1000)
                except PlaywrightTimeout:
                    pass  # a page that keeps polling still has its text by now
            html = await page.content()
            status = response.status if response is not None else None
            return RenderedPage(url=url, final_url=page.url, status=status, html=html,
                                blocked_urls=blocked)
        except PlaywrightTimeout:
            raise ToolError("timeout", f"rendering {url} took longer than "
                                       f"{self.config.navigation_timeout_s:g} s; try again later",
                            retryable=True) from None
        except PlaywrightError as error:
            if url in blocked or "ERR_BLOCKED_BY_CLIENT" in str(error):
                raise ToolError("blocked", f"the browser refused to load {url}: a request went to a "
                                           f"non-public address ({', '.join(blocked) or url}); "
                                           f"add the host to visit.guard.allow_hosts to allow it"
                                ) from None
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise ToolError("browser", f"the browser could not load {url}: {first_line}",
                            retryable=True) from None
        finally:
            await context.close()

    async def _fetch_checked(self, route: Route, blocked: list[str]) -> APIResponse | None:
        """Make the routed request with every redirect hop checked; None when refused or failed.

        Chromium follows the redirects of a continued request without routing the next hop, so the
        request is made here with redirects off. A navigation gets its 3xx back and the browser
        follows it with a new, routed request (so the document keeps its real URL); Chromium rejects
        handed-back redirects for subresources, so their hops are followed here, each one checked.
        """
        request = route.request
        url = request.url
        timeout_ms = self.config.navigation_timeout_s * 1000
        for _ in range(self.config.max_redirects + 1):
            try:
                response = await route.fetch(url=url, max_redirects=0, timeout=timeout_ms)
            except PlaywrightError:
                return None
            location = response.headers.get("location")
            if request.is_navigation_request() or response.status not in _REDIRECTS or not location:
                return response
            url = urljoin(url, location)
            try:
                await self.guard.check_url(url)
            except ToolError:
                blocked.append(url)
                return None
        return None

    async def aclose(self) -> None:
        """Close the browser and Playwright; safe to call twice."""
        browser, self._browser = self._browser, None
        playwright, self._playwright = self._playwright, None
        if browser is not None:
            try:
                await browser.close()
            except PlaywrightError:
                pass  # already gone
        if playwright is not None:
            await playwright.stop()

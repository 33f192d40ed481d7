"""Rendering with a real browser, for pages whose text only exists after JavaScript runs.

One headless Chromium (Debian's ``/usr/bin/chromium``; Playwright cannot download its own here) is
started lazily per renderer and shared by all visits; each visit gets a fresh browser context, so no
cookies or storage leak between episodes.

Every connection the browser makes goes through an :class:`~turnstile.envs.visit.egress.EgressProxy` started
for that visit: the document and each of its redirect hops, scripts, ``fetch``/XHR, iframes, forms,
meta refreshes, WebSockets, prefetches and preconnects. The proxy asks the
:class:`~turnstile.envs.visit.guard.SsrfGuard` at connect time and connects only to the address it checked, so
no TCP connection to a refused address is opened and DNS rebinding does not get through. Chromium
is left no way around it (see :data:`EGRESS_ARGS`): its resolver answers only the proxy's own name,
loopback goes through the proxy too (Playwright's ``<-loopback>`` bypass rule), contexts without a
proxy of their own get one that does not resolve, QUIC is off, and WebRTC may not send UDP that
bypasses the proxy. A refused main-frame navigation raises ``ToolError("blocked")`` naming the
refused address; refused subresources just fail to load and are listed in
``RenderedPage.blocked_urls``. Service workers are blocked, and images, media and fonts are not
loaded (they carry no text and cost time).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from playwright.async_api import (
    Browser,
    BrowserContext,
    Page,
    Playwright,
    ProxySettings,
    Request,
    Response,
    Route,
    async_playwright,
)
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeout

from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.egress import FAILED_HEADER, REFUSED_HEADER, EgressConfig, EgressProxy, url_authority
from turnstile.envs.visit.guard import SsrfGuard

DEFAULT_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
_PROXY_NAME = "egress.turnstile.invalid"  # the one name Chromium's resolver answers
EGRESS_ARGS = (
    # Chromium resolves no name itself (IP literals included, checked): only the proxy's.
    f"--host-resolver-rules=MAP {_PROXY_NAME} 127.0.0.1 , MAP * ~NOTFOUND",
    # WebRTC: no UDP unless proxied (an HTTP proxy carries none); its TCP (TURN) uses the proxy.
    # The switch sets the webrtc.ip_handling_policy pref; "--force-webrtc-..." does nothing here.
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--disable-quic",
)
# Where a context without a proxy of its own would send everything: a name that does not resolve.
_NO_EGRESS: ProxySettings = {"server": "http://no-egress.turnstile.invalid:1", "bypass": "<-loopback>"}


@dataclass
class BrowserConfig:
    """How the browser is started and how long a render may take.

    ``args`` are Chromium's command-line switches; :data:`EGRESS_ARGS` always follow them, so they
    cannot be switched off here.
    """

    executable_path: str = "/usr/bin/chromium"
    args: list[str] = field(default_factory=lambda: list(DEFAULT_ARGS))
    navigation_timeout_s: float = 20.0
    wait_until: Literal["load", "domcontentloaded", "networkidle"] = "load"
    network_idle_timeout_s: float = 3.0  # after load, wait this long at most for the network to settle
    skip_resource_types: list[str] = field(default_factory=lambda: ["image", "media", "font"])
    egress: EgressConfig = field(default_factory=EgressConfig)


@dataclass
class RenderedPage:
    """The DOM after rendering, as HTML, and what the egress proxy refused on the way.

    ``blocked_urls`` holds the URL of each refused plain-HTTP request and the ``host:port`` of each
    refused tunnel (HTTPS, WebSocket), whose URL the proxy never sees.
    """

    url: str
    final_url: str
    status: int | None
    html: str
    blocked_urls: list[str] = field(default_factory=list)


class BrowserRenderer:
    """Renders URLs in headless Chromium with every connection checked by the guard."""

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
                    args=[*self.config.args, *EGRESS_ARGS], proxy=_NO_EGRESS)
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
        async with EgressProxy(self.guard, self.config.egress) as proxy:
            # "<-loopback>" spelled out: Playwright adds it only by default (an environment
            # variable turns it off), and without it Chromium would not proxy loopback.
            try:
                context = await browser.new_context(
                    proxy={"server": f"http://{_PROXY_NAME}:{proxy.port}", "bypass": "<-loopback>"},
                    service_workers="block")
            except PlaywrightError as error:  # Chromium crashed or went away: a retryable failure
                raise _browser_failed(url, error) from None
            try:
                return await self._render_in(context, proxy, url)
            finally:
                await context.close()

    async def _render_in(self, context: BrowserContext, proxy: EgressProxy, url: str) -> RenderedPage:
        try:
            if self.config.skip_resource_types:
                await context.route("**/*", self._skip_or_continue)
            page = await context.new_page()
        except PlaywrightError as error:
            raise _browser_failed(url, error) from None
        # host:port of main-frame navigations that failed or got a 403 naming a target: the
        # candidates; _raise_if_refused keeps those the proxy did refuse.
        failed_navigations: list[str] = []
        documents: list[Response] = []  # the main frame's responses, redirects included

        def on_response(response: Response) -> None:  # a refused plain-HTTP hop: our 403
            if _navigates(response.request, page):
                documents.append(response)
                if REFUSED_HEADER.lower() in response.headers:
                    failed_navigations.append(response.headers[REFUSED_HEADER.lower()])

        def on_request_failed(request: Request) -> None:  # a refused tunnel fails the request
            if _navigates(request, page):
                failed_navigations.append(url_authority(request.url) or "")

        page.on("response", on_response)
        page.on("requestfailed", on_request_failed)
        try:
            response = await page.goto(url, wait_until=self.config.wait_until,
                                       timeout=self.config.navigation_timeout_s * 1000)
            await self._settle(page)
            html = await page.content()
        except PlaywrightTimeout:
            _raise_if_refused(url, failed_navigations, proxy)
            raise ToolError("timeout", f"rendering {url} took longer than "
                                       f"{self.config.navigation_timeout_s:g} s; try again later",
                            retryable=True) from None
        except PlaywrightError as error:
            _raise_if_refused(url, failed_navigations, proxy)
            raise _browser_failed(url, error) from None
        _raise_if_refused(url, failed_navigations, proxy)
        failure = documents[-1].headers.get(FAILED_HEADER.lower()) if documents else None
        if failure is not None:  # the proxy's own 502, not the site's page
            raise ToolError("connect", f"the browser could not load {url}: {failure}; the site may "
                                       f"be down", retryable=True)
        status = response.status if response is not None else None
        blocked = [refusal.url or refusal.target for refusal in proxy.refusals]
        return RenderedPage(url=url, final_url=page.url, status=status, html=html,
                            blocked_urls=blocked)

    async def _skip_or_continue(self, route: Route) -> None:
        if route.request.resource_type in self.config.skip_resource_types:
            await route.abort()
        else:
            await route.continue_()

    async def _settle(self, page: Page) -> None:
        """Give a page that keeps loading after ``load`` a short while to finish."""
        if self.config.network_idle_timeout_s > 0:
            try:
                await page.wait_for_load_state("networkidle",
                                               timeout=self.config.network_idle_timeout_s * 1000)
            except PlaywrightTimeout:
                pass  # a page that keeps polling still has its text by now

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


def _navigates(request: Request, page: Page) -> bool:
    """Whether ``request`` loads a document into the page's main frame (any hop, any initiator)."""
    return request.is_navigation_request() and request.frame == page.main_frame


def _raise_if_refused(url: str, navigations: list[str], proxy: EgressProxy) -> None:
    """Raise ``blocked`` when the proxy refused a main-frame navigation (redirect, script, form...).

    Only targets the proxy itself refused count, so a page cannot fake a refusal with the header.
    """
    refused = {refusal.target: refusal for refusal in proxy.refusals}
    for target in navigations:
        if target in refused:
            raise ToolError("blocked", f"the browser refused to load {url}: the page went on to "
                                       f"{target}, and the guard {refused[target].reason}")


def _browser_failed(url: str, error: PlaywrightError) -> ToolError:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return ToolError("browser", f"the browser could not load {url}: {first_line}", retryable=True)

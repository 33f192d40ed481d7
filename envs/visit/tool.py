"""The ``visit`` tool: read web pages for a goal, safely and within a token budget.

One call visits up to ``max_urls`` pages concurrently. Each page is fetched statically (guarded,
bounded), its main text extracted with trafilatura, and — when that text is empty or shorter than
``render_min_chars`` (``render="auto"``), or always (``render="always"``) — rendered in headless
Chromium first. The text is then either cut to ``max_tokens`` and shown as is, or, with the LLM
extractor enabled, turned into evidence and a summary for the goal (see ``summarize.py``).

Output formats (docs/algorithms.md §1), several pages joined with ``"\\n=======\\n"``::

    Content of <url> (goal: <goal>):
    <text>

    The useful information in <url> for user goal <goal> as follows:

    Evidence in page:
    <evidence>

    Summary:
    <summary>

A page that fails among several becomes ``Failed to visit <url>: <reason>``; when every page fails the
call raises the first page's :class:`ToolError`. The tool is built from :class:`VisitConfig` alone and
opens clients (HTTP pool, browser, extractor) on first use, so an unused tool pickles cleanly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from turnstile.envs.tools.base import JsonObject, JsonValue, ToolError
from turnstile.envs.visit.browser import BrowserConfig, BrowserRenderer
from turnstile.envs.visit.extract import ExtractConfig, extract_text
from turnstile.envs.visit.fetch import FetchConfig, Fetcher
from turnstile.envs.visit.guard import GuardConfig, Resolver, SsrfGuard
from turnstile.envs.visit.summarize import ExtractorConfig, LlmExtractor
from turnstile.envs.visit.tokens import TokenConfig, TokenCounter, build_counter, fit_to_budget

RenderMode = Literal["never", "auto", "always"]
SEPARATOR = "\n=======\n"


@dataclass
class VisitConfig:
    """Everything the visit tool needs; the nested configs belong to the parts they configure."""

    fetch: FetchConfig = field(default_factory=FetchConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    browser: BrowserConfig = field(default_factory=BrowserConfig)
    tokens: TokenConfig = field(default_factory=TokenConfig)
    extractor: ExtractorConfig = field(default_factory=ExtractorConfig)
    render: RenderMode = "auto"
    render_min_chars: int = 200  # in auto mode, static text shorter than this triggers rendering
    max_tokens: int = 4096
    max_urls: int = 5

    def __post_init__(self) -> None:
        if self.render not in ("never", "auto", "always"):
            raise ValueError(f"visit.render must be never, auto or always, not {self.render!r}")
        if self.max_tokens <= 0 or self.max_urls <= 0:
            raise ValueError("visit.max_tokens and visit.max_urls must be positive")


class VisitTool:
    """The agent's ``visit`` tool (see the module docstring for what it returns)."""

    name = "visit"
    description = ("Visit web pages and return their content for a goal. Pass one URL or a list of "
                   "URLs, and the goal: what you want to learn from them.")
    parameters: ClassVar[JsonObject] = {
        "type": "object",
        "properties": {
            "url": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                               "minItems": 1}],
                "description": "The URL, or a list of URLs, to visit (http or https).",
            },
            "goal": {"type": "string", "description": "What information to look for in the pages."},
        },
        "required": ["url", "goal"],
    }

    def __init__(self, config: VisitConfig | None = None, *, resolver: Resolver | None = None,
                 token_counter: TokenCounter | None = None) -> None:
        """``resolver`` replaces DNS for the guard (tests); ``token_counter`` the configured one."""
        self.config = config or VisitConfig()
        self._resolver = resolver
        self._counter = token_counter
        self._guard: SsrfGuard | None = None
        self._fetcher: Fetcher | None = None
        self._renderer: BrowserRenderer | None = None
        self._extractor: LlmExtractor | None = None
        if self.config.extractor.enabled and not self.config.extractor.model:
            raise ValueError("visit.extractor.enabled is true but visit.extractor.model is empty; "
                             "set it to the model name the endpoint serves")

    # -- arguments ------------------------------------------------------------------------------

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        """``{"url": [unique stripped http(s) URLs], "goal": stripped goal}``, or ``bad_arguments``."""
        raw = arguments.get("url")
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ToolError("bad_arguments", 'visit needs "url": a URL string or a list of URL '
                                             'strings, e.g. {"url": "https://example.com", "goal": '
                                             '"..."}')
        urls: list[str] = []
        for item in raw:
            url = item.strip()
            if url and url not in urls:
                urls.append(url)
        if not urls:
            raise ToolError("bad_arguments", 'visit got no URL: give at least one in "url"')
        if len(urls) > self.config.max_urls:
            raise ToolError("bad_arguments", f"visit takes at most {self.config.max_urls} URLs per "
                                             f"call, got {len(urls)}; split them over several calls")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
                raise ToolError("bad_arguments", f"{url!r} is not an http(s) URL; write the full "
                                                 f"address, e.g. https://{url.split('://')[-1]}")
        goal = arguments.get("goal")
        if not isinstance(goal, str) or not goal.strip():
            raise ToolError("bad_arguments", 'visit needs "goal": a non-empty string saying what to '
                                             'look for in the pages')
        url_values: list[JsonValue] = list(urls)
        return {"url": url_values, "goal": goal.strip()}

    # -- visiting -------------------------------------------------------------------------------

    async def call(self, arguments: JsonObject) -> str:
        """Visit every URL of already-normalised ``arguments``; see the module docstring."""
        urls = arguments["url"]
        goal = arguments["goal"]
        assert isinstance(urls, list) and isinstance(goal, str), "call() takes normalize()'s output"
        targets = [str(url) for url in urls]
        results = await asyncio.gather(*(self._visit_one(url, goal) for url in targets),
                                       return_exceptions=True)
        sections: list[str] = []
        errors: list[ToolError] = []
        for url, result in zip(targets, results, strict=True):
            if isinstance(result, ToolError):
                errors.append(result)
                sections.append(f"Failed to visit {url}: {result.message}")
            elif isinstance(result, BaseException):
                raise result
            else:
                sections.append(result)
        if len(errors) == len(targets):
            raise errors[0]
        return SEPARATOR.join(sections)

    async def _visit_one(self, url: str, goal: str) -> str:
        text = await self._page_text(url)
        if not text.strip():
            return f"The page {url} has no readable text."
        budgeted = fit_to_budget(text, self._token_counter(), self.config.max_tokens)
        if self.config.extractor.enabled:
            extraction = await self._llm().extract(url, goal, budgeted)
            if extraction is not None:
                return (f"The useful information in {url} for user goal {goal} as follows:\n\n"
                        f"Evidence in page:\n{extraction.evidence}\n\nSummary:\n{extraction.summary}")
        return f"Content of {url} (goal: {goal}):\n{budgeted}"

    async def _page_text(self, url: str) -> str:
        if self.config.render == "always":
            return await self._rendered_text(url)
        page = await self._fetch().fetch(url)
        if not page.is_html:
            return page.html.strip()  # plain text needs no extraction
        text = extract_text(page.html, page.final_url, self.config.extract)
        if self.config.render == "never" or len(text) >= self.config.render_min_chars:
            return text
        try:
            rendered = await self._rendered_text(url)
        except ToolError as error:
            if text and error.kind != "blocked":
                return text  # the short static text beats no text
            raise  # a page that sends the browser into refused space is refused as a whole
        return rendered if len(rendered) > len(text) else text

    async def _rendered_text(self, url: str) -> str:
        rendered = await self._browser().render(url)
        return extract_text(rendered.html, rendered.final_url, self.config.extract)

    # -- parts, built on first use -------------------------------------------------------------

    def _guard_now(self) -> SsrfGuard:
        if self._guard is None:
            self._guard = SsrfGuard(self.config.guard, self._resolver)
        return self._guard

    def _fetch(self) -> Fetcher:
        if self._fetcher is None:
            self._fetcher = Fetcher(self.config.fetch, self._guard_now())
        return self._fetcher

    def _browser(self) -> BrowserRenderer:
        if self._renderer is None:
            self._renderer = BrowserRenderer(self.config.browser, self._guard_now())
        return self._renderer

    def _llm(self) -> LlmExtractor:
        if self._extractor is None:
            self._extractor = LlmExtractor(self.config.extractor)
        return self._extractor

    def _token_counter(self) -> TokenCounter:
        if self._counter is None:
            self._counter = build_counter(self.config.tokens)
        return self._counter

    async def aclose(self) -> None:
        """Close the HTTP pools and the browser; safe to call twice."""
        fetcher, self._fetcher = self._fetcher, None
        renderer, self._renderer = self._renderer, None
        extractor, self._extractor = self._extractor, None
        if fetcher is not None:
            await fetcher.aclose()
        if renderer is not None:
            await renderer.aclose()
        if extractor is not None:
            await extractor.aclose()

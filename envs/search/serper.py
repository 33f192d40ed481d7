"""Web search through a Serper-compatible API (google.serper.dev or a service speaking its protocol).

Real web results are what evaluation on BrowseComp-style benchmarks needs. The client is a plain
:class:`~turnstile.envs.search.base.SearchBackend`: ``POST {base_url}/search`` with the key in ``X-API-KEY`` and
``{"q": query, "num": top_k}``; the ``organic`` results become hits. Failures become
:class:`~turnstile.envs.tools.base.ToolError`: rate limits, server errors and timeouts are retryable, other
client errors are not. Retrying and caching belong to the toolbox, not here.

The HTTP client is created on the first search, so a config-built backend can be pickled and sent to
a Ray actor before it is used. :func:`post_json` is shared with the retrieval-server client.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from turnstile.envs.search.base import SearchHit
from turnstile.envs.tools.base import Fault, JsonValue, ToolError


@dataclass(frozen=True)
class SerperConfig:
    base_url: str = "https://google.serper.dev"
    api_key_env: str = "SERPER_API_KEY"
    """Name of the environment variable holding the key (the key itself never goes in a config)."""
    timeout_s: float = 10.0


async def post_json(client: httpx.AsyncClient, url: str, payload: Mapping[str, JsonValue], *,
                    service: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> JsonValue:
    """POST ``payload`` as JSON and return the decoded JSON answer, or raise ToolError.

    Timeouts, connection failures, 429 and 5xx are retryable; other statuses and answers that are
    not JSON are not. ``service`` names the remote side in messages.
    """
    try:
        response = await client.post(url, json=dict(payload), headers=dict(headers or {}), timeout=timeout_s)
    except httpx.TimeoutException:
        raise ToolError("timeout", f"{service} did not answer within {timeout_s} s; try again later",
                        retryable=True) from None
    except httpx.TransportError as exc:
        raise ToolError("network", f"could not reach {service} at {url} ({type(exc).__name__}); "
                        "check that it is running and reachable", retryable=True) from None
    status = response.status_code
    if status == 429 or status >= 500:
        raise ToolError("http_status", f"{service} answered HTTP {status}; try again later", retryable=True,
                        fault=Fault.environment)
    if status in (401, 403):
        raise ToolError("http_status", f"{service} refused the request (HTTP {status}): check the API key",
                        fault=Fault.environment)
    if status >= 400:
        raise ToolError("http_status", f"{service} rejected the request (HTTP {status}): "
                        f"{response.text[:200]}")
    try:
        return json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ToolError("bad_response", f"{service} answered with something that is not JSON: "
                        f"{response.text[:100]!r}") from None


class SerperSearch:
    """A :class:`~turnstile.envs.search.base.SearchBackend` over a Serper-compatible web search API."""

    def __init__(self, config: SerperConfig) -> None:
        api_key = os.environ.get(config.api_key_env, "").strip()
        if not api_key:
            raise ValueError(f"Serper web search needs an API key: set the environment variable "
                             f"{config.api_key_env} (or point search.serper.api_key_env at the variable "
                             f"that holds it), or use search.backend=local")
        self._config = config
        self._api_key = api_key
        self._client: httpx.AsyncClient | None = None

    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        if not query.strip():
            raise ToolError("bad_arguments", "the search query is empty: write some words to search for")
        if self._client is None:
            self._client = httpx.AsyncClient()
        answer = await post_json(
            self._client, f"{self._config.base_url.rstrip('/')}/search", {"q": query, "num": top_k},
            headers={"X-API-KEY": self._api_key}, service="Serper", timeout_s=self._config.timeout_s,
        )
        return parse_organic(answer)[:top_k]

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def __getstate__(self) -> dict[str, object]:
        # An open HTTP pool cannot cross a process boundary; the copy opens its own.
        return {**self.__dict__, "_client": None}


def parse_organic(answer: JsonValue) -> list[SearchHit]:
    """The ``organic`` results of a Serper answer; results without a link are skipped."""
    if not isinstance(answer, dict):
        raise ToolError("bad_response", "Serper answered JSON that is not an object")
    organic = answer.get("organic", [])
    if not isinstance(organic, list):
        raise ToolError("bad_response", "Serper's 'organic' field is not a list")
    hits = []
    for result in organic:
        if not isinstance(result, dict):
            continue
        link, title, snippet = result.get("link"), result.get("title"), result.get("snippet")
        if not isinstance(link, str):
            continue
        hits.append(SearchHit(title=title if isinstance(title, str) else link,
                              url=link, snippet=snippet if isinstance(snippet, str) else ""))
    return hits

"""Search through a retrieval server in the style of Search-R1 (dense or BM25 over Wikipedia dumps).

Many search-agent papers train against a local retriever (e5 + FAISS over wiki-18) served over HTTP
rather than a web API. This client speaks that protocol: ``POST {url}`` with
``{"queries": [q], "topk": k, "return_scores": true}``; the answer is
``{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}`` where ``contents`` is the quoted
title on the first line followed by the body. Documents with explicit ``title``/``text`` fields, and
results without the ``document``/``score`` wrapper (``return_scores`` false), are accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from turnstile.envs.search.base import SearchHit
from turnstile.envs.search.serper import post_json
from turnstile.envs.tools.base import JsonValue, ToolError

SNIPPET_CHARS = 300


@dataclass(frozen=True)
class RetrievalServerConfig:
    url: str = "http://127.0.0.1:8000/retrieve"
    url_scheme: str = "doc://"
    """A hit's url is the document's ``url`` when it has one, else ``url_scheme + id``."""
    timeout_s: float = 10.0


class RetrievalServerSearch:
    """A :class:`~turnstile.envs.search.base.SearchBackend` over a Search-R1-style retrieval server."""

    def __init__(self, config: RetrievalServerConfig) -> None:
        self._config = config
        self._client: httpx.AsyncClient | None = None

    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        if not query.strip():
            raise ToolError("bad_arguments", "the search query is empty: write some words to search for")
        if self._client is None:
            self._client = httpx.AsyncClient()
        answer = await post_json(
            self._client, self._config.url, {"queries": [query], "topk": top_k, "return_scores": True},
            service="the retrieval server", timeout_s=self._config.timeout_s,
        )
        return parse_result(answer, self._config.url_scheme)[:top_k]

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_client": None}


def parse_result(answer: JsonValue, url_scheme: str) -> list[SearchHit]:
    """The hits for the first (only) query of a retrieval-server answer."""
    per_query = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(per_query, list):
        raise ToolError("bad_response", "the retrieval server's answer has no 'result' list")
    if not per_query:
        return []
    results = per_query[0]
    if not isinstance(results, list):
        raise ToolError("bad_response", "the retrieval server's 'result' is not a list of lists")
    return [_hit(result, url_scheme) for result in results]


def _hit(result: JsonValue, url_scheme: str) -> SearchHit:
    document = result.get("document", result) if isinstance(result, dict) else None
    if not isinstance(document, dict):
        raise ToolError("bad_response", f"the retrieval server returned a result that is not an object: "
                        f"{str(result)[:100]}")
    title, text, contents = document.get("title"), document.get("text"), document.get("contents")
    if isinstance(title, str) and isinstance(text, str):
        body = text
    elif isinstance(contents, str):
        first_line, _, body = contents.partition("\n")
        title = first_line.strip().strip('"').strip()
    else:
        raise ToolError("bad_response", "a retrieval-server document has neither 'contents' nor "
                        "'title' and 'text'")
    url = document.get("url")
    if not isinstance(url, str):
        url = f"{url_scheme}{document.get('id', '')}"
    return SearchHit(title=title, url=url, snippet=_excerpt(body))


def _excerpt(body: str) -> str:
    body = " ".join(body.split())
    if len(body) <= SNIPPET_CHARS:
        return body
    return body[:SNIPPET_CHARS].rsplit(" ", 1)[0] + "…"

"""The ``search`` tool the agent calls, and the registry of search backends it can run on.

The tool follows the agent protocol (docs/algorithms.md §1): arguments ``{"query": [str, ...]}`` (a bare
string, or the key ``queries`` used by some public trajectories, are accepted), several queries run
concurrently, and the observation lists each query's hits as markdown links with snippets, in the
format of the Tongyi DeepResearch family so that public checkpoints read it unchanged.

Backends are chosen in ``SearchConfig.backend`` through :data:`SEARCH_BACKENDS`, the project's one
plugin mechanism (``envs/plugins.py``): a built-in name (``local``, ``serper``, ``retrieval``,
registered with ``@register_search_backend("name")``), an entry point of the group
``turnstile.search_backends``, or ``package.module:factory``; a factory takes the search config and
returns a :class:`~turnstile.envs.search.base.SearchBackend`. :func:`build_search_backend` builds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from turnstile.envs.plugins import Registry
from turnstile.envs.search.base import Document, SearchBackend, SearchHit
from turnstile.envs.search.local import LocalIndex, LocalIndexConfig
from turnstile.envs.search.retrieval import RetrievalServerConfig, RetrievalServerSearch
from turnstile.envs.search.serper import SerperConfig, SerperSearch
from turnstile.envs.tools.base import JsonObject, JsonValue, ToolError

__all__ = [
    "LocalIndexConfig", "RetrievalServerConfig", "SearchConfig", "SearchTool", "SerperConfig",
    "build_search_backend", "register_search_backend", "search_backend_names",
]

QUERY_SEPARATOR = "\n=======\n"


@dataclass(frozen=True)
class SearchConfig:
    backend: str = "local"
    top_k: int = 5
    max_queries: int = 5
    """Most queries one call may carry; more is refused so one turn cannot fan out without bound."""
    local: LocalIndexConfig = field(default_factory=LocalIndexConfig)
    serper: SerperConfig = field(default_factory=SerperConfig)
    retrieval: RetrievalServerConfig = field(default_factory=RetrievalServerConfig)


SearchBackendFactory = Callable[[SearchConfig], SearchBackend]
SEARCH_BACKENDS: Registry[SearchBackendFactory] = Registry(
    "search.backend", "turnstile.search_backends", error=ValueError, expected="a search backend factory")


def register_search_backend(name: str) -> Callable[[SearchBackendFactory], SearchBackendFactory]:
    """Register a function building a backend from the search config under ``name``."""
    return SEARCH_BACKENDS.register(name)


def search_backend_names() -> list[str]:
    return SEARCH_BACKENDS.names()


def build_search_backend(cfg: SearchConfig, documents: Sequence[Document] | None = None) -> SearchBackend:
    """The backend ``cfg.backend`` names; or, when ``documents`` are given, a local index over them.

    An environment that brings its own corpus (the synthetic world) passes its documents; the index
    then uses ``cfg.local.engine`` and ignores ``cfg.backend``.
    """
    if documents is not None:
        return LocalIndex.from_documents(documents, engine=cfg.local.engine)
    return SEARCH_BACKENDS.load(cfg.backend)(cfg)


@register_search_backend("local")
def _local_index(cfg: SearchConfig) -> SearchBackend:
    if not cfg.local.corpus:
        raise ValueError("search.backend=local needs a corpus: set search.local.corpus to a JSONL file "
                         'of {"id", "title", "text", "url"} lines')
    return LocalIndex.from_jsonl(cfg.local.corpus, engine=cfg.local.engine,
                                 url_prefix=cfg.local.url_prefix or None)


@register_search_backend("serper")
def _serper(cfg: SearchConfig) -> SearchBackend:
    return SerperSearch(cfg.serper)


@register_search_backend("retrieval")
def _retrieval_server(cfg: SearchConfig) -> SearchBackend:
    return RetrievalServerSearch(cfg.retrieval)


class SearchTool:
    """The agent's ``search`` tool over one :class:`~turnstile.envs.search.base.SearchBackend`."""

    name = "search"
    description = ("Search the web. Give one or more queries; each returns the top results with "
                   "title, url and a snippet.")

    def __init__(self, backend: SearchBackend, top_k: int = 5, max_queries: int = 5) -> None:
        self._backend = backend
        self._top_k = top_k
        self._max_queries = max_queries
        self.parameters: JsonObject = {
            "type": "object",
            "properties": {
                "query": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": max_queries,
                    "description": f"Search queries (1 to {max_queries}); each is searched separately.",
                },
            },
            "required": ["query"],
        }

    @classmethod
    def from_config(cls, cfg: SearchConfig, documents: Sequence[Document] | None = None) -> SearchTool:
        return cls(build_search_backend(cfg, documents), top_k=cfg.top_k, max_queries=cfg.max_queries)

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        return {"query": list[JsonValue](self._queries(arguments))}

    def _queries(self, arguments: Mapping[str, object]) -> list[str]:
        key = "query" if "query" in arguments else "queries" if "queries" in arguments else None
        if key is None:
            raise ToolError("bad_arguments", 'search needs "query": pass {"query": ["your search terms"]}')
        value = arguments[key]
        raw = [value] if isinstance(value, str) else value
        if not isinstance(raw, list) or not all(isinstance(q, str) for q in raw):
            raise ToolError("bad_arguments", f'"{key}" must be a list of strings, like '
                            '{"query": ["first query", "second query"]}')
        queries: list[str] = [q.strip() for q in raw if q.strip()]
        if not queries:
            raise ToolError("bad_arguments", "the search query is empty: give at least one non-empty query")
        if len(queries) > self._max_queries:
            raise ToolError("bad_arguments", f"{len(queries)} queries in one call; give at most "
                            f"{self._max_queries} and search the rest in another call")
        return queries

    async def call(self, arguments: JsonObject) -> str:
        queries = self._queries(arguments)
        outcomes = await asyncio.gather(*(self._backend.search(q, self._top_k) for q in queries),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, ToolError):
                raise outcome
        errors = [outcome for outcome in outcomes if isinstance(outcome, ToolError)]
        if len(errors) == len(outcomes):
            raise errors[0]
        sections = []
        for query, outcome in zip(queries, outcomes, strict=True):
            if isinstance(outcome, ToolError):
                sections.append(f"The search for '{query}' failed: {outcome.message}")
            elif isinstance(outcome, list):
                sections.append(format_results(query, outcome))
        return QUERY_SEPARATOR.join(sections)

    async def aclose(self) -> None:
        await self._backend.aclose()


def format_results(query: str, hits: Sequence[SearchHit]) -> str:
    """One query's section of the observation."""
    if not hits:
        return f"No results found for '{query}'. Try a shorter or more general query."
    entries = []
    for rank, hit in enumerate(hits, start=1):
        entry = f"{rank}. [{hit.title}]({hit.url})"
        entries.append(f"{entry}\n{hit.snippet}" if hit.snippet else entry)
    return f"A search for '{query}' found {len(hits)} results:\n\n## Web Results\n" + "\n\n".join(entries)

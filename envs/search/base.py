"""What every search backend provides, and the corpus documents a local index is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SearchHit:
    """One result as the agent sees it."""

    title: str
    url: str
    snippet: str


@dataclass(frozen=True)
class Document:
    """One page of an offline corpus: what a local index searches and the corpus server serves.

    ``url`` is where the page can be visited (for a served corpus: the corpus server's address for
    ``doc_id``). ``html`` is optional: when present the server serves it as is, otherwise it renders
    ``title`` and ``text`` into a plain page.
    """

    doc_id: str
    title: str
    text: str
    url: str
    html: str | None = None


@runtime_checkable
class SearchBackend(Protocol):
    """Answers one query with up to ``top_k`` hits, best first.

    Raises :class:`turnstile.envs.tools.base.ToolError` on failure (``retryable=True`` for transient network
    errors). ``aclose`` is safe to call twice.
    """

    async def search(self, query: str, top_k: int) -> list[SearchHit]: ...

    async def aclose(self) -> None: ...

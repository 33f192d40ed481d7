"""The corpus the agent searches and visits: which one (:class:`CorpusConfig`, :func:`corpus_documents`,
used by the driver that serves it and by every rollout worker that indexes it), and the offline
corpus file, one JSONL format read and written in one place.

Each line is ``{"id", "title", "text"[, "url"][, "html"]}``. The local search index, the corpus
server and the dataset converters (HotpotQA paragraphs) all use it. ``url`` may be left out: the
corpus server assigns its own, and ``url_prefix`` gives ``url_prefix + id``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.envs.search.base import Document
from turnstile.envs.synthetic.world import WorldConfig


def read_corpus(path: str | Path, url_prefix: str | None = None,
                require_url: bool = False) -> list[Document]:
    """Documents of a JSONL corpus. Blank lines are skipped; a bad line raises ValueError naming the
    file, the line and the field. Without ``url`` and ``url_prefix`` a document's url is "" (an
    error with ``require_url``: a search index must say where each hit can be visited)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus file {path} does not exist: pass a JSONL file of "
                         '{"id", "title", "text"} lines')
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                documents.append(_document(line, url_prefix, require_url))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return documents


def _document(line: str, url_prefix: str | None, require_url: bool) -> Document:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    doc_id = record.get("id")
    if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or str(doc_id) == "":
        raise ValueError('"id" must be a non-empty string or an integer')
    for key in ("title", "text"):
        if not isinstance(record.get(key), str):
            raise ValueError(f'"{key}" must be a string')
    url, page = record.get("url"), record.get("html")
    if url is None and url_prefix is None and require_url:
        raise ValueError('"url" is missing: add it to every line or set a url_prefix')
    if url is None:
        url = f"{url_prefix}{doc_id}" if url_prefix is not None else ""
    elif not isinstance(url, str):
        raise ValueError('"url" must be a string')
    if page is not None and not isinstance(page, str):
        raise ValueError('"html" must be a string when present')
    return Document(doc_id=str(doc_id), title=record["title"], text=record["text"], url=url, html=page)


@dataclass
class CorpusConfig:
    """What the local search index covers and where its pages are served.

    ``kind``: ``synthetic`` (the world of ``world``), ``jsonl`` (``path``, a corpus file),
    ``hotpotqa`` (``path``, a HotpotQA-style task file: its paragraphs, at the URLs its tasks' clues
    name), or ``none`` (the search backend is remote: Serper or a retrieval server). ``base_url`` is filled by
    the driver once the corpus server runs.
    """

    kind: str = "synthetic"
    world: WorldConfig = field(default_factory=WorldConfig)
    path: str = ""
    host: str = "127.0.0.1"  # where the corpus server listens (0.0.0.0 on a multi-node cluster)
    port: int = 0
    base_url: str = ""


def corpus_documents(corpus: CorpusConfig, base_url: str) -> list[Document]:
    """The corpus' documents with the urls under which ``base_url`` serves them."""
    if corpus.kind == "synthetic":
        from turnstile.envs.synthetic.render import world_documents
        from turnstile.envs.synthetic.world import generate_world

        return world_documents(generate_world(corpus.world), base_url)
    if corpus.kind == "jsonl":
        from turnstile.envs.corpus_server import page_path

        return [Document(d.doc_id, d.title, d.text, base_url + page_path(d.doc_id), d.html)
                for d in read_corpus(corpus.path)]
    if corpus.kind == "hotpotqa":  # the paragraphs of a HotpotQA-style task file, as the tasks cite them
        from turnstile.envs.corpus_server import PAGE_PREFIX
        from turnstile.envs.datasets.hotpotqa import read_hotpotqa

        return read_hotpotqa(corpus.path, base_url + PAGE_PREFIX).corpus
    if corpus.kind == "none":
        return []
    raise ValueError(f"corpus.kind={corpus.kind!r} is not known; use synthetic, jsonl, hotpotqa or none")

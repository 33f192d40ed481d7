"""An offline search engine over a corpus held in memory.

Training runs cannot call a web search API tens of thousands of times per step, and tests and the
synthetic world need results that are reproducible. :class:`LocalIndex` answers queries from a BM25
index built over a list of :class:`~turnstile.envs.search.base.Document` (or a JSONL corpus file) and behaves
like any other :class:`~turnstile.envs.search.base.SearchBackend`.

Two BM25 engines sit behind the same class: ``tantivy`` (Rust, an inverted index) and ``bm25s``
(numpy, sparse score matrices, PyStemmer stemming). docs/benchmarks/search-index.md compares them on
HotpotQA and explains the default. Both score the title and the body separately and add the title
score with a boost; on top of that, a page whose whole title is the query (after stemming) is put
first, so that searching an entity's exact name finds its page.

Queries never go through a query language: they are split into terms by the engine's own analyzer
and combined as plain term queries, so quotes, colons, parentheses and AND/OR in what the model
writes are ordinary text and cannot make the search fail.

Build an index with ``LocalIndex.from_jsonl("corpus.jsonl")`` or ``LocalIndex.from_documents(docs)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import tantivy

from turnstile.envs.corpus import read_corpus
from turnstile.envs.search.base import Document, SearchHit
from turnstile.envs.tools.base import ToolError

if TYPE_CHECKING:
    import bm25s

DEFAULT_ENGINE = "tantivy"
TITLE_BOOST = 1.5
"""Weight of the title's BM25 score relative to the body's: a page about X outranks pages citing X.
Higher values cost recall on HotpotQA questions (see docs/benchmarks/search-index.md)."""
SNIPPET_CHARS = 300


@dataclass(frozen=True)
class LocalIndexConfig:
    corpus: str = ""
    """JSONL corpus file; may stay empty when the environment supplies its own documents."""
    engine: str = DEFAULT_ENGINE
    url_prefix: str = ""
    """Used for corpus lines without "url": the url is url_prefix + id."""


class _Engine(Protocol):
    """A BM25 ranking over the rows of a document list."""

    def rank(self, query: str, top_k: int) -> list[int]:
        """Row numbers of the best ``top_k`` documents matching ``query``, best first."""
        ...

    def terms(self, text: str) -> list[str]:
        """``text`` as the index sees it (lowercased, stemmed, stop words removed)."""
        ...


_ENGINES: dict[str, Callable[[Sequence[Document], float], _Engine]] = {}


def _engine(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        _ENGINES[name] = cls
        return cls

    return register


def engine_names() -> list[str]:
    """The BM25 engines a :class:`LocalIndex` can use."""
    return sorted(_ENGINES)


@_engine("tantivy")
class _TantivyEngine:
    """tantivy with a simple tokenizer, lowercasing, ASCII folding, English stop words and stemming."""

    _ANALYZER = "en_stem"

    def __init__(self, documents: Sequence[Document], title_boost: float) -> None:
        self._title_boost = title_boost
        self._analyzer = (
            tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(40))
            .filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.ascii_fold())
            .filter(tantivy.Filter.stopword("english"))
            .filter(tantivy.Filter.stemmer("english"))
            .build()
        )
        builder = tantivy.SchemaBuilder()
        builder.add_text_field("title", tokenizer_name=self._ANALYZER)
        builder.add_text_field("text", tokenizer_name=self._ANALYZER)
        builder.add_integer_field("row", stored=True, indexed=False)
        self._schema = builder.build()
        self._index = tantivy.Index(self._schema)
        self._index.register_tokenizer(self._ANALYZER, self._analyzer)
        writer = self._index.writer(64_000_000, 1)
        for row, doc in enumerate(documents):
            writer.add_document(tantivy.Document(title=doc.title, text=doc.text, row=row))
        writer.commit()
        writer.wait_merging_threads()
        self._index.reload()
        self._searcher = self._index.searcher()

    def terms(self, text: str) -> list[str]:
        return list(self._analyzer.analyze(text))

    def rank(self, query: str, top_k: int) -> list[int]:
        clauses = []
        for term in dict.fromkeys(self.terms(query)):
            title = tantivy.Query.term_query(self._schema, "title", term)
            clauses.append((tantivy.Occur.Should, tantivy.Query.boost_query(title, self._title_boost)))
            clauses.append((tantivy.Occur.Should, tantivy.Query.term_query(self._schema, "text", term)))
        if not clauses:
            return []
        hits = self._searcher.search(tantivy.Query.boolean_query(clauses), top_k, count=False).hits
        return [int(self._searcher.doc(address)["row"][0]) for _score, address in hits]


@_engine("bm25s")
class _Bm25sEngine:
    """bm25s (Lucene BM25) over PyStemmer-stemmed terms, with separate title and body indexes."""

    _WORD = re.compile(r"\w+")

    def __init__(self, documents: Sequence[Document], title_boost: float) -> None:
        self._title_boost = title_boost
        import Stemmer  # bm25s (with numba) is imported when this engine is chosen
        from bm25s.stopwords import STOPWORDS_EN

        self._stemmer = Stemmer.Stemmer("english")
        self._stopwords = frozenset(STOPWORDS_EN)
        self._rows = len(documents)
        self._title = self._field_index([self.terms(doc.title) for doc in documents])
        self._text = self._field_index([self.terms(doc.text) for doc in documents])

    @staticmethod
    def _field_index(terms_per_doc: list[list[str]]) -> bm25s.BM25 | None:
        # bm25s cannot index a field in which no document has a single term.
        if not any(terms_per_doc):
            return None
        import bm25s

        index = bm25s.BM25()
        index.index(terms_per_doc, show_progress=False)
        return index

    def _scores(self, index: bm25s.BM25 | None, terms: list[str]) -> np.ndarray:
        if index is None:
            return np.zeros(self._rows, dtype=np.float32)
        return index.get_scores(terms)

    def terms(self, text: str) -> list[str]:
        words = [w for w in self._WORD.findall(text.lower()) if w not in self._stopwords]
        return self._stemmer.stemWords(words)

    def rank(self, query: str, top_k: int) -> list[int]:
        terms = list(dict.fromkeys(self.terms(query)))
        if not terms:
            return []
        scores = self._title_boost * self._scores(self._title, terms) + self._scores(self._text, terms)
        k = min(top_k, len(scores))
        best = np.argpartition(-scores, k - 1)[:k]
        best = best[np.argsort(-scores[best], kind="stable")]
        return [int(row) for row in best if scores[row] > 0]


class LocalIndex:
    """A :class:`~turnstile.envs.search.base.SearchBackend` over an in-memory corpus; see the module docstring."""

    def __init__(self, documents: Sequence[Document], engine: str = DEFAULT_ENGINE, *,
                 title_boost: float = TITLE_BOOST, snippet_chars: int = SNIPPET_CHARS) -> None:
        if engine not in _ENGINES:
            raise ValueError(f"unknown search engine {engine!r}: choose one of {engine_names()}")
        if not documents:
            raise ValueError("cannot build a local search index over zero documents: check the corpus")
        self.engine = engine
        self._documents = list(documents)
        self._ranker = _ENGINES[engine](self._documents, title_boost)
        self._snippet_chars = snippet_chars
        # Pages whose whole title is the query go first whatever BM25 says: searching an entity's
        # exact name must find its page even when other pages repeat the name many times.
        self._by_title: dict[tuple[str, ...], list[int]] = {}
        for row, doc in enumerate(self._documents):
            self._by_title.setdefault(tuple(self._ranker.terms(doc.title)), []).append(row)

    @classmethod
    def from_documents(cls, docs: Sequence[Document], engine: str = DEFAULT_ENGINE) -> LocalIndex:
        return cls(docs, engine=engine)

    @classmethod
    def from_jsonl(cls, path: str | Path, engine: str = DEFAULT_ENGINE,
                   url_prefix: str | None = None) -> LocalIndex:
        return cls(read_corpus(path, url_prefix=url_prefix, require_url=True), engine=engine)

    def __len__(self) -> int:
        return len(self._documents)

    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        # BM25 over a corpus that fits in memory answers in about a millisecond: running it in a
        # thread would cost more than it saves.
        if not query.strip():
            raise ToolError("bad_arguments", "the search query is empty: write some words to search for")
        if top_k < 1:
            raise ToolError("bad_arguments", f"top_k must be at least 1, got {top_k}")
        terms = self._ranker.terms(query)
        exact = self._by_title.get(tuple(terms), []) if terms else []
        ranked = list(dict.fromkeys([*exact, *self._ranker.rank(query, top_k)]))[:top_k]
        return [self._hit(self._documents[row], set(terms)) for row in ranked]

    async def aclose(self) -> None:
        pass

    def _hit(self, doc: Document, query_terms: set[str]) -> SearchHit:
        snippet = best_window(doc.text, query_terms, self._ranker.terms, self._snippet_chars)
        return SearchHit(title=doc.title, url=doc.url, snippet=snippet)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def best_window(text: str, query_terms: set[str], terms: Callable[[str], list[str]],
                max_chars: int = SNIPPET_CHARS, max_sentences: int = 200) -> str:
    """The run of sentences (at most ``max_chars``) that holds the most distinct query terms.

    Falls back to the start of the text when no sentence holds a query term. Only the first
    ``max_sentences`` sentences are looked at, so a long page costs no more than a short one.
    """
    text = " ".join(text.split())
    sentences = _SENTENCE_END.split(text, maxsplit=max_sentences)[:max_sentences]
    found = [query_terms.intersection(terms(sentence)) for sentence in sentences]
    best_start, best_count = 0, 0
    for start in range(len(sentences)):
        if not found[start]:
            continue
        covered: set[str] = set()
        length = 0
        for end in range(start, len(sentences)):
            if end > start and length + len(sentences[end]) > max_chars:
                break
            covered |= found[end]
            length += len(sentences[end]) + 1
        if len(covered) > best_count:
            best_start, best_count = start, len(covered)
    return _cut(" ".join(sentences[best_start:]), max_chars)


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit(" ", 1)[0] if " " in text[:max_chars] else text[:max_chars]
    return cut.rstrip(" ,;:") + "…"

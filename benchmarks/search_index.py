"""Compare the local search engines (tantivy, bm25s) on HotpotQA: build time, latency, recall@10.

The corpus is every paragraph of the 500 HotpotQA dev questions, deduplicated by title (about 5,000
Wikipedia paragraphs); the queries are the questions themselves. Recall@10 is the fraction of a
question's two supporting paragraphs found in the top 10, averaged over questions.

A second measurement stands in for the synthetic world: 3,000 generated entity pages whose names
share words and whose texts repeat other entities' names; the query is an entity's name plus two
other words, and "name top-1" is the share of queries whose first hit is that entity's page. It
shows what the title boost buys. The results decide ``envs.search.local.DEFAULT_ENGINE`` and
``TITLE_BOOST`` (see docs/benchmarks/search-index.md).

Run: .venv/bin/python benchmarks/search_index.py [--data ../shared/data] [--repeats 3]
     [--title-boosts 1,1.5,2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from turnstile.envs.search.base import Document
from turnstile.envs.search.local import TITLE_BOOST, LocalIndex, engine_names

HOTPOTQA = Path("multihop/hotpotqa_dev500.jsonl")


@dataclass(frozen=True)
class Question:
    text: str
    supporting_titles: frozenset[str]


@dataclass(frozen=True)
class EngineResult:
    engine: str
    title_boost: float
    build_s: float
    p50_ms: float
    p99_ms: float
    recall_at_10: float
    name_top1: float


def load_hotpotqa(path: Path, limit: int | None = None) -> tuple[list[Document], list[Question]]:
    """The deduplicated paragraph corpus and the questions of a HotpotQA JSONL file."""
    by_title: dict[str, Document] = {}
    questions = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            for paragraph in record["paragraphs"]:
                title = paragraph["title"]
                if title not in by_title:
                    by_title[title] = Document(doc_id=str(len(by_title)), title=title,
                                               text=paragraph["text"], url=f"hotpotqa://{title}")
            supporting = frozenset(p["title"] for p in record["paragraphs"] if p["is_supporting"])
            questions.append(Question(record["question"], supporting))
    if limit is not None:
        questions = questions[:limit]
    return list(by_title.values()), questions


async def recall_at_k(index: LocalIndex, questions: list[Question], k: int = 10) -> float:
    """Mean over questions of the share of supporting titles among the top ``k`` hits."""
    total = 0.0
    for question in questions:
        titles = {hit.title for hit in await index.search(question.text, k)}
        total += len(question.supporting_titles & titles) / len(question.supporting_titles)
    return total / len(questions)


def entity_world(n: int = 3000, seed: int = 0) -> list[Document]:
    """Generated entity pages: names built from a small pool of syllables, texts citing other names."""
    rng = random.Random(seed)
    stems = [a + b for a in ("var", "mor", "tel", "as", "quin", "bel", "dor", "fen", "gal", "hal")
             for b in ("ny", "ton", "ia", "ar", "en", "is", "oth", "um", "ek", "ul")]
    kinds = ("Bridge", "River", "Company", "Castle", "Lake", "University", "Museum", "Station", "Prize",
             "Band")
    names: set[str] = set()
    while len(names) < n:
        middle = rng.choice(stems).capitalize() + " " if rng.random() < 0.5 else ""
        names.add(f"{rng.choice(stems).capitalize()} {middle}{rng.choice(kinds)}")
    ordered = sorted(names)
    documents = []
    for row, name in enumerate(ordered):
        cited = rng.sample(ordered, 6)
        text = f"{name} is a {name.split()[-1].lower()}. " + " ".join(
            f"It is linked to {other}, and {other} is known for it." for other in cited)
        documents.append(Document(doc_id=str(row), title=name, text=text, url=f"world://{row}"))
    return documents


async def name_top1(engine: str, title_boost: float, world: list[Document]) -> float:
    """Share of "<name> history founded" queries whose first hit is the entity's own page."""
    index = LocalIndex(world, engine=engine, title_boost=title_boost)
    found = 0
    for doc in world:
        hits = await index.search(f"{doc.title} history founded", 1)
        found += bool(hits) and hits[0].url == doc.url
    return found / len(world)


async def measure(engine: str, title_boost: float, documents: list[Document],
                  questions: list[Question], repeats: int) -> EngineResult:
    builds = []
    for _ in range(repeats):
        start = time.perf_counter()
        index = LocalIndex(documents, engine=engine, title_boost=title_boost)
        builds.append(time.perf_counter() - start)
    latencies_ms = []
    for _ in range(repeats):
        for question in questions:
            start = time.perf_counter()
            await index.search(question.text, 10)
            latencies_ms.append((time.perf_counter() - start) * 1000)
    latencies_ms.sort()
    return EngineResult(
        engine=engine,
        title_boost=title_boost,
        build_s=statistics.median(builds),
        p50_ms=statistics.median(latencies_ms),
        p99_ms=latencies_ms[min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))],
        recall_at_10=await recall_at_k(index, questions),
        name_top1=await name_top1(engine, title_boost, entity_world()),
    )


def markdown_table(results: list[EngineResult], n_docs: int, n_questions: int) -> str:
    rows = [
        f"| engine | title boost | build (s, {n_docs} docs) | p50 query (ms) | p99 query (ms) "
        f"| recall@10 ({n_questions} questions) | name top-1 (3000 entities) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(f"| {r.engine} | {r.title_boost:g} | {r.build_s:.2f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
                    f"| {r.recall_at_10:.3f} | {r.name_top1:.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data",
                        help="the shared data folder holding multihop/hotpotqa_dev500.jsonl")
    parser.add_argument("--title-boosts", default=str(TITLE_BOOST),
                        help="comma-separated title boosts to measure, e.g. 1,1.5,2")
    parser.add_argument("--repeats", type=int, default=3, help="builds and query passes per engine")
    args = parser.parse_args()
    documents, questions = load_hotpotqa(args.data / HOTPOTQA)
    boosts = [float(b) for b in args.title_boosts.split(",")]
    results = [asyncio.run(measure(engine, boost, documents, questions, args.repeats))
               for boost in boosts for engine in engine_names()]
    print(markdown_table(results, len(documents), len(questions)))


if __name__ == "__main__":
    main()

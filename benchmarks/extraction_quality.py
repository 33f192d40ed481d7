"""How well does the visit tool's extraction recover article text? Measures it on real pages.

Reads the 121 news/blog pages of the shared data (``webpages/html/*.html.gz``, gold text in
``webpages/ground_truth.json`` field ``articleBody``) and, for each extraction setting, reports the
token-level precision, recall and F1 of the extracted text against the gold text (bag of lower-cased
word tokens, averaged over pages), how many pages came out empty or with recall below 0.5 (the
article was missed: the failure an agent cannot recover from), and the mean extraction time per
page. The numbers decide the default of ``ExtractConfig.favor``; they are written up in
``docs/benchmarks/extraction.md``.

Run:  .venv/bin/python benchmarks/extraction_quality.py [--data ../shared/data] [--limit N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trafilatura

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from turnstile.envs.visit.extract import ExtractConfig, extract_text  # noqa: E402

_WORD = re.compile(r"\w+", re.UNICODE)


def tokens(text: str) -> Counter[str]:
    return Counter(token.lower() for token in _WORD.findall(text))


def precision_recall_f1(predicted: str, gold: str) -> tuple[float, float, float]:
    """Token-multiset precision, recall and F1 (an empty prediction scores 0, not undefined)."""
    pred, ref = tokens(predicted), tokens(gold)
    overlap = sum((pred & ref).values())
    precision = overlap / sum(pred.values()) if pred else 0.0
    recall = overlap / sum(ref.values()) if ref else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


@dataclass
class Row:
    name: str
    precision: float
    recall: float
    f1: float
    empty: int
    missed: int
    ms_per_page: float


Extractor = Callable[[str, str], str]


def settings() -> dict[str, Extractor]:
    """The settings compared: the three ``favor`` values, fast mode, and trafilatura's baselines."""
    def configured(config: ExtractConfig) -> Extractor:
        return lambda html, url: extract_text(html, url, config)

    return {
        "balanced (trafilatura default)": configured(ExtractConfig(favor="balanced")),
        "favor_precision": configured(ExtractConfig(favor="precision")),
        "favor_recall": configured(ExtractConfig(favor="recall")),
        "balanced, fast (no fallback)": configured(ExtractConfig(favor="balanced", fast=True)),
        "baseline (article/p heuristic)": lambda html, _url: trafilatura.baseline(html)[1],
        "html2txt (all visible text)": lambda html, _url: trafilatura.html2txt(html),
    }


def load_pages(data: Path, limit: int | None) -> list[tuple[str, str, str]]:
    """(html, url, gold text) per page, in file-name order."""
    folder = data / "webpages"
    gold = json.loads((folder / "ground_truth.json").read_text(encoding="utf-8"))
    pages: list[tuple[str, str, str]] = []
    for path in sorted((folder / "html").glob("*.html.gz")):
        key = path.name.removesuffix(".html.gz")
        entry = gold.get(key) or gold.get(path.name)
        if entry is None:
            continue
        raw = gzip.decompress(path.read_bytes())
        pages.append((raw.decode("utf-8", errors="replace"), entry.get("url", ""), entry["articleBody"]))
    return pages[:limit] if limit else pages


def measure(name: str, extractor: Extractor, pages: list[tuple[str, str, str]]) -> Row:
    totals = [0.0, 0.0, 0.0]
    empty = missed = 0
    elapsed = 0.0
    for html, url, _ in pages[:3]:
        extractor(html, url)  # warm-up: first calls pay for imports and lxml caches
    for html, url, gold in pages:
        start = time.perf_counter()
        text = extractor(html, url)
        elapsed += time.perf_counter() - start
        empty += not text.strip()
        scores = precision_recall_f1(text, gold)
        missed += scores[1] < 0.5
        for index, value in enumerate(scores):
            totals[index] += value
    n = len(pages)
    return Row(name, totals[0] / n, totals[1] / n, totals[2] / n, empty, missed, 1000 * elapsed / n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data", type=Path,
                        default=Path(os.environ.get("TURNSTILE_DATA", REPO.parent / "shared" / "data")))
    parser.add_argument("--limit", type=int, default=None, help="only the first N pages")
    args = parser.parse_args()
    pages = load_pages(args.data, args.limit)
    if not pages:
        sys.exit(f"no pages found under {args.data / 'webpages'}; pass --data or set TURNSTILE_DATA")
    print(f"{len(pages)} pages, trafilatura {trafilatura.__version__}\n")
    print("| setting | precision | recall | F1 | empty | recall < 0.5 | ms/page |")
    print("|---|---|---|---|---|---|---|")
    for name, extractor in settings().items():
        row = measure(name, extractor, pages)
        print(f"| {row.name} | {row.precision:.3f} | {row.recall:.3f} | {row.f1:.3f} | "
              f"{row.empty} | {row.missed} | {row.ms_per_page:.1f} |", flush=True)


if __name__ == "__main__":
    main()

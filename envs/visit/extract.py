"""Main-text extraction: HTML in, the article text an agent should read out.

Uses trafilatura. Its precision/recall trade-off is a setting (``favor``) because the best choice was
measured, not guessed: see ``benchmarks/extraction_quality.py`` and ``docs/benchmarks/extraction.md``
for the numbers behind the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Favor = Literal["balanced", "precision", "recall"]


@dataclass
class ExtractConfig:
    """How trafilatura extracts the main text."""

    favor: Favor = "balanced"
    include_tables: bool = True
    include_comments: bool = False
    include_links: bool = False
    fast: bool = False  # True skips trafilatura's fallback extractors: faster, lower recall


def extract_text(html: str, url: str | None = None, config: ExtractConfig | None = None) -> str:
    """The main text of ``html`` as plain text with paragraphs on their own lines; "" when none."""
    import trafilatura  # a quarter of a second to import; only a visit needs it

    cfg = config or ExtractConfig()
    if not html.strip():
        return ""
    text = trafilatura.extract(
        html,
        url=url,
        output_format="txt",
        favor_precision=cfg.favor == "precision",
        favor_recall=cfg.favor == "recall",
        include_tables=cfg.include_tables,
        include_comments=cfg.include_comments,
        include_links=cfg.include_links,
        fast=cfg.fast,
        deduplicate=False,
    )
    return (text or "").strip()

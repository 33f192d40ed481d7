"""Answer normalisation and exact match (docs/algorithms.md §3): lower case, punctuation and articles
removed, whitespace collapsed. Shared by the synthetic world's evaluation, the rollout summary and
the outcome reward, so "correct" means the same everywhere."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")
_ARTICLES = frozenset({"a", "an", "the"})


def normalize_answer(text: str) -> str:
    """Lower case, punctuation (thousands commas included) and articles removed, spaces collapsed."""
    text = _PUNCTUATION.sub("", text.casefold())
    return " ".join(word for word in text.split() if word not in _ARTICLES)


def answer_matches(answer: str | None, gold: Sequence[str]) -> bool:
    """Exact match after normalisation against any of the gold alternatives."""
    return answer is not None and normalize_answer(answer) in {normalize_answer(g) for g in gold}

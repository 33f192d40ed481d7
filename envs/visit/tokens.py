"""Token budgets for page text: an observation must not blow up the policy's context.

The default counter is a regex approximation (a word or one punctuation mark is a token): fast, no
model files, and close enough to a BPE count on English prose for budgeting. When the exact count of
the policy's tokenizer matters, point ``TokenConfig.tokenizer_path`` at a local Hugging Face tokenizer
(needs ``transformers``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

TRUNCATION_MARKER = "[... page truncated to {budget} tokens]"


@runtime_checkable
class TokenCounter(Protocol):
    """Counts tokens and cuts text at a token boundary.

    Contract: ``truncate(text, budget)`` returns a prefix of ``text`` with at most ``budget`` tokens
    (``text`` itself when it fits) and never splits a token.
    """

    def count(self, text: str) -> int: ...

    def truncate(self, text: str, budget: int) -> str: ...


@dataclass
class TokenConfig:
    """Which counter to use: the regex approximation, or a local HF tokenizer when a path is set."""

    tokenizer_path: str | None = None


class RegexTokenCounter:
    """Approximate count: every run of word characters and every other non-space character."""

    _TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)

    def count(self, text: str) -> int:
        return sum(1 for _ in self._TOKEN.finditer(text))

    def truncate(self, text: str, budget: int) -> str:
        if budget <= 0:
            return ""
        for index, match in enumerate(self._TOKEN.finditer(text), start=1):
            if index == budget:
                return text[:match.end()]
        return text


class HfTokenCounter:
    """Exact count with a Hugging Face tokenizer loaded from a local folder."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # imported here: loading transformers takes seconds

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise ValueError(f"visit.tokens.tokenizer_path={path!r} is not a tokenizer directory "
                             f"({error}); point it at a model folder or unset it") from None

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, text: str, budget: int) -> str:
        if budget <= 0:
            return ""
        if getattr(self._tokenizer, "is_fast", False):
            encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = encoded["offset_mapping"]
            return text if len(offsets) <= budget else text[:offsets[budget - 1][1]]
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        # transformers types decode() as str | list[str]: one id list gives one str.
        return text if len(ids) <= budget else self._tokenizer.decode(ids[:budget])  # type: ignore[return-value]


def build_counter(config: TokenConfig) -> TokenCounter:
    """The counter ``config`` asks for."""
    if config.tokenizer_path:
        return HfTokenCounter(config.tokenizer_path)
    return RegexTokenCounter()


def fit_to_budget(text: str, counter: TokenCounter, budget: int) -> str:
    """``text`` when it fits in ``budget`` tokens, else its cut prefix and a truncation marker."""
    cut = counter.truncate(text, budget)
    if len(cut) >= len(text):
        return text
    return cut.rstrip() + "\n" + TRUNCATION_MARKER.format(budget=budget)

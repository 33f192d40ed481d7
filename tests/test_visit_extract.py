"""Extraction on a real page from the shared data, and token budgets."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile.envs.visit.extract import ExtractConfig, extract_text
from turnstile.envs.visit.tokens import RegexTokenCounter, TokenConfig, build_counter, fit_to_budget


def precision_recall(predicted: str, gold: str) -> tuple[float, float]:
    pred = Counter(re.findall(r"\w+", predicted.lower()))
    ref = Counter(re.findall(r"\w+", gold.lower()))
    common = sum((pred & ref).values())
    return common / max(1, sum(pred.values())), common / max(1, sum(ref.values()))


@pytest.mark.parametrize("favor", ["balanced", "precision", "recall"])
def test_real_page_overlaps_gold(shared_data: Path, favor: str) -> None:
    folder = shared_data / "webpages"
    gold = json.loads((folder / "ground_truth.json").read_text(encoding="utf-8"))
    path = sorted((folder / "html").glob("*.html.gz"))[0]
    entry = gold[path.name.removesuffix(".html.gz")]
    html = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    text = extract_text(html, entry["url"], ExtractConfig(favor=favor))  # type: ignore[arg-type]
    precision, recall = precision_recall(text, entry["articleBody"])
    assert recall > 0.9 and precision > 0.6, (precision, recall)
    assert len(text) < len(html) / 3  # markup and boilerplate are gone


def test_empty_and_script_only_pages_give_no_text() -> None:
    assert extract_text("") == ""
    assert extract_text("<html><body><div id=root></div><script>x()</script></body></html>") == ""


def test_regex_counter_counts_words_and_punctuation() -> None:
    counter = RegexTokenCounter()
    assert counter.count("Hello, world!") == 4
    assert counter.truncate("Hello, world! Again.", 3) == "Hello, world"
    assert counter.truncate("short", 10) == "short"


def test_fit_to_budget_adds_marker_only_when_cut() -> None:
    counter = build_counter(TokenConfig())
    text = " ".join(f"word{i}" for i in range(5000))
    cut = fit_to_budget(text, counter, 4096)
    assert cut.endswith("[... page truncated to 4096 tokens]")
    assert counter.count(cut.rsplit("\n", 1)[0]) == 4096
    assert fit_to_budget("a few words", counter, 4096) == "a few words"


def test_hf_counter_counts_and_cuts_with_the_policy_tokenizer() -> None:
    from transformers import AutoTokenizer

    from turnstile.rollout.model_store import ensure_default_model

    path = str(ensure_default_model())
    counter = build_counter(TokenConfig(tokenizer_path=path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "Shirley Temple served as Chief of Protocol of the United States. " * 20
    assert counter.count(text) == len(tokenizer.encode(text, add_special_tokens=False))
    cut = counter.truncate(text, 17)
    assert text.startswith(cut) and counter.count(cut) <= 17 and counter.count(cut) >= 15
    with pytest.raises(ValueError, match="not a tokenizer directory"):
        build_counter(TokenConfig(tokenizer_path="/nonexistent"))


@given(st.text(), st.integers(min_value=1, max_value=50))
def test_truncate_is_a_prefix_within_budget(text: str, budget: int) -> None:
    counter = RegexTokenCounter()
    cut = counter.truncate(text, budget)
    assert text.startswith(cut)
    assert counter.count(cut) == min(budget, counter.count(text))

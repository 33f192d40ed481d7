"""HotpotQA-style files: clue chains from supporting paragraphs and a deduplicated, servable corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.corpus import read_corpus, write_corpus
from envs.datasets import DatasetError, read_hotpotqa, title_slug

PREFIX = "http://127.0.0.1:8765/wiki/"


def paragraph(title: str, text: str, supporting: bool = False) -> dict[str, object]:
    return {"title": title, "text": text, "is_supporting": supporting}


def write_file(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


BRIDGE = {
    "id": "q1", "source": "test", "question": "Which office did the star of Kiss and Tell hold?",
    "answers": ["Chief of Protocol"],
    "paragraphs": [
        paragraph("Kiss and Tell (1945 film)", "It is a film.  Kiss and Tell stars Shirley Temple.", True),
        paragraph("Shirley Temple", "Shirley Temple was an actress.  She served as Chief of Protocol.", True),
        paragraph("Distractor", "Nothing here."),
    ],
}
COMPARISON = {
    "id": "q2", "source": "test", "question": "Are Shirley Temple and Distractor both people?",
    "answers": ["no"],
    "paragraphs": [
        paragraph("Shirley Temple", "A different text for a title seen before.", True),
        paragraph("Distractor", "There is no one here.", True),
    ],
}


def test_bridge_question_has_a_bridge_then_an_answer_clue(tmp_path: Path) -> None:
    hotpot = read_hotpotqa(write_file(tmp_path / "h.jsonl", [BRIDGE]), PREFIX)
    (task,) = hotpot.tasks
    assert task.clues is not None
    bridge, answer = task.clues
    assert (bridge.role, answer.role) == ("bridge", "answer")
    assert bridge.text == "Kiss and Tell stars Shirley Temple."  # first sentence naming the title
    assert bridge.evidence_urls == (PREFIX + "Kiss_and_Tell_(1945_film)",)
    assert bridge.aliases == ("Kiss and Tell (1945 film)",)
    assert answer.text == "Shirley Temple was an actress. She served as Chief of Protocol."
    assert answer.evidence_urls == (PREFIX + "Shirley_Temple",) and answer.aliases == ("Chief of Protocol",)
    assert [c.id for c in task.clues] == ["q1/clue0", "q1/clue1"]


def test_yes_no_answers_mark_no_paragraph_and_titles_are_deduplicated(tmp_path: Path) -> None:
    hotpot = read_hotpotqa(write_file(tmp_path / "h.jsonl", [BRIDGE, COMPARISON]), PREFIX)
    assert hotpot.tasks[1].clues is not None
    assert [c.role for c in hotpot.tasks[1].clues] == ["bridge", "bridge"]
    assert [d.title for d in hotpot.corpus] == ["Kiss and Tell (1945 film)", "Shirley Temple", "Distractor"]
    assert hotpot.corpus[1].text.startswith("Shirley Temple was")  # the first text of a title is kept


def test_slugs_are_url_safe_and_unique() -> None:
    titles = ["Shirley Temple", "Shirley_Temple", "Pokémon", "Pokemon", "A/B?c#d", "", "日本"]
    slugs = [title_slug(t) for t in titles]
    assert len(set(slugs)) == len(slugs)
    assert slugs[0] == "Shirley_Temple"
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789()',.!-_~")
    assert all(s and set(s) <= allowed for s in slugs)


def test_empty_url_prefix_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="url_prefix is empty"):
        read_hotpotqa(write_file(tmp_path / "h.jsonl", [BRIDGE]), "")


def test_missing_paragraphs_names_the_line(tmp_path: Path) -> None:
    broken = {k: v for k, v in BRIDGE.items() if k != "paragraphs"}
    with pytest.raises(DatasetError, match=r"h\.jsonl line 2: field 'paragraphs'"):
        read_hotpotqa(write_file(tmp_path / "h.jsonl", [BRIDGE, broken]), PREFIX)


def test_shared_hotpotqa_file(shared_data: Path, tmp_path: Path) -> None:
    path = shared_data / "multihop" / "hotpotqa_dev500.jsonl"
    hotpot = read_hotpotqa(path, PREFIX)
    assert len(hotpot.tasks) == 500
    assert len({t.id for t in hotpot.tasks}) == 500
    assert all(t.clues is not None and len(t.clues) == 2 for t in hotpot.tasks)
    assert all(sum(c.role == "answer" for c in t.clues or ()) <= 1 for t in hotpot.tasks)
    assert sum(any(c.role == "answer" for c in t.clues or ()) for t in hotpot.tasks) > 350

    titles = {p["title"] for line in path.read_text(encoding="utf-8").splitlines()
              for p in json.loads(line)["paragraphs"]}
    assert len(hotpot.corpus) == len(titles)
    assert len({d.doc_id for d in hotpot.corpus}) == len(hotpot.corpus)
    urls = {d.url for d in hotpot.corpus}
    assert len(urls) == len(hotpot.corpus)
    assert all(u in urls for t in hotpot.tasks for c in t.clues or () for u in c.evidence_urls)

    out = tmp_path / "corpus.jsonl"
    assert write_corpus(hotpot.corpus, out) == len(hotpot.corpus)
    assert read_corpus(out) == hotpot.corpus
    assert set(json.loads(out.open(encoding="utf-8").readline())) == {"id", "title", "text", "url"}

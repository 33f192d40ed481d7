"""HotpotQA-style files: clue chains from supporting paragraphs and a deduplicated, servable corpus
(one page per distinct paragraph, also where titles repeat, as in MuSiQue)."""

from __future__ import annotations

import html
import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.tools_for_tests import write_corpus
from turnstile.envs.corpus import read_corpus
from turnstile.envs.corpus_server import CorpusServer
from turnstile.envs.datasets import (
    DatasetConfig,
    DatasetError,
    HotpotQA,
    load_tasks,
    paragraph_slug,
    read_hotpotqa,
    title_slug,
)
from turnstile.envs.search.base import Document
from turnstile.envs.search.local import LocalIndex

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
    assert task.metadata["hops"] == 2  # its two supporting paragraphs


def test_yes_no_answers_mark_no_paragraph_and_repeated_paragraphs_are_one_page(tmp_path: Path) -> None:
    again = dict(BRIDGE, id="q3")  # the same paragraphs once more: the same pages
    hotpot = read_hotpotqa(write_file(tmp_path / "h.jsonl", [BRIDGE, COMPARISON, again]), PREFIX)
    assert hotpot.tasks[1].clues is not None
    assert [c.role for c in hotpot.tasks[1].clues] == ["bridge", "bridge"]
    # "Shirley Temple" comes back with another text: a page of its own; "Distractor" too.
    assert [d.title for d in hotpot.corpus] == ["Kiss and Tell (1945 film)", "Shirley Temple", "Distractor",
                                                "Shirley Temple", "Distractor"]
    first_ids = ["Kiss_and_Tell_(1945_film)", "Shirley_Temple", "Distractor"]
    assert [d.doc_id for d in hotpot.corpus[:3]] == first_ids
    assert hotpot.corpus[1].text.startswith("Shirley Temple was")  # the first text keeps the title's URL
    other_text = COMPARISON["paragraphs"][0]["text"]  # type: ignore[index]
    assert hotpot.corpus[3].doc_id == paragraph_slug("Shirley Temple", other_text)
    assert hotpot.tasks[1].clues[0].evidence_urls == (hotpot.corpus[3].url,)
    same = tuple(replace(c, id=c.id.replace("q1", "q3")) for c in hotpot.tasks[0].clues or ())
    assert hotpot.tasks[2].clues == same


def pages_by_url(hotpot: HotpotQA) -> dict[str, Document]:
    pages = {d.url: d for d in hotpot.corpus}
    assert len(pages) == len(hotpot.corpus) == len({d.doc_id for d in hotpot.corpus})
    assert all(d.url == PREFIX + d.doc_id for d in hotpot.corpus)
    return pages


def test_paragraphs_sharing_a_title_each_get_a_page_and_their_clues_point_at_it(tmp_path: Path) -> None:
    """Several paragraphs under one title in one question (MuSiQue does this), HotpotQA's shape."""
    row = {"id": "m1", "question": "Who did the founder of Quiet Engine marry?", "answers": ["Ilse Marlow"],
           "paragraphs": [
               paragraph("Tomas Venn", "Tomas Venn is a guitarist.  He founded Quiet Engine in 1983.", True),
               paragraph("Tomas Venn", "In 1985 Tomas Venn married Ilse Marlow.", True),
               paragraph("Tomas Venn", "Venn toured Japan twice."),
           ]}
    hotpot = read_hotpotqa(write_file(tmp_path / "h.jsonl", [row]), PREFIX)
    pages = pages_by_url(hotpot)
    assert [d.text for d in hotpot.corpus] == [p["text"] for p in row["paragraphs"]]
    assert hotpot.corpus[0].url == PREFIX + "Tomas_Venn"  # the first text of the title: as before
    assert all(d.doc_id.startswith("Tomas_Venn~p") for d in hotpot.corpus[1:])
    (task,) = hotpot.tasks
    assert task.clues is not None
    bridge, answer = task.clues
    assert (bridge.role, answer.role) == ("bridge", "answer")
    assert "founded Quiet Engine" in pages[bridge.evidence_urls[0]].text
    assert "married Ilse Marlow" in pages[answer.evidence_urls[0]].text  # not the first Tomas Venn text


MUSIQUE = Path(__file__).parent / "fixtures" / "multihop" / "musique_shared_titles.jsonl"


def test_musique_rows_every_paragraph_its_page_clues_in_hop_order() -> None:
    hotpot = read_hotpotqa(MUSIQUE, PREFIX)
    rows = [json.loads(line) for line in MUSIQUE.read_text(encoding="utf-8").splitlines()]
    pages = pages_by_url(hotpot)
    distinct = {(p["title"], p["paragraph_text"]) for row in rows for p in row["paragraphs"]}
    assert {(d.title, d.text) for d in hotpot.corpus} == distinct and len(hotpot.corpus) == len(distinct)
    for row, task in zip(rows, hotpot.tasks, strict=True):
        assert task.id == row["id"] and task.metadata["source"] == "musique"
        assert task.answers == (row["answer"], *row["answer_aliases"])
        assert task.clues is not None
        by_idx = {p["idx"]: p for p in row["paragraphs"]}
        hops = [by_idx[hop["paragraph_support_idx"]] for hop in row["question_decomposition"]]
        # one clue per hop, in hop order, each at the page holding that hop's paragraph
        assert [pages[c.evidence_urls[0]].text for c in task.clues] == [p["paragraph_text"] for p in hops]
        assert [c.role for c in task.clues] == ["bridge", "answer"]
        assert task.clues[-1].aliases == task.answers
        assert task.metadata["hops"] == len(hops)  # held-out accuracy is reported by hop count
    married = next(d for d in hotpot.corpus if "married" in d.text)
    assert married.title == "Tomas Venn" and married.doc_id == paragraph_slug(married.title, married.text)


async def test_every_musique_paragraph_is_found_by_search() -> None:
    hotpot = read_hotpotqa(MUSIQUE, PREFIX)
    index = LocalIndex.from_documents(hotpot.corpus)
    for doc in hotpot.corpus:
        hits = await index.search(doc.text, top_k=1)
        assert [hit.url for hit in hits] == [doc.url], doc.text
    by_title = await index.search("Tomas Venn", top_k=3)
    assert {hit.url for hit in by_title} == {d.url for d in hotpot.corpus if d.title == "Tomas Venn"}


@pytest.mark.integration
def test_every_musique_paragraph_is_served_at_its_own_url() -> None:
    hotpot = read_hotpotqa(MUSIQUE, PREFIX)
    with CorpusServer(hotpot.corpus) as server:
        for doc in hotpot.corpus:
            page = httpx.get(server.url_for(doc.doc_id))
            assert page.status_code == 200 and html.escape(doc.text) in page.text


@pytest.mark.parametrize(("change", "message"), [
    ({"answerable": False}, "'answerable' is false"),
    ({"question_decomposition": [{"id": 1, "paragraph_support_idx": 1}]},
     r"field 'question_decomposition'\[0\].paragraph_support_idx is 1, which names no supporting paragraph"),
    ({"answer_aliases": "Ilse Venn"}, "field 'answer_aliases' must be a list"),
])
def test_musique_rows_that_cannot_be_tasks_name_line_and_field(change: dict[str, object], message: str,
                                                               tmp_path: Path) -> None:
    first, second = [json.loads(line) for line in MUSIQUE.read_text(encoding="utf-8").splitlines()]
    with pytest.raises(DatasetError, match=r"h\.jsonl line 2: " + message):
        read_hotpotqa(write_file(tmp_path / "h.jsonl", [first, {**second, **change}]), PREFIX)


def test_musique_file_through_the_registry() -> None:
    tasks = load_tasks(DatasetConfig(kind="hotpotqa", path=str(MUSIQUE), url_prefix=PREFIX))
    assert [task.id for task in tasks] == ["2hop__1_2", "2hop__1_3"]


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


def test_musique_urls_do_not_depend_on_the_file(tmp_path: Path) -> None:
    """A train and a dev file served from one corpus: a paragraph's URL is the same in both, so a
    dev clue never lands on another paragraph of its title that the train file saw first."""
    rows = [json.loads(line) for line in MUSIQUE.read_text().splitlines() if line.strip()]
    alone = dict(rows[0], paragraphs=[p for p in rows[0]["paragraphs"] if p["idx"] != 1])
    train = read_hotpotqa(write_file(tmp_path / "train.jsonl", rows), PREFIX)
    dev = read_hotpotqa(write_file(tmp_path / "dev.jsonl", [alone]), PREFIX)
    pages = pages_by_url(train)
    for clue in dev.tasks[0].clues or ():
        (url,) = clue.evidence_urls
        assert url in pages, url
        assert pages[url].text in {p["paragraph_text"] for p in alone["paragraphs"]}


def test_a_hotpotqa_corpus_serves_every_page_its_tasks_cite(shared_data: Path) -> None:
    from turnstile.envs.corpus import CorpusConfig, corpus_documents
    from turnstile.envs.corpus_server import PAGE_PREFIX

    path = shared_data / "multihop" / "hotpotqa_dev500.jsonl"
    base = "http://127.0.0.1:9"
    documents = corpus_documents(CorpusConfig(kind="hotpotqa", path=str(path)), base)
    served = {document.url for document in documents}
    tasks = load_tasks(DatasetConfig(kind="hotpotqa", path=str(path), url_prefix=base + PAGE_PREFIX))
    cited = {url for task in tasks for clue in task.clues or () for url in clue.evidence_urls}
    assert len(tasks) == 500 and len(documents) > 4000 and cited <= served

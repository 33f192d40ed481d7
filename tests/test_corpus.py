"""The corpus JSONL format: one reader and writer for the index, the server and the converters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools_for_tests import write_corpus
from turnstile.envs.corpus import read_corpus
from turnstile.envs.search.base import Document


def test_reads_ids_html_and_url_prefix(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": 7, "title": "T", "text": "x"}) + "\n\n"
                    + json.dumps({"id": "h", "title": "H", "text": "y", "html": "<p>y</p>",
                                  "url": "http://a/h"}) + "\n")
    docs = read_corpus(path)
    assert [(d.doc_id, d.html, d.url) for d in docs] == [("7", None, ""), ("h", "<p>y</p>", "http://a/h")]
    assert read_corpus(path, url_prefix="http://p/")[0].url == "http://p/7"


@pytest.mark.parametrize(("line", "problem"), [
    ('{"id": "a", "title": 3, "text": "x"}', '"title" must be a string'),
    ('{"id": true, "title": "t", "text": "x"}', '"id" must be'),
    ('{"id": "a", "title": "t", "text": "x", "html": 5}', '"html" must be a string'),
    ('{"id": "a", "title": "t", "text": "x", "url": 5}', '"url" must be a string'),
    ("[1]", "expected a JSON object"),
    ("{broken", "not valid JSON"),
])
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"id": "ok", "title": "t", "text": "x"}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        read_corpus(path)
    assert f"{path}:2:" in str(info.value) and problem in str(info.value)


def test_missing_file_and_round_trip(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(tmp_path / "missing.jsonl")
    docs = [Document("a", "A", "text a", "http://x/a"), Document("b", "B", "text b", "http://x/b", "<p>b</p>")]
    out = tmp_path / "sub" / "out.jsonl"
    assert write_corpus(docs, out) == 2
    assert read_corpus(out) == docs

"""Generic JSONL and parquet task files: round trips, field maps, and errors that point at the row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.envs.datasets import DatasetError, load_jsonl, load_parquet
from turnstile.envs.tasks import Clue, Task


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def task_row(task: Task) -> dict[str, object]:
    row: dict[str, object] = {"id": task.id, "question": task.question, "answers": list(task.answers),
                              "metadata": task.metadata}
    if task.clues is not None:
        row["clues"] = [
            {"id": c.id, "text": c.text, "role": c.role, "evidence_urls": list(c.evidence_urls),
             "aliases": list(c.aliases)}
            for c in task.clues
        ]
    return row


TASKS = [
    Task(id="t1", question="Which river flows through the capital?", answers=("Danube", "the Danube"),
         clues=(Clue(id="t1/c0", text="The capital is Vienna.", role="bridge",
                     evidence_urls=("http://x/wiki/Vienna",), aliases=("Wien",)),
                Clue(id="t1/c1", text="The Danube flows through Vienna.", role="answer")),
         metadata={"level": 2, "tags": ["geo"]}),
    Task(id="t2", question="Zwei plus zwei?", answers=("4",)),
]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tasks.jsonl", [task_row(t) for t in TASKS])
    assert load_jsonl(path) == TASKS


def test_parquet_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tasks.parquet"
    rows = [{"id": t.id, "question": t.question, "answers": list(t.answers)} for t in TASKS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_parquet(path)
    assert [(t.id, t.question, t.answers) for t in loaded] == [(t.id, t.question, t.answers) for t in TASKS]


def test_single_answer_string_is_wrapped_and_missing_id_is_stable(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "q1", "answers": "a1"}\n\n{"question": "q2", "answers": ["a2"]}\n')
    first, second = load_jsonl(path)
    assert first.answers == ("a1",)
    assert (first.id, second.id) == ("mine:1", "mine:3")  # line numbers, blank lines counted
    assert [t.id for t in load_jsonl(path)] == ["mine:1", "mine:3"]


def test_field_map_renames_and_extra_fields_go_to_metadata(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"qid": 7, "query": "q?", "answer": "a", "level": "hard"}])
    (task,) = load_jsonl(path, {"qid": "id", "query": "question", "answer": "answers"})
    assert (task.id, task.question, task.answers, task.metadata) == ("7", "q?", ("a",), {"level": "hard"})


def test_parquet_field_map(tmp_path: Path) -> None:
    path = tmp_path / "mapped.parquet"
    pq.write_table(pa.Table.from_pylist([{"query": "q?", "answer": "a"}]), path)
    (task,) = load_parquet(path, {"query": "question", "answer": "answers"})
    assert (task.id, task.question, task.answers) == ("mapped:1", "q?", ("a",))


def test_malformed_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answers": ["a"]}\n\n{"question": "q", "answers": [\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl line 3: malformed JSON"):
        load_jsonl(path)


def test_missing_question_names_line_and_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "noq.jsonl", [{"question": "q", "answers": "a"}, {"answers": ["a"]}])
    with pytest.raises(DatasetError, match=r"noq\.jsonl line 2: missing field 'question'"):
        load_jsonl(path)


@pytest.mark.parametrize("answers", [[], [""], None])
def test_empty_answers_are_rejected(tmp_path: Path, answers: object) -> None:
    row = {"question": "q"} if answers is None else {"question": "q", "answers": answers}
    path = write_jsonl(tmp_path / "noa.jsonl", [row])
    with pytest.raises(DatasetError, match=r"noa\.jsonl line 1: (missing )?field 'answers'"):
        load_jsonl(path)


def test_bad_clue_role_names_the_clue(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "answers": "a",
                                               "clues": [{"text": "t", "role": "hint"}]}])
    with pytest.raises(DatasetError, match=r"line 1: field 'clues'\[0\]\.role is 'hint'"):
        load_jsonl(path)


def test_parquet_missing_column_lists_columns(tmp_path: Path) -> None:
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{"query": "q", "answers": ["a"]}]), path)
    with pytest.raises(DatasetError, match=r"missing column 'question' \(columns: query, answers\)"):
        load_parquet(path)


def test_parquet_null_question_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answers": ["a"]},
                                         {"question": None, "answers": ["b"]}]), path)
    with pytest.raises(DatasetError, match=r"nulls\.parquet row 2: missing field 'question'"):
        load_parquet(path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(DatasetError, match="no such file"):
        load_parquet(tmp_path / "absent.parquet")


text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30).filter(str.strip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(question=text, answers=st.lists(text, min_size=1, max_size=3),
       metadata=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3))
def test_any_task_survives_a_jsonl_round_trip(tmp_path: Path, question: str, answers: list[str],
                                              metadata: dict[str, object]) -> None:
    task = Task(id="p", question=question, answers=tuple(a.strip() for a in answers), metadata=metadata)
    path = write_jsonl(tmp_path / "prop.jsonl", [task_row(task)])
    assert load_jsonl(path) == [task]

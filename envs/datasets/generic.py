"""Tasks from plain JSONL and parquet files, the format anyone can write by hand or export.

A row holds ``id``, ``question``, ``answers`` (a list, or one string that becomes a one-item list),
optional ``clues`` (a list of objects with ``text``, ``role`` and optionally ``id``,
``evidence_urls``, ``aliases``) and optional ``metadata`` (an object). Files that name their fields
differently are read through a field map, e.g. ``{"query": "question", "answer": "answers"}``.
Fields that are not task fields are kept in ``metadata`` so nothing in the file is silently lost.

Every error names the file, the line (JSONL, 1-based) or row (parquet, 1-based) and the field,
because a bad row in a 100k-line file is otherwise a needle in a haystack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TypeGuard

from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.base import JsonValue

TASK_FIELDS = ("id", "question", "answers", "clues", "metadata")
CLUE_ROLES = ("bridge", "constraint", "answer")


class DatasetError(ValueError):
    """A dataset file cannot be turned into tasks; the message names the file, row and field."""


def where(path: Path, row: int, *, unit: str = "line") -> str:
    """How errors point at a row: ``file.jsonl line 12``."""
    return f"{path} {unit} {row}"


def load_jsonl(path: str | Path, field_map: Mapping[str, str] | None = None) -> list[Task]:
    """Read one task per non-blank line of a JSONL file.

    A missing ``id`` becomes ``<file stem>:<line number>``, which stays the same as long as the
    file does not change.
    """
    path = Path(path)
    tasks: list[Task] = []
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path")
    with path.open("rb") as lines:
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DatasetError(
                    f"{where(path, line_no)}: not valid UTF-8; re-save the file as UTF-8"
                ) from None
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{where(path, line_no)}: malformed JSON ({exc.msg} at column {exc.colno}); "
                    "each line must hold one complete JSON object"
                ) from None
            tasks.append(task_from_record(record, where=where(path, line_no),
                                          default_id=f"{path.stem}:{line_no}", field_map=field_map))
    return tasks


def load_parquet(path: str | Path, field_map: Mapping[str, str] | None = None) -> list[Task]:
    """Read one task per row of a parquet file; a missing ``id`` becomes ``<file stem>:<row>``."""
    import pyarrow.parquet as pq  # imported here so JSONL users do not pay for pyarrow

    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several unrelated types for unreadable files
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
    renamed = {field_map.get(name, name) if field_map else name for name in table.column_names}
    for required in ("question", "answers"):
        if required not in renamed:
            raise DatasetError(
                f"{path}: missing column {required!r} (columns: {', '.join(table.column_names)}); "
                "rename it or map it with field_map, e.g. {'answer': 'answers'}"
            )
    return [
        task_from_record(record, where=where(path, row, unit="row"),
                         default_id=f"{path.stem}:{row}", field_map=field_map)
        for row, record in enumerate(table.to_pylist(), start=1)
    ]


def task_from_record(record: object, *, where: str, default_id: str,
                     field_map: Mapping[str, str] | None = None) -> Task:
    """Turn one decoded row into a Task, or raise DatasetError naming ``where`` and the field."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    fields = _apply_field_map(record, field_map or {}, where)

    task_id = fields.get("id")
    if task_id is None or task_id == "":
        task_id = default_id
    elif isinstance(task_id, (str, int)) and not isinstance(task_id, bool):
        task_id = str(task_id)
    else:
        raise DatasetError(f"{where}: field 'id' must be a string or an integer")

    question = fields.get("question")
    if question is None:
        raise DatasetError(f"{where}: missing field 'question' (map another field to it with field_map)")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: field 'question' must be a non-empty string")

    answers = parse_answers(fields.get("answers"), where)
    clues = _clues(fields.get("clues"), task_id, where)

    metadata = fields.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DatasetError(f"{where}: field 'metadata' must be an object")
    extra = {name: value for name, value in fields.items() if name not in TASK_FIELDS}
    return Task(id=task_id, question=question, answers=answers, clues=clues,
                metadata={**extra, **metadata})


def _apply_field_map(record: dict[str, JsonValue], field_map: Mapping[str, str],
                     where: str) -> dict[str, JsonValue]:
    fields: dict[str, JsonValue] = {}
    for name, value in record.items():
        target = field_map.get(name, name)
        if target in fields:
            raise DatasetError(
                f"{where}: both {name!r} and another field map to {target!r}; fix field_map"
            )
        fields[target] = value
    return fields


def parse_answers(value: JsonValue, where: str) -> tuple[str, ...]:
    if value is None:
        raise DatasetError(f"{where}: missing field 'answers' (map another field to it with field_map)")
    items = [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value
    if not isinstance(items, list):
        raise DatasetError(f"{where}: field 'answers' must be a list of strings or one string")
    answers: list[str] = []
    for index, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise DatasetError(f"{where}: field 'answers'[{index}] must be a string")
        text = str(item).strip()
        if text:
            answers.append(text)
    if not answers:
        raise DatasetError(f"{where}: field 'answers' is empty; a task needs at least one answer")
    return tuple(answers)


def _clues(value: JsonValue, task_id: str, where: str) -> tuple[Clue, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise DatasetError(f"{where}: field 'clues' must be a list of objects")
    clues: list[Clue] = []
    for index, item in enumerate(value):
        at = f"{where}: field 'clues'[{index}]"
        if not isinstance(item, dict):
            raise DatasetError(f"{at} must be an object with 'text' and 'role'")
        text, role = item.get("text"), item.get("role")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{at}.text must be a non-empty string")
        if role not in CLUE_ROLES:
            raise DatasetError(f"{at}.role is {role!r}; use one of {', '.join(CLUE_ROLES)}")
        clue_id = item.get("id") or f"{task_id}/clue{index}"
        clues.append(Clue(
            id=str(clue_id), text=text, role=str(role),
            evidence_urls=_strings(item.get("evidence_urls"), f"{at}.evidence_urls"),
            aliases=_strings(item.get("aliases"), f"{at}.aliases"),
        ))
    return tuple(clues)


def _strings(value: JsonValue, at: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not _is_strings(value):
        raise DatasetError(f"{at} must be a list of strings")
    return tuple(value)


def _is_strings(value: JsonValue) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


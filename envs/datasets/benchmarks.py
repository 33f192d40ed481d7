"""Published evaluation benchmarks, read from the files exactly as their authors released them.

BrowseComp-ZH and xbench-DeepSearch are published encrypted so their text does not leak into web
crawls (and from there into training data). They are decrypted here, in memory, at load time only:
nothing in this module writes, prints or logs decrypted text, and its errors name rows and fields,
never content. Keep it that way when you change it.

* BrowseComp-ZH (xlsx): key = SHA-256 digest of the row's canary, repeated to the ciphertext's length,
  XOR with the base64-decoded cell (BrowseComp's scheme).
* xbench-DeepSearch (csv): key = the row's canary string itself (UTF-8 bytes), repeated, XOR with the
  base64-decoded cell. (Checked: this gives valid UTF-8 for every row; the SHA-256 key gives none.)

A wrong canary is caught on the question: with a wrong key its bytes are not UTF-8 or hold control
characters (checked on the published files: none passes). Short answers alone could pass by chance.

Each loader checks that it yields the published number of questions, so a truncated or wrong file
fails loudly instead of shrinking an evaluation. Row numbers in errors are as a spreadsheet shows
them: the header is row 1, the first question row 2.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import json
import re
from pathlib import Path

from turnstile.envs.datasets.generic import DatasetError, load_jsonl, task_from_record, where
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonValue

BROWSECOMP_ZH_COUNT = 289
XBENCH_DEEPSEARCH_COUNTS: dict[str, int] = {"DeepSearch-2505.csv": 100, "DeepSearch-2510.csv": 100}
WEBWALKERQA_COUNT = 680
WEBSHAPER_COUNT = 500

# Control characters other than tab and newlines: a decrypted question never holds them.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def browsecomp_key(canary: str) -> bytes:
    """BrowseComp's key: the SHA-256 digest of the canary."""
    return hashlib.sha256(canary.encode("utf-8")).digest()


def xbench_key(canary: str) -> bytes:
    """xbench's key: the canary's own bytes."""
    return canary.encode("utf-8")


def xor_cipher(data: bytes, key: bytes) -> bytes:
    """XOR ``data`` with ``key`` repeated to its length (encrypts and decrypts alike)."""
    if not key:
        raise ValueError("the XOR key is empty")
    repeated = key * (len(data) // len(key) + 1)
    return bytes(a ^ b for a, b in zip(data, repeated, strict=False))


def encrypt_text(plaintext: str, key: bytes) -> str:
    """The published form of ``plaintext``: base64 of the XOR. Used to build test fixtures."""
    return base64.b64encode(xor_cipher(plaintext.encode("utf-8"), key)).decode("ascii")


def decrypt_text(ciphertext: str, key: bytes, *, at: str, field: str, is_question: bool = False) -> str:
    """Decrypt one cell in memory. Raises DatasetError naming ``at`` and ``field`` (never the text)
    when the cell is not base64 or the key does not turn it into text."""
    try:
        plain = xor_cipher(base64.b64decode(ciphertext, validate=True), key)
    except (binascii.Error, ValueError):
        raise DatasetError(f"{at}: field {field!r} is not base64; the file is damaged") from None
    try:
        text = plain.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or (is_question and _CONTROL.search(text)):
        raise DatasetError(
            f"{at}: field {field!r} does not decrypt to text with this row's canary; the canary is "
            "wrong or the file was altered. Use the file as published."
        )
    return text


def load_browsecomp_zh(path: str | Path, *, expected_count: int | None = None) -> list[Task]:
    """BrowseComp-ZH from ``browsecomp-zh-encrypted.xlsx`` (columns Topic, Question, Answer, canary).

    ``expected_count`` defaults to the published :data:`BROWSECOMP_ZH_COUNT`.
    """
    import openpyxl  # only this benchmark needs it

    path = _existing(path)
    workbook = openpyxl.load_workbook(path, read_only=True, data_only=True)
    try:
        rows = list(workbook.worksheets[0].iter_rows(values_only=True))
    finally:
        workbook.close()
    if not rows:
        raise DatasetError(f"{path}: the first sheet is empty")
    header = [str(cell) if cell is not None else "" for cell in rows[0]]
    columns = _columns(path, header, ("Topic", "Question", "Answer", "canary"))
    tasks: list[Task] = []
    for row_no, row in enumerate(rows[1:], start=2):
        if all(cell is None for cell in row):
            continue
        at = where(path, row_no, unit="row")
        cells = {name: row[index] if index < len(row) else None for name, index in columns.items()}
        key = browsecomp_key(_canary(cells["canary"], at))
        question = decrypt_text(_cell(cells["Question"], at, "Question"), key, at=at, field="Question",
                                is_question=True)
        answer = decrypt_text(_cell(cells["Answer"], at, "Answer"), key, at=at, field="Answer")
        topic = decrypt_text(_cell(cells["Topic"], at, "Topic"), key, at=at, field="Topic")
        tasks.append(_task(f"browsecomp-zh:{row_no - 1}", question, answer, at,
                           {"source": "browsecomp-zh", "topic": topic}))
    return _counted(path, tasks, expected_count if expected_count is not None else BROWSECOMP_ZH_COUNT)


def load_xbench(path: str | Path, *, expected_count: int | None = None) -> list[Task]:
    """xbench-DeepSearch from ``DeepSearch-<version>.csv`` (columns id, prompt, answer,
    reference_steps, canary).

    ``expected_count`` defaults to the published count for the file's name
    (:data:`XBENCH_DEEPSEARCH_COUNTS`); a renamed file must pass it.
    """
    path = _existing(path)
    if expected_count is None:
        if path.name not in XBENCH_DEEPSEARCH_COUNTS:
            raise DatasetError(
                f"{path}: not a published xbench file name ({', '.join(XBENCH_DEEPSEARCH_COUNTS)}); "
                "pass expected_count for a renamed or new release"
            )
        expected_count = XBENCH_DEEPSEARCH_COUNTS[path.name]
    source = f"xbench-{path.stem.lower()}"
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle)
        _columns(path, list(reader.fieldnames or []), ("id", "prompt", "answer", "reference_steps", "canary"))
        tasks: list[Task] = []
        for row_no, row in enumerate(reader, start=2):
            at = where(path, row_no, unit="row")
            key = xbench_key(_canary(row["canary"], at))
            question = decrypt_text(_cell(row["prompt"], at, "prompt"), key, at=at, field="prompt",
                                    is_question=True)
            answer = decrypt_text(_cell(row["answer"], at, "answer"), key, at=at, field="answer")
            steps = row["reference_steps"] or ""
            if steps:
                steps = decrypt_text(steps, key, at=at, field="reference_steps")
            row_id = _cell(row["id"], at, "id")
            tasks.append(_task(f"{source}:{row_id}", question, answer, at,
                               {"source": source, "xbench_id": row_id, "reference_steps": steps}))
    return _counted(path, tasks, expected_count)


def load_webwalkerqa(path: str | Path, *, expected_count: int | None = None) -> list[Task]:
    """WebWalkerQA from WebThinker's ``webwalkerqa_test680_webthinker.json`` (a JSON list whose items
    hold Question, answer, domain, type, difficulty_level, lang, root_url, source_website,
    golden_path; all but the question and answer are kept in metadata). Ids are ``webwalkerqa:<n>``,
    n the 1-based position in the list."""
    path = _existing(path)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path} line {exc.lineno}: malformed JSON ({exc.msg})") from None
    if not isinstance(records, list):
        raise DatasetError(f"{path}: expected a JSON list of questions")
    tasks: list[Task] = []
    for index, record in enumerate(records, start=1):
        if isinstance(record, dict):
            record = {**record, "metadata": {"source": "webwalkerqa"}}
        tasks.append(task_from_record(record, where=f"{path} item {index}", default_id=f"webwalkerqa:{index}",
                                      field_map={"Question": "question", "answer": "answers"}))
    return _counted(path, tasks, expected_count if expected_count is not None else WEBWALKERQA_COUNT)


def load_webshaper(path: str | Path, *, expected_count: int | None = None) -> list[Task]:
    """WebShaper from Tongyi DeepResearch's ``webshaper500_tongyi.jsonl`` (id, question, answer,
    formalization, urls; the last two kept in metadata). Some questions are published wrapped in a
    pair of double quotes; the pair is removed since it is an export artefact, not part of the
    question. Ids are ``webshaper:<file id>``."""
    path = _existing(path)
    tasks = [
        Task(id=f"webshaper:{task.id}", question=_unquote(task.question), answers=task.answers,
             metadata={**task.metadata, "source": "webshaper"})
        for task in load_jsonl(path, field_map={"answer": "answers"})
    ]
    return _counted(path, tasks, expected_count if expected_count is not None else WEBSHAPER_COUNT)


def _unquote(question: str) -> str:
    stripped = question.strip()
    if len(stripped) > 1 and stripped[0] == stripped[-1] == '"' and '"' not in stripped[1:-1]:
        return stripped[1:-1].strip()
    return stripped


def _task(task_id: str, question: str, answer: str, at: str, metadata: dict[str, JsonValue]) -> Task:
    if not question.strip():
        raise DatasetError(f"{at}: the question decrypts to an empty string")
    if not answer.strip():
        raise DatasetError(f"{at}: the answer decrypts to an empty string")
    return Task(id=task_id, question=question.strip(), answers=(answer.strip(),), metadata=metadata)


def _counted(path: Path, tasks: list[Task], expected: int) -> list[Task]:
    if len(tasks) != expected:
        raise DatasetError(
            f"{path}: read {len(tasks)} questions, the published count is {expected}; the file is "
            "truncated or not the published release (pass expected_count if that is intended)"
        )
    return tasks


def _columns(path: Path, header: list[str], required: tuple[str, ...]) -> dict[str, int]:
    missing = [name for name in required if name not in header]
    if missing:
        raise DatasetError(
            f"{path}: missing column(s) {', '.join(missing)} (header: {', '.join(header)}); "
            "use the file as published"
        )
    return {name: header.index(name) for name in required}


def _canary(value: object, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{at}: the canary is missing, so the row cannot be decrypted; "
                           "use the file as published")
    return value


def _cell(value: object, at: str, field: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DatasetError(f"{at}: field {field!r} is empty")
    return str(value)


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path (see data/README.md)")
    return path

"""Published benchmarks load with their published counts; encrypted ones decrypt only in memory.

These tests must never show decrypted text: they assert on counts and booleans computed first (so a
failing assert cannot print a question), and synthetic fixtures use text written here.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import openpyxl
import pytest

from turnstile.envs.datasets import (
    BROWSECOMP_ZH_COUNT,
    WEBSHAPER_COUNT,
    WEBWALKERQA_COUNT,
    XBENCH_DEEPSEARCH_COUNTS,
    DatasetConfig,
    DatasetError,
    load_browsecomp_zh,
    load_tasks,
    load_xbench,
)
from turnstile.envs.datasets.benchmarks import browsecomp_key, encrypt_text, xbench_key
from turnstile.envs.tasks import Task

CANARY = "TEST DATA canary GUID 00000000-test"

PUBLISHED = [
    ("browsecomp_zh", "browsecomp-zh-encrypted.xlsx", BROWSECOMP_ZH_COUNT, "browsecomp-zh"),
    ("xbench", "DeepSearch-2505.csv", XBENCH_DEEPSEARCH_COUNTS["DeepSearch-2505.csv"],
     "xbench-deepsearch-2505"),
    ("xbench", "DeepSearch-2510.csv", XBENCH_DEEPSEARCH_COUNTS["DeepSearch-2510.csv"],
     "xbench-deepsearch-2510"),
    ("webwalkerqa", "webwalkerqa_test680_webthinker.json", WEBWALKERQA_COUNT, "webwalkerqa"),
    ("webshaper", "webshaper500_tongyi.jsonl", WEBSHAPER_COUNT, "webshaper"),
]


def problems(tasks: list[Task], source: str) -> dict[str, int]:
    """Counts of defects, computed without ever putting task text into an assertion."""
    return {
        "duplicate ids": len(tasks) - len({t.id for t in tasks}),
        "empty questions": sum(not t.question.strip() for t in tasks),
        "empty answers": sum(not t.answers or not all(a.strip() for a in t.answers) for t in tasks),
        "wrong source": sum(t.metadata.get("source") != source for t in tasks),
        "ids without source prefix": sum(not t.id.startswith(source + ":") for t in tasks),
    }


@pytest.mark.parametrize(("kind", "name", "count", "source"), PUBLISHED, ids=[p[1] for p in PUBLISHED])
def test_published_file_loads_with_published_count(shared_data: Path, kind: str, name: str, count: int,
                                                   source: str) -> None:
    tasks = load_tasks(DatasetConfig(kind=kind, path=str(shared_data / "benchmarks" / name)))
    n_tasks = len(tasks)
    assert n_tasks == count
    found = problems(tasks, source)
    assert found == dict.fromkeys(found, 0)


def test_benchmark_metadata_fields(shared_data: Path) -> None:
    bench = shared_data / "benchmarks"
    walker_path = bench / "webwalkerqa_test680_webthinker.json"
    walker = load_tasks(DatasetConfig(kind="webwalkerqa", path=str(walker_path)))
    keys = {"domain", "type", "difficulty_level", "lang", "root_url", "source_website", "golden_path"}
    assert sum(not keys <= set(t.metadata) for t in walker) == 0
    shaper = load_tasks(DatasetConfig(kind="webshaper", path=str(bench / "webshaper500_tongyi.jsonl")))
    assert sum(not isinstance(t.metadata.get("urls"), list) for t in shaper) == 0
    assert sum(t.question.startswith('"') and t.question.endswith('"') for t in shaper) == 0
    zh = load_browsecomp_zh(bench / "browsecomp-zh-encrypted.xlsx")
    assert sum(not isinstance(t.metadata.get("topic"), str) for t in zh) == 0
    xb = load_xbench(bench / "DeepSearch-2510.csv")
    assert sum(not isinstance(t.metadata.get("reference_steps"), str) for t in xb) == 0


def test_wrong_canary_in_published_xbench_file_names_the_row(shared_data: Path, tmp_path: Path) -> None:
    """A copy of the (still encrypted) file in tmp with row 4's canary altered must not load."""
    copy = tmp_path / "DeepSearch-2505.csv"
    shutil.copyfile(shared_data / "benchmarks" / "DeepSearch-2505.csv", copy)
    with copy.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    rows[3][-1] = rows[3][-1][::-1]  # row 4 as a spreadsheet counts: the header is row 1
    with copy.open("w", encoding="utf-8", newline="") as handle:
        csv.writer(handle).writerows(rows)
    with pytest.raises(DatasetError, match=r"row 4: field 'prompt' does not decrypt") as caught:
        load_xbench(copy)
    assert "canary is wrong" in str(caught.value)


def write_xbench(path: Path, rows: list[tuple[str, str, str, str]]) -> Path:
    """rows: (question, answer, steps, canary); text is encrypted with each row's canary."""
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "prompt", "answer", "reference_steps", "canary"])
        for index, (question, answer, steps, canary) in enumerate(rows, start=1):
            key = xbench_key(CANARY)
            writer.writerow([index, encrypt_text(question, key), encrypt_text(answer, key),
                             encrypt_text(steps, key), canary])
    return path


def write_browsecomp(path: Path, rows: list[tuple[str, str, str, str | None]]) -> Path:
    """rows: (topic, question, answer, canary); text is encrypted with the true test canary."""
    workbook = openpyxl.Workbook()
    sheet = workbook.active
    sheet.append(["Topic", "Question", "Answer", "canary"])
    key = browsecomp_key(CANARY)
    for topic, question, answer, canary in rows:
        sheet.append([encrypt_text(topic, key), encrypt_text(question, key), encrypt_text(answer, key),
                      canary])
    workbook.save(path)
    return path


def test_xbench_synthetic_round_trip(tmp_path: Path) -> None:
    path = write_xbench(tmp_path / "mine.csv", [
        ("第一个问题是什么？", "答案", "步骤", CANARY),
        ("Second question?", "42", "", CANARY),
    ])
    tasks = load_xbench(path, expected_count=2)
    assert [(t.id, t.question, t.answers) for t in tasks] == [
        ("xbench-mine:1", "第一个问题是什么？", ("答案",)),
        ("xbench-mine:2", "Second question?", ("42",)),
    ]
    assert tasks[0].metadata["reference_steps"] == "步骤"


def test_xbench_wrong_and_missing_canary(tmp_path: Path) -> None:
    wrong = write_xbench(tmp_path / "wrong.csv", [
        ("一个足够长的问题，用来检测错误的密钥。", "答案", "", CANARY),
        ("另一个足够长的问题，用来检测错误的密钥。", "答案", "", "not it"),
    ])
    with pytest.raises(DatasetError, match=r"wrong\.csv row 3: field 'prompt' does not decrypt"):
        load_xbench(wrong, expected_count=2)
    missing = write_xbench(tmp_path / "missing.csv", [("问题？", "答案", "", "")])
    with pytest.raises(DatasetError, match=r"missing\.csv row 2: the canary is missing"):
        load_xbench(missing, expected_count=1)


def test_xbench_count_and_name_checks(tmp_path: Path) -> None:
    short = write_xbench(tmp_path / "DeepSearch-2505.csv", [("问题？", "答案", "", CANARY)])
    with pytest.raises(DatasetError, match="read 1 questions, the published count is 100"):
        load_xbench(short)
    renamed = write_xbench(tmp_path / "renamed.csv", [("问题？", "答案", "", CANARY)])
    with pytest.raises(DatasetError, match="pass expected_count"):
        load_xbench(renamed)


def test_browsecomp_synthetic_round_trip_and_bad_canaries(tmp_path: Path) -> None:
    good = write_browsecomp(tmp_path / "good.xlsx", [("历史", "哪一年？", "1949", CANARY)])
    (task,) = load_browsecomp_zh(good, expected_count=1)
    assert (task.id, task.question, task.answers, task.metadata) == (
        "browsecomp-zh:1", "哪一年？", ("1949",), {"source": "browsecomp-zh", "topic": "历史"})
    wrong = write_browsecomp(tmp_path / "wrong.xlsx", [
        ("历史", "哪一年？", "1949", CANARY),
        ("历史", "哪一个城市最先建成？", "某地", CANARY + "x"),
    ])
    with pytest.raises(DatasetError, match=r"wrong\.xlsx row 3: field 'Question' does not decrypt"):
        load_browsecomp_zh(wrong, expected_count=2)
    missing = write_browsecomp(tmp_path / "missing.xlsx", [("历史", "哪一年？", "1949", None)])
    with pytest.raises(DatasetError, match=r"missing\.xlsx row 2: the canary is missing"):
        load_browsecomp_zh(missing, expected_count=1)


def test_browsecomp_missing_column_is_named(tmp_path: Path) -> None:
    workbook = openpyxl.Workbook()
    workbook.active.append(["Topic", "Question", "Answer"])
    workbook.save(tmp_path / "cols.xlsx")
    with pytest.raises(DatasetError, match="missing column"):
        load_browsecomp_zh(tmp_path / "cols.xlsx")

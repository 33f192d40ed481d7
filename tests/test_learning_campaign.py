"""The ablation campaign's record: committed run summaries survive a fresh clone and are not rerun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import learning


def summary(before: float, after: float) -> dict[str, object]:
    return {"evals": {"0": before, "5": (before + after) / 2, "10": after}, "browse_correct": 0.5,
            "browse_wrong": 0.4, "turns": 3.0, "format": {"0": 0.9, "10": 0.8}, "wall_s": 600.0}


def test_record_feeds_the_table_and_keeps_its_runs(tmp_path: Path) -> None:
    record = tmp_path / "runs.json"
    record.write_text(json.dumps({"grpo": {"0": summary(0.10, 0.30), "1": summary(0.20, 0.30)}}))
    results = learning.report(tmp_path / "empty", None, record)
    runs = results["grpo"]["seeds"]
    assert sorted(runs) == [0, 1]
    assert runs[1]["evals"] == {0: 0.20, 5: 0.25, 10: 0.30}
    row = learning.table(results)[2]
    # mean change (+20 and +10 points) and its spread over the two seeds
    assert "| 2 |" in row and "15.0 ± 7.1" in row
    assert json.loads(record.read_text())["grpo"]["1"]["evals"]["10"] == 0.30


def test_recorded_runs_are_not_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "runs.json"
    record.write_text(json.dumps({"grpo": {"0": summary(0.10, 0.30)}}))
    trained: list[tuple[str, int]] = []
    monkeypatch.setattr(learning, "train", lambda arm, seed, _out, _extra: trained.append((arm, seed)) or 0.0)
    monkeypatch.setattr(sys, "argv", ["learning.py", "--arms", "grpo", "--seeds", "2", "--out",
                                      str(tmp_path / "out"), "--record", str(record)])
    learning.main()
    assert trained == [("grpo", 1)]

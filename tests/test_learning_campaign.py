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


def test_welch_interval_uses_student_t_with_welch_degrees_of_freedom() -> None:
    assert learning.t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert learning.t_quantile(0.975, 30) == pytest.approx(2.042, abs=1e-3)
    difference, low, high = learning.welch_interval([0.30, 0.32, 0.28], [0.20, 0.25, 0.18])
    # by hand: variances of the means 1.33e-4 and 4.33e-4, 3.12 degrees of freedom, t = 3.13
    assert difference == pytest.approx(0.09) and (low, high) == (pytest.approx(0.0159, abs=5e-4),
                                                                  pytest.approx(0.1641, abs=5e-4))
    assert learning.welch_interval([0.2, 0.2], [0.1, 0.1]) == (pytest.approx(0.1),) * 3


def test_the_multihop_arms_get_their_own_table(tmp_path: Path) -> None:
    def run(before: float, after: float, uniform: float) -> dict[str, object]:
        return {**summary(before, after), "uniform": {"1": uniform, "2": uniform},
                "hops": {"0": {"2": 0.15, "3": 0.05}, "10": {"2": after + 0.05, "3": after - 0.05}}}
    record = tmp_path / "runs.json"
    record.write_text(json.dumps({
        "grpo": {"0": summary(0.10, 0.30)},
        "mh_grpo": {"0": run(0.10, 0.10, 0.9), "1": run(0.10, 0.14, 0.8)},
        "mh_igpo": {"0": run(0.10, 0.20, 0.9), "1": run(0.10, 0.22, 0.9)}}))
    doc = tmp_path / "learning.md"
    doc.write_text("# Learning\n\n<!-- learning-table -->\n<!-- learning-table -->\n\ntext\n")
    learning.report(tmp_path / "empty", doc, record)
    text = doc.read_text()
    one_hop, multihop = text.split("<!-- learning-table -->")[1], text.split("<!-- multihop-table -->")[1]
    assert "| grpo:" in one_hop and "mh_" not in one_hop
    rows = {line.split(":")[0].strip("| "): line for line in multihop.splitlines() if line.startswith("| mh_")}
    assert sorted(rows) == ["mh_grpo", "mh_igpo"]
    # IGPO 21 ± 1.4 against GRPO 12 ± 2.8: +9 points, its Welch interval, groups 90% uniform
    assert "| 21.0 ± 1.4 |" in rows["mh_igpo"] and "+9.0 [" in rows["mh_igpo"] and "| 90.0 ± 0.0 |" in rows["mh_igpo"]
    assert "| 15.0 ± 0.0 / 5.0 ± 0.0 | 26.0 ± 1.4 / 16.0 ± 1.4 |" in rows["mh_igpo"]  # before, after: 2 and 3 hops
    assert (tmp_path / "learning-multihop.png").is_file() and text.rstrip().endswith("<!-- multihop-table -->")


def test_a_run_killed_after_its_first_evaluation_is_not_finished(tmp_path: Path) -> None:
    out = tmp_path / "mh_igpo" / "seed0"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("steps: 20\neval_every: 10\n")
    row = {"step": 0.0, "eval/accuracy": 0.16}
    (out / "run.json").write_text(json.dumps({"step": 0, "history": [row]}))
    assert not learning.finished(out)
    rows = [row, *({"step": float(s), "reward/mean": 0.0} for s in range(1, 20)), {"step": 20.0, "eval/accuracy": 0.1}]
    (out / "run.json").write_text(json.dumps({"step": 20, "history": rows}))
    assert learning.finished(out)


def test_the_comparison_is_drawn_per_step_over_the_steps_every_seed_has(tmp_path: Path) -> None:
    drawn: list[tuple[list[int], list[float], list[float]]] = []

    class Axis:
        def errorbar(self, x: list[int], y: list[float], *, yerr: list[float], capsize: float, label: str,
                     **style: object) -> None:
            drawn.append((x, y, yerr))

    runs = [{"turns_by_step": {1: 5.0, 2: 4.0, 3: 6.0}}, {"turns_by_step": {1: 7.0, 2: 4.0}}]
    learning._curve(Axis(), runs, lambda r: r["turns_by_step"], "arm")
    assert drawn == [([1, 2], [6.0, 4.0], [pytest.approx(1.414, abs=1e-3), 0.0])]

    def run(after: float) -> dict[str, object]:
        return {**summary(0.10, after), "uniform": {"1": 0.5}, "hops": {"10": {"2": after, "3": 0.0}},
                "turns_by_step": {"1": 5.0, "2": 4.5}}
    record = tmp_path / "runs.json"
    record.write_text(json.dumps({"mh_grpo_lr3e5": {"0": run(0.10), "1": run(0.12)},
                                  "mh_igpo_lr3e5": {"0": run(0.14)}, "mh_grpo": {"0": run(0.02)}}))
    doc = tmp_path / "learning.md"
    doc.write_text("# Learning\n")
    results = learning.report(tmp_path / "empty", doc, record)
    assert results["mh_grpo_lr3e5"]["seeds"][1]["turns_by_step"] == {1: 5.0, 2: 4.5}  # steps back as ints
    assert (tmp_path / "learning-multihop-arms.png").stat().st_size > 10_000


def test_the_offpolicy_arms_get_their_table_with_the_gap_and_the_rate_of_the_run(tmp_path: Path) -> None:
    def run(before: float, after: float, kl: float, ratio_max: float) -> dict[str, object]:
        steps = {str(step): {"kl": kl, "k3_kl": kl / 2, "ratio_max": ratio_max, "staleness": 0.5,
                             "tokens_per_s": 100.0, "step_s": 30.0} for step in (1, 2)}
        return {**summary(before, after), "offpolicy": steps}

    record = tmp_path / "runs.json"
    record.write_text(json.dumps({
        "op_sync_fp32": {"0": run(0.10, 0.30, 0.0, 1.0), "1": run(0.20, 0.30, 0.0, 1.0)},
        "op_async": {"0": run(0.10, 0.40, 0.002, 3.0), "1": run(0.20, 0.40, 0.004, 2.0)}}))
    results = learning.report(tmp_path / "empty", None, record)
    assert not learning.table({arm: entry for arm, entry in results.items() if arm not in learning.OFFPOLICY_ARMS})[2:]
    rows = learning.offpolicy_table(results)
    fp32, stale = (next(r for r in rows if r.startswith(f"| {arm}:")) for arm in ("op_sync_fp32", "op_async"))
    # change +20 and +10 points: mean 15, t(0.975, 1) = 12.706, half-width 12.706 * 7.07 / sqrt(2) = 63.5
    assert "+15.0 [-48.5, +78.5]" in fp32
    assert "| +10.0 [+10.0, +10.0] |" in stale  # after 40 vs 30, neither varies
    assert "| 0.003 / 0.0015 | 3.00 |" in stale  # KL mean over steps and seeds, ratio max the max
    assert "| 10 | 10.0 |" in stale  # 2 steps x 100 tokens/s x 30 s over a 600 s run, 10 minutes

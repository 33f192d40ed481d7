"""The worked examples E1–E5 of docs/algorithms.md §9, run through ``turnstile credit`` on real files.

Inputs and expected values live in ``tests/fixtures/credit/``: ``eN.jsonl`` are turn records,
``eN.expected.json`` list the runs (estimator, options) and the per-turn values each must produce.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import TypedDict

import pytest

from turnstile.cluster.cli.commands import credit as credit_command
from turnstile.learner.credit import abc_sft_weight, group_normalize

FIXTURES = Path(__file__).parent / "fixtures" / "credit"
TOLERANCE = 1e-5


def turnstile_credit(*argv: str) -> int:
    """``turnstile credit ARGV`` through the command's own parser and ``run`` (the CLI minus the
    other commands' imports)."""
    parser = argparse.ArgumentParser(prog="turnstile credit")
    credit_command.add_arguments(parser)
    return credit_command.run(parser.parse_args(list(argv)))


class ExampleRun(TypedDict, total=False):
    input: str  # a turn-record file in FIXTURES
    estimator: str
    options: list[str]
    expect: dict[str, dict[str, list[float | None]]]  # trajectory name -> field -> value per turn
    stats: dict[str, float]  # batch statistics the command must print (name=value)
    segments: dict[str, list[list[int]]]  # trajectory name -> turns that must share one advantage


def expected_files() -> list[Path]:
    return sorted(FIXTURES.glob("e*.expected.json"))


def runs() -> list[object]:
    params: list[object] = []
    for path in expected_files():
        for index, run in enumerate(json.loads(path.read_text())["runs"]):
            options = "-".join(run["options"]) or "defaults"
            name = f"{path.name.split('.')[0]}-{index}-{run['estimator']}-{options}"
            params.append(pytest.param(run, id=name))
    return params


def read_output(path: Path) -> dict[str, dict]:
    return {record["name"]: record for record in map(json.loads, path.read_text().splitlines())}


def assert_close_list(actual: list[float | None], expected: list[float | None], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {actual} vs {expected}"
    for turn, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if e is None:
            assert a is None, f"{what} turn {turn}: expected null, got {a}"
        else:
            assert a is not None and abs(a - e) <= TOLERANCE, f"{what} turn {turn}: {a} vs {e}"


def test_every_example_has_fixtures() -> None:
    names = {path.name.split(".")[0] for path in expected_files()}
    assert names == {"e1", "e2", "e3", "e4", "e5"}


@pytest.mark.parametrize("run", runs())
def test_worked_example(run: ExampleRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "credited.jsonl"
    code = turnstile_credit("--estimator", run["estimator"], "--in", str(FIXTURES / run["input"]),
                            "--out", str(out), *run["options"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    records = read_output(out)
    for name, fields in run["expect"].items():
        turns = records[name]["turns"]
        for field, expected in fields.items():
            assert_close_list([turn[field] for turn in turns], expected, f"{run['input']} {name}.{field}")
        assert all(math.isfinite(turn["advantage"]) for turn in turns)
    for stat, expected in run.get("stats", {}).items():
        match = re.search(rf"{stat}=(-?[\d.]+)", printed)
        assert match, f"{stat} not reported in {printed!r}"
        assert abs(float(match.group(1)) - expected) <= TOLERANCE
    if run.get("stats") == {}:
        assert "ig_scale" not in printed
    for name, segments in run.get("segments", {}).items():
        advantages = [turn["advantage"] for turn in records[name]["turns"]]
        shared = [{advantages[t] for t in segment} for segment in segments]
        assert all(len(values) == 1 for values in shared), f"turns of a segment differ: {advantages}"
        heads = [values.pop() for values in shared]
        assert len(set(heads)) == len(heads), f"distinct segments share an advantage: {advantages}"


def test_output_keeps_every_input_field(tmp_path: Path) -> None:
    out = tmp_path / "credited.jsonl"
    source = FIXTURES / "e3.jsonl"
    assert turnstile_credit("--estimator", "abc_grpo", "--in", str(source), "--out", str(out)) == 0
    original = json.loads(source.read_text())
    written = json.loads(out.read_text())
    assert {key: value for key, value in written.items() if key != "turns"} == \
        {key: value for key, value in original.items() if key != "turns"}
    for before, after in zip(original["turns"], written["turns"], strict=True):
        assert {key: after[key] for key in before} == before
        assert set(after) - set(before) == {"advantage", "reward", "sft_weight"}


def test_e3_abc_sft_weights() -> None:
    for row in json.loads((FIXTURES / "e3.expected.json").read_text())["abc_sft_weight"]:
        assert abs(abc_sft_weight(row["score"]) - row["weight"]) <= TOLERANCE, row["events"]


def test_e5_renormalising_after_downsampling() -> None:
    case = json.loads((FIXTURES / "e5.expected.json").read_text())["group_normalize_after_drop"]
    assert_close_list(group_normalize(case["rewards"]), case["normalized"], "group_normalize")


def test_e5_gspo_sequence_ratio() -> None:
    """GSPO's ratio as the learner computes it (``learner.batch.importance_ratios``): the geometric
    mean over a round's response tokens, padding and observations masked out, differentiable."""
    torch = pytest.importorskip("torch")
    from turnstile.learner.batch import importance_ratios

    case = json.loads((FIXTURES / "e5.expected.json").read_text())["gspo_ratio"]
    new = torch.tensor([case["new"] + [0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([case["old"] + [-9.0]], dtype=torch.float64)
    [ratio] = importance_ratios(new, old, torch.tensor([[1, 1, 1, 0]]), per_sequence=True)
    assert abs(ratio.item() - case["ratio"]) <= TOLERANCE
    ratio.backward()
    assert new.grad is not None and torch.all(new.grad[0, :3] > 0) and new.grad[0, 3] == 0


def test_credit_is_wired_into_the_turnstile_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from turnstile.cluster.cli import main

    out = tmp_path / "credited.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["credit", "--estimator", "gspo_round", "--in", str(FIXTURES / "e5.jsonl"), "--out", str(out)])
    assert exit_info.value.code == 0, capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 3

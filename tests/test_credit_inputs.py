"""Bad input to ``turnstile credit``: every error names the line, field or option and writes nothing."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Protocol

import pytest

from turnstile.cluster.cli.commands import credit as credit_command
from turnstile.learner.credit import ESTIMATORS, build_estimator, estimator_class, group_by_uid, read_trajectories

GOOD = {"uid": "q", "outcome": 1.0, "turns": [{"tool": "visit", "ig_value": -2.0, "step_score": 1.8},
                                             {"tool": None, "ig_value": -1.0, "step_score": 2.0}]}


class Credit(Protocol):
    def __call__(self, lines: list[str], *argv: str) -> tuple[int, str, Path]:
        """``turnstile credit ARGV`` on a file of ``lines``: exit code, printed text, the --out path."""


@pytest.fixture
def credit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Credit:
    def run(lines: list[str], *argv: str) -> tuple[int, str, Path]:
        source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        source.write_text("".join(line + "\n" for line in lines))
        parser = argparse.ArgumentParser(prog="turnstile credit")
        credit_command.add_arguments(parser)
        code = credit_command.run(parser.parse_args(["--in", str(source), "--out", str(out), *argv]))
        return code, capsys.readouterr().out, out
    return run


def without(obj: dict, key: str) -> dict:
    return {k: v for k, v in obj.items() if k != key}


@pytest.mark.parametrize("field", ["uid", "outcome", "turns"])
def test_missing_trajectory_field_names_line_and_field(field: str, credit: Credit) -> None:
    lines = [json.dumps(GOOD), json.dumps(without(GOOD, field))]
    code, printed, out = credit(lines, "--estimator", "grpo")
    assert code == 1
    assert f"line 2: missing field '{field}'" in printed
    assert not out.exists()


def test_missing_turn_field_names_line_turn_and_field(credit: Credit) -> None:
    broken = dict(GOOD, turns=[GOOD["turns"][0], without(GOOD["turns"][1], "tool")])
    code, printed, _ = credit([json.dumps(broken)], "--estimator", "grpo")
    assert code == 1 and "line 1, turn 1: missing field 'tool'" in printed


@pytest.mark.parametrize(("estimator", "field"), [("igpo", "ig_value"), ("abc_grpo", "step_score")])
def test_field_an_estimator_needs_is_named(estimator: str, field: str, credit: Credit) -> None:
    broken = dict(GOOD, turns=[without(turn, field) for turn in GOOD["turns"]])
    code, printed, _ = credit([json.dumps(GOOD), "", json.dumps(broken)], "--estimator", estimator)
    assert code == 1 and f"line 3, turn 0: missing field '{field}'" in printed
    assert credit([json.dumps(broken)], "--estimator", "grpo")[0] == 0  # reads neither


def test_malformed_json_line(credit: Credit) -> None:
    code, printed, out = credit([json.dumps(GOOD), json.dumps(GOOD), '{"uid": "q", "outcome": 1,'],
                                    "--estimator", "grpo")
    assert code == 1 and "line 3: not valid JSON" in printed and not out.exists()


@pytest.mark.parametrize(("line", "message"), [
    ("[1, 2]", "line 1: expected a JSON object"),
    (json.dumps(dict(GOOD, outcome="yes")), "line 1: field 'outcome' must be a finite number"),
    (json.dumps(dict(GOOD, outcome=float("nan"))), "line 1: field 'outcome' must be a finite number"),
    (json.dumps(dict(GOOD, answered="no")), "line 1: field 'answered' must be true or false"),
    (json.dumps(dict(GOOD, turns=[])), "line 1: field 'turns' must be a non-empty list"),
    (json.dumps(dict(GOOD, turns=[{"tool": 3}])), "line 1, turn 0: field 'tool' must be a tool name or null"),
])
def test_bad_values_name_line_and_field(line: str, message: str, credit: Credit) -> None:
    code, printed, _ = credit([line], "--estimator", "grpo")
    assert code == 1 and message in printed


@pytest.mark.parametrize("estimator", ESTIMATORS.names())
@pytest.mark.parametrize(("line", "message"), [
    ('{"uid": "q", "outcome": 1.0, "turns": [{"tool": "visit", "ig_value": NaN, "step_score": 1.8}, '
     '{"tool": null, "ig_value": -1.0, "step_score": 2.0}]}',
     "line 2, turn 0: field 'ig_value' must be a finite number, got NaN"),
    ('{"uid": "q", "outcome": 1.0, "note": Infinity, "turns": [{"tool": null, "ig_value": -1.0, "step_score": 2.0}]}',
     "line 2: field 'note' must be a finite number, got Infinity"),
    ('{"uid": "q", "outcome": 1.0, "turns": [{"tool": "visit", "ig_value": -2.0, "step_score": 1.8}, '
     '{"tool": null, "ig_value": -1.0, "step_score": 2.0, "debug": {"logprobs": [-1.0, -Infinity]}}]}',
     "line 2, turn 1: field 'debug.logprobs[1]' must be a finite number, got -Infinity"),
    ('{"uid": "q", "outcome": 1.0, "turns": [{"tool": null, "ig_value": -1.0, "step_score": 1e999}]}',
     "line 2, turn 0: field 'step_score' must be a finite number, got Infinity"),
])
def test_non_finite_numbers_are_refused_in_any_field_by_every_estimator(
        estimator: str, line: str, message: str, credit: Credit) -> None:
    """Python's JSON reader takes NaN and Infinity; the writer refuses them. Every estimator must
    reject them at read time, naming line and field, whether it reads the field or passes it on."""
    code, printed, out = credit([json.dumps(GOOD), line], "--estimator", estimator)
    assert code == 1, printed
    assert printed.splitlines() == [printed.strip()]  # one line, no traceback
    assert message in printed and "JSON has no NaN or Infinity" in printed
    assert not out.exists()


def test_ig_value_null_on_some_turns_only_is_an_error(credit: Credit) -> None:
    mixed = dict(GOOD, turns=[dict(GOOD["turns"][0], ig_value=None), GOOD["turns"][1]])
    code, printed, _ = credit([json.dumps(mixed)], "--estimator", "igpo")
    assert code == 1 and "line 1: field 'ig_value' is null on some turns" in printed


def test_ig_value_null_on_every_turn_turns_information_gain_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    off = dict(GOOD, turns=[dict(turn, ig_value=None) for turn in GOOD["turns"]])
    source.write_text(json.dumps(GOOD) + "\n" + json.dumps(off) + "\n")
    with caplog.at_level(logging.WARNING):
        [credit] = build_estimator("igpo").assign(group_by_uid(read_trajectories(source))).groups
    assert [turn.extras["ig"] for turn in credit[1]] == [None, None]
    assert [turn.reward for turn in credit[1]] == [None, 1.0]
    assert "line 2: v is null on every turn" in caplog.text


def test_unknown_estimator(credit: Credit) -> None:
    code, printed, _ = credit([json.dumps(GOOD)], "--estimator", "ppo")
    assert code == 2
    assert "unknown estimator 'ppo'; known: abc_grpo, grpo, gspo_round, igpo" in printed
    with pytest.raises(KeyError, match="unknown estimator 'ppo'; known: abc_grpo, grpo, gspo_round, igpo"):
        estimator_class("ppo")


@pytest.mark.parametrize(("estimator", "option", "message"), [
    ("grpo", "eta=0.5", "unknown option 'eta' for estimator grpo; its options are: format_penalty"),
    ("igpo", "gama=0.9", "unknown option 'gama' for estimator igpo"),
    ("abc_grpo", "eta=0.3", "unknown option 'eta' for estimator abc_grpo; its options are: gamma, norm"),
    ("abc_grpo", "norm=scaled_separate", "IG-Scale is igpo's; abc_grpo takes joint or separate"),
    ("igpo", "norm=pooled", "bad value for 'norm'"),
    ("igpo", "ig_type=kl", "bad value for 'ig_type'"),
    ("igpo", "ig_tools=visit", "bad value for 'ig_tools'"),
    ("igpo", "gamma=fast", "bad value for 'gamma'"),
    ("abc_grpo", "gamma=1.5", "gamma=1.5: the discount must be in [0, 1]"),
    ("igpo", "s_max=0", "s_max=0.0: must be a finite number > 0"),
    ("gspo_round", "format_penalty=-1", "format_penalty=-1.0: must be a finite number >= 0"),
    ("igpo", "gamma", "override 'gamma' is not key=value"),
])
def test_bad_option_is_named(estimator: str, option: str, message: str, credit: Credit) -> None:
    code, printed, out = credit([json.dumps(GOOD)], "--estimator", estimator, option)
    assert code == 2 and message in printed, printed
    assert not out.exists()


@pytest.mark.parametrize("option", ["ig_tools=[]", "ig_tools=[visit,search]", "norm=separate",
                                    "ig_type=prob_diff", "format_penalty=0"])
def test_good_igpo_options_are_accepted(option: str, credit: Credit) -> None:
    code, printed, out = credit([json.dumps(GOOD)] * 2, "--estimator", "igpo", option)
    assert code == 0, printed
    assert len(out.read_text().splitlines()) == 2


def test_missing_input_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    credit_command.add_arguments(parser)
    args = parser.parse_args(["--estimator", "grpo", "--in", str(tmp_path / "absent.jsonl"),
                              "--out", str(tmp_path / "out.jsonl")])
    assert credit_command.run(args) == 1
    assert "absent.jsonl: no such file" in capsys.readouterr().out


def test_a_scored_rollout_file_is_a_turn_record_file(tmp_path: Path) -> None:
    # One trajectory format: `turnstile credit` reads the rollout's own lines (turns inside
    # segments, stop_reason, the same field names) and gives what credit on the objects gives.
    from turnstile.learner.credit import build_estimator
    from turnstile.learner.credit.assign import assign_credit
    from turnstile.learner.credit.records import credited_records, group_by_uid, read_trajectories
    from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn, save_trajectories

    def episode(sample: int, outcome: float, answered: bool) -> Trajectory:
        turns = [Turn(index=i, response_ids=[1], response_logprobs=[0.0], weights_version=0, context_len=1,
                      finish_reason="stop", action=action, tool=tool, format_ok=True, ig_value=value)
                 for i, (action, tool, value) in enumerate([("tool_call", "search", -2.0), ("tool_call", "visit", -1.5),
                                                           ("answer", "search", -0.5)])]
        return Trajectory(uid="g", sample=sample, task_id="t", question="q?", answers=["a"], outcome=outcome,
                          segments=[Segment(prompt_ids=[0], turns=turns[:2]), Segment(prompt_ids=[0], turns=turns[2:])],
                          stop_reason=StopReason.ANSWERED if answered else StopReason.NO_ANSWER)

    rolled = [episode(0, 1.0, True), episode(1, 0.0, True), episode(2, 0.0, False)]
    save_trajectories(rolled, tmp_path / "scored.jsonl")
    estimator = build_estimator("igpo")
    assign_credit(rolled, estimator)
    groups = group_by_uid(read_trajectories(tmp_path / "scored.jsonl"))
    assert [t.answered for t in groups[0].trajectories] == [True, True, False]
    assert [turn.called_tool for turn in groups[0].trajectories[0].turns] == ["search", "visit", None]
    written = credited_records(groups, estimator.assign(groups).groups)
    assert [[turn["advantage"] for segment in row["segments"] for turn in segment["turns"]] for row in written] == \
        [[turn.advantage for turn in t.turns] for t in rolled]
    assert "turns" not in written[0] and [len(segment["turns"]) for segment in written[0]["segments"]] == [2, 1]

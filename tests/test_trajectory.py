"""Trajectory JSONL: round trip, and bad files fail with the line number and the field at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnstile.rollout.trajectory import (
    Segment,
    StopReason,
    Trajectory,
    TrajectoryError,
    Turn,
    load_trajectories,
    save_trajectories,
)


def sample_trajectory(uid: str = "q1", sample: int = 0) -> Trajectory:
    first = Turn(index=0, response_ids=[5, 6, 2], response_logprobs=[-0.5, -1.25, -0.1],
                 weights_version=3, context_len=4, finish_reason="stop", response_text="<think>a</think>",
                 action="tool_call", tool="search", arguments={"query": ["x"]}, format_ok=True,
                 observation_text="<tool_response>\nhit\n</tool_response>", observation_ids=[9, 9],
                 tool_ok=True, generate_s=0.01, tool_s=0.002)
    last = Turn(index=1, response_ids=[7, 2], response_logprobs=[-0.3, -0.2], weights_version=4,
                context_len=9, finish_reason="stop", action="answer", format_ok=True, answer="Ada",
                ig_value=-1.5, events=["found:c1"])
    return Trajectory(uid=uid, sample=sample, task_id=uid, question="Who?", answers=["Ada"],
                      segments=[Segment(prompt_ids=[1, 2, 3, 4], turns=[first, last])],
                      stop_reason=StopReason.ANSWERED, answer="Ada", metadata={"kind": "chain"})


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    originals = [sample_trajectory("q1", 0), sample_trajectory("q1", 1)]
    assert save_trajectories(originals, path) == 2
    loaded = load_trajectories(path)
    assert loaded == originals
    segment = loaded[0].segments[0]
    assert segment.flat_ids() == [1, 2, 3, 4, 5, 6, 2, 9, 9, 7, 2] and len(segment) == 11
    assert [t.weights_version for t in loaded[0].turns] == [3, 4]


def write(tmp_path: Path, records: list[object]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def good() -> dict:
    return sample_trajectory().to_json()  # type: ignore[return-value]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.pop("uid"), "field 'trajectory.uid' is missing"),
    (lambda r: r.update(sample="0"), "field 'trajectory.sample': expected int"),
    (lambda r: r.update(stop_reason="finished"), "'stop_reason': 'finished' is not one of"),
    (lambda r: r.update(schema=99), "version 99 is not supported"),
    (lambda r: r.update(colour="red"), "field 'trajectory.colour' is not part of the schema"),
    (lambda r: r["segments"][0]["turns"][1].pop("weights_version"),
     "field 'segments[0].turns[1].weights_version' is missing"),
    (lambda r: r["segments"][0]["turns"][0]["response_logprobs"].pop(),
     "'segments[0].turns[0].response_logprobs': 2 values for 3 response ids"),
    (lambda r: r["segments"][0]["prompt_ids"].append(-3),
     "'segments[0].prompt_ids[4]': token ids are non-negative integers"),
    (lambda r: r["segments"][0]["turns"][0].update(format_ok=1), "expected bool"),
    (lambda r: r["segments"][0]["turns"][0]["response_logprobs"].__setitem__(0, "nan"),
     "expected a finite number"),
    (lambda r: r.update(segments={}), "field 'trajectory.segments': expected list"),
])
def test_bad_records_name_line_and_field(tmp_path: Path, mutate, message: str) -> None:  # noqa: ANN001
    record = good()
    mutate(record)
    path = write(tmp_path, [good(), record])
    with pytest.raises(TrajectoryError) as info:
        load_trajectories(path)
    assert f"{path}:2:" in str(info.value) and message in str(info.value), str(info.value)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    path = write(tmp_path, [good(), "", "{truncated"])
    with pytest.raises(TrajectoryError, match=r"bad\.jsonl:3: not valid JSON"):
        load_trajectories(path)
    with pytest.raises(TrajectoryError, match="does not exist"):
        load_trajectories(tmp_path / "none.jsonl")


def test_nan_is_never_written(tmp_path: Path) -> None:
    trajectory = sample_trajectory()
    trajectory.turns[0].response_logprobs[0] = float("nan")
    with pytest.raises(ValueError):
        save_trajectories([trajectory], tmp_path / "nan.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_a_record_without_stop_reason_is_a_trajectory_error() -> None:
    from turnstile.rollout.trajectory import Trajectory, TrajectoryError

    record = {"uid": "u", "sample": 0, "task_id": "t", "question": "q", "answers": [], "segments": []}
    with pytest.raises(TrajectoryError, match="stop_reason' is missing"):
        Trajectory.from_json(record)

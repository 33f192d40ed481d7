"""The trajectory data model and its JSONL form (documented in docs/trajectory.md).

A :class:`Trajectory` is one episode: the task, its group id (``uid``: the G samples of one prompt
share it) and its segments. A :class:`Segment` is one model context — the prompt ids it started
from and the turns generated in it — and becomes exactly one training sample. A :class:`Turn` is one
assistant turn with everything needed to train on it and to audit it: the ids and log-probs as
generated, the weights version that generated them, the observation ids appended after it, and the
reward fields that the reward service fills in later.

Token-in/token-out invariant: a segment's flattened ids are its prompt ids followed, for each turn,
by the turn's response ids and then its observation ids. Nothing is ever re-tokenised.

One trajectory per JSONL line. Loading checks every field and reports the line number and the
field path at fault.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, TypeVar

from turnstile.envs.files import atomic_write
from turnstile.envs.protocol import StopReason
from turnstile.envs.tools.base import Fault, JsonObject, JsonValue

SCHEMA_VERSION = 1
T = TypeVar("T")


@dataclass
class Turn:
    index: int  # position in the trajectory (0-based, across segments)
    # A turn of a turn-record file (learner/credit/records.py) has no tokens: these default to none.
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weights_version: int = 0
    context_len: int = 0  # tokens of the context the response was generated from
    finish_reason: str = "stop"
    response_text: str = ""
    action: str = "malformed"  # "tool_call" | "answer" | "malformed"
    tool: str | None = None
    arguments: JsonObject | None = None
    format_ok: bool = False
    format_errors: list[str] = field(default_factory=list)
    answer: str | None = None
    observation_text: str = ""
    observation_ids: list[int] = field(default_factory=list)
    forced_final: bool = False
    tool_ok: bool | None = None
    tool_error: str | None = None
    tool_fault: str | None = None  # a failed call: "policy" or "environment" (envs.tools.base.Fault)
    tool_cached: bool = False
    generate_s: float = 0.0
    tool_s: float = 0.0
    # Filled by the reward service and the credit assignment:
    ig_value: float | None = None  # v_s measured before this turn (docs/algorithms.md §4)
    ig_version: int | None = None  # the weights version that measured ig_value on the engine (rollout/probes.py)
    ig: float | None = None  # information gain assigned to this turn
    reward: float | None = None  # turn reward before normalisation
    step_score: float | None = None  # ABC step score (docs/algorithms.md §6)
    events: list[str] = field(default_factory=list)
    advantage: float | None = None

    @property
    def called_tool(self) -> str | None:
        """The tool this turn called, None for an answer or a malformed turn."""
        return self.tool if self.action == "tool_call" else None


@dataclass
class Segment:
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)

    def flat_ids(self) -> list[int]:
        """The whole context of this segment: prompt, then each response and observation."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids.extend(turn.response_ids)
            ids.extend(turn.observation_ids)
        return ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + sum(len(t.response_ids) + len(t.observation_ids)
                                          for t in self.turns)


@dataclass
class Trajectory:
    uid: str  # group id: the G samples of one task share it
    sample: int  # index within the group
    task_id: str
    question: str
    answers: list[str]
    segments: list[Segment] = field(default_factory=list)
    stop_reason: StopReason = StopReason.NO_ANSWER
    answer: str | None = None
    context_manager: str = "mono"
    policy: str = ""  # model or engine name, for people reading the file
    wall_s: float = 0.0
    outcome: float | None = None  # filled by the reward service
    metadata: dict[str, JsonValue] = field(default_factory=dict)

    @property
    def turns(self) -> list[Turn]:
        return [turn for segment in self.segments for turn in segment.turns]

    @property
    def answered(self) -> bool:
        return self.stop_reason is StopReason.ANSWERED

    def to_json(self) -> JsonObject:
        record: JsonObject = {"schema": SCHEMA_VERSION}
        record.update(asdict(self))
        record["stop_reason"] = self.stop_reason.value
        return record

    @classmethod
    def from_json(cls, record: object) -> Trajectory:
        """Build from a decoded JSON object; raises TrajectoryError naming the field at fault."""
        return _trajectory(record)


class TrajectoryError(ValueError):
    """A trajectory record is malformed; the message names the line and the field."""


# ---- files ---------------------------------------------------------------------------------------

def save_trajectories(trajectories: Iterable[Trajectory], path: str | Path) -> int:
    """Write one trajectory per line, replacing the file; returns the count. A trajectory that cannot
    be written (a NaN log-prob) fails the call and leaves no file behind."""
    count = 0
    with atomic_write(path) as out:
        for trajectory in trajectories:
            write_trajectory(trajectory, out)
            count += 1
    return count


def write_trajectory(trajectory: Trajectory, out: IO[str]) -> None:
    out.write(json.dumps(trajectory.to_json(), ensure_ascii=False, allow_nan=False) + "\n")


def iter_trajectories(path: str | Path) -> Iterator[Trajectory]:
    path = Path(path)
    if not path.is_file():
        raise TrajectoryError(f"trajectory file {path} does not exist")
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrajectoryError(f"{path}:{number}: not valid JSON ({exc.msg} at column "
                                      f"{exc.colno})") from None
            try:
                yield _trajectory(record)
            except TrajectoryError as exc:
                raise TrajectoryError(f"{path}:{number}: {exc}") from None


def load_trajectories(path: str | Path) -> list[Trajectory]:
    return list(iter_trajectories(path))


# ---- validation ----------------------------------------------------------------------------------

def _trajectory(record: object) -> Trajectory:
    obj = _object(record, "trajectory")
    schema = obj.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise TrajectoryError(f"field 'schema': version {schema!r} is not supported "
                              f"(this turnstile reads version {SCHEMA_VERSION})")
    _known(obj, Trajectory, "trajectory", extra={"schema"})
    stop_value = _get(obj, "stop_reason", str, "trajectory")  # a missing field raises TrajectoryError here
    try:
        stop = StopReason(stop_value)
    except ValueError:
        known = ", ".join(r.value for r in StopReason)
        raise TrajectoryError(f"field 'stop_reason': {stop_value!r} is not one of {known}") from None
    segments = [_segment(item, f"segments[{i}]")
                for i, item in enumerate(_get(obj, "segments", list, "trajectory"))]
    return Trajectory(
        uid=_get(obj, "uid", str, "trajectory"),
        sample=_get(obj, "sample", int, "trajectory"),
        task_id=_get(obj, "task_id", str, "trajectory"),
        question=_get(obj, "question", str, "trajectory"),
        answers=_str_list(_get(obj, "answers", list, "trajectory"), "answers"),
        segments=segments,
        stop_reason=stop,
        answer=_optional(obj, "answer", str, "trajectory"),
        context_manager=_get(obj, "context_manager", str, "trajectory", default="mono"),
        policy=_get(obj, "policy", str, "trajectory", default=""),
        wall_s=_number(obj, "wall_s", "trajectory", default=0.0),
        outcome=_optional_number(obj, "outcome", "trajectory"),
        metadata=_get(obj, "metadata", dict, "trajectory", default={}),
    )


def _segment(record: object, where: str) -> Segment:
    obj = _object(record, where)
    _known(obj, Segment, where)
    turns = [_turn(item, f"{where}.turns[{i}]")
             for i, item in enumerate(_get(obj, "turns", list, where))]
    return Segment(prompt_ids=_ids(_get(obj, "prompt_ids", list, where), f"{where}.prompt_ids"),
                   turns=turns)


def _turn(record: object, where: str) -> Turn:
    obj = _object(record, where)
    _known(obj, Turn, where)
    response_ids = _ids(_get(obj, "response_ids", list, where), f"{where}.response_ids")
    logprobs = [_finite(v, f"{where}.response_logprobs[{i}]")
                for i, v in enumerate(_get(obj, "response_logprobs", list, where))]
    if len(logprobs) != len(response_ids):
        raise TrajectoryError(f"field '{where}.response_logprobs': {len(logprobs)} values for "
                              f"{len(response_ids)} response ids")
    return Turn(
        index=_get(obj, "index", int, where),
        response_ids=response_ids,
        response_logprobs=logprobs,
        weights_version=_get(obj, "weights_version", int, where),
        context_len=_get(obj, "context_len", int, where),
        finish_reason=_get(obj, "finish_reason", str, where),
        response_text=_get(obj, "response_text", str, where, default=""),
        action=_get(obj, "action", str, where, default="malformed"),
        tool=_optional(obj, "tool", str, where),
        arguments=_optional(obj, "arguments", dict, where),
        format_ok=_get(obj, "format_ok", bool, where, default=False),
        format_errors=_str_list(_get(obj, "format_errors", list, where, default=[]),
                                f"{where}.format_errors"),
        answer=_optional(obj, "answer", str, where),
        observation_text=_get(obj, "observation_text", str, where, default=""),
        observation_ids=_ids(_get(obj, "observation_ids", list, where, default=[]),
                             f"{where}.observation_ids"),
        forced_final=_get(obj, "forced_final", bool, where, default=False),
        tool_ok=_optional(obj, "tool_ok", bool, where),
        tool_error=_optional(obj, "tool_error", str, where),
        tool_fault=_fault(obj, where),
        tool_cached=_get(obj, "tool_cached", bool, where, default=False),
        generate_s=_number(obj, "generate_s", where, default=0.0),
        tool_s=_number(obj, "tool_s", where, default=0.0),
        ig_value=_optional_number(obj, "ig_value", where),
        ig_version=_optional(obj, "ig_version", int, where),
        ig=_optional_number(obj, "ig", where),
        reward=_optional_number(obj, "reward", where),
        step_score=_optional_number(obj, "step_score", where),
        events=_str_list(_get(obj, "events", list, where, default=[]), f"{where}.events"),
        advantage=_optional_number(obj, "advantage", where),
    )


class _Missing(enum.Enum):
    """The default of a field that must be present."""

    MISSING = enum.auto()


_MISSING = _Missing.MISSING


def _object(record: object, where: str) -> dict[str, JsonValue]:
    if not isinstance(record, dict):
        raise TrajectoryError(f"field '{where}': expected an object, got {type(record).__name__}")
    return record


def _known(obj: dict[str, JsonValue], cls: type, where: str, extra: set[str] | None = None) -> None:
    allowed = {f.name for f in fields(cls)} | (extra or set())
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise TrajectoryError(f"field '{where}.{unknown[0]}' is not part of the schema "
                              "(see docs/trajectory.md)")


def _get(obj: dict[str, JsonValue], key: str, kind: type[T], where: str,
         default: T | _Missing = _MISSING) -> T:
    if key not in obj:
        if default is _MISSING:
            raise TrajectoryError(f"field '{where}.{key}' is missing")
        return default
    value = obj[key]
    # bool is a subclass of int: an int field must not accept true/false.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TrajectoryError(f"field '{where}.{key}': expected {kind.__name__}, got "
                              f"{type(value).__name__}")
    return value


def _optional(obj: dict[str, JsonValue], key: str, kind: type[T], where: str) -> T | None:
    if obj.get(key) is None:
        return None
    return _get(obj, key, kind, where)


def _finite(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TrajectoryError(f"field '{where}': expected a finite number, got {value!r}")
    return float(value)


def _number(obj: dict[str, JsonValue], key: str, where: str, default: float) -> float:
    return _finite(obj[key], f"{where}.{key}") if key in obj else default


def _fault(obj: dict[str, JsonValue], where: str) -> str | None:
    value = _optional(obj, "tool_fault", str, where)
    if value is not None and value not in set(Fault):
        raise TrajectoryError(f"field '{where}.tool_fault': expected one of {', '.join(Fault)} or null, "
                              f"got {value!r}")
    return value


def _optional_number(obj: dict[str, JsonValue], key: str, where: str) -> float | None:
    return None if obj.get(key) is None else _finite(obj[key], f"{where}.{key}")


def _ids(values: list[JsonValue], where: str) -> list[int]:
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TrajectoryError(f"field '{where}[{i}]': token ids are non-negative integers, "
                                  f"got {value!r}")
    return values  # type: ignore[return-value]


def _str_list(values: list[JsonValue], where: str) -> list[str]:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise TrajectoryError(f"field '{where}[{i}]': expected a string, got {type(value).__name__}")
    return values  # type: ignore[return-value]

"""Turn records: the file format of ``turnstile credit``, read into the rollout's own trajectories.

One trajectory per JSONL line, only what credit assignment needs, so that an estimator can be run
and checked on a hand-written file without the rollout's token-level trajectory format::

    {"uid": "q17", "outcome": 1.0, "answered": true,
     "turns": [{"tool": "search", "format_ok": true, "ig_value": -2.5, "step_score": 1.8}, ...]}

``answered`` and ``format_ok`` default to true; ``ig_value`` (the information-gain value measured
before the turn, docs/algorithms.md §4) and ``step_score`` (the clue step score, §6) are read by the
estimators that need them. The names are the rollout trajectory's own (``rollout/trajectory.py``),
and a trajectory line (``docs/trajectory.md``: turns inside ``segments``, ``stop_reason``) is read
as its record, so a scored rollout file is a turn-record file too. Every other field, of the
trajectory or of a turn, is kept and written back unchanged; the estimator adds ``advantage`` and
``reward`` (and its own fields) to every turn. Every number in the file, in any field, must be
finite: JSON has no ``NaN`` or ``Infinity``, and neither is written.

A line is read into a :class:`Record`: a :class:`turnstile.rollout.trajectory.Trajectory` (the type every
estimator takes) without tokens, which keeps its line for messages and the object as read, so that
the credit is written back into it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from turnstile.envs.files import atomic_write
from turnstile.envs.protocol import StopReason
from turnstile.rollout.trajectory import Segment, Trajectory, Turn


class CreditInputError(ValueError):
    """A turn-record file the estimators cannot use; the message names the line and field."""


@dataclass
class Record(Trajectory):
    """A trajectory read from a turn-record file: the rollout's own type, holding what credit
    assignment reads, with the line it came from (``line``, 1-based, for messages) and the object as
    read (``fields``, extra keys included), to be written back with the credit."""

    line: int = 0
    fields: Mapping[str, object] = field(default_factory=dict)

    @property
    def turn_fields(self) -> list[Mapping[str, object]]:
        """Each turn's object as read."""
        if "turns" in self.fields or "segments" not in self.fields:
            return cast("list[Mapping[str, object]]", self.fields["turns"])
        return cast("list[Mapping[str, object]]", _segment_turns(dict(self.fields), origin(self)))


def origin(trajectory: Trajectory) -> str:
    """Where a trajectory came from, for messages: its line in a turn-record file, or its uid and
    sample."""
    if isinstance(trajectory, Record):
        return f"line {trajectory.line}"
    return f"trajectory {trajectory.uid}/{trajectory.sample}"


def turn_numbers(trajectory: Trajectory, name: str, *, why: str) -> list[float | None]:
    """Field ``name`` (``ig_value``, ``step_score``) of every turn, as floats.

    Either every turn has a number, or every turn has ``null`` (the reward that fills the field
    could not score this trajectory; the estimator then leaves that reward out). A missing key (in a
    turn-record file), a mix, or a value that is not a finite number is an error naming the line or
    trajectory, turn and field; ``why`` tells the user what the field is for.
    """
    read = trajectory.turn_fields if isinstance(trajectory, Record) else None
    values: list[float | None] = []
    for position, turn in enumerate(trajectory.turns):
        at = f"{origin(trajectory)}, turn {turn.index}"
        if read is not None and name not in read[position]:
            raise CreditInputError(f"{at}: missing field '{name}' ({why})")
        value = read[position][name] if read is not None else getattr(turn, name)
        values.append(None if value is None else _finite(value, at, name))
    if any(v is None for v in values) and not all(v is None for v in values):
        raise CreditInputError(f"{origin(trajectory)}: field '{name}' is null on some turns and set on "
                               f"others; set it on every turn, or null on every turn to leave it out")
    return values


@dataclass(frozen=True)
class Group:
    """The G trajectories of one prompt (same ``uid``): the unit every estimator normalises over."""

    uid: str
    trajectories: tuple[Trajectory, ...]


@dataclass(frozen=True)
class TurnCredit:
    """What an estimator writes on one turn.

    ``reward`` is the turn's reward before normalisation, ``None`` where the turn carries none;
    ``extras`` are further per-turn fields of the estimator (``ig``, ``sft_weight``).
    """

    advantage: float
    reward: float | None
    extras: Mapping[str, float | None] = field(default_factory=dict)


TrajectoryCredit = list[TurnCredit]
GroupCredit = list[TrajectoryCredit]


def parse_trajectory(text: str, line: int) -> Record:
    """One JSONL line as a trajectory; errors name ``line`` and the field and say what to write.

    Python's JSON reader accepts ``NaN``, ``Infinity`` and ``-Infinity`` (and turns ``1e999`` into
    infinity), which JSON does not allow and the output writer refuses: a non-finite number in any
    field, read by the estimator or only passed through, is an error here, before any work is done.
    """
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            _reject_non_finite(obj, line)
    except json.JSONDecodeError as error:
        raise CreditInputError(f"line {line}: not valid JSON ({error.msg}, column {error.colno}); "
                               f"each line must be one trajectory object") from None
    except RecursionError:
        raise CreditInputError(f"line {line}: nested too deeply to be a trajectory record") from None
    return trajectory_from_object(obj, line)


_JSON_SPELLING = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _reject_non_finite(obj: dict[str, object], line: int) -> None:
    """Raise naming the line, the turn and the field path of the first non-finite number."""
    found = _first_non_finite(obj, ())
    if found is None:
        return
    path, value = found
    where = f"line {line}"
    if len(path) >= 3 and path[0] == "turns" and isinstance(path[1], int):
        where, path = f"{where}, turn {path[1]}", path[2:]
    name = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")
    raise CreditInputError(f"{where}: field '{name}' must be a finite number, got "
                           f"{_JSON_SPELLING[repr(value)]}; JSON has no NaN or Infinity (write null "
                           f"where there is no value)")


def _first_non_finite(value: object, path: tuple[str | int, ...]
                      ) -> tuple[tuple[str | int, ...], float] | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    keyed: list[tuple[str | int, object]] = []
    if isinstance(value, dict):
        keyed = list(value.items())
    elif isinstance(value, list):
        keyed = list(enumerate(value))
    for key, item in keyed:
        found = _first_non_finite(item, (*path, key))
        if found is not None:
            return found
    return None


def trajectory_from_object(obj: object, line: int) -> Record:
    """A decoded JSON object as a trajectory (see the module docstring for the fields)."""
    where = f"line {line}"
    if not isinstance(obj, dict):
        raise CreditInputError(f"{where}: expected a JSON object with uid, outcome and turns, "
                               f"got {type(obj).__name__}")
    uid = _required(obj, "uid", where)
    if not isinstance(uid, str) or not uid:
        raise CreditInputError(f"{where}: field 'uid' must be a non-empty string (the group id)")
    outcome = _finite(_required(obj, "outcome", where), where, "outcome")
    try:  # a trajectory line says why it ended; a turn record may say only whether it answered
        stop = StopReason(obj.get("stop_reason", StopReason.ANSWERED.value))
    except ValueError:
        known = ", ".join(reason.value for reason in StopReason)
        raise CreditInputError(f"{where}: field 'stop_reason' must be one of {known}, "
                               f"got {obj.get('stop_reason')!r}") from None
    answered = _boolean(obj.get("answered", stop is StopReason.ANSWERED), where, "answered")
    if answered != (stop is StopReason.ANSWERED):
        stop = StopReason.ANSWERED if answered else StopReason.NO_ANSWER
    raw_turns = _segment_turns(obj, where) if "turns" not in obj and "segments" in obj \
        else _required(obj, "turns", where)
    if not isinstance(raw_turns, list) or not raw_turns:
        raise CreditInputError(f"{where}: field 'turns' must be a non-empty list of turn objects")
    turns = [_turn(raw, index, where) for index, raw in enumerate(raw_turns)]
    return Record(uid=uid, sample=line, task_id="", question="", answers=[], outcome=outcome,
                  stop_reason=stop, segments=[Segment(prompt_ids=[], turns=turns)], line=line, fields=obj)


def _segment_turns(obj: dict[str, object], where: str) -> list[object]:
    """The turns of a rollout trajectory line, across its segments, in order."""
    segments = obj["segments"]
    if not isinstance(segments, list) or not all(
            isinstance(segment, dict) and isinstance(segment.get("turns"), list) for segment in segments):
        raise CreditInputError(f"{where}: field 'segments' must be a list of objects with 'turns' lists")
    return [turn for segment in segments for turn in segment["turns"]]


def read_trajectories(path: str | Path) -> list[Record]:
    """Every trajectory of a turn-record file, in file order; blank lines are skipped."""
    trajectories = []
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if text.strip():
                trajectories.append(parse_trajectory(text, number))
    if not trajectories:
        raise CreditInputError("the file holds no trajectories (one JSON object per line expected)")
    return trajectories


def group_by_uid(trajectories: Iterable[Trajectory]) -> list[Group]:
    """Groups in order of first appearance; members need not be adjacent in the file."""
    members: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        members.setdefault(trajectory.uid, []).append(trajectory)
    return [Group(uid=uid, trajectories=tuple(group)) for uid, group in members.items()]


def credited_records(groups: Sequence[Group], credit: Sequence[GroupCredit]) -> list[dict[str, object]]:
    """The trajectories (read by :func:`read_trajectories`) as JSON objects with each turn's credit
    written in, in file order."""
    rows: list[tuple[int, dict[str, object]]] = []
    for group, group_credit in zip(groups, credit, strict=True):
        for trajectory, turn_credits in zip(group.trajectories, group_credit, strict=True):
            if not isinstance(trajectory, Record):
                raise TypeError(f"{origin(trajectory)} was not read from a turn-record file")
            turns = []
            for read, turn_credit in zip(trajectory.turn_fields, turn_credits, strict=True):
                written = dict(read)
                written["reward"] = turn_credit.reward
                written["advantage"] = turn_credit.advantage
                written.update(turn_credit.extras)
                turns.append(written)
            record = dict(trajectory.fields)
            if "turns" in record or "segments" not in record:
                record["turns"] = turns
            else:  # a trajectory line: each turn back in its segment
                written_turns = iter(turns)
                segments = cast("list[dict[str, list[object]]]", record["segments"])  # as _segment_turns checked
                record["segments"] = [{**segment, "turns": [next(written_turns) for _ in segment["turns"]]}
                                      for segment in segments]
            rows.append((trajectory.line, record))
    return [record for _, record in sorted(rows, key=lambda row: row[0])]


def write_records(path: str | Path, records: Iterable[Mapping[str, object]]) -> None:
    """Write JSONL atomically, so an interrupted run never leaves half a file behind."""
    with atomic_write(path) as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")


def _turn(raw: object, index: int, where: str) -> Turn:
    where = f"{where}, turn {index}"
    if not isinstance(raw, dict):
        raise CreditInputError(f"{where}: expected a turn object, got {type(raw).__name__}")
    tool = _required(raw, "tool", where)
    if tool is not None and not isinstance(tool, str):
        raise CreditInputError(f"{where}: field 'tool' must be a tool name or null (answer or "
                               f"malformed turn), got {tool!r}")
    format_ok = _boolean(raw.get("format_ok", True), where, "format_ok")
    tool_ok = raw.get("tool_ok")  # whether the call succeeded; null or absent: not known
    if tool_ok is not None:
        tool_ok = _boolean(tool_ok, where, "tool_ok")
    action = raw.get("action", "tool_call" if tool is not None else "answer")  # a trajectory line says
    return Turn(index=index, tool=tool, action=str(action), format_ok=format_ok, tool_ok=tool_ok)


def _required(obj: Mapping[str, object], name: str, where: str) -> object:
    if name not in obj:
        raise CreditInputError(f"{where}: missing field '{name}'")
    return obj[name]


def _finite(value: object, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CreditInputError(f"{where}: field '{name}' must be a finite number, got {value!r}")
    return float(value)


def _boolean(value: object, where: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise CreditInputError(f"{where}: field '{name}' must be true or false, got {value!r}")
    return value

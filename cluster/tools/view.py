"""The trajectory viewer behind ``turnstile view``: rollout, scored or credited trajectory files (or a
training run's steps) as one self-contained HTML page that works offline.

A JSONL line of a long-horizon episode is too long to read by hand, and the questions asked of a
training step are comparative: how did the G samples of one group differ, which turns got which
advantage, where did the information gain come from. The page shows each group's samples side by
side, each turn as a row coloured by its advantage, and the full texts of a turn on click.

How the page stays fast on a 1,000-trajectory × 200-turn file (docs/benchmarks/viewer.md): each
trajectory's turns are embedded as their own ``<script type="application/json">`` tag, which the page
parses only when the trajectory is shown (or searched); at load it parses only the small index of
groups and per-trajectory summaries. The page is written while the files are read, so memory here
holds the index, never all the texts.

Hostile text: response and observation texts come from web pages and model output. In the page they
only ever reach the DOM as ``textContent``; every JSON tag escapes ``<`` as ``\\u003c`` so that no text
can close its tag; and a Content-Security-Policy lets no script run but the page's own (by hash),
and nothing load from anywhere.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import IO, TypedDict

from turnstile.envs.files import atomic_write
from turnstile.envs.tools.base import JsonObject, JsonValue
from turnstile.rollout.summary import is_correct
from turnstile.rollout.trajectory import Trajectory, TrajectoryError, Turn

DATA_MARKER = "<!-- turnstile:data -->"  # where the page template takes the embedded JSON
HASH_MARKER = "{{script_hash}}"  # the CSP hash of the page's own script
RUN_KINDS = ("scored", "rollouts", "eval")  # the trajectory folders of a training run's OUT/
STEP_FILE = re.compile(r"step(\d+)\.jsonl")

# What the page gets of each turn, one array per turn in this order (named once, in the index).
# Token ids and log-probs are left out (only their counts stay): people read the texts, and the ids
# and log-probs would only make the page larger.
TURN_FIELDS = ("index", "segment", "action", "tool", "arguments", "format_ok", "format_errors", "answer",
               "response_text", "observation_text", "ig_value", "ig", "reward", "step_score", "events",
               "advantage", "weights_version", "finish_reason", "forced_final", "tool_ok", "tool_error", "tool_fault",
               "tool_cached", "context_len", "response_tokens", "observation_tokens", "generate_s", "tool_s",
               "extras")
_SCHEMA_TURN_FIELDS = frozenset(f.name for f in fields(Turn))


class ViewError(ValueError):
    """Input the viewer cannot show; the message names the path (and line) and what to do."""


@dataclass(frozen=True)
class Source:
    """One trajectory file, shown as one entry of the page's file/step picker."""

    path: Path
    label: str
    kind: str  # "scored", "rollouts" or "eval" in a training run; "file" otherwise
    step: int | None = None


@dataclass
class PageSummary:
    """What a written page holds, for the command's closing lines."""

    path: Path
    files: int = 0
    groups: int = 0
    trajectories: int = 0
    turns: int = 0
    bytes: int = 0
    empty: list[str] = field(default_factory=list)  # labels of files without a trajectory


# ---- inputs --------------------------------------------------------------------------------------

def find_sources(paths: Sequence[str | Path]) -> list[Source]:
    """The trajectory files the arguments name: a file as itself; a training run's ``OUT/`` as its
    steps (``scored/stepN.jsonl``, ``rollouts/stepN.jsonl`` of steps not scored yet, then
    ``eval/stepN.jsonl``); any other directory as the ``*.jsonl`` files directly in it that hold
    trajectories (an eval's ``trajectories.jsonl``, not its ``results.jsonl`` or ``fleet.jsonl``)."""
    sources: list[Source] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            sources.append(Source(path=path, label=str(path), kind="file"))
        elif path.is_dir():
            found = run_sources(path) or [Source(path=p, label=str(p), kind="file")
                                          for p in sorted(path.glob("*.jsonl")) if _holds_trajectories(p)]
            if not found:
                raise ViewError(f"{path}: no trajectory files in this directory (expected *.jsonl, or a "
                                "training run's scored/, rollouts/ or eval/ folders with stepN.jsonl)")
            sources.extend(found)
        else:
            raise ViewError(f"{path}: no such file or directory")
    return sources


def _holds_trajectories(path: Path) -> bool:
    """Whether a directory's JSONL file is trajectories (its first line has their ``segments``); a
    file named on the command line is read whatever it is, and says what is wrong with it."""
    if not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as lines:
        first = lines.readline(1 << 20)
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return True  # a damaged trajectory file: read it, and say where it is damaged
    return isinstance(record, dict) and "segments" in record


def run_sources(out: Path) -> list[Source]:
    """A training run's step files, in step order; a step scored already is shown from ``scored/``
    only (it holds the same episodes as ``rollouts/``, with their rewards and advantages)."""
    steps = {kind: _step_files(out / kind) for kind in RUN_KINDS}
    training = {**{s: ("rollouts", p) for s, p in steps["rollouts"].items()},
                **{s: ("scored", p) for s, p in steps["scored"].items()}}
    sources = [Source(path=p, label=f"step {s} ({kind})", kind=kind, step=s)
               for s, (kind, p) in sorted(training.items())]
    return sources + [Source(path=p, label=f"eval step {s}", kind="eval", step=s)
                      for s, p in sorted(steps["eval"].items())]


def _step_files(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    matches = ((STEP_FILE.fullmatch(p.name), p) for p in folder.iterdir() if p.is_file())
    return {int(m.group(1)): p for m, p in matches if m}


def read_trajectories(path: Path) -> Iterator[tuple[Trajectory, list[JsonObject]]]:
    """Each trajectory of ``path`` with the turn fields the schema does not know (what an estimator
    adds, e.g. abc_grpo's ``sft_weight``), one dict per turn.

    A line that is not JSON or not a trajectory stops the reading with ``path:line`` and the field at
    fault, as ``rollout.trajectory.load_trajectories`` does: a page that silently left lines out would
    show wrong group sizes and accuracies. Blank lines are skipped, as there.
    """
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield _parse_line(line, f"{path}:{number}")
    except UnicodeDecodeError:
        raise ViewError(f"{path}: not a UTF-8 text file; give a trajectory JSONL file") from None
    except OSError as error:
        raise ViewError(f"{path}: cannot be read ({error.strerror})") from None


def _parse_line(line: str, where: str) -> tuple[Trajectory, list[JsonObject]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ViewError(f"{where}: not valid JSON ({error.msg} at column {error.colno}); "
                        "the file is corrupt or not a trajectory file") from None
    if isinstance(record, dict) and "turns" in record and "segments" not in record:
        raise ViewError(f"{where}: a turn-record line (learner/credit/records.py), not a trajectory; "
                        "view reads trajectory files (docs/trajectory.md)")
    extras = _pop_unknown_turn_fields(record)
    try:
        return Trajectory.from_json(record), extras
    except TrajectoryError as error:
        raise ViewError(f"{where}: {error}") from None


def _pop_unknown_turn_fields(record: object) -> list[JsonObject]:
    """Remove and return the non-schema fields of every turn, so that the schema check passes."""
    extras: list[JsonObject] = []
    segments = record.get("segments") if isinstance(record, dict) else None
    for segment in segments if isinstance(segments, list) else []:
        turns = segment.get("turns") if isinstance(segment, dict) else None
        for turn in turns if isinstance(turns, list) else []:
            if isinstance(turn, dict):
                extras.append({key: turn.pop(key) for key in sorted(set(turn) - _SCHEMA_TURN_FIELDS)})
    return extras


# ---- page data -----------------------------------------------------------------------------------

def turn_row(turn: Turn, segment: int, extras: JsonObject) -> list[JsonValue]:
    """One turn as the page gets it, in ``TURN_FIELDS`` order."""
    values: dict[str, JsonValue] = {
        "segment": segment, "response_tokens": len(turn.response_ids),
        "observation_tokens": len(turn.observation_ids), "extras": extras or None}
    return [values[name] if name in values else getattr(turn, name) for name in TURN_FIELDS]


class TrajectorySummary(TypedDict):
    """One trajectory in the page's group list (:func:`trajectory_summary`)."""

    key: int
    sample: int
    task_id: str
    outcome: float | None
    correct: bool
    stop_reason: str
    answer: str | None
    turns: int
    segments: int
    tools: list[str]
    advantage_range: list[float] | None
    version_range: list[int] | None
    ig_curve: list[float] | None
    context_manager: str
    policy: str
    wall_s: float
    metadata: JsonObject


class GroupSummary(TypedDict):
    """A group in the page's group list (:func:`group_summary`)."""

    uid: str
    question: str
    answers: list[str]
    trajectories: list[TrajectorySummary]
    mean_outcome: float | None
    accuracy: float
    mean_turns: float
    advantage_range: list[float] | None


class SourceEntry(TypedDict):
    """One file in the page's index (:func:`embed_source`)."""

    label: str
    path: str
    kind: str
    step: int | None
    trajectories: int
    turns: int
    max_abs_advantage: float
    groups: list[GroupSummary]


def trajectory_summary(trajectory: Trajectory, key: int) -> TrajectorySummary:
    """What the group list and the filters need of one trajectory without parsing its turns;
    ``key`` names the JSON tag that holds its turns."""
    turns = trajectory.turns
    advantages = [t.advantage for t in turns if t.advantage is not None]
    versions = [t.weights_version for t in turns]
    return {
        "key": key, "sample": trajectory.sample, "task_id": trajectory.task_id,
        "outcome": trajectory.outcome, "correct": is_correct(trajectory),
        "stop_reason": trajectory.stop_reason.value, "answer": trajectory.answer,
        "turns": len(turns), "segments": len(trajectory.segments),
        "tools": sorted({t.tool for t in turns if t.tool}),
        "advantage_range": [min(advantages), max(advantages)] if advantages else None,
        "version_range": [min(versions), max(versions)] if versions else None,
        "ig_curve": cumulative_ig(turns), "context_manager": trajectory.context_manager,
        "policy": trajectory.policy, "wall_s": trajectory.wall_s, "metadata": trajectory.metadata,
    }


def cumulative_ig(turns: Sequence[Turn]) -> list[float] | None:
    """The running sum of the turns' information gain (a turn without one adds 0); None when no turn
    has one (IG was not measured or credit was not assigned yet)."""
    if all(turn.ig is None for turn in turns):
        return None
    total, curve = 0.0, []
    for turn in turns:
        total += turn.ig or 0.0
        curve.append(round(total, 6))
    return curve


def group_summary(uid: str, question: str, answers: list[str], members: list[TrajectorySummary]) -> GroupSummary:
    """A group (the G samples of one task) with the statistics its header shows."""
    outcomes = [m["outcome"] for m in members if m["outcome"] is not None]
    ranges = [m["advantage_range"] for m in members if m["advantage_range"] is not None]
    return {
        "uid": uid, "question": question, "answers": answers, "trajectories": members,
        "mean_outcome": sum(outcomes) / len(outcomes) if outcomes else None,
        "accuracy": sum(bool(m["correct"]) for m in members) / len(members),
        "mean_turns": sum(m["turns"] for m in members) / len(members),
        "advantage_range": [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None,
    }


def embed_json(value: object) -> str:
    """JSON that is safe inside a ``<script>`` element: ``<`` only occurs inside JSON strings, where
    ``\\u003c`` means the same, and without it no text can write ``</script>`` or ``<!--``."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


# ---- the page ------------------------------------------------------------------------------------

def page_template() -> tuple[str, str]:
    """The page before and after its data, with the CSP hash of its script filled in."""
    template = resources.files(__name__.rpartition(".")[0]).joinpath("view_page.html").read_text(encoding="utf-8")
    script = template[template.rindex("<script>") + len("<script>"):template.rindex("</script>")]
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    head, tail = template.replace(HASH_MARKER, f"sha256-{digest}").split(DATA_MARKER)
    return head, tail


def write_page(sources: Sequence[Source], out: Path) -> PageSummary:
    """Write the page for ``sources`` to ``out`` (replaced only once complete)."""
    head, tail = page_template()
    summary = PageSummary(path=out)
    # A lone surrogate (a JSON "\ud800" in the input) cannot be encoded as UTF-8; written back as
    # its JSON escape it is what the input said, and it only occurs inside JSON strings.
    with atomic_write(out, errors="backslashreplace") as page:
        page.write(head)
        listings = [embed_source(source, page, summary) for source in sources]
        if summary.trajectories == 0:
            raise ViewError(f"{', '.join(s.label for s in sources)}: no trajectories in "
                            f"{'this file' if len(sources) == 1 else 'these files'}")
        index = {"turn_fields": list(TURN_FIELDS), "sources": listings,
                 "default_source": default_source(sources)}
        page.write(f'<script type="application/json" id="turnstile-index">{embed_json(index)}</script>\n')
        page.write(tail)
    summary.bytes = out.stat().st_size
    return summary


@dataclass
class _Group:
    """A group while its file is read: the task, and its samples' summaries so far."""

    question: str
    answers: list[str]
    members: list[TrajectorySummary] = field(default_factory=list)


def embed_source(source: Source, page: IO[str], summary: PageSummary) -> SourceEntry:
    """Write each trajectory's turns of ``source`` as its own JSON tag; return the file's index entry
    (its groups in order of first appearance, with the trajectories' summaries)."""
    groups: dict[str, _Group] = {}
    first, turns, largest = summary.trajectories, 0, 0.0
    for trajectory, extras in read_trajectories(source.path):
        key = summary.trajectories
        rows = turn_rows(trajectory, extras)
        page.write(f'<script type="application/json" id="turns-{key}">{embed_json(rows)}</script>\n')
        group = groups.setdefault(trajectory.uid, _Group(trajectory.question, trajectory.answers))
        group.members.append(trajectory_summary(trajectory, key))
        largest = max(largest, max_abs_advantage(trajectory))
        summary.trajectories += 1
        turns += len(rows)
    trajectories = summary.trajectories - first
    summary.files += 1
    summary.groups += len(groups)
    summary.turns += turns
    if not trajectories:
        summary.empty.append(source.label)
    return {"label": source.label, "path": str(source.path), "kind": source.kind, "step": source.step,
            "trajectories": trajectories, "turns": turns, "max_abs_advantage": largest,
            "groups": [group_summary(uid, g.question, g.answers, g.members) for uid, g in groups.items()]}


def turn_rows(trajectory: Trajectory, extras: Sequence[JsonObject]) -> list[list[JsonValue]]:
    """Every turn of ``trajectory`` as a page row; ``extras`` holds one dict per turn."""
    numbered = ((segment, turn) for segment, part in enumerate(trajectory.segments) for turn in part.turns)
    return [turn_row(turn, segment, extra) for (segment, turn), extra in zip(numbered, extras, strict=True)]


def max_abs_advantage(trajectory: Trajectory) -> float:
    """The largest |advantage| of a turn (0 without one): the page's colour scale runs to the file's."""
    return max((abs(t.advantage) for t in trajectory.turns if t.advantage is not None), default=0.0)


def default_source(sources: Sequence[Source]) -> int:
    """The entry the page opens on: a run's latest training step, else the first file."""
    training = [i for i, s in enumerate(sources) if s.kind in ("scored", "rollouts")]
    return training[-1] if training else 0

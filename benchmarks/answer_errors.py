"""What the answers of an evaluation are: right, a wrong name some tool result showed, a name no tool
result showed (invented), or none — and how many turns were malformed, with the commonest reasons.

The table in ``docs/benchmarks/learning.md`` ("What was tried next") comes from this, run on the
evaluations a training run writes (``OUT/eval/step<k>.jsonl``), one row per file:

    .venv/bin/python benchmarks/answer_errors.py OUT/eval/step0.jsonl OUT/eval/step10.jsonl

"Shown" is a case-insensitive substring test of the answer against every tool result of the episode
(the search listing and the pages it opened): a wrong name that was on screen is a wrong choice of
line or result; one that never was is drawn from the model's own distribution.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from turnstile.rollout.summary import is_correct
from turnstile.rollout.trajectory import Trajectory, load_trajectories

KINDS = ("correct", "a name on no page", "a name shown", "no answer")


def answer_kind(trajectory: Trajectory) -> str:
    """One of :data:`KINDS`."""
    if is_correct(trajectory):
        return "correct"
    answer = (trajectory.answer or "").strip().casefold()
    if not trajectory.answered or not answer:
        return "no answer"
    shown = any(answer in turn.observation_text.casefold() for turn in trajectory.turns)
    return "a name shown" if shown else "a name on no page"


def summary(trajectories: list[Trajectory]) -> dict[str, object]:
    """Counts of each answer kind, turns, malformed turns and the three commonest format errors."""
    kinds = Counter(answer_kind(t) for t in trajectories)
    turns = [turn for t in trajectories for turn in t.turns]
    reasons = Counter(error for turn in turns if not turn.format_ok for error in turn.format_errors)
    return {"episodes": len(trajectories), **{kind: kinds[kind] for kind in KINDS},
            "turns": len(turns), "malformed turns": sum(not turn.format_ok for turn in turns),
            "reasons": reasons.most_common(3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="trajectory JSONL files (an evaluation each)")
    args = parser.parse_args()
    columns = ("episodes", *KINDS, "turns", "malformed turns")
    print("| file | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    rows = [(path, summary(load_trajectories(path))) for path in args.files]
    for path, row in rows:
        print(f"| {Path(path).name} | " + " | ".join(str(row[c]) for c in columns) + " |")
    for path, row in rows:
        print(f"{Path(path).name}: commonest format errors {row['reasons']}")


if __name__ == "__main__":
    main()

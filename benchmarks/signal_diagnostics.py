"""Is the dense signal meaningful? Information gain and ABC step scores of the turns that read a
clue page, against the other turns, on the scripted expert's trajectories scored with the warm model.

The expert runs once on every held-out task of the embedded default (the same episode settings as
training). ``information_gain`` (``--model``, by default the warm start, as the scorer) measures v before
every turn; a turn's IG is v after it minus v before it (the next turn's v minus its own). The
``clue_steps`` plugin (heuristic judge) writes each turn's step score. A turn *reads a clue page*
when it opens one of the task's evidence pages (a visit); a search whose results merely list one
does not (on one-hop tasks every search lists the entity's page). Reported per signal: the mean of
the turns that read a clue page, of the searches that list one, and of the other tool turns, and a
two-sided Mann-Whitney rank test of the first group against all the other tool turns (normal
approximation with the tie correction: written here, the project does not depend on scipy for one
test).

    .venv/bin/python benchmarks/signal_diagnostics.py [--tasks 64] [--trajectories OUT/eval/step0.jsonl]

``--all-wrong RUN [RUN ...]`` reads training runs instead (``turnstile train`` output directories):
in every step's credited samples (``RUN/scored``), the groups with no correct answer, turn by turn:
where the information gain, the step scores and the advantages landed on the turns that read a clue
page, the searches that list one, the other tool turns, the failed tool calls (a page that does not
exist, a refused call), the wrong answers and the last turns of the
episodes a limit cut; and the first-turn advantage of a wrong answer against a cut episode (what
answering sooner earns where every answer is wrong).

``--by-context A.jsonl ...`` reads trajectory files (a run's ``eval/step0.jsonl``, say) and gives the
share of well-formed turns by the length of the context each turn was written from (500-token bins)
and by turn: where a model stops writing the protocol as its episodes grow.

``--advantages A.jsonl B.jsonl ...`` instead compares what each estimator tells the policy about
opening a page: in files credited by ``turnstile score`` (the same trajectories, one estimator
each), the first turn's advantage of the episodes that visit a page against those that do not,
overall and within the groups that hold both.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from turnstile.cluster.jobs.defaults import DEFAULT_TASKS
from turnstile.cluster.jobs.score import find_tasks
from turnstile.cluster.jobs.session import RayConfig, init_ray
from turnstile.cluster.recipes.warm_start import WarmStartRecipe, expert_trajectories
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.apply import score_groups
from turnstile.rollout.model_store import WARM_MODEL
from turnstile.rollout.trajectory import Trajectory


def mann_whitney(a: list[float], b: list[float]) -> tuple[float, float]:
    """U statistic's z and two-sided p (normal approximation, tie-corrected)."""
    pooled = sorted((value, group) for group, values in ((0, a), (1, b)) for value in values)
    ranks: list[float] = [0.0] * len(pooled)
    i, ties = 0, 0.0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(a), len(b)
    rank_sum = sum(rank for rank, (_, group) in zip(ranks, pooled, strict=True) if group == 0)
    u = rank_sum - n1 * (n1 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    z = (u - n1 * n2 / 2) / math.sqrt(variance) if variance > 0 else 0.0
    return z, math.erfc(abs(z) / math.sqrt(2))


GROUPS = ("reads a clue page", "search listing one", "other tool turn")


def turn_group(turn_tool: str | None, arguments: dict | None, observation: str, clue_urls: set[str]) -> str:
    if turn_tool == "visit" and arguments and str(arguments.get("url", "")) in clue_urls:
        return GROUPS[0]
    if turn_tool == "search" and any(url in observation for url in clue_urls):
        return GROUPS[1]
    return GROUPS[2]


def split_turns(trajectories: list[Trajectory], tasks: dict[str, Task]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {name: {group: [] for group in GROUPS} for name in ("ig", "step_score")}
    for trajectory in trajectories:
        task = tasks[trajectory.task_id]
        urls = {url for clue in task.clues or () for url in clue.evidence_urls}
        turns = trajectory.turns
        for turn, following in itertools.pairwise(turns):
            if not turn.tool:
                continue
            clue = turn_group(turn.tool, turn.arguments, turn.observation_text, urls)
            if turn.ig_value is not None and following.ig_value is not None:
                out["ig"][clue].append(following.ig_value - turn.ig_value)
            if turn.step_score is not None:
                out["step_score"][clue].append(turn.step_score)
    return out


def visit_advantages(trajectories: list[Trajectory]) -> dict[str, float]:
    """First-turn advantage of the episodes that open a page and of those that do not."""
    by_group: dict[str, dict[bool, list[float]]] = {}
    for trajectory in trajectories:
        advantage = trajectory.turns[0].advantage if trajectory.turns else None
        if advantage is None:
            continue
        visits = any(turn.tool == "visit" for turn in trajectory.turns)
        by_group.setdefault(trajectory.uid, {True: [], False: []})[visits].append(advantage)
    visiting = [a for group in by_group.values() for a in group[True]]
    hasty = [a for group in by_group.values() for a in group[False]]
    within = [statistics.fmean(g[True]) - statistics.fmean(g[False]) for g in by_group.values()
              if g[True] and g[False]]
    return {"visits_n": len(visiting), "visits_mean": statistics.fmean(visiting) if visiting else math.nan,
            "no_visit_n": len(hasty), "no_visit_mean": statistics.fmean(hasty) if hasty else math.nan,
            "groups_with_both": len(within), "within_mean": statistics.fmean(within) if within else math.nan}


ALL_WRONG_KINDS = (*GROUPS, "failed tool call", "wrong answer", "last turn, cut episode")


def all_wrong_turns(run: Path) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[float]], int, int]:
    """Over every step of a run, the turns of the groups with no correct sample, by kind: the IG the
    estimator credited (``ig``), the step score and the advantage; the first-turn advantage and the
    length of the wrong answers and of the cut episodes; the number of such groups and of all groups."""
    from omegaconf import OmegaConf

    from turnstile.rollout.summary import is_correct
    from turnstile.rollout.trajectory import load_trajectories

    config = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
    data = DatasetConfig(**config["rollout"]["data"])  # type: ignore[arg-type, index, call-overload]
    by_kind: dict[str, dict[str, list[float]]] = {kind: {"ig": [], "step_score": [], "advantage": []}
                                                  for kind in ALL_WRONG_KINDS}
    episodes: dict[str, list[float]] = {"wrong answer: first-turn advantage": [], "wrong answer: turns": [],
                                        "cut: first-turn advantage": [], "cut: turns": []}
    wrong_groups = total_groups = 0
    for path in sorted((run / "scored").glob("step*.jsonl")):
        trajectories = load_trajectories(path)
        tasks = find_tasks(data, trajectories)
        groups: dict[str, list[Trajectory]] = {}
        for trajectory in trajectories:
            groups.setdefault(trajectory.uid, []).append(trajectory)
        total_groups += len(groups)
        for group in groups.values():
            if any(is_correct(t) for t in group):
                continue
            wrong_groups += 1
            for trajectory in group:
                answered = trajectory.stop_reason.value == "answered"
                urls = {url for clue in tasks[trajectory.task_id].clues or () for url in clue.evidence_urls}
                turns = trajectory.turns
                prefix = "wrong answer" if answered else "cut"
                if turns and turns[0].advantage is not None:
                    episodes[f"{prefix}: first-turn advantage"].append(turns[0].advantage)
                episodes[f"{prefix}: turns"].append(float(len(turns)))
                for position, turn in enumerate(turns):
                    if position == len(turns) - 1:
                        kind = "wrong answer" if answered else "last turn, cut episode"
                    elif turn.tool_ok is False:  # a 404, a refused or malformed call: it read nothing
                        kind = "failed tool call"
                    else:
                        kind = turn_group(turn.tool, turn.arguments, turn.observation_text, urls)
                    for name, value in (("ig", turn.ig), ("step_score", turn.step_score),
                                        ("advantage", turn.advantage)):
                        if value is not None:
                            by_kind[kind][name].append(float(value))
    return by_kind, episodes, wrong_groups, total_groups


def print_all_wrong(runs: list[str]) -> None:
    def cell(values: list[float]) -> str:
        return f"{statistics.fmean(values):+.3f} ({len(values)})" if values else "-"

    for run in runs:
        by_kind, episodes, wrong, total = all_wrong_turns(Path(run))
        print(f"\n{run}: {wrong} of {total} training groups had no correct sample")
        print("| turn | information gain credited (n) | step score (n) | advantage (n) |")
        print("|---|---|---|---|")
        for kind, values in by_kind.items():
            print(f"| {kind} | {cell(values['ig'])} | {cell(values['step_score'])} | {cell(values['advantage'])} |")
        print("| episode | mean (n) |\n|---|---|")
        for name, figures in episodes.items():
            print(f"| {name} | {cell(figures)} |")


def print_by_context(paths: list[str]) -> None:
    from turnstile.rollout.trajectory import load_trajectories

    by_length: dict[int, list[bool]] = {}
    by_turn: dict[int, list[bool]] = {}
    for path in paths:
        for trajectory in load_trajectories(path):
            for turn in trajectory.turns:
                by_length.setdefault(turn.context_len // 500 * 500, []).append(turn.format_ok)
                by_turn.setdefault(turn.index, []).append(turn.format_ok)
    for title, table in (("context (tokens)", by_length), ("turn", by_turn)):
        keys = sorted(table)
        labels = [f"{k}-{k + 499}" if title.startswith("context") else str(k + 1) for k in keys]
        print(f"| {title} | {' | '.join(labels)} |\n|---|{'---|' * len(keys)}")
        print(f"| turns | {' | '.join(str(len(table[k])) for k in keys)} |")
        print(f"| well formed | {' | '.join(f'{sum(table[k]) / len(table[k]):.1%}' for k in keys)} |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--model", default=WARM_MODEL, help="the IG scorer (a model directory or name)")
    parser.add_argument("--trajectories", default="", help="score these instead (e.g. a train run's "
                        "out/eval/step0.jsonl: the warm policy's own turns, right and wrong)")
    parser.add_argument("--advantages", nargs="*", default=[], help="credited files (turnstile score) to "
                        "compare: first-turn advantage of the episodes that open a page vs the others")
    parser.add_argument("--all-wrong", nargs="*", default=[], help="train runs' output directories: where "
                        "the signals landed, turn by turn, in the groups with no correct sample")
    parser.add_argument("--by-context", nargs="*", default=[], help="trajectory files: the share of well-formed "
                        "turns by context length and by turn")
    args = parser.parse_args()
    if args.by_context:
        print_by_context(args.by_context)
        return
    if args.all_wrong:
        print_all_wrong(args.all_wrong)
        return
    if args.advantages:
        from turnstile.rollout.trajectory import load_trajectories

        print("| file | episodes that open a page: n, first-turn advantage | the others: n, advantage | "
              "groups with both | within-group difference |")
        print("|---|---|---|---|---|")
        for path in args.advantages:
            r = visit_advantages(load_trajectories(path))
            print(f"| {path} | {r['visits_n']}, {r['visits_mean']:+.3f} | {r['no_visit_n']}, "
                  f"{r['no_visit_mean']:+.3f} | {r['groups_with_both']} | {r['within_mean']:+.3f} |")
        return
    init_ray(RayConfig(num_cpus=4))
    if args.trajectories:
        from turnstile.rollout.trajectory import load_trajectories

        trajectories = load_trajectories(args.trajectories)
        source = args.trajectories
    else:
        recipe = replace(WarmStartRecipe(), corpus_ports=(0,))
        with tempfile.TemporaryDirectory() as tmp:
            trajectories = expert_trajectories(recipe, Path(tmp) / "expert.jsonl", progress=False,
                                               split="eval", limit=args.tasks)
        source = "the scripted expert on held-out tasks (all answered correctly)"
    trajectories = trajectories[:args.tasks]
    data = DatasetConfig(kind="synthetic", path="", split="eval", options=dict(DEFAULT_TASKS))
    tasks = find_tasks(data, trajectories)
    specs = [PluginSpec("information_gain", {"model": args.model}), PluginSpec("clue_steps", {"judge": "heuristic"})]
    unscored = asyncio.run(score_groups(specs, trajectories, tasks))
    if unscored:
        raise SystemExit(f"{unscored} trajectories could not be scored: {trajectories[0].metadata.get('reward_error')}")
    groups = split_turns(trajectories, tasks)
    print(f"{len(trajectories)} trajectories from {source}, {sum(len(t.turns) for t in trajectories)} "
          f"turns; IG scored by {args.model}")
    print(f"| signal | {' | '.join(f'{g}: n, mean' for g in GROUPS)} | rank test z (first vs the rest) | p |")
    print("|---|---|---|---|---|---|")
    for name, split in groups.items():
        clue = split[GROUPS[0]]
        rest = [value for group in GROUPS[1:] for value in split[group]]
        means = " | ".join(f"{len(split[g])}, {statistics.fmean(split[g]):.4f}" if split[g] else "0, -"
                           for g in GROUPS)
        if not clue or not rest:
            print(f"| {name} | {means} | - | - |")
            continue
        z, p = mann_whitney(clue, rest)
        print(f"| {name} | {means} | {z:.2f} | {p:.2g} |")

if __name__ == "__main__":
    main()

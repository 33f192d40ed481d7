"""Is the dense signal meaningful? Information gain and ABC step scores of the turns that read a
clue page, against the other turns, on the scripted expert's trajectories scored with the warm model.

The expert runs once on every held-out task of the embedded default (the same episode settings as
training). ``information_gain`` (``--model``, by default the warm start ``tiny-qwen3-sft``, as the scorer) measures v before
every turn; a turn's IG is v after it minus v before it (the next turn's v minus its own). The
``clue_steps`` plugin (heuristic judge) writes each turn's step score. A turn *reads a clue page*
when it visits one of the task's evidence pages, or its search results list one. Reported: the mean
of each group and a two-sided Mann-Whitney rank test (normal approximation with the tie correction:
written here, the project does not depend on scipy for one test).

    .venv/bin/python benchmarks/signal_diagnostics.py [--tasks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from cluster.rollout import RayConfig, init_ray
from cluster.score import find_tasks, run_plugins
from cluster.warm_start import DEFAULT_TASKS, WarmStartRecipe, expert_trajectories
from envs.datasets.registry import DatasetConfig
from envs.tasks import Task
from rewards.base import RewardSpec, build_reward
from rollout.model_store import WARM_MODEL
from rollout.trajectory import Trajectory


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


def reads_clue(turn_tool: str | None, arguments: dict | None, observation: str, clue_urls: set[str]) -> bool:
    if turn_tool == "visit" and arguments and str(arguments.get("url", "")) in clue_urls:
        return True
    return turn_tool == "search" and any(url in observation for url in clue_urls)


def split_turns(trajectories: list[Trajectory], tasks: dict[str, Task]) -> dict[str, dict[bool, list[float]]]:
    out: dict[str, dict[bool, list[float]]] = {"ig": {True: [], False: []}, "step_score": {True: [], False: []}}
    for trajectory in trajectories:
        task = tasks[trajectory.task_id]
        urls = {url for clue in task.clues for url in clue.evidence_urls}
        turns = trajectory.turns
        for turn, following in zip(turns, turns[1:], strict=False):
            if not turn.tool:
                continue
            clue = reads_clue(turn.tool, turn.arguments, turn.observation_text, urls)
            if turn.ig_value is not None and following.ig_value is not None:
                out["ig"][clue].append(following.ig_value - turn.ig_value)
            if turn.step_score is not None:
                out["step_score"][clue].append(turn.step_score)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--model", default=WARM_MODEL, help="the IG scorer (a model directory or name)")
    parser.add_argument("--trajectories", default="", help="score these instead (e.g. a train run's "
                        "out/eval/step0.jsonl: the warm policy's own turns, right and wrong)")
    args = parser.parse_args()
    init_ray(RayConfig(num_cpus=4))
    if args.trajectories:
        from rollout.trajectory import load_trajectories

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
    plugins = [build_reward(RewardSpec("information_gain", {"model": args.model})),
               build_reward(RewardSpec("clue_steps", {"judge": "heuristic"}))]
    asyncio.run(run_plugins(plugins, trajectories, tasks))
    groups = split_turns(trajectories, tasks)
    print(f"{len(trajectories)} trajectories from {source}, {sum(len(t.turns) for t in trajectories)} "
          f"turns; IG scored by {args.model}")
    print("| signal | turns reading a clue page: n, mean | other tool turns: n, mean | rank test z | p |")
    print("|---|---|---|---|---|")
    for name, split in groups.items():
        clue, other = split[True], split[False]
        if not clue or not other:
            print(f"| {name} | {len(clue)} | {len(other)} | - | - |")
            continue
        z, p = mann_whitney(clue, other)
        print(f"| {name} | {len(clue)}, {statistics.fmean(clue):.4f} | {len(other)}, "
              f"{statistics.fmean(other):.4f} | {z:.2f} | {p:.2g} |")


if __name__ == "__main__":
    main()

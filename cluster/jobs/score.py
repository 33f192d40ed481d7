"""Scoring saved trajectories: the configured reward plugins, then the configured estimator.

The offline form of the reward service: read trajectories (JSONL), find each one's task (with its
clues) in the configured dataset, run every reward plugin over each group of G samples
(:func:`turnstile.rewards.apply.score_groups`: a group a plugin fails on is written unscored, with
``metadata["reward_error"]``), assign per-turn advantages with one estimator over the scored ones,
and write them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from turnstile.envs.corpus_server import PAGE_PREFIX
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.learner.credit import estimator_from_options
from turnstile.learner.credit.assign import assign_credit
from turnstile.learner.credit.registry import CreditResult
from turnstile.rewards.apply import DEFAULT_SCORE_TIMEOUT_S, score_groups
from turnstile.rollout.trajectory import Trajectory, load_trajectories, save_trajectories


@dataclass
class ScoreJob:
    """Which tasks the trajectories answer, how to reward them, and how to assign credit."""

    data: DatasetConfig = field(default_factory=lambda: DatasetConfig(kind="synthetic", path=""))
    rewards: list[PluginSpec] = field(default_factory=lambda: [PluginSpec("exact_match"), PluginSpec("format")])
    estimator: PluginSpec = field(default_factory=lambda: PluginSpec("igpo"))
    score_timeout_s: float = DEFAULT_SCORE_TIMEOUT_S  # one reward plugin on one group


@dataclass(frozen=True)
class ScoreReport:
    trajectories: int
    groups: int
    mean_outcome: float
    stats: dict[str, float]
    unscored: int = 0  # a reward plugin failed on them: outcome None, metadata["reward_error"]


def score_file(cfg: ScoreJob, source: Path, out: Path) -> ScoreReport:
    """Score ``source`` into ``out`` (see the module docstring)."""
    return asyncio.run(score_saved(cfg, source, out))


async def score_saved(cfg: ScoreJob, source: Path, out: Path) -> ScoreReport:
    trajectories = load_trajectories(source)
    if not trajectories:
        raise ValueError(f"{source} holds no trajectories")
    estimator = estimator_from_options(cfg.estimator.kind, cfg.estimator.options)
    tasks = find_tasks(cfg.data, trajectories)
    unscored = await score_groups(cfg.rewards, trajectories, tasks, cfg.score_timeout_s)
    scored = [t for t in trajectories if t.outcome is not None]  # the unscored get no credit
    result: CreditResult = assign_credit(scored, estimator) if scored else CreditResult([])
    save_trajectories(trajectories, out)
    outcomes = [t.outcome for t in scored if t.outcome is not None]
    return ScoreReport(len(trajectories), len({t.uid for t in trajectories}),
                       sum(outcomes) / len(outcomes) if outcomes else 0.0, result.stats, unscored)


def find_tasks(data: DatasetConfig, trajectories: Sequence[Trajectory]) -> dict[str, Task]:
    """Each trajectory's task from the dataset (clues included), loaded with the page prefix the
    rollout served the corpus under; a trajectory whose task is not there gets a task built from
    its own question and answers (no clues)."""
    tasks: dict[str, Task] = {}
    by_prefix: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        base = str(trajectory.metadata.get("corpus_url", ""))
        by_prefix.setdefault(data.url_prefix or (base + PAGE_PREFIX if base else ""), []).append(trajectory)
    for prefix, members in by_prefix.items():
        known = {task.id: task for task in load_tasks(replace(data, url_prefix=prefix, limit=None))}
        for trajectory in members:
            tasks[trajectory.task_id] = known.get(trajectory.task_id) or Task(
                id=trajectory.task_id, question=trajectory.question, answers=tuple(trajectory.answers))
    return tasks

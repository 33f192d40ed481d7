"""The rollout job: tasks × G samples through a fleet of engine and worker actors, to a JSONL file.

Reads like the first half of the loop in docs/design.md §1: a fleet session (:mod:`turnstile.cluster.jobs.session`:
the corpus served, the tasks loaded, engine replicas and rollout workers started) hands out episodes as
workers free up and writes each trajectory as it arrives.

A worker that dies mid-run loses the episodes it was running; they are **rerun** on another worker
(Ray restarts the dead one, up to ``worker_restarts`` times), at most ``max_episode_attempts`` times
each, after which an episode is reported failed in the summary. The run never waits on a dead actor.
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from turnstile.cluster.jobs.session import RolloutJob, fleet_session
from turnstile.rollout.summary import RolloutSummary, summarize


def run_rollout(cfg: RolloutJob, out: Path, progress: bool = True) -> RolloutSummary:
    """Run every task's G samples and write the trajectories to ``out`` (JSONL, as they arrive)."""
    started = time.monotonic()
    with fleet_session(cfg, [cfg.data], events=fleet_events(out)) as session:
        (tasks,) = session.tasks
        episodes = [(task, f"{task.id}", sample) for task in tasks for sample in range(cfg.group_size)]
        with tqdm(total=len(episodes), desc="episodes", unit="ep", disable=not progress) as bar:
            trajectories, failed, rerun = session.generate(episodes, out, bar)
    return summarize(trajectories, time.monotonic() - started, failed, rerun)


def fleet_events(out: Path) -> Path:
    """Where a rollout to ``out`` writes its fleet's scale events: beside it, ``<stem>.fleet.jsonl``."""
    return out.with_name(f"{out.stem}.fleet.jsonl")


def rollout_logs(out: Path) -> Path:
    """Where a rollout to ``out`` sends its workers' output (:mod:`turnstile.cluster.fleet.logs`):
    ``<stem>.logs/`` beside it."""
    return out.with_name(f"{out.stem}.logs")

"""Fault tolerance of `turnstile train` (async mode, where the store and the reward service run), on
the memory and the redis store.

One run per store kills a rollout worker, an engine replica and a reward worker mid-run, the way
a node failure or an OOM kill would (``ray.kill`` of the named actor; Ray restarts rollout and reward
workers, the fleet replaces a dead engine replica), and counts: the run finishes its steps, and every
task whose group reached the learner has its G samples exactly once. (The three faults share a run
to keep the suite's training pipelines few; each has its own assertions.)
Killing the driver and resuming is in ``test_train_resume.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from tests.test_train import EXAMPLE, SMALL
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.cluster.jobs.train import run_train
from turnstile.rollout.trajectory import Trajectory, load_trajectories

pytestmark = pytest.mark.integration

G = 4
STEPS = 3
# IGPO with information gain measured on the (hf) replicas during rollout: the faults below reach the probes too
INFORMATION_GAIN = ["estimator.kind=igpo", "rewards=[{kind: exact_match}, {kind: format}, {kind: information_gain}]"]


def overrides(tmp_path: Path, store: str, redis_url: str, *extra: str) -> list[str]:
    return [*SMALL, "mode=async", "staleness=1", f"steps={STEPS}", "eval_every=0", f"out={tmp_path}",
            f"name=f{tmp_path.name[-12:]}", f"rollout.group_size={G}", "tasks_per_step=1",
            "rollout.episode.env.max_turns=6", "rollout.fleet.workers=2",
            "rollout.fleet.episodes_per_worker=8", "rollout.fleet.checkpoint_every=2",
            f"store.kind={store}", f"store.namespace=t{tmp_path.name[-12:]}",
            *([f"store.url={redis_url}"] if store == "redis" else []), *extra]


class Killer(threading.Thread):
    """Polls ``ready()`` and, once it is true, kills the named actor (restartable, like a crash)."""

    def __init__(self, actor: str, ready: Callable[[], bool]) -> None:
        super().__init__(daemon=True)
        self.actor, self.ready, self.killed_at = actor, ready, None
        self.error: BaseException | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline:
                try:
                    if self.ready():
                        ray.kill(ray.get_actor(self.actor), no_restart=False)
                        self.killed_at = time.monotonic()
                        return
                except ValueError:  # the actor is not started yet
                    pass
                except ray.exceptions.GetTimeoutError:  # a busy actor did not answer the poll: ask again
                    pass
                time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error


class ResumeWatcher(threading.Thread):
    """Counts, while the run lasts, the episodes the run's rollout workers resumed from a
    checkpoint (each worker's ``status()["resumed"]``, the largest seen per worker name). A resumed
    episode may belong to a group the run never trains (one finished after the last step's groups),
    so the scored files alone cannot show it."""

    def __init__(self, prefix: str) -> None:
        super().__init__(daemon=True)
        self.prefix, self.seen = prefix, {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for name in [n for n in ray.util.list_named_actors() if n.startswith(self.prefix)]:
                try:
                    self.seen[name] = max(self.seen.get(name, 0), worker_status(name)["resumed"])
                except (ValueError, ray.exceptions.RayError):  # gone, restarting or busy: ask again
                    pass
            self.stop.wait(0.2)

    @property
    def resumed(self) -> int:
        return sum(self.seen.values())


def worker_status(name: str) -> dict[str, int]:
    return ray.get(ray.get_actor(name).status.remote(), timeout=30)


def trained_on(out: Path) -> list[Trajectory]:
    return [t for step in range(STEPS) for t in load_trajectories(out / "scored" / f"step{step}.jsonl")]


def assert_exactly_once(out: Path) -> list[Trajectory]:
    samples = trained_on(out)
    assert len(samples) == STEPS * G
    keys = Counter((t.uid, t.sample) for t in samples)
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]  # no sample twice
    groups = Counter(t.uid for t in samples)
    assert set(groups.values()) == {G}  # every group whole: G samples, each once
    assert all(sorted(t.sample for t in samples if t.uid == uid) == list(range(G)) for uid in groups)
    assert all(t.outcome is not None for t in samples)  # every sample scored
    history = json.loads((out / "run.json").read_text())["history"]
    assert [int(m["step"]) for m in history] == list(range(1, STEPS + 1))
    return samples


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_killed_worker_replica_and_reward_worker_lose_nothing(ray_local: None, redis_url: str,
                                                              tmp_path: Path, store: str) -> None:
    """Three independent faults in one run (each would end a run that did not handle it): a rollout
    worker killed while it runs an episode that has saved a checkpoint, an engine replica killed
    while it serves, a reward worker killed once it has scored. Each is checked on its own below."""
    job = load_config(TrainJob, EXAMPLE, overrides(tmp_path, store, redis_url, "rollout.fleet.engine_replicas=2",
                                                   "rollout.fleet.engine_cpus=0.5", "reward_service.workers=2",
                                                   *INFORMATION_GAIN))
    worker, replica, reward = f"{job.name}-worker-0", f"{job.name}-engine-0", f"{job.name}-reward-0"

    def scored_some() -> bool:
        return ray.get(ray.get_actor(reward).counts.remote(), timeout=30).scored >= 1

    killers = [Killer(worker, lambda: worker_status(worker)["checkpointed"] >= 1),
               Killer(replica, lambda: worker_status(f"{job.name}-worker-1")["checkpointed"] >= 1),
               Killer(reward, scored_some)]
    for killer in killers:
        killer.start()
    watcher = ResumeWatcher(f"{job.name}-worker-")
    watcher.start()
    try:
        state = run_train(job, progress=False)
    finally:
        watcher.stop.set()
        watcher.join(timeout=30)
    for killer in killers:
        killer.join(timeout=5)
        assert killer.error is None and killer.killed_at is not None, f"{killer.actor} was never killed"
    # The run went on: updates published to the replicas serving, every step trained, every task's G
    # samples exactly once (assert_exactly_once), every one scored (the reward worker's items too).
    assert state.step == STEPS and state.weights_version == STEPS
    samples = assert_exactly_once(tmp_path)

    # The rollout worker: its episodes ran again elsewhere ...
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert history[-1]["rollout/rerun"] >= 1
    # ... from their checkpoints, not from the start: a worker resumed one while the run lasted
    # (its group may finish after the last step's), and any that reached a step resumed at a
    # checkpoint's turn.
    assert watcher.resumed >= 1, f"no episode of the killed worker resumed from its checkpoint: {watcher.seen}"
    finished = [t for path in (tmp_path / "scored").glob("*.jsonl") for t in load_trajectories(path)]
    resumed = [t for t in finished if t.metadata.get("resumed_at_turn")]
    assert all(t.metadata["resumed_at_turn"] % 2 == 0 for t in resumed)  # checkpoint_every=2

    # The engine replica: its requests moved, not failed; the fleet replaced it with one serving
    # the version of its time.
    assert all(t.stop_reason.value != "engine_error" for t in samples)
    events = [json.loads(line) for line in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    assert any(e["action"] == "replace" and e["member"] == "engine-0" for e in events), events
    ready = [e for e in events if e["action"] == "ready" and e["member"] == "engine-2"]
    assert ready and ready[0]["reason"].startswith("serves weights version"), events
    # Information gain was measured on the replicas while the episodes ran (rollout/probes.py): the
    # probes of the killed replica's episodes went to the replica that took them over, and those of
    # the killed worker's episodes were taken again only where the checkpoint had no value: every
    # boundary of every sample has one value, none missing.
    assert all(t.metadata.get("ig_missing") is None for t in samples), [t.metadata for t in samples]
    assert all(turn.ig_value is not None and turn.ig_version is not None for t in samples for turn in t.turns)
    assert sum(t.metadata["ig_probes"]["boundaries"] for t in samples) >= len(samples)  # type: ignore[index]


def test_tool_failures_at_30_percent_every_episode_completes(ray_local: None, redis_url: str,
                                                             tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The random tiny model rarely writes a valid call, so the scripted expert drives the rollout
    # (the learner still trains the tiny model on its turns): every turn calls a tool.
    job = load_config(TrainJob, EXAMPLE, overrides(
        tmp_path, "memory", redis_url, "rollout.engine.kind=scripted", "rollout.episode.max_new_tokens=200",
        "rollout.episode.context_budget=4096", "rollout.episode.env.max_turns=12",
        "rollout.tools.toolbox.inject_failure_rate=0.3", "rollout.tools.toolbox.inject_seed=3",
        "rollout.tools.toolbox.max_attempts=1",
        "rollout.tools.toolbox.cache.backend=none"))
    state = run_train(job, progress=False)
    assert state.step == STEPS
    samples = assert_exactly_once(tmp_path)
    # Every episode ran to an end of its own (no engine error, no timeout) despite the failures.
    assert all(t.stop_reason.value in ("answered", "no_answer", "context_overflow", "malformed_answer")
               for t in samples)
    calls = [turn for t in samples for turn in t.turns if turn.tool_ok is not None]
    failed = [turn for turn in calls if turn.tool_ok is False]
    # ~35 calls at 30%: bounds about 2.5 standard deviations wide (which calls fail depends on how
    # the async fleet spreads the episodes over the two workers, each drawing from its seeded stream).
    assert len(calls) >= 30 and 0.1 <= len(failed) / len(calls) <= 0.5
    assert {turn.tool_error for turn in failed} == {"injected"}
    # ... and the failures are in the metrics and on the console. (A step's ~10 calls may all
    # succeed: 0.7^10 = 3%; so the per-step rate is only required to be a rate.)
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert sum(m["rollout/tool_failures"] for m in history) == len(failed)
    assert all(0.0 <= m["rollout/tool_error_rate"] <= 1.0 for m in history)
    assert any(m["rollout/tool_error_rate"] > 0.0 for m in history)
    assert "tool failures" in capsys.readouterr().out
    # Injected failures are the environment's: an episode whose last call failed so was decided by
    # the environment; it is counted, kept in the scored file, and never credited or trained.
    assert all(turn.tool_fault == "environment" for turn in failed)
    decided = [t for t in samples if "environment_fault" in t.metadata]
    assert sum(m["rollout/environment_decided"] for m in history) == len(decided)
    assert sum(m["rollout/environment_left_out"] for m in history) == len(decided)
    assert all(turn.advantage is None for t in decided for turn in t.turns)

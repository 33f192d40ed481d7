"""Kill the driver of `turnstile train` mid-run (SIGKILL, as a lost head node would), then
`turnstile train --resume`: the run continues from its last checkpoint, repeating and skipping no step.

Both drivers are real `turnstile train` processes joining the test session's Ray cluster. The dead
driver's actors (fleet, learner, reward workers, and a memory store's actor) die with it; a redis
store keeps its items, and the resumed driver works in a namespace of its own, so the dead driver's
half-done items never mix with the regenerated ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from tests.test_train import EXAMPLE, SMALL
from turnstile.rollout.trajectory import load_trajectories

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
STEPS = 4


def turnstile_train(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "from turnstile.cluster.cli import main; main()", "train", *args],
                            cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def steps_done(out: Path) -> int:
    try:
        return int(json.loads((out / "run.json").read_text())["step"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


@pytest.mark.parametrize(("mode", "store"), [("sync", "memory"), ("async", "memory"), ("async", "redis")])
def test_killed_driver_resumes_without_repeating_or_skipping(ray_local: None, redis_url: str,
                                                             tmp_path: Path, mode: str, store: str) -> None:
    out = tmp_path / "run"
    args = ["--config", str(EXAMPLE), "--no-progress", *SMALL, f"mode={mode}", f"steps={STEPS}",
            "eval_every=0", f"out={out}", f"store.kind={store}", f"store.namespace=r{tmp_path.name[-10:]}",
            f"rollout.ray.address={ray.get_runtime_context().gcs_address}",
            *([f"store.url={redis_url}"] if store == "redis" else [])]
    first = turnstile_train(args, tmp_path / "first.log")
    deadline = time.monotonic() + 480
    while steps_done(out) < 1 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    assert steps_done(out) >= 1, "the first driver wrote no checkpoint in time"
    os.killpg(first.pid, signal.SIGKILL)  # mid-step: the step after the checkpoint is under way
    first.wait(timeout=30)
    killed_after = steps_done(out)
    assert killed_after < STEPS

    second = turnstile_train([*args, "--resume"], tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    printed = (tmp_path / "second.log").read_text()
    assert f"resumed at step {killed_after} (weights version {killed_after})" in printed
    assert f"done: {STEPS} steps, weights version {STEPS}" in printed
    # The resumed driver logged exactly the steps after the checkpoint, and the run's history has
    # every step once.
    logged = [int(line.split()[1]) for line in printed.splitlines() if line.startswith("step ")]
    assert logged == list(range(killed_after + 1, STEPS + 1))
    history = json.loads((out / "run.json").read_text())["history"]
    assert [int(m["step"]) for m in history] == list(range(1, STEPS + 1))
    for step in range(STEPS):
        batch = load_trajectories(out / "scored" / f"step{step}.jsonl")
        keys = [(t.uid, t.sample) for t in batch]
        assert len(batch) == 4 and len(set(keys)) == 4
        if mode == "sync":  # each step's rollouts ran on the weights published by the step before
            assert {turn.weights_version for t in batch for turn in t.turns} == {step}

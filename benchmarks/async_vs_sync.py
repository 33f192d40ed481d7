"""Throughput of ``turnstile train`` asynchronous vs synchronous on long-tailed episodes.

The policy engine is the scripted expert of the synthetic world, so episode lengths are the real
long tail of its questions: chain questions end in about 10 turns, aggregation questions run past
100 (up to about 200). The learner is the real one (veRL on CPU, the tiny model, contexts cut to
``--max-length`` tokens). Both runs use the same configuration and the same tasks; the figure is
samples trained per second of wall time, and the ratio async / sync.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 8] [--tasks-per-step 2] [--group-size 2]

In sync mode every step waits for its slowest episode before the learner starts, and rollout idles
while the learner trains; async keeps up to (η + 1) batches of episodes running.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.cluster.jobs.train import run_train
from turnstile.rollout.trajectory import load_trajectories

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.yaml"


def run(mode: str, args: argparse.Namespace, out: Path) -> tuple[float, int, dict[str, float]]:
    overrides = [
        f"mode={mode}", f"steps={args.steps}", f"tasks_per_step={args.tasks_per_step}",
        f"rollout.group_size={args.group_size}", "rollout.engine.kind=scripted",
        "rollout.data.limit=40", "rollout.data.shuffle=true",  # data.seed is the world's: the expert knows seed 0
        # the synthetic world's full mix (2-8 hops, 15% aggregations), not the default's short questions
        "rollout.data.options={min_hops: 2, max_hops: 8, aggregation_fraction: 0.15, count: 200}",
        "rollout.episode.context_budget=400000", "rollout.episode.max_new_tokens=512",
        "rollout.episode.env.max_turns=200", "rollout.fleet.episodes_per_worker=16",
        "eval_every=0", "checkpoint_every=0", f"staleness={args.staleness}",
        f"learner.mini_batch={args.tasks_per_step * args.group_size}", "learner.micro_batch=2",
        f"learner.max_length={args.max_length}", f"out={out / mode}", "metrics.console=false",
    ]
    job = load_config(TrainJob, EXAMPLE, overrides)
    started = time.monotonic()
    state = run_train(job, progress=False)
    wall = time.monotonic() - started
    turns = sorted(len(t.turns) for path in (out / mode / "scored").glob("*.jsonl")
                   for t in load_trajectories(path))
    return wall, state.step * args.tasks_per_step * args.group_size, {"turns": turns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, args, Path(tmp)) for mode in ("sync", "async")}
    print(f"{'mode':6} {'wall s':>8} {'samples':>8} {'turns':>7} {'samples/s':>10}  turns per episode")
    rates = {}
    for mode, (wall, samples, extra) in results.items():
        rates[mode] = samples / wall
        turns = extra["turns"]
        print(f"{mode:6} {wall:8.1f} {samples:8d} {sum(turns):7d} {rates[mode]:10.3f}  "
              f"min {turns[0]} median {statistics.median(turns):g} max {turns[-1]}")
    print(f"async / sync throughput: {rates['async'] / rates['sync']:.2f}")


if __name__ == "__main__":
    main()

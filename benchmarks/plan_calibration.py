"""The plan's host-memory figures (`turnstile plan`, cluster/jobs/plan.py) against what a real run uses:
a few steps of `turnstile train` on a config, read by the soak's sampler (benchmarks/soak.py: the
RSS of every process of the run by role, after each step's checkpoint), the largest reading of
each role against the plan's figure for it on this machine. Also the learner's figure against the
CPU learner's measured peaks of docs/benchmarks/learner.md §1 (benchmarks/learner_long.py).

    .venv/bin/python benchmarks/plan_calibration.py --out runs/plan_calibration              # the default
    .venv/bin/python benchmarks/plan_calibration.py --config examples/train_smollm2.yaml \\
        --out runs/plan_calibration_smollm2 rollout.engine.model=smollm2-135m-instruct
    .venv/bin/python benchmarks/plan_calibration.py --learner-only

Target: every role within ±25% of the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.soak import load, run_sampled
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.plan import make_plan, this_machine
from turnstile.cluster.jobs.run import TrainJob
from turnstile.learner.memory import policy_memory
from turnstile.learner.trainer import LearnerConfig
from turnstile.rollout.engines.shape import model_shape
from turnstile.rollout.model_store import ensure_default_model, resolve_model

MB = 1 << 20
# the soak's role names for the plan's
ROLES = {"engine replica": "engines", "rollout worker": "rollout workers", "policy rank": "learner",
         "reward worker": "reward workers", "store": "store", "driver": "driver"}
# docs/benchmarks/learner.md §1, after (head_chunk 1,024): tokens of the one sample, peak RSS GiB (GRPO)
LEARNER_LONG = [(5_098, 1.08), (23_623, 2.24), (45_744, 3.72), (90_089, 5.71)]


def learner_rows(model: str = "", measured_rows: list[tuple[int, float]] = LEARNER_LONG) -> list[str]:
    """The plan's policy-rank figure against measured peaks (tokens of one sample, GiB)."""
    shape = model_shape(resolve_model(model) if model else str(ensure_default_model()))
    config = LearnerConfig(mini_batch=1, micro_batch=1, max_length=131072, head_chunk=1024)
    lines = ["| sample tokens | plan (GiB) | measured peak (GiB) | plan / measured |", "|---|---|---|---|"]
    for tokens, measured in measured_rows:
        planned = sum(policy_memory(shape, config, gpu=False, tokens=tokens).values()) / 2**30
        lines.append(f"| {tokens:,} | {planned:.2f} | {measured:.2f} | {planned / measured:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a train config (default: built-in)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/plan_calibration"))
    parser.add_argument("--learner-only", action="store_true", help="only the learner's table (runs nothing)")
    parser.add_argument("--learner-rows", type=Path, default=None,
                        help="benchmarks/learner_long.py's rows (JSONL) to compare instead of learner.md's")
    parser.add_argument("--model", default="", help="the model of --learner-rows (default: the tiny model)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    if args.learner_rows:
        rows = [json.loads(line) for line in args.learner_rows.read_text().splitlines() if line.strip()]
        print("\n".join(learner_rows(args.model, [(r["tokens"], r["peak_rss"] / 2**30) for r in rows
                                                   if r["head_chunk"]])))
    else:
        print("\n".join(learner_rows()))
    if args.learner_only:
        return
    run_dir, log = args.out / "run", args.out / "memory.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = load_config(TrainJob, args.config, [*args.overrides, f"steps={args.steps}", "eval_every=0",
                                              "checkpoint_every=1", f"out={run_dir}", "name=calibration"])
    plan = make_plan(job, this_machine(job.rollout.ray.num_cpus))
    if not log.is_file():
        run_sampled(job, log)
    rows = load(log)
    peak = {role: max(row.get("peak_mb", row["rss_mb"]).get(role, 0.0) for row in rows) for role in ROLES.values()}
    processes = {role: max(row["processes"].get(role, 0) for row in rows) for role in ROLES.values()}
    print(f"\n{args.config or 'the embedded default'}: {len(rows)} readings (steps {rows[0]['step']}-"
          f"{rows[-1]['step']}), each role's peak RSS (the sum of its processes' VmHWM) against the plan on "
          "this machine")
    print("| role | count | processes | plan (MB) | measured peak (MB) | plan / measured |")
    print("|---|---|---|---|---|---|")
    result = []
    for role in plan.roles:
        name = ROLES.get(role.name)
        if name is None or not peak.get(name):
            continue
        planned = role.host_bytes * role.count / MB
        if name == "rollout workers" and processes[name] <= role.count:  # no Chromium was started: no page needed it
            planned -= role.parts.get("Chromium", 0.0) * role.count / MB
        print(f"| {role.name} | {role.count} | {processes[name]} | {planned:.0f} | {peak[name]:.0f} | "
              f"{planned / peak[name]:.2f} |")
        result.append({"role": role.name, "plan_mb": planned, "measured_mb": peak[name]})
    (args.out / "calibration.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

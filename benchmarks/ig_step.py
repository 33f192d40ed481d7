"""A training step of IGPO against GRPO on the default task, with information gain measured on the
engines during rollout and, as the baseline, after the fact in the reward stage.

Three ``turnstile train`` runs of the embedded default (``examples/train.yaml``: the warm start on
vLLM, veRL on CPU, 8 tasks x 4 samples a step), one after another in this process, for ``--steps``
steps each with no evaluation and no checkpoint:

- ``grpo``: the default's rewards (exact match, format) and GRPO;
- ``igpo (engine)``: IGPO with the ``information_gain`` reward, measured on the engine while the
  episodes run (``scorer: auto``, what ``turnstile train`` does on vLLM);
- ``igpo (after the fact)``: the same with ``scorer: kv_cache``: the transformers scorer on the
  run's weights archive, in the reward stage.

A step is everything between two rollouts: rollout, rewards, credit, the learner's update and the
publish. The first step of each run is left out (start-up). Target (issue 49): IGPO's step within
1.15x GRPO's.

    .venv/bin/python benchmarks/ig_step.py [--steps 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.cluster.jobs.train import run_train

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.yaml"
STAGES = ("rollout", "rewards", "credit", "learner", "publish")
IGPO = ["estimator.kind=igpo"]
ARMS = {
    "grpo": [],
    "igpo (engine)": [*IGPO, "rewards=[{kind: exact_match}, {kind: format}, {kind: information_gain}]"],
    "igpo (after the fact)": [*IGPO, "rewards=[{kind: exact_match}, {kind: format}, "
                                     "{kind: information_gain, options: {scorer: kv_cache}}]"],
}


def run(name: str, overrides: list[str], steps: int, out: Path) -> list[dict[str, float]]:
    job = load_config(TrainJob, EXAMPLE, [*overrides, f"steps={steps}", "eval_every=0", "checkpoint_every=0",
                                          f"out={out / name.split()[0]}{'-after' if 'after' in name else ''}",
                                          "metrics.console=false"])
    return run_train(job, progress=False).history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ig-step-"))
    rows = {}
    for name, overrides in ARMS.items():
        history = run(name, overrides, args.steps, out)[1:]  # the first step pays for start-up
        rows[name] = history
        print(f"{name}: done ({len(history)} steps timed)", flush=True)
    grpo = statistics.fmean(sum(step[f"time/{s}_s"] for s in STAGES) for step in rows["grpo"])
    print(f"| arm | step (s) | vs GRPO | {' | '.join(f'{s} (s)' for s in STAGES)} | probes per step | "
          "prefill per probe | R | IG missing |")
    print("|---|---|---|" + "---|" * len(STAGES) + "---|---|---|---|")
    for name, history in rows.items():
        step = statistics.fmean(sum(row[f"time/{s}_s"] for s in STAGES) for row in history)
        stages = " | ".join(f"{statistics.fmean(row[f'time/{s}_s'] for row in history):.1f}" for s in STAGES)
        probes = [row for row in history if "ig/probes" in row]
        extra = (f"{statistics.fmean(r['ig/probes'] for r in probes):.0f} | "
                 f"{statistics.fmean(r['ig/prefill_per_probe'] for r in probes):.1f} | "
                 f"{statistics.fmean(r['ig/pseudo_tokens_per_probe'] for r in probes):.1f} | "
                 f"{sum(r['ig/missing'] for r in probes):.0f}") if probes else "- | - | - | -"
        print(f"| {name} | {step:.1f} | {step / grpo:.2f} | {stages} | {extra} |", flush=True)


if __name__ == "__main__":
    main()

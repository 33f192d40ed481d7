"""``turnstile plan``: where a training run's roles go and whether it fits, before anything starts
(see :mod:`turnstile.cluster.jobs.plan`).

    turnstile plan                                                  # the embedded default, this machine
    turnstile plan --config examples/train_gpu.yaml --cluster 2x8xh100 \\
        rollout.engine.model=/models/Qwen3-8B learner.model=/models/Qwen3-8B
    turnstile plan --config recipes/gpu_one.yaml --cluster 1x1xh100 --turns 20
"""

from __future__ import annotations

import argparse
import json

NAME = "plan"
HELP = "Check a training config against a cluster before it starts: placement, GPU and host memory, step time."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="a train config (default: built-in)")
    parser.add_argument("--cluster", metavar="SPEC",
                        help="NODESxGPUSxKIND[,cpus=C][,mem=GB], KIND h100, h200, NNgb or cpu, e.g. 2x8xh100 "
                             "(default: the Ray cluster it is connected to, else this machine)")
    parser.add_argument("--turns", type=int, default=0, help="mean turns an episode (default: max_turns)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for train")


def run(args: argparse.Namespace) -> int:
    from turnstile.cluster.cli.config import load_config
    from turnstile.cluster.jobs.plan import Assumptions, default_cluster, make_plan, parse_cluster, plan_payload, render
    from turnstile.cluster.jobs.run import TrainJob

    try:
        job = load_config(TrainJob, args.config, list(args.overrides))
        cluster = parse_cluster(args.cluster) if args.cluster else default_cluster(job)
        if args.turns < 0:
            raise ValueError(f"--turns {args.turns}: give a number of turns >= 1 (0: max_turns)")
        plan = make_plan(job, cluster, assumptions=Assumptions(turns=args.turns))
    except ValueError as error:  # ConfigError, PlanError, a model without config.json
        print(f"turnstile plan: {error}")
        return 2
    print(json.dumps(plan_payload(plan), indent=1) if args.json else "\n".join(render(plan)))
    return 0 if plan.fits else 1

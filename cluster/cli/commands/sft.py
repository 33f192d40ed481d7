"""``turnstile sft``: fine-tune the policy on expert trajectories or cleaned chat rows (veRL's trainer).

    turnstile rollout --config examples/rollout_scripted.yaml --out runs/expert.jsonl data.split=train
    turnstile sft --config examples/sft.yaml data.path=runs/expert.jsonl
    turnstile data clean --in raw.jsonl --out runs/clean.jsonl && \\
        turnstile sft --config examples/sft.yaml data.path=runs/clean.jsonl

Prints the evaluation before training (share of well-formed turns on held-out tasks), the loss every
``log_every`` steps, the evaluation after, and where the model was written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cluster.cli.logs import add_verbose_argument, console_logging, worker_logs

NAME = "sft"
HELP = "Supervised fine-tuning on trajectories or chat rows, with evaluation before and after."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="experiment YAML (default: built-in)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbose_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. data.path=runs/expert.jsonl steps=100")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from ray.exceptions import RayError

    from turnstile.cluster.cli.config import ConfigError, dump_config, load_config
    from turnstile.cluster.jobs.session import init_ray
    from turnstile.cluster.jobs.sft import SftJob, run_sft
    from turnstile.cluster.jobs.train import resume_hint
    from turnstile.learner.sft import SftDataError
    from turnstile.learner.trainer import LearnerError
    from turnstile.rollout.errors import describe_error

    try:
        job = load_config(SftJob, args.config, args.overrides)
    except (ConfigError, LearnerError) as error:
        print(f"turnstile sft: {error}")
        return 2
    console_logging(args.verbose)
    try:

        Path(job.out).mkdir(parents=True, exist_ok=True)
        (Path(job.out) / "config.yaml").write_text(dump_config(job))
        init_ray(job.ray, worker_logs(Path(job.out), args.verbose))
        run_sft(job, progress=not args.no_progress)
    except (SftDataError, LearnerError, ValueError, FileNotFoundError) as error:
        print(f"turnstile sft: {error}")
        return 1
    except RayError as error:  # a worker of ours died (the node ran out of memory, say)
        print(f"turnstile sft: {describe_error(error)}; {resume_hint(Path(job.out), 'resume=true')}")
        return 1
    return 0

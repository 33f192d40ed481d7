"""``turnstile train``: the main job (see :mod:`turnstile.cluster.jobs.train`).

    turnstile train                                   # the embedded default: synthetic world, tiny model, CPU
    turnstile train --config examples/train.yaml steps=20 rollout.group_size=8
    turnstile train --config examples/train.yaml resume=true   # continue from out/checkpoint
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cluster.cli.logs import add_verbose_argument, console_logging, worker_logs

NAME = "train"
HELP = "Train the policy: rollouts, rewards, credit, veRL updates and weight publishing, step by step."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="experiment YAML (default: built-in)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_verbose_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. steps=10 rollout.group_size=8")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from ray.exceptions import RayError

    from turnstile.cluster.cli.config import dump_config, load_config
    from turnstile.cluster.fleet.dispatch import NoWorkersLeft
    from turnstile.cluster.jobs.run import TrainJob, check
    from turnstile.cluster.jobs.session import init_ray
    from turnstile.cluster.jobs.train import learning_line, resume_hint, run_train, where_outputs_are
    from turnstile.envs.corpus_server import CorpusServerError
    from turnstile.learner.publish import PublishError
    from turnstile.rewards.service import RewardServiceError
    from turnstile.rollout.errors import describe_error
    from turnstile.rollout.fleet import EngineStartError
    from turnstile.rollout.store import StoreError

    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    try:
        job = load_config(TrainJob, args.config, overrides)
        check(job)
    except (ValueError, StoreError) as error:  # ConfigError, TrainError, RewardError, a store refused
        print(f"turnstile train: {error}")
        return 2
    console_logging(args.verbose)
    Path(job.out).mkdir(parents=True, exist_ok=True)
    (Path(job.out) / "config.yaml").write_text(dump_config(job))
    print(f"train: {job.mode}, {job.steps} steps of {job.tasks_per_step} tasks x {job.rollout.group_size} "
          f"samples, engine {job.rollout.engine.kind}, learner dp={job.learner.dp}, out {job.out}")
    try:
        init_ray(job.rollout.ray, worker_logs(Path(job.out), args.verbose))
        state = run_train(job, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, CorpusServerError, StoreError, RewardServiceError,
            NoWorkersLeft, EngineStartError) as error:  # each says what to do
        print(f"turnstile train: {error}")
        return 1
    except (RayError, PublishError) as error:  # a worker of ours died (out of memory, say); no replica took the weights
        print(f"turnstile train: {describe_error(error)}; {resume_hint(Path(job.out))}")
        return 1
    print(f"done: {state.step} steps, weights version {state.weights_version}")
    print(where_outputs_are(Path(job.out)))
    if line := learning_line(Path(job.out), state):  # the last line: before -> after
        print(line)
    return 0

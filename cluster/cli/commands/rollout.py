"""``turnstile rollout``: run G samples of every task through the rollout fleet on Ray, write the
trajectories as JSONL and print a summary.

    turnstile rollout --config examples/rollout.yaml --out runs/rollout.jsonl
    turnstile rollout --config examples/rollout.yaml context.kind=iter_research group_size=8 --out ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cluster.cli.logs import add_verbose_argument, console_logging

NAME = "rollout"
HELP = "Roll out G samples per task on Ray and write trajectories (JSONL) with a summary."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="experiment YAML (default: built-in)")
    parser.add_argument("--out", metavar="FILE.jsonl", required=True, help="where to write trajectories")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbose_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. group_size=8 engine.kind=hf")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from ray.exceptions import RayError

    from turnstile.cluster.cli.config import ConfigError, dump_config, load_config
    from turnstile.cluster.fleet.dispatch import NoWorkersLeft
    from turnstile.cluster.jobs.rollout import rollout_logs, run_rollout
    from turnstile.cluster.jobs.session import RolloutJob, init_ray
    from turnstile.envs.corpus_server import CorpusServerError
    from turnstile.rollout.errors import describe_error
    from turnstile.rollout.fleet import EngineStartError

    try:
        cfg = load_config(RolloutJob, args.config, args.overrides)
    except ConfigError as error:
        print(f"turnstile rollout: {error}")
        return 2
    console_logging(args.verbose)
    out = Path(args.out)
    print(f"rollout: {cfg.data.kind} tasks x {cfg.group_size} samples, engine {cfg.engine.kind} "
          f"({cfg.fleet.engine_replicas} replica(s)), {cfg.fleet.workers} worker(s) x "
          f"{cfg.fleet.episodes_per_worker} episodes, context {cfg.context.kind}")
    try:
        init_ray(cfg.ray, None if args.verbose else rollout_logs(out))
        summary = run_rollout(cfg, out, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, CorpusServerError, NoWorkersLeft, EngineStartError) as error:
        print(f"turnstile rollout: {error}")
        return 1
    except RayError as error:  # a worker of ours died (the node ran out of memory, say)
        print(f"turnstile rollout: {describe_error(error)}; the trajectories written so far are in the output file")
        return 1
    out.with_suffix(".config.yaml").write_text(dump_config(cfg))
    print(summary.render())
    print(f"trajectories: {out} (look at them: turnstile view {out})"
          + (f", workers' logs: {rollout_logs(out)}/" if rollout_logs(out).is_dir() else ""))
    if summary.all_failed:
        print(f"turnstile rollout: every episode failed; the first said: {summary.first_error or '?'}")
        return 1
    return 0 if summary.failed == 0 else 3

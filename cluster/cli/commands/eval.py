"""``turnstile eval``: k samples of every benchmark question on the fleet, pass@k, avg@k and maj@k
(see :mod:`turnstile.cluster.jobs.eval`).

    turnstile eval                                              # the warm start on the synthetic held-out questions
    turnstile eval --config examples/eval.yaml k=8 rollout.engine.model=DIR out=runs/eval-x
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cluster.cli.logs import add_verbose_argument, console_logging, worker_logs

NAME = "eval"
HELP = "Evaluate a policy on benchmarks: k samples per question, pass@1..k, avg@k, maj@k (resumable)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="evaluation YAML (default: built-in)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbose_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. k=8 out=runs/eval rollout.engine.model=DIR")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from ray.exceptions import RayError

    from turnstile.cluster.cli.config import dump_config, load_config
    from turnstile.cluster.fleet.dispatch import NoWorkersLeft
    from turnstile.cluster.jobs.eval import EvalJob, render, run_eval
    from turnstile.cluster.jobs.session import init_ray
    from turnstile.envs.corpus_server import CorpusServerError
    from turnstile.rollout.errors import describe_error
    from turnstile.rollout.fleet import EngineStartError

    try:
        cfg = load_config(EvalJob, args.config, args.overrides)
    except ValueError as error:  # ConfigError and the config's own checks
        print(f"turnstile eval: {error}")
        return 2
    console_logging(args.verbose)
    names = ", ".join(bench.name for bench in cfg.benchmarks)
    print(f"eval: {names}; k={cfg.k}; engine {cfg.rollout.engine.kind} ({cfg.rollout.engine.model}); out {cfg.out}")
    try:
        init_ray(cfg.rollout.ray, worker_logs(Path(cfg.out), args.verbose))
        summary = run_eval(cfg, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, CorpusServerError, NoWorkersLeft,
            EngineStartError) as error:  # each says what to do
        print(f"turnstile eval: {error}")
        return 1
    except RayError as error:  # a worker of ours died (the node ran out of memory, say)
        print(f"turnstile eval: {describe_error(error)}; run the same command again: it continues with the "
              "samples it has no line for")
        return 1
    (Path(cfg.out) / "config.yaml").write_text(dump_config(cfg))
    print(render(summary))
    print(f"results: {cfg.out}/results.jsonl, summary: {cfg.out}/summary.json, figure: {cfg.out}/eval.png"
          + (f", workers' logs: {cfg.out}/logs/" if (Path(cfg.out) / "logs").is_dir() else ""))
    return 0

"""``turnstile score``: run the configured reward plugins and estimator over saved trajectories.

    turnstile score --config examples/score.yaml --in runs/rollout.jsonl --out runs/scored.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "score"
HELP = "Score saved trajectories with the configured reward plugins and assign credit."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", help="score config (default: built-in)")
    parser.add_argument("--in", dest="source", metavar="FILE.jsonl", required=True,
                        help="trajectories written by turnstile rollout")
    parser.add_argument("--out", metavar="FILE.jsonl", required=True, help="where to write them scored")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. estimator.kind=grpo")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from turnstile.cluster.cli.config import ConfigError, load_config
    from turnstile.cluster.jobs.score import ScoreJob, score_file
    from turnstile.learner.credit import CreditInputError
    from turnstile.rewards.base import RewardError
    from turnstile.rollout.trajectory import TrajectoryError

    try:
        cfg = load_config(ScoreJob, args.config, args.overrides)
    except ConfigError as error:
        print(f"turnstile score: {error}")
        return 2
    try:
        report = score_file(cfg, Path(args.source), Path(args.out))
    except (TrajectoryError, CreditInputError, RewardError, KeyError, ValueError) as error:
        print(f"turnstile score: {error}")
        return 1
    stats = "".join(f"  {key}={value:.6f}" for key, value in report.stats.items())
    print(f"scored {report.trajectories} trajectories in {report.groups} groups with "
          f"{', '.join(r.kind for r in cfg.rewards)}; credit: {cfg.estimator.kind}{stats}")
    if report.unscored:
        print(f"{report.unscored} trajectories are unscored (a reward plugin failed on their group; "
              "outcome null, the reason in metadata.reward_error) and got no credit")
    print(f"mean outcome {report.mean_outcome:.3f}; written: {args.out} (look at it: turnstile view {args.out})")
    return 0

"""``turnstile credit``: run one credit-assignment estimator on a file of turn records.

Reads trajectories with their rewards (one per JSONL line, format in ``learner/credit/records.py``),
treats the whole file as one batch, and writes the same lines back with ``advantage`` and ``reward``
on every turn. Useful to inspect what an estimator does with real rewards, and how the tests
check the worked examples of docs/algorithms.md §9::

    turnstile credit --estimator igpo --in scored.jsonl --out credited.jsonl
    turnstile credit --estimator igpo --in scored.jsonl --out credited.jsonl norm=joint ig_tools=[]
    turnstile credit --estimator abc_grpo --in scored.jsonl --out credited.jsonl gamma=0.5

Options (key=value) depend on the estimator: igpo takes norm, gamma, eta, s_max, format_penalty,
penalise_unanswered, credit_failed_calls, ig_tools, ig_type; abc_grpo takes gamma, norm (separate or joint); grpo and
gspo_round take format_penalty and penalise_unanswered.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from turnstile.cluster.cli.config import ConfigError, load_config
from turnstile.learner.credit import (
    ESTIMATORS,
    CreditInputError,
    Estimator,
    build_estimator,
    credited_records,
    estimator_class,
    group_by_uid,
    option_names,
    read_trajectories,
    write_records,
)

NAME = "credit"
HELP = "Compute per-turn advantages for a JSONL file of scored trajectories with one estimator."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--estimator", required=True, metavar="NAME",
                        help=f"credit-assignment estimator: {', '.join(ESTIMATORS.names())}, or "
                             "package.module:Class")
    parser.add_argument("--in", dest="input", metavar="FILE.jsonl", required=True,
                        help="turn records: one trajectory per line")
    parser.add_argument("--out", metavar="FILE.jsonl", required=True,
                        help="where to write the records with advantages")
    parser.add_argument("options", nargs="*", metavar="key=value",
                        help="estimator options, e.g. norm=joint gamma=0.9 ig_tools=[visit,search]")


def run(args: argparse.Namespace) -> int:
    try:
        estimator = configured_estimator(args.estimator, args.options)
    except ConfigError as error:
        print(f"turnstile credit: {error}")
        return 2
    try:
        groups = group_by_uid(read_trajectories(args.input))
        result = estimator.assign(groups)
    except FileNotFoundError:
        print(f"turnstile credit: {args.input}: no such file")
        return 1
    except (CreditInputError, UnicodeDecodeError) as error:
        print(f"turnstile credit: {args.input}: {error}")
        return 1
    out = Path(args.out)
    write_records(out, credited_records(groups, result.groups))
    trajectories = sum(len(group.trajectories) for group in groups)
    turns = sum(len(t.turns) for group in groups for t in group.trajectories)
    stats = "".join(f"  {key}={value:.6f}" for key, value in result.stats.items())
    print(f"credit: {args.estimator} on {len(groups)} group(s), {trajectories} trajectories, "
          f"{turns} turns{stats}")
    print(f"written: {out} (look at it: turnstile view {out})")
    return 0


def configured_estimator(name: str, options: Sequence[str]) -> Estimator:
    """Estimator ``name`` built from ``key=value`` options; ConfigError names a bad key or value."""
    try:
        known = option_names(name)
    except KeyError as error:  # an unknown name, or an import path that does not load
        raise ConfigError(str(error.args[0])) from None
    for item in options:
        key = item.split("=", 1)[0]
        if "=" in item and key not in known:
            raise ConfigError(f"unknown option '{key}' for estimator {name}; its options are: "
                              f"{', '.join(known) or '(none)'}")
    cls = estimator_class(name)
    try:
        config: object = load_config(cls.Options, None, options)
    except ValueError as error:  # ConfigError from the merge, or a range check of the options
        raise ConfigError(str(error).splitlines()[0]) from None
    return build_estimator(name, config)

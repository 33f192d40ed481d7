"""``turnstile data``: prepare training data. One sub-command so far, ``clean`` (docs/algorithms.md §10):
raw agent trajectories in (chat rows such as WebDancer's, or R1-Searcher's rollouts; see
``learner/sft_formats.py``), SFT rows in this project's protocol out, every step counted (see
``learner/sft_data.py`` for the steps)::

    turnstile data clean --in webdancer.jsonl --out sft.jsonl
    turnstile data clean --in webdancer.jsonl --out sft.jsonl --no-require-correct
    turnstile data clean --in r1_searcher_hotpotqa.jsonl --out sft.jsonl --format r1_searcher
    turnstile data clean --in raw.jsonl --out sft.jsonl --judge-url http://127.0.0.1:8000/v1 \\
        --judge-model qwen3-32b --resample 50:1,100:2,inf:5

Without a judge, an answer is accepted only on an exact match with the reference; rows whose answer
cannot be verified are dropped unless ``--no-require-correct`` is given (they are then kept and
counted as unverified). Long-form answers rarely match exactly: judge them, or opt out knowingly.
An input in which no line is a row of a known format is an error (exit 1), and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the pipeline is imported when the command runs: the command line starts fast
    from turnstile.learner.sft_data import CleanConfig, CleanReport, StepCount

NAME = "data"
HELP = "Prepare training data: 'data clean' turns raw agent trajectories into SFT rows."
UNREADABLE_SHOWN = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from turnstile.learner.sft_data import KNOWN_TOOLS, CleanConfig  # only for this command
    from turnstile.learner.sft_formats import AUTO, FORMATS

    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    clean = sub.add_parser("clean", help="clean, filter and resample trajectories for SFT (§10)",
                           description="Clean, filter and resample raw agent trajectories for SFT.")
    clean.add_argument("--in", dest="source", metavar="FILE.jsonl", required=True,
                       help="raw trajectories, one per line: {messages, answer, ...} (chat) or "
                            "{question, answer, gen_text_store, ...} (r1_searcher)")
    clean.add_argument("--format", dest="input_format", default=AUTO, choices=[AUTO, *FORMATS],
                       help="input format (default: %(default)s, recognised per row by its fields)")
    clean.add_argument("--out", metavar="FILE.jsonl", required=True, help="where to write the rows")
    clean.add_argument("--tools", default=",".join(KNOWN_TOOLS),
                       help="allowed tools, comma separated (default: %(default)s)")
    clean.add_argument("--require-correct", action=argparse.BooleanOptionalAction, default=True,
                       help="drop rows whose answer is neither an exact match nor accepted by the "
                            "judge (default: on; --no-require-correct keeps unverified rows)")
    clean.add_argument("--judge-url", metavar="URL",
                       help="OpenAI-compatible endpoint up to /v1 for the LLM judge (off by default)")
    clean.add_argument("--judge-model", metavar="NAME", help="model the judge endpoint serves")
    clean.add_argument("--judge-key-env", default="OPENAI_API_KEY", metavar="VAR",
                       help="environment variable holding the judge's API key (default: %(default)s)")
    clean.add_argument("--resample", default="50:1,100:2,inf:5", metavar="TURNS:COPIES,...",
                       help="turn-aware resampling tiers (default: %(default)s)")
    clean.add_argument("--max-queries", type=int, default=CleanConfig.max_queries,
                       help="most queries a search call may carry (default: %(default)s, as the tool)")


def run(args: argparse.Namespace) -> int:
    from turnstile.envs.chat_client import ChatUnavailable
    from turnstile.learner.sft_data import NoReadableRows, clean_file  # see add_arguments

    try:
        config = clean_config(args)
    except ValueError as error:
        print(f"turnstile data clean: {error}")
        return 2
    source, target = Path(args.source), Path(args.out)
    if not target.parent.is_dir():
        print(f"turnstile data clean: {target.parent}: no such directory for --out")
        return 1
    try:
        report = clean_file(source, target, config, progress=_progress)
    except (FileNotFoundError, NoReadableRows) as error:  # names the path
        print(f"turnstile data clean: {error}")
        return 1
    except ChatUnavailable as error:
        print(f"turnstile data clean: the judge failed, nothing was written: {error}")
        return 1
    print_report(report, target)
    return 0


def clean_config(args: argparse.Namespace) -> CleanConfig:
    """The pipeline's config from the ``clean`` options; ValueError says which option is wrong."""
    from turnstile.envs.chat_client import ChatClientConfig
    from turnstile.learner.sft_data import CleanConfig, parse_resample

    if (args.judge_url is None) != (args.judge_model is None):
        raise ValueError("the judge needs both --judge-url and --judge-model")
    judge = None
    if args.judge_url is not None:
        judge = ChatClientConfig(base_url=args.judge_url, model=args.judge_model,
                                 api_key_env=args.judge_key_env)
    if args.max_queries < 1:
        raise ValueError("--max-queries must be at least 1")
    tools = tuple(name.strip() for name in args.tools.split(",") if name.strip())
    return CleanConfig(allowed_tools=tools, require_correct=args.require_correct, judge=judge,
                       resample=parse_resample(args.resample), max_queries=args.max_queries,
                       input_format=args.input_format)


def _progress(message: str) -> None:
    print(f"data clean: {message}", file=sys.stderr, flush=True)


def print_report(report: CleanReport, target: Path) -> None:
    from turnstile.learner.sft_data import KEPT_UNVERIFIED, NOT_VERIFIED

    print(f"data clean: {report.source}")
    print(f"read: {report.rows_read} rows, {len(report.unreadable)} unreadable")
    print("format: " + ", ".join(f"{name} ({count} rows)" for name, count in sorted(report.formats.items())))
    for where in report.unreadable[:UNREADABLE_SHOWN]:
        print(f"  unreadable: {where}")
    if len(report.unreadable) > UNREADABLE_SHOWN:
        print(f"  ... and {len(report.unreadable) - UNREADABLE_SHOWN} more unreadable rows")
    for number, step in enumerate(report.steps, start=1):
        print_step(number, step)
    print(f"written: {report.written} rows to {target}")
    unverified = report.steps[4].dropped[NOT_VERIFIED]
    if unverified:
        print(f"note: {unverified} rows were dropped because their answer is not an exact "
              "match; judge them with --judge-url/--judge-model, or keep them with "
              f"--no-require-correct (counted as '{KEPT_UNVERIFIED}')")


def print_step(number: int, step: StepCount) -> None:
    from turnstile.learner.sft_data import SCHEMA_MISMATCHES, STEP_NAMES, schema_mismatch_lines

    mismatch_events = {event for events in SCHEMA_MISMATCHES.values() for event in events}
    print(f"step {number} {step.name}: {step.rows_in} rows in, {step.rows_out} rows out")
    for event, count in step.events.items():
        if event not in mismatch_events:  # said in a sentence below
            print(f"  {event}: {count}")
    if step.name == STEP_NAMES[0]:
        for line in schema_mismatch_lines(step.events):
            print(f"  {line}")
    for reason, count in sorted(step.dropped.items()):
        print(f"  dropped ({reason}): {count}")

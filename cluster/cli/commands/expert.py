"""``turnstile expert``: run the scripted expert on synthetic questions through the real tools.

The end-to-end check of the offline stack (corpus server, search index, visit tool with Chromium,
environment, protocol): it prints accuracy, tool calls per question and how many questions took
100+ tool calls. The acceptance target is >= 95% correct and >= 20 such long questions out of 200.
"""

from __future__ import annotations

import argparse
import asyncio

NAME = "expert"
HELP = "Run the scripted expert on synthetic-world questions end to end and report its accuracy."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=int, default=200, help="number of questions (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic world seed (default 0)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="episodes run at the same time (default 8)")
    parser.add_argument("--min-accuracy", type=float, default=0.0,
                        help="exit with status 1 when accuracy is below this (e.g. 0.95)")
    parser.add_argument("--min-long", type=int, default=0,
                        help="exit with status 1 when fewer questions were long runs (100+ tool calls)")


def run(args: argparse.Namespace) -> int:
    # imported here: the command line (and --help) starts without them
    from tqdm import tqdm

    from turnstile.envs.synthetic.evaluate import QuestionResult, evaluate_expert

    if args.questions < 1 or args.concurrency < 1:
        print("turnstile expert: --questions and --concurrency must be at least 1")
        return 2
    with tqdm(total=args.questions, unit="question") as bar:
        correct = 0

        def advance(result: QuestionResult) -> None:
            nonlocal correct
            correct += result.correct
            bar.update(1)
            bar.set_postfix(correct=correct, calls=result.tool_calls)

        report = asyncio.run(evaluate_expert(args.questions, args.seed, args.concurrency,
                                             on_result=advance))
    print(report.summary())
    ok = report.accuracy >= args.min_accuracy and report.long_runs >= args.min_long
    return 0 if ok else 1

"""The ``turnstile`` command line: one sub-command per module in ``cluster/cli/commands``.

Each command module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("serve_corpus", "episode", "expert", "build_model", "rollout", "score", "credit", "data", "sft", "plan",
            "train", "eval", "view")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command with its help line; the arguments of the one ``argv`` names (all, without
    ``argv``). A command module imports what its work needs when it runs, so ``turnstile --help``
    and a command's ``--help`` start without torch, vLLM or Ray."""
    chosen = next((word for word in argv if not word.startswith("-")), "") if argv is not None else None
    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMANDS:
        module = importlib.import_module(f"{__name__}.commands.{module_name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        if chosen is None or chosen == module.NAME:
            module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        code = args._run(args)  # noqa: SLF001 - the command's own attribute, set in build_parser
    except KeyboardInterrupt:
        print("turnstile: interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code)

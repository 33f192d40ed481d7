"""What an engine (and the plan, :mod:`turnstile.cluster.jobs.plan`) needs to know of a model before
loading it: how long a sequence it takes, what its key-value cache costs a token, how many
parameters it has and what a token's activations cost. Read from the model's ``config.json`` alone
(no weights).

``engine.max_model_len: 0`` (the default) follows the model: its config's maximum positions, or
less where the run needs less (:func:`follow_model`). On vLLM-CPU the KV cache is an explicit size;
:func:`kv_cache_bytes` derives it from the model's layers, key-value heads and head size, and refuses
a size that cannot hold one sequence, saying how much would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from turnstile.rollout.engines.config import EngineConfig

# The names model configs give their maximum sequence length (vLLM reads the same ones; the
# smallest wins) and their key-value head count.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")
KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
CPU_BLOCK_TOKENS = 128  # vLLM-CPU's KV cache block (vllm/platforms/cpu.py)
CPU_MIN_KV_CACHE_BYTES = 256 << 20  # the CPU default never goes below what the tiny model always had
CPU_KV_SEQUENCES = 4  # whole sequences the default CPU cache holds (more run; vLLM preempts and recomputes)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    positions: int | None  # the longest sequence the config allows; None where it names none
    hidden: int = 0
    heads: int = 0  # query heads
    mlp: int = 0  # the MLP's inner width
    vocab: int = 0
    tied: bool = False  # the LM head shares the embedding's weights

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v and output projections, a gated MLP, two norms."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q_dim + 2 * kv_dim) + 3 * self.hidden * self.mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params * (1 if self.tied else 2) + self.hidden

    def layer_activations(self, tokens: int, dtype_bytes: int = 2) -> float:
        """Bytes one decoder layer keeps for backward over ``tokens``, as autograd saves them in a
        Hugging Face decoder layer: each norm's input and output (4 x hidden); q, its normed and
        rotated copies, keys and values repeated to the query heads, attention's output and its
        reshaped copy (7 x q); k, its normed and rotated copies, v (4 x kv); the MLP's gate, its
        activation, up and their product (4 x MLP). Attention itself keeps no tokens x tokens matrix
        (flash or SDPA). Models without q/k norms keep a little less."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_token = 4 * self.hidden + 7 * q_dim + 4 * kv_dim + 4 * self.mlp
        return float(dtype_bytes) * tokens * per_token

    def kv_bytes_per_token(self, dtype: str, tensor_parallel: int = 1) -> int:
        """Keys and values of every layer for one token, on one tensor-parallel rank."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"engine.dtype={dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        return 2 * self.layers * max(1, self.kv_heads // tensor_parallel) * self.head_dim * DTYPE_BYTES[dtype]

    def kv_bytes_for(self, tokens: int, dtype: str, tensor_parallel: int = 1,
                     block: int = CPU_BLOCK_TOKENS) -> int:
        """One sequence of ``tokens`` in whole blocks, plus the block vLLM keeps empty."""
        return (-(-tokens // block) + 1) * block * self.kv_bytes_per_token(dtype, tensor_parallel)


def model_shape(model: str) -> ModelShape:
    """The shape of the model in directory (or hub cache name) ``model``, from its config; a
    ValueError in one line where there is no readable config.json."""
    from pathlib import Path

    from transformers import AutoConfig

    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        raise ValueError(f"{model} has no config.json: give a Hugging Face model directory (config.json, "
                         "tokenizer, weights)")
    try:
        config = AutoConfig.from_pretrained(model).get_text_config()  # a multimodal model's language part
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{model}: no readable Hugging Face config.json there ({str(error).splitlines()[0][:160]}); "
                         "give a model directory (config.json, tokenizer, weights)") from None
    heads = int(config.num_attention_heads)
    kv_heads = next((int(value) for key in KV_HEAD_KEYS if (value := getattr(config, key, None))), heads)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    positions = [int(value) for key in POSITION_KEYS if (value := getattr(config, key, None))]
    mlp = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden)
    return ModelShape(layers=int(config.num_hidden_layers), kv_heads=kv_heads, head_dim=head_dim,
                      positions=min(positions) if positions else None, hidden=hidden, heads=heads, mlp=mlp,
                      vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)))


def follow_model(engine: EngineConfig, model: str, room: int | None = None) -> EngineConfig:
    """``engine`` on ``model`` with ``max_model_len`` as set, or (0) the model's maximum positions,
    or ``room`` tokens where the run never needs more."""
    engine = replace(engine, model=model)
    if engine.max_model_len:
        return engine
    positions = model_shape(model).positions
    if positions is None and room is None:
        raise ValueError(f"engine.max_model_len=0 follows the model, and {model}'s config names no maximum "
                         "length: set engine.max_model_len")
    return replace(engine, max_model_len=min(p for p in (positions, room) if p is not None))


def kv_cache_bytes(engine: EngineConfig, shape: ModelShape, cpu: bool) -> int | None:
    """The KV cache size to give vLLM (None: vLLM sizes it from ``gpu_memory_utilization``).

    On CPU, unset (0), it holds :data:`CPU_KV_SEQUENCES` sequences of ``engine.max_model_len``
    tokens (at least 256 MiB). Set, it must hold one: a ValueError names the setting and the size."""
    length = engine.max_model_len or shape.positions or 0
    tensor_parallel = engine.vllm.tensor_parallel_size
    one = shape.kv_bytes_for(length, engine.dtype, tensor_parallel, CPU_BLOCK_TOKENS if cpu else 16)
    given = engine.vllm.kv_cache_memory_bytes
    if given and length and given < one:
        raise ValueError(
            f"engine.vllm.kv_cache_memory_bytes={given} cannot hold one sequence of engine.max_model_len={length} "
            f"tokens of this model: that takes {one} bytes ({one / 2**30:.2f} GiB: keys and values of "
            f"{shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} in {engine.dtype}); raise it "
            "to at least that, or lower engine.max_model_len")
    if given or not cpu:
        return given or None
    return max(CPU_MIN_KV_CACHE_BYTES, min(CPU_KV_SEQUENCES, engine.vllm.max_num_seqs) * one)

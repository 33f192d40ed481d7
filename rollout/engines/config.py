"""Engine configuration: one typed config, with a section per engine kind.

Kept apart from the engines so reading a config never imports vLLM or torch models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HFEngineConfig:
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    max_batch: int = 8  # sequences per forward when scoring


@dataclass
class VllmEngineConfig:
    # On GPUs, vLLM's own sizing. On CPU it is a share of the memory node minus the process' own
    # memory, which is fragile; kv_cache_memory_bytes is what sizes it there.
    gpu_memory_utilization: float = 0.05
    # KV cache size in bytes; 0 = on GPUs size it from gpu_memory_utilization, on CPU from the
    # model: 4 sequences of max_model_len tokens, at least 256 MiB (rollout/engines/shape.py). A size
    # that cannot hold one sequence is refused at start, with the size that would.
    kv_cache_memory_bytes: int = 0
    enforce_eager: bool = True
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    # Tokens per KV-cache block, the prefix cache's unit; 0 = vLLM's own (128 on CPU, 16 on GPUs).
    # An information-gain probe forwards the context's last, partly filled block again: about half a
    # block on average (on CPU the smallest block vLLM takes is 32).
    block_size: int = 0
    tensor_parallel_size: int = 1
    # How new weights reach the engine: "inplace" (same process: CPU, or a colocated learner),
    # "nccl" (vLLM's weight-transfer engine from the learner's GPUs), "checkpoint" (a shared dir).
    weight_sync: str = "inplace"
    checkpoint_dir: str = ""


@dataclass
class ScriptedEngineConfig:
    mode: str = "expert"  # "expert": the scripted expert (synthetic plans, clue chains); "replay": recorded turns
    replay_path: str = ""  # trajectories JSONL for mode=replay
    report: bool = False  # write a <report> block (iter_research protocol)
    # the share of chain questions the expert answers from the search listing, unread (a guess)
    hasty_fraction: float = 0.0
    # the share of chain questions of 2+ hops on which it stops early, answering with a bridge entity
    early_fraction: float = 0.0
    world_seed: int = 0
    world_entities: int = 3000
    questions: dict[str, Any] = field(default_factory=dict)  # the synthetic data's options (data.options)
    # Another data set's tasks, whose clue chains the expert follows (HotpotQA, MuSiQue: a
    # DatasetConfig's fields); empty: the synthetic world's. A rollout sets it from its own data.
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hasty_fraction", "early_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"engine.scripted.{name}={getattr(self, name)} must be in [0, 1]")


@dataclass
class EngineConfig:
    """Which engine, on which model, and each engine's own options.

    ``kind`` is a registered engine name (entry-point group ``turnstile.engines``: vllm, hf,
    scripted) or ``package.module:Class``. ``model`` is a Hugging Face model directory or hub name;
    empty means the default tiny model, built locally on first use (``turnstile build-model``).
    The built-in engines read their section (``hf``, ``vllm``, ``scripted``); an engine from another
    package reads ``options`` (with :func:`turnstile.envs.plugins.typed_options` and a dataclass of its own).
    """

    kind: str = "vllm"
    model: str = ""
    dtype: str = "float32"
    seed: int = 0
    # Longest sequence (prompt + generation) the engine takes; 0 = follow the model: its config's
    # maximum positions, or in a run no more than the context budget and one turn need.
    max_model_len: int = 0
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    scripted: ScriptedEngineConfig = field(default_factory=ScriptedEngineConfig)
    options: dict[str, Any] = field(default_factory=dict)  # an engine of another package: its own options

"""An engine's length and KV cache from its model's config (rollout/engines/shape.py): read from
config.json alone, following the model unless set, and a KV cache that cannot hold one sequence
refused with the size that would."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
from turnstile.rollout.engines.shape import CPU_MIN_KV_CACHE_BYTES, follow_model, kv_cache_bytes, model_shape
from turnstile.rollout.model_store import ensure_default_model

# Llama-3-8B's shape (no head_dim in its config: hidden / heads), without weights.
LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}


def config_dir(tmp_path: Path, **fields: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return str(tmp_path)


def test_the_shape_is_read_from_the_config(tmp_path: Path) -> None:
    shape = model_shape(config_dir(tmp_path))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.positions) == (32, 8, 128, 8192)
    assert shape.kv_bytes_per_token("float32") == 2 * 32 * 8 * 128 * 4
    assert shape.kv_bytes_for(8192, "float32") == (64 + 1) * 128 * 262_144  # whole blocks and the null block
    tiny = model_shape(str(ensure_default_model()))
    assert tiny.kv_bytes_per_token("float32") == 2 * tiny.layers * tiny.kv_heads * tiny.head_dim * 4


def test_the_length_follows_the_model_unless_set(tmp_path: Path) -> None:
    model = config_dir(tmp_path)
    assert follow_model(EngineConfig(), model).max_model_len == 8192  # the model's positions
    assert follow_model(EngineConfig(), model, room=3232).max_model_len == 3232  # what the run needs
    assert follow_model(EngineConfig(max_model_len=1024), model, room=3232).max_model_len == 1024  # as set
    assert follow_model(EngineConfig(), model).model == model


def test_a_config_without_a_length_needs_one_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from turnstile.rollout.engines import shape

    model = config_dir(tmp_path)
    monkeypatch.setattr(shape, "model_shape", lambda _model: replace(model_shape(model), positions=None))
    with pytest.raises(ValueError, match=r"names no maximum length: set engine\.max_model_len"):
        follow_model(EngineConfig(), model)
    assert follow_model(EngineConfig(), model, room=4096).max_model_len == 4096


def test_the_cpu_kv_cache_holds_sequences_of_the_model_and_a_small_one_is_refused(tmp_path: Path) -> None:
    shape = model_shape(config_dir(tmp_path))
    one = 2_181_038_080  # one 8,192-token sequence of Llama-3-8B's shape in float32
    engine = EngineConfig(max_model_len=8192)
    assert kv_cache_bytes(engine, shape, cpu=True) == 4 * one
    assert kv_cache_bytes(engine, shape, cpu=False) is None  # on GPUs vLLM sizes it
    tiny = model_shape(str(ensure_default_model()))  # 4 sequences of 512 tokens: far below the floor
    assert kv_cache_bytes(EngineConfig(max_model_len=512), tiny, cpu=True) == CPU_MIN_KV_CACHE_BYTES
    refused = EngineConfig(max_model_len=8192, vllm=VllmEngineConfig(kv_cache_memory_bytes=256 << 20))
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes=268435456 cannot hold one sequence of "
                                         rf"engine.max_model_len=8192 tokens of this model: that takes {one} bytes"):
        kv_cache_bytes(refused, shape, cpu=True)
    enough = EngineConfig(max_model_len=8192, vllm=VllmEngineConfig(kv_cache_memory_bytes=one))
    assert kv_cache_bytes(enough, shape, cpu=True) == one

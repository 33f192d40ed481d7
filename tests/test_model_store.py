"""The default tiny model: built locally, protocol tags as single tokens, loads with transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnstile.rollout.model_store import (
    BUILD_INFO,
    PROTOCOL_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    ensure_default_model,
)

SMALL = TinyModelSpec(name="test-tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      head_dim=8, tokenizer_world_entities=3000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", SMALL)


def test_tokenizer_keeps_protocol_tags_whole(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for tag in PROTOCOL_TOKENS:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids) == tag
    text = '<think>\nfind it\n</think>\n<tool_call>\n{"name": "search"}\n</tool_call>'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_chatml(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


def test_model_loads_and_runs(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = json.loads((model_dir / BUILD_INFO).read_text())
    assert config["hidden_size"] == 32 and model.config.vocab_size == SMALL.vocab_size
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, SMALL.vocab_size) and torch.isfinite(logits).all()


def test_refuses_to_overwrite(model_dir: Path) -> None:
    with pytest.raises(FileExistsError, match="--force"):
        build_tiny_model(model_dir, SMALL)


def test_concurrent_first_use_builds_once(tmp_path: Path) -> None:
    code = ("from turnstile.rollout.model_store import ensure_default_model, TinyModelSpec as S;"
            "print(ensure_default_model(S(name='race', hidden_size=32, intermediate_size=64,"
            " num_hidden_layers=1, head_dim=8, tokenizer_world_entities=3000)))")
    env = {"TURNSTILE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = {proc.communicate(timeout=300)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(outputs) == 1
    built = Path(outputs.pop())
    assert (built / BUILD_INFO).is_file()
    assert [p.name for p in built.parent.iterdir() if not p.name.startswith(".")] == [built.name]


def test_default_model_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path))
    first = ensure_default_model(SMALL)
    stamp = (first / BUILD_INFO).stat().st_mtime_ns
    assert ensure_default_model(SMALL) == first and (first / BUILD_INFO).stat().st_mtime_ns == stamp

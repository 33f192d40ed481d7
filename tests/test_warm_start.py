"""The warm start of the embedded default: the question mix it is made for, the committed model
directory, and its rebuild (``turnstile build-model tiny-qwen3-sft``) against the committed copy."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.cli import main
from cluster.warm_start import DEFAULT_TASKS, WarmStartRecipe
from envs.datasets.generic import DatasetError
from envs.datasets.registry import DatasetConfig, load_tasks
from envs.synthetic.dataset import question_config
from rollout.model_store import BUILD_INFO, RANDOM_MODEL, WARM_MODEL, resolve_model, warm_model_path

REBUILD_TOLERANCE = 0.02
"""Largest relative L2 distance between the rebuilt and the committed weights (all tensors). On the
machine that built the committed copy a rebuild is bit-identical (measured: 0.0); a CPU with other
vector units sums in another order, and 300 optimiser steps carry that difference forward."""


def test_question_options_are_checked() -> None:
    assert question_config({"min_hops": 0, "max_hops": 1}).max_hops == 1
    with pytest.raises(DatasetError, match="unknown option 'hops'.*min_hops"):
        question_config({"hops": 2})
    with pytest.raises(DatasetError, match="max_hops='2' must be a int"):
        question_config({"max_hops": "2"})
    with pytest.raises(DatasetError, match="min_hops must be >= 0 and <= questions.max_hops"):
        question_config({"min_hops": 3, "max_hops": 1})


def test_the_default_mix_needs_one_or_two_pages() -> None:
    tasks = load_tasks(DatasetConfig(kind="synthetic", path="", split="all", options=dict(DEFAULT_TASKS)))
    assert len(tasks) == DEFAULT_TASKS["count"]
    pages = [len({url for clue in task.clues for url in clue.evidence_urls}) for task in tasks]
    assert set(pages) == {1, 2}
    assert 0.4 < pages.count(1) / len(pages) < 0.8  # some questions need a second page
    zero_hop = [t for t in tasks if t.metadata["hops"] == 0]
    assert zero_hop and all(t.metadata["attribute"] is not None for t in zero_hop)  # about the start itself
    held_out = load_tasks(DatasetConfig(kind="synthetic", path="", split="eval", options=dict(DEFAULT_TASKS)))
    assert len(held_out) >= 64 and not {t.id for t in held_out} & {
        t.id for t in load_tasks(DatasetConfig(kind="synthetic", path="", split="train",
                                               options=dict(DEFAULT_TASKS)))}


def test_models_known_by_name() -> None:
    assert resolve_model(RANDOM_MODEL) == resolve_model("")
    assert resolve_model("/some/dir") == "/some/dir"
    warm = Path(resolve_model(WARM_MODEL))
    assert warm == warm_model_path()
    info = json.loads((warm / BUILD_INFO).read_text())
    assert info["name"] == WARM_MODEL and "scripted expert" in info["what"]
    assert info["made_by"].startswith(f"turnstile build-model {WARM_MODEL}")
    assert info["recipe"] == json.loads(json.dumps(asdict(WarmStartRecipe())))  # the recipe in the code
    files = {p.name: p.stat().st_size for p in warm.iterdir()}
    assert sum(files.values()) <= 10 * 2**20 and "model.safetensors" in files
    # The same tokenizer as the random tiny model it was trained from.
    base = Path(resolve_model(RANDOM_MODEL))
    assert (warm / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()


def test_warm_model_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["build-model", WARM_MODEL])
    assert done.value.code == 2 and "needs --out" in capsys.readouterr().out


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a)
    size = sum(float(b[k].double().norm() ** 2) for k in b)
    return (diff / size) ** 0.5


@pytest.mark.slow
@pytest.mark.integration
def test_rebuild_matches_the_committed_copy(ray_local: None, tmp_path: Path,  # noqa: ARG001
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["build-model", WARM_MODEL, "--out", str(tmp_path / "warm"), "--no-progress"])
    assert done.value.code == 0, capsys.readouterr().out
    committed, rebuilt = warm_model_path(), tmp_path / "warm"
    ours, theirs = json.loads((rebuilt / BUILD_INFO).read_text()), json.loads((committed / BUILD_INFO).read_text())
    assert ours["data"]["sha256"] == theirs["data"]["sha256"]  # the same expert tokens, in the same order
    distance = relative_distance(load_file(rebuilt / "model.safetensors"), load_file(committed / "model.safetensors"))
    assert distance <= REBUILD_TOLERANCE, distance

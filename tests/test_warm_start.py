"""The warm start: the question mix it is made for, models known by name, and its recipe
(``turnstile build-model tiny-qwen3-sft``) on a small scale."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from cluster.cli import main
from cluster.warm_start import (
    CHECK_SEQUENCES,
    DEFAULT_TASKS,
    TRACE_STEPS,
    RepeatedRuns,
    WarmStartRecipe,
    loss_weights,
)
from envs.datasets.generic import DatasetError
from envs.datasets.registry import DatasetConfig, load_tasks
from envs.synthetic.dataset import question_config
from rollout.model_store import BUILD_INFO, RANDOM_MODEL, WARM_MODEL, resolve_model, warm_model_path

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


def test_models_known_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import rollout.model_store as store

    assert resolve_model(RANDOM_MODEL) == resolve_model("")
    assert resolve_model("/some/dir") == "/some/dir"
    monkeypatch.setattr(store, "COMMITTED", tmp_path)
    with pytest.raises(FileNotFoundError, match=f"turnstile build-model {WARM_MODEL} --out"):
        resolve_model(WARM_MODEL)
    (tmp_path / WARM_MODEL).mkdir()
    (tmp_path / WARM_MODEL / BUILD_INFO).write_text("{}")
    assert resolve_model(WARM_MODEL) == str(tmp_path / WARM_MODEL) == str(warm_model_path())


def test_warm_model_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["build-model", WARM_MODEL])
    assert done.value.code == 2 and "needs --out" in capsys.readouterr().out


@pytest.mark.integration
def test_a_small_recipe_builds_a_model_that_says_what_it_is(ray_local: None, tmp_path: Path) -> None:  # noqa: ARG001
    from transformers import AutoModelForCausalLM

    from cluster.warm_start import build_warm_model

    recipe = WarmStartRecipe(tasks={**DEFAULT_TASKS, "count": 60}, corpus_ports=(0,), induction_steps=2,
                             induction_batch=4, steps=2, batch=2)
    target = build_warm_model(tmp_path / "warm", recipe, progress=False)
    info = json.loads((target / BUILD_INFO).read_text())
    assert info["name"] == WARM_MODEL and "scripted expert" in info["what"]
    assert info["made_by"].startswith(f"turnstile build-model {WARM_MODEL}")
    assert info["recipe"] == json.loads(json.dumps(asdict(recipe)))
    assert info["data"]["episodes"] >= 40 and info["data"]["policy_tokens"] < info["data"]["tokens"]
    assert len(info["data"]["sha256"]) == 64 and info["train"]["seconds"] > 0
    check = info["check"]
    assert check["sequences"] == min(CHECK_SEQUENCES, info["data"]["sequences"])
    assert len(check["trace"]["induction"]) == len(check["trace"]["sft"]) == TRACE_STEPS
    assert (target / "tokenizer.json").read_text() == (Path(resolve_model(RANDOM_MODEL)) / "tokenizer.json").read_text()
    base = AutoModelForCausalLM.from_pretrained(resolve_model(RANDOM_MODEL))
    tuned = AutoModelForCausalLM.from_pretrained(target)
    moved = [name for name, p in tuned.named_parameters() if not torch.equal(p, base.get_parameter(name))]
    assert moved  # two optimiser steps changed the weights
    with pytest.raises(FileExistsError, match="--force"):
        build_warm_model(target, recipe, progress=False)


def test_loss_weights_skip_the_prompt_and_weigh_tool_results() -> None:
    assert loss_weights([0, 0, 1, 1, 0, 0, 1], 0.2) == [0, 0, 1, 1, 0.2, 0.2, 1]
    assert loss_weights([0, 0, 0], 0.2) == [0, 0, 0]  # nothing the policy wrote: no loss


def test_the_copying_task_teaches_a_random_model_to_copy() -> None:
    """The copying stage's task, on a 64-token pool: the random tiny model predicts the second copy
    no better than chance (ln 64 = 4.2), and after 200 steps nearly perfectly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(RANDOM_MODEL))
    runs = RepeatedRuns(list(range(100, 164)), seed=0)
    with torch.no_grad():
        before = float(runs.loss(model, 16))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0)
    for _ in range(200):
        loss = runs.loss(model, 32)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        optimiser.zero_grad()
    with torch.no_grad():
        after = float(runs.loss(model, 16))
    assert before > 4.0 and after < 0.5, (before, after)
    with pytest.raises(ValueError, match="non-empty"):
        RepeatedRuns([], seed=0)



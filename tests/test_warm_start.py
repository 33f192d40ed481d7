"""The warm start: the question mix it is made for, models known by name, and their recipes
(``turnstile build-model tiny-qwen3-sft``, ``turnstile build-model tiny-qwen3-mixed``) on a small
scale."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from turnstile.cluster.cli import main
from turnstile.cluster.jobs.defaults import DEFAULT_TASKS
from turnstile.cluster.recipes.warm_start import (
    CHECK_SEQUENCES,
    RECIPES,
    TRACE_STEPS,
    RepeatedRuns,
    WarmStartRecipe,
    loss_weights,
)
from turnstile.envs.datasets.generic import DatasetError
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.synthetic.dataset import question_config
from turnstile.rollout.model_store import (
    BUILD_INFO,
    COMMITTED_MODELS,
    RANDOM_MODEL,
    SFT_MODEL,
    WARM_MODEL,
    committed_model_path,
    resolve_model,
)


def test_question_options_are_checked() -> None:
    assert question_config({"min_hops": 0, "max_hops": 1}).max_hops == 1
    with pytest.raises(DatasetError, match=r"unknown option 'hops'.*min_hops"):
        question_config({"hops": 2})
    with pytest.raises(DatasetError, match="bad value for option 'max_hops'"):
        question_config({"max_hops": "two"})
    with pytest.raises(DatasetError, match="option 'seed' is set by the dataset config"):
        question_config({"seed": 3})
    with pytest.raises(DatasetError, match=r"min_hops must be >= 0 and <= questions.max_hops"):
        question_config({"min_hops": 3, "max_hops": 1})


def test_a_recipe_trains_on_whole_episodes() -> None:
    """A recipe whose episodes may run longer than its training sequences is refused: the cut
    sequences lose their last turns (the multi-hop warm start's second build never learnt to write
    a turn past ~3,000 tokens of context for that reason)."""
    with pytest.raises(ValueError, match="max_length=3072 is below context_budget=4096"):
        WarmStartRecipe(context_budget=4096)
    assert all(recipe.max_length >= recipe.context_budget for recipe in RECIPES.values())


def test_the_default_mix_asks_the_name_one_relation_away() -> None:
    tasks = load_tasks(DatasetConfig(kind="synthetic", path="", split="all", options=dict(DEFAULT_TASKS)))
    assert len(tasks) == DEFAULT_TASKS["count"]
    assert {len({url for clue in task.clues for url in clue.evidence_urls}) for task in tasks} == {1}
    assert all(t.metadata["hops"] == 1 and t.metadata["attribute"] is None for t in tasks)
    assert all(t.question.startswith("What is the name of the ") for t in tasks)
    assert len({t.metadata["path"][0][1] for t in tasks}) == 16  # every relation of the schema
    held_out = load_tasks(DatasetConfig(kind="synthetic", path="", split="eval", options=dict(DEFAULT_TASKS)))
    assert len(held_out) >= 64 and not {t.id for t in held_out} & {
        t.id for t in load_tasks(DatasetConfig(kind="synthetic", path="", split="train",
                                               options=dict(DEFAULT_TASKS)))}


def test_models_known_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import turnstile.rollout.model_store as store

    assert resolve_model(RANDOM_MODEL) == resolve_model("")
    assert resolve_model("/some/dir") == "/some/dir"
    monkeypatch.setattr(store, "COMMITTED", tmp_path)
    for name in COMMITTED_MODELS:
        with pytest.raises(FileNotFoundError, match=f"turnstile build-model {name} --out"):
            resolve_model(name)
        (tmp_path / name).mkdir()
        (tmp_path / name / BUILD_INFO).write_text("{}")
        assert resolve_model(name) == str(tmp_path / name) == str(committed_model_path(name))


@pytest.mark.parametrize("name", COMMITTED_MODELS)
def test_committed_models_need_out(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["build-model", name])
    assert done.value.code == 2 and "needs --out" in capsys.readouterr().out


@pytest.mark.integration
def test_a_small_recipe_builds_a_model_that_says_what_it_is(ray_local: None, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from turnstile.cluster.recipes.warm_start import build_warm_model

    recipe = WarmStartRecipe(tasks={**DEFAULT_TASKS, "count": 60}, corpus_ports=(0,), induction_steps=2,
                             induction_batch=4, steps=2, batch=2)
    target = build_warm_model(tmp_path / "warm", recipe, name=SFT_MODEL, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm"]  # the build's data and checkpoints are gone
    info = json.loads((target / BUILD_INFO).read_text())
    assert info["name"] == SFT_MODEL and "scripted expert" in info["what"]
    assert info["made_by"].startswith(f"turnstile build-model {SFT_MODEL}")
    assert info["recipe"] == json.loads(json.dumps(asdict(recipe)))
    assert info["data"]["episodes"] >= 40 and info["data"]["policy_tokens"] < info["data"]["tokens"]
    assert len(info["data"]["sha256"]) == 64 and info["train"]["seconds"] > 0 and info["data"]["seconds"] > 0
    check = info["check"]
    assert check["sequences"] == min(CHECK_SEQUENCES, info["data"]["sequences"])
    assert len(check["trace"]["induction"]) == recipe.induction_steps < TRACE_STEPS == len(check["trace"]["sft"])
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


@pytest.mark.slow  # 200 optimiser steps: about a minute, kept out of the fast tier
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




# ---- the committed models (rollout/models/tiny-qwen3-sft, rollout/models/tiny-qwen3-mixed) -------

@pytest.mark.parametrize("name", COMMITTED_MODELS)
def test_the_committed_models_say_what_they_are(name: str) -> None:
    """One version, safetensors, at most 10 MB, made by its recipe on the random model's tokenizer."""
    path = committed_model_path(name)
    weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    assert weights == ["model.safetensors"]
    assert sum(p.stat().st_size for p in path.iterdir()) <= 10 * 2**20
    info = json.loads((path / BUILD_INFO).read_text())
    assert info["name"] == name and info["made_by"].startswith(f"turnstile build-model {name}")
    # the recipe in the code; a field added since records nothing and has its default, which is
    # what the build did (early_fraction 0, the default's turns and context)
    recipe = json.loads(json.dumps(asdict(RECIPES[name])))
    defaults = json.loads(json.dumps(asdict(WarmStartRecipe())))
    assert {key: recipe[key] for key in info["recipe"]} == info["recipe"]
    assert all(recipe[key] == defaults[key] for key in recipe.keys() - info["recipe"].keys())
    assert (path / "tokenizer.json").read_text() == (Path(resolve_model(RANDOM_MODEL)) / "tokenizer.json").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("name", COMMITTED_MODELS)
def test_the_committed_models_rebuild(name: str, ray_local: None, tmp_path: Path) -> None:
    """The CI-sized rebuild: the expert's first 40 training tasks give the committed data's first
    sequences (same digest) and the first steps of each stage give the recorded losses (within 1e-3:
    float sums differ between CPUs and thread counts)."""
    from turnstile.cluster.recipes.warm_start import expert_trajectories, rebuild_record, training_sequences

    recipe = RECIPES[name]
    info = json.loads((committed_model_path(name) / BUILD_INFO).read_text())
    head = expert_trajectories(recipe, tmp_path / "train.jsonl", progress=False, limit=40, shards=1)
    sequences = training_sequences(head, recipe.max_length)
    assert len(sequences) >= CHECK_SEQUENCES
    rebuilt = rebuild_record(Path(resolve_model(recipe.base)), sequences[:CHECK_SEQUENCES], recipe)
    assert rebuilt["sha256"] == info["check"]["sha256"]
    for stage in ("induction", "sft"):
        assert rebuilt["trace"][stage] == pytest.approx(info["check"]["trace"][stage], abs=1e-3)


@pytest.mark.integration
def test_the_models_read_the_answer_off_the_page_and_the_warm_start_sometimes_does_not_open_it(
        ray_local: None, tmp_path: Path) -> None:
    """What the models are for, teacher-forced on held-out expert trajectories: tiny-qwen3-sft
    predicts the answer's tokens whole where the random model predicts none; and after the search
    listing, the warm start begins the hasty agent's turn ("I answer from the search listing")
    with a probability between 0.2 and 0.8 on average, where tiny-qwen3-sft almost never does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnstile.cluster.recipes.warm_start import expert_trajectories, training_sequences

    recipe = RECIPES[SFT_MODEL]
    held_out = expert_trajectories(recipe, tmp_path / "eval.jsonl", progress=False, split="eval", limit=24)
    sequences = [ids for ids, _ in training_sequences(held_out, recipe.max_length)]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(RANDOM_MODEL))
    tags = tokenizer.convert_tokens_to_ids(["<answer>", "</answer>"])
    models = {name: AutoModelForCausalLM.from_pretrained(resolve_model(name)).eval()
              for name in (RANDOM_MODEL, SFT_MODEL, WARM_MODEL)}
    whole = {name: sum(answer_predicted_whole(models[name], ids, *tags) for ids in sequences)
             for name in (SFT_MODEL, RANDOM_MODEL)}
    assert whole[RANDOM_MODEL] == 0 and whole[SFT_MODEL] >= len(held_out) // 2, whole

    # the context of each episode's second turn: everything before its response
    second = [t.turns[1] for t in held_out]
    contexts = [ids[: t.context_len] for ids, t in zip(sequences, second, strict=True)]
    hasty = {name: sum(turn_start_probability(models[name], tokenizer, ids, "I answer from the search listing")
                       for ids in contexts) / len(contexts) for name in (SFT_MODEL, WARM_MODEL)}
    assert hasty[SFT_MODEL] < 0.05 and 0.2 < hasty[WARM_MODEL] < 0.8, hasty


def turn_start_probability(model: torch.nn.Module, tokenizer: object, context: list[int], text: str) -> float:
    """The model's probability that the turn after ``context`` begins ``<think>`` then ``text``."""
    wanted = tokenizer.encode("<think>\n" + text)  # type: ignore[attr-defined]
    ids = torch.tensor([context + wanted])
    with torch.no_grad():
        log_probs = model(input_ids=ids).logits[0, len(context) - 1: -1].log_softmax(-1)
    return float(log_probs.gather(1, torch.tensor(wanted)[:, None]).sum().exp())


def answer_predicted_whole(model: torch.nn.Module, ids: list[int], open_tag: int, close_tag: int) -> bool:
    """Whether the model's argmax, teacher-forced, is every token of the final answer and its
    closing tag (the last ``<answer>``: the system prompt names the tags too)."""
    start = len(ids) - 1 - ids[::-1].index(open_tag)
    end = len(ids) - 1 - ids[::-1].index(close_tag)
    with torch.no_grad():
        predicted = model(input_ids=torch.tensor([ids[:end]])).logits[0].argmax(-1).tolist()
    return all(predicted[i - 1] == ids[i] for i in range(start + 1, end + 1))


def test_a_killed_build_continues_from_its_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SFT killed after its second step's checkpoint, run again: the same weights as one run through
    (the model, the optimiser, the schedule, the data order and both random streams are restored)."""
    from safetensors.torch import load_file

    import turnstile.cluster.recipes.warm_start as warm

    monkeypatch.setattr(warm, "CHECKPOINT_EVERY", 2)
    rng = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(20, 4000, (60,), generator=rng).tolist(), [0] * 20 + [1] * 20 + [0] * 10 + [1] * 10)
                 for _ in range(5)]
    recipe = WarmStartRecipe(induction_steps=2, induction_batch=4, steps=5, batch=2, warmup_steps=1)
    base = Path(resolve_model(RANDOM_MODEL))
    warm.train_sft(base, sequences, recipe, tmp_path / "through", progress=False)

    steps = []
    real_record = warm._record

    def killed_at_step_3(trace: list[float], loss: float) -> None:
        steps.append(loss)
        if len(steps) == 2 + 3:  # the copying stage's 2 steps, then SFT's 3rd
            raise KeyboardInterrupt
        real_record(trace, loss)

    monkeypatch.setattr(warm, "_record", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        warm.train_sft(base, sequences, recipe, tmp_path / "killed", progress=False, checkpoint=tmp_path / "state.pt")
    monkeypatch.setattr(warm, "_record", real_record)
    report = warm.train_sft(base, sequences, recipe, tmp_path / "resumed", progress=False,
                            checkpoint=tmp_path / "state.pt")
    through, resumed = (load_file(tmp_path / name / "model.safetensors") for name in ("through", "resumed"))
    assert through.keys() == resumed.keys()
    assert all(torch.equal(through[key], resumed[key]) for key in through)
    assert len(report["trace"]["sft"]) == TRACE_STEPS

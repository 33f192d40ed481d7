"""What the hf engine promises beyond the shared contract: its sampler, KV-cache decoding, weight
updates checked against a fresh transformers model, input errors, and one-at-a-time concurrency.

The contract every engine meets is in ``tests/test_engine_conformance.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engines import (
    MAX_MODEL_LEN,
    SELF_ATOL,
    conformance_prompts,
    engine_config,
    fresh_reference_model,
    max_abs_difference,
    original_weights,
    perturbed_weights,
    reference_logprobs,
)
from turnstile.rollout.engines.base import FINISH_ABORT, FINISH_LENGTH, SamplingParams
from turnstile.rollout.engines.config import EngineConfig, HFEngineConfig
from turnstile.rollout.engines.hf import HFEngine, sample_token, torch_dtype
from turnstile.rollout.engines.registry import build_engine

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture
def engine() -> HFEngine:
    """A fresh engine per test: these tests change weights and close engines."""
    return HFEngine.from_config(engine_config("hf"))


# The sampler.

def test_greedy_picks_the_argmax_and_reports_its_raw_logprob() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    token, logprob = sample_token(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


@pytest.mark.parametrize(("top_p", "allowed"), [(0.5, {0}), (0.6, {0, 1}), (0.79, {0, 1}),
                                                (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p: float, allowed: set[int]) -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, SamplingParams(top_p=top_p), generator)[0] for _ in range(400)}
    assert drawn == allowed


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.integers(1, 6),
       temperature=st.floats(0.05, 3.0), top_p=st.floats(0.05, 1.0))
def test_sampled_tokens_respect_top_k_and_report_raw_logprobs(seed: int, top_k: int,
                                                              temperature: float,
                                                              top_p: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(32, generator=generator) * 3
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    token, logprob = sample_token(logits, sampling, generator)
    assert token in set(torch.topk(logits, top_k).indices.tolist())
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-6)


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"float8.*float32, bfloat16, float16"):
        torch_dtype("float8")


# Building and decoding.

def test_the_registry_builds_the_hf_engine() -> None:
    assert isinstance(build_engine(EngineConfig(kind="hf", max_model_len=MAX_MODEL_LEN)), HFEngine)


async def test_decoding_prefills_once_then_feeds_one_token_per_step(
        engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    model = engine._model  # the engine's own model, to watch what each forward receives
    assert model is not None
    widths: list[int] = []
    original_forward: Callable[..., object] = model.forward

    def recording_forward(*args: object, **kwargs: object) -> object:
        widths.append(int(kwargs["input_ids"].shape[1]))  # type: ignore[union-attr]
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    prompt = conformance_prompts()[2]
    generation = await engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=1))
    assert generation.finish_reason == FINISH_LENGTH
    assert widths == [len(prompt)] + [1] * 9


async def test_generation_stops_at_max_model_len(engine: HFEngine) -> None:
    prompt = [5] * (MAX_MODEL_LEN - 3)
    generation = await engine.generate(prompt, SamplingParams(max_new_tokens=50, seed=1))
    assert len(generation.token_ids) == 3 and generation.finish_reason == FINISH_LENGTH


# Weight updates.

async def test_updated_weights_match_a_fresh_transformers_model(engine: HFEngine) -> None:
    new_weights = perturbed_weights(original_weights(), seed=7)
    reference = fresh_reference_model(weights=new_weights)
    await engine.update_weights(3, new_weights)
    prompt = conformance_prompts()[1]
    generation = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0))
    sequence = list(prompt) + list(generation.token_ids)
    span = (len(prompt), len(sequence))
    expected = reference_logprobs(reference, sequence, span)
    assert generation.weights_version == 3
    assert max_abs_difference(generation.logprobs, expected) <= SELF_ATOL
    assert max_abs_difference((await engine.score([sequence], [span]))[0], expected) <= SELF_ATOL
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([sequence])).logits[0]
    assert tuple(logits[len(prompt) - 1:-1].argmax(dim=-1).tolist()) == generation.token_ids


async def test_a_full_state_dict_with_the_tied_head_is_accepted(engine: HFEngine) -> None:
    weights = perturbed_weights(original_weights(), seed=2)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    await engine.update_weights(4, weights)
    assert await engine.weights_version() == 4


def _without(name: str) -> dict[str, torch.Tensor]:
    weights = original_weights()
    del weights[name]
    return weights


def _with(name: str, value: object) -> dict[str, torch.Tensor]:
    weights: dict[str, object] = dict(original_weights())
    weights[name] = value
    return weights  # type: ignore[return-value]  # deliberately malformed


@pytest.mark.parametrize(("weights", "named"), [
    (lambda: _without("model.layers.2.mlp.up_proj.weight"), r"missing model\.layers\.2\.mlp\.up_proj"),
    (lambda: _with("model.layers.9.extra.weight", torch.zeros(3)), r"unexpected model\.layers\.9\.extra"),
    (lambda: _with("model.norm.weight", torch.ones(64)), r"model\.norm\.weight has shape \(64,\), expected \(128,\)"),
    (lambda: _with("model.norm.weight", [1.0] * 128), r"model\.norm\.weight is a list, not a tensor"),
    (lambda: _with("lm_head.weight", torch.zeros(8192, 128)), r"tied parameters .*lm_head\.weight.* different"),
], ids=["missing", "unexpected", "shape", "not-a-tensor", "tied-mismatch"])
async def test_a_bad_state_dict_is_rejected_and_changes_nothing(
        engine: HFEngine, weights: Callable[[], dict[str, torch.Tensor]], named: str) -> None:
    prompt = conformance_prompts()[0]
    span = (1, len(prompt))
    before = await engine.score([prompt], [span])
    with pytest.raises(ValueError, match=named) as raised:
        await engine.update_weights(9, weights())
    assert "nothing was loaded" in str(raised.value)
    assert await engine.weights_version() == 0
    assert await engine.score([prompt], [span]) == before


# Inputs.

@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 40])
async def test_a_prompt_without_room_to_generate_names_both_lengths(engine: HFEngine,
                                                                    length: int) -> None:
    with pytest.raises(ValueError, match=rf"{length} tokens.*max_model_len is {MAX_MODEL_LEN}"):
        await engine.generate([7] * length, GREEDY)


@pytest.mark.parametrize(("prompt", "message"), [([], "empty"), ([1, 8192], r"outside.*\[8192\]"),
                                                 ([-1, 3], r"outside.*\[-1\]")])
async def test_bad_prompts_are_explained(engine: HFEngine, prompt: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await engine.generate(prompt, GREEDY)


@pytest.mark.parametrize(("spans", "message"), [
    ([(0, 2)], r"span 0 is \[0, 2\).*no prefix"),
    ([(2, 9)], r"span 0 is \[2, 9\) but sequence 0 has 5 tokens"),
    ([(3, 2)], r"span 0 is \[3, 2\)"),
    ([(1, 2), (1, 2)], "1 sequences but 2 spans"),
])
async def test_bad_spans_are_explained(engine: HFEngine, spans: list[tuple[int, int]],
                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await engine.score([[1, 2, 3, 4, 5]], spans)


async def test_score_gives_the_same_log_probs_for_any_batch_size() -> None:
    sequences = [list(prompt) for prompt in conformance_prompts()] * 3
    spans = [(1, len(sequence)) if i % 2 else (len(sequence) - 3, len(sequence))
             for i, sequence in enumerate(sequences)]
    spans[1] = (4, 4)
    results = []
    for max_batch in (1, 2, 8):
        config = EngineConfig(kind="hf", max_model_len=MAX_MODEL_LEN,
                              hf=HFEngineConfig(max_batch=max_batch))
        results.append(await HFEngine.from_config(config).score(sequences, spans))
    for batched in results[1:]:
        for left, right in zip(results[0], batched, strict=True):
            assert max_abs_difference(left, right) <= 1e-5


# Concurrency and shutdown.

async def test_concurrent_generations_complete_while_the_loop_stays_free(engine: HFEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    prompts = conformance_prompts() * 2
    sampling = SamplingParams(max_new_tokens=20, seed=9)
    ticking = asyncio.create_task(ticker())
    try:
        together = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    finally:
        ticking.cancel()
    assert ticks > 10  # the event loop ran while the model worked in its thread
    assert all(len(g.token_ids) == 20 for g in together)
    alone = [await engine.generate(p, sampling) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


async def test_a_cancelled_generation_frees_the_model(engine: HFEngine) -> None:
    long_request = asyncio.create_task(engine.generate(conformance_prompts()[0], SamplingParams(
        max_new_tokens=MAX_MODEL_LEN - 100, seed=1)))
    await asyncio.sleep(0.3)
    long_request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long_request
    started = time.monotonic()
    await engine.generate(conformance_prompts()[0], GREEDY)
    assert time.monotonic() - started < 10  # not waiting for ~1,900 tokens of the cancelled request


async def test_close_aborts_generations_in_flight_and_is_idempotent(engine: HFEngine) -> None:
    in_flight = asyncio.create_task(engine.generate(conformance_prompts()[0], SamplingParams(
        max_new_tokens=MAX_MODEL_LEN - 100, seed=1)))
    await asyncio.sleep(0.3)
    await engine.aclose()
    aborted = await in_flight
    assert aborted.finish_reason == FINISH_ABORT
    assert len(aborted.token_ids) == len(aborted.logprobs) < MAX_MODEL_LEN - 100
    await engine.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate(conformance_prompts()[0], GREEDY)

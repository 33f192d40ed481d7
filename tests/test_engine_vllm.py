"""The ``vllm`` engine against transformers on the same weights (vLLM's CPU build here).

One vLLM engine serves the whole module (it takes ~25–35 s to start on CPU); the lifecycle test
starts a second one. Reference log-probs come from transformers in fp32 on the same model
directory: vLLM's agree to about 1e-5 here, checked at ``LOGPROB_TOLERANCE``.

Run: ``pytest -m integration tests/test_engine_vllm.py``.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from turnstile.rollout.engines.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, PolicyEngine, SamplingParams
from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
from turnstile.rollout.engines.vllm import VllmEngine

LOGPROB_TOLERANCE = 1e-4  # absolute, fp32 vLLM-CPU vs fp32 transformers
MAX_MODEL_LEN = 512
PROMPT = [11, 250, 1033, 77, 4096, 12, 901, 3000]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def engine_config(**vllm_options: object) -> EngineConfig:
    return EngineConfig(kind="vllm", model="", dtype="float32", seed=0,
                        max_model_len=MAX_MODEL_LEN,
                        vllm=VllmEngineConfig(kv_cache_memory_bytes=64 << 20, max_num_seqs=32,
                                              **vllm_options))  # type: ignore[arg-type]


def model_dir() -> Path:
    from turnstile.rollout.model_store import ensure_default_model

    return ensure_default_model()


class Reference:
    """Teacher-forced log-probs from transformers (fp32) on the engine's model directory."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.original = {name: t.clone() for name, t in self.model.state_dict().items()}

    @torch.no_grad()
    def logprobs(self, ids: Sequence[int], start: int, end: int) -> list[float]:
        """log p(ids[i] | ids[:i]) for i in [start, end), at temperature 1."""
        logits = self.model(torch.tensor([list(ids)])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [logp[i - 1, ids[i]].item() for i in range(start, end)]

    def perturbed(self, seed: int) -> Mapping[str, torch.Tensor]:
        """Perturb the reference model's weights in place and return its (HF-named) state dict."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.model.parameters():  # tied embeddings are visited once
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(0.05 * noise * parameter.abs().mean())
        return self.model.state_dict()

    def restore(self) -> Mapping[str, torch.Tensor]:
        self.model.load_state_dict(self.original)
        return self.model.state_dict()


def assert_close(got: Sequence[float], want: Sequence[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    assert worst <= LOGPROB_TOLERANCE, f"max |vLLM - transformers| = {worst:.2e}"


# ------------------------------------------------------------------ fast: no vLLM start


def test_unstarted_engine_is_a_small_picklable_spec() -> None:
    engine = VllmEngine.from_config(engine_config())
    clone = pickle.loads(pickle.dumps(engine.config))
    assert clone == engine.config
    assert isinstance(engine, PolicyEngine)


def test_bad_weight_sync_is_rejected_at_build() -> None:
    with pytest.raises(ValueError, match="weight_sync"):
        VllmEngine.from_config(engine_config(weight_sync="rsync"))
    with pytest.raises(ValueError, match="checkpoint_dir"):
        VllmEngine.from_config(engine_config(weight_sync="checkpoint"))


async def test_prompt_too_long_names_both_lengths_without_starting_vllm() -> None:
    engine = VllmEngine.from_config(engine_config())
    with pytest.raises(ValueError, match=rf"{MAX_MODEL_LEN + 5}.*{MAX_MODEL_LEN}"):
        await engine.generate([7] * (MAX_MODEL_LEN + 5), GREEDY)
    with pytest.raises(ValueError, match=rf"{MAX_MODEL_LEN}.*{MAX_MODEL_LEN}"):
        await engine.score([[7] * MAX_MODEL_LEN], [(1, 2)])
    with pytest.raises(ValueError, match="span"):
        await engine.score([[7, 8, 9]], [(0, 2)])
    await engine.aclose()
    await engine.aclose()


async def test_a_start_that_fails_says_vllms_reason_and_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's config refusals are pydantic validation errors whose first line is only a count ("1
    validation error for ModelConfig"): the message carries the reason, and every later request
    gets it again without a second start (a start costs tens of seconds on CPU)."""
    from pydantic import BaseModel, field_validator

    class ModelConfig(BaseModel):
        max_model_len: int

        @field_validator("max_model_len")
        @classmethod
        def fits(cls, value: int) -> int:
            raise ValueError(f"User-specified max_model_len ({value}) is greater than the derived max_model_len")

    starts = []

    def build(_self: VllmEngine) -> None:
        starts.append(1)
        ModelConfig(max_model_len=65536)

    monkeypatch.setattr(VllmEngine, "_build", build)
    engine = VllmEngine.from_config(engine_config())
    for call in (engine.start(), engine.generate([7, 8], GREEDY), engine.start()):
        with pytest.raises(RuntimeError, match=r"vLLM could not start on \S+: ValidationError: Value error, "
                                               r"User-specified max_model_len \(65536\) is greater"):
            await call
    assert starts == [1]
    await engine.aclose()


# ------------------------------------------------------------------ integration: one engine

@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(model_dir())


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine() -> AsyncIterator[VllmEngine]:
    engine = VllmEngine.from_config(engine_config())
    await engine.start()
    print(f"vLLM engine started in {engine.startup_seconds:.1f} s")
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_greedy_is_deterministic_and_matches_transformers(
        engine: VllmEngine, reference: Reference) -> None:
    first = await engine.generate(PROMPT, GREEDY)
    second = await engine.generate(PROMPT, GREEDY)
    assert first == second
    assert first.finish_reason == FINISH_LENGTH and len(first.token_ids) == 12
    assert first.weights_version == 0
    assert all(lp <= 0 and lp > float("-inf") for lp in first.logprobs)
    full = PROMPT + list(first.token_ids)
    assert_close(first.logprobs, reference.logprobs(full, len(PROMPT), len(full)))
    # greedy picks the argmax of the reference at every step
    with torch.no_grad():
        logits = reference.model(torch.tensor([full])).logits[0]
    assert [int(logits[i].argmax()) for i in range(len(PROMPT) - 1, len(full) - 1)] == \
        list(first.token_ids)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_sampled_logprobs_are_raw_and_seeds_reproduce(
        engine: VllmEngine, reference: Reference) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=50, seed=7)
    first = await engine.generate(PROMPT, sampling)
    again = await engine.generate(PROMPT, sampling)
    assert first.token_ids == again.token_ids
    full = PROMPT + list(first.token_ids)
    # log-probs under the model's own distribution (temperature 1, no top-p/top-k)
    assert_close(first.logprobs, reference.logprobs(full, len(PROMPT), len(full)))


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_stop_token_is_included_with_its_logprob(
        engine: VllmEngine, reference: Reference) -> None:
    free = await engine.generate(PROMPT, GREEDY)
    stop_id = free.token_ids[3]
    cut = free.token_ids.index(stop_id) + 1  # the first time the stop id is generated
    stopped = await engine.generate(
        PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_id, 5)))
    assert stopped.finish_reason == FINISH_STOP
    assert stopped.token_ids == free.token_ids[:cut]
    assert stopped.token_ids[-1] == stop_id
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=LOGPROB_TOLERANCE)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_max_new_tokens_gives_length(engine: VllmEngine) -> None:
    for n in (1, 5):
        out = await engine.generate(PROMPT, SamplingParams(max_new_tokens=n, temperature=1.0,
                                                           seed=3))
        assert len(out.token_ids) == len(out.logprobs) == n
        assert out.finish_reason == FINISH_LENGTH
    # near the context limit vLLM stops at max_model_len, also as "length"
    long_prompt = [9] * (MAX_MODEL_LEN - 3)
    out = await engine.generate(long_prompt, SamplingParams(max_new_tokens=50, temperature=0.0))
    assert out.finish_reason == FINISH_LENGTH and len(out.token_ids) == 3


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_score_matches_transformers_teacher_forcing(
        engine: VllmEngine, reference: Reference) -> None:
    sequences = [[*PROMPT, 5, 6, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], PROMPT[:2]]
    spans = [(len(PROMPT), len(PROMPT) + 4), (1, 11), (1, 2)]
    scored = await engine.score(sequences, spans)
    for sequence, (start, end), got in zip(sequences, spans, scored, strict=True):
        assert_close(got, reference.logprobs(sequence, start, end))
    assert await engine.score([PROMPT], [(3, 3)]) == [[]]
    # a scored prefix that was cached by generation is still computed in full
    generated = await engine.generate(PROMPT, GREEDY)
    full = PROMPT + list(generated.token_ids)
    (again,) = await engine.score([full], [(len(PROMPT), len(full))])
    assert_close(again, generated.logprobs)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_many_concurrent_requests(engine: VllmEngine) -> None:
    prompts = [[100 + i, 7, 300 + 5 * i, 42] for i in range(24)]
    sequential = [await engine.generate(p, GREEDY) for p in prompts[:4]]
    concurrent = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    for one, batched in zip(sequential, concurrent, strict=False):  # the first four
        assert batched.token_ids == one.token_ids
        assert batched.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
    assert all(len(g.token_ids) == 12 for g in concurrent)
    scores = await asyncio.gather(*(engine.score([p], [(1, 4)]) for p in prompts))
    assert all(len(s[0]) == 3 for s in scores)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_prompt_too_long_raises_value_error(engine: VllmEngine) -> None:
    with pytest.raises(ValueError, match=rf"{MAX_MODEL_LEN}.*{MAX_MODEL_LEN}"):
        await engine.generate([7] * MAX_MODEL_LEN, GREEDY)
    assert (await engine.generate(PROMPT, GREEDY)).finish_reason == FINISH_LENGTH


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_update_weights_in_place(engine: VllmEngine, reference: Reference) -> None:
    # long enough to fill prefix-cache blocks, which must not be reused across versions
    long_prompt = [(37 * i) % 8000 + 10 for i in range(300)]
    before = await engine.generate(long_prompt, GREEDY)
    in_flight = asyncio.create_task(
        engine.generate(PROMPT, SamplingParams(max_new_tokens=150, temperature=1.0, seed=1)))
    await asyncio.sleep(0)  # submitted first, so scheduled no later than the probe below
    await engine.generate([5, 6], SamplingParams(max_new_tokens=1))  # one step has run
    assert not in_flight.done()
    try:
        await engine.update_weights(1, reference.perturbed(seed=1))
        assert await engine.weights_version() == 1
        crossing = await in_flight
        crossing_ids = PROMPT + list(crossing.token_ids)
        crossing_new = reference.logprobs(crossing_ids, len(PROMPT), len(crossing_ids))

        after = await engine.generate(long_prompt, GREEDY)
        assert after.weights_version == 1
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
        full = long_prompt + list(after.token_ids)
        assert_close(after.logprobs, reference.logprobs(full, len(long_prompt), len(full)))
        (scored,) = await engine.score([full], [(1, len(full))])
        assert_close(scored, reference.logprobs(full, 1, len(full)))
    finally:
        await engine.update_weights(2, reference.restore())
    restored = await engine.generate(long_prompt, GREEDY)
    assert restored.token_ids == before.token_ids and restored.weights_version == 2
    assert restored.logprobs == pytest.approx(before.logprobs, abs=LOGPROB_TOLERANCE)

    # The request that crossed the update reports the version it started on; its first tokens
    # come from the old weights and the rest from the new ones, over a recomputed context.
    assert crossing.weights_version == 0 and len(crossing.token_ids) == 150
    crossing_old = reference.logprobs(crossing_ids, len(PROMPT), len(crossing_ids))
    switch = next(i for i, (got, old) in enumerate(zip(crossing.logprobs, crossing_old, strict=True))
                  if abs(got - old) > LOGPROB_TOLERANCE)
    assert 0 < switch < 150
    assert_close(crossing.logprobs[switch:], crossing_new[switch:])


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_checkpoint_reload_and_close(tmp_path: Path, reference: Reference) -> None:
    """A second engine: weights from a checkpoint dir; aclose aborts requests in flight. Its
    length and KV cache are left to follow the model, a copy of the tiny one whose config says 512
    positions: vLLM takes the 512 and the KV cache sized from the model's shape."""
    import json
    import shutil

    from safetensors.torch import save_file

    from turnstile.rollout.engines.shape import CPU_MIN_KV_CACHE_BYTES

    model = tmp_path / "model"
    shutil.copytree(model_dir(), model)
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 512}))
    config = engine_config(weight_sync="checkpoint", checkpoint_dir=str(tmp_path))
    checkpoint = VllmEngine.from_config(replace(config, model=str(model), max_model_len=0,
                                                vllm=replace(config.vllm, kv_cache_memory_bytes=0)))
    assert checkpoint.config.max_model_len == 512
    try:
        weights = reference.perturbed(seed=2)
        tied = {"lm_head.weight"} if reference.model.config.tie_word_embeddings else set()
        save_file({k: v.contiguous() for k, v in weights.items() if k not in tied},
                  str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match="checkpoint_dir"):
            await checkpoint.update_weights(5, weights)
        await checkpoint.update_weights(5, {})
        out = await checkpoint.generate(PROMPT, GREEDY)
        assert out.weights_version == 5
        llm = checkpoint._llm  # what vLLM took
        assert llm is not None and llm.model_config.max_model_len == 512
        assert llm.vllm_config.cache_config.kv_cache_memory_bytes == CPU_MIN_KV_CACHE_BYTES  # 4 x 512 tokens < 256 MiB
        full = PROMPT + list(out.token_ids)
        assert_close(out.logprobs, reference.logprobs(full, len(PROMPT), len(full)))

        running = asyncio.create_task(
            checkpoint.generate(PROMPT, SamplingParams(max_new_tokens=400, temperature=1.0)))
        await asyncio.sleep(0.3)
        await checkpoint.aclose()
        aborted = await running
        assert aborted.finish_reason == FINISH_ABORT
        assert len(aborted.token_ids) == len(aborted.logprobs) < 400
    finally:
        reference.restore()
        await checkpoint.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await checkpoint.generate(PROMPT, GREEDY)

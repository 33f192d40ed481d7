"""Engines for the conformance suite: one factory per engine kind, and what the checks share.

Every sampling engine (``hf``, ``vllm``) is built here from an :class:`EngineConfig` on one of two
models: the default tiny model (Qwen3, its own 8k vocabulary and minimal ChatML template) and a real
pretrained one of another architecture (``smollm2-135m-instruct``: Llama, tied embeddings, a 49k
vocabulary, SmolLM2's own template, converted from its package). The engines of one model serve the
same weights and see the same prompts. Engines are built once per test session through
:class:`EnginePool` (vLLM takes 30-50 s to start). The ``scripted`` engine
does not sample from a model and has its own tests.

The reference for "the right log-probs" is a plain transformers forward pass over the whole
sequence (:func:`reference_logprobs`), independent of any engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from _pytest.mark import ParameterSet  # what pytest.param returns
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from turnstile.envs.protocol import render_tool_call, render_tool_response, system_prompt
from turnstile.rollout.engines.base import PolicyEngine
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.model_store import resolve_model

REPO = Path(__file__).resolve().parent.parent

# Small enough to test the prompt-length check cheaply, large enough for every prompt here.
MAX_MODEL_LEN = 2048

# Tolerances for fp32 weights (bf16 engines on GPUs would need looser ones).
# Log-probs an engine returns from generate() against its own score() of the same sequence: the hf
# engine's incremental (KV-cache) decode and its full forward differ by about 1e-6.
SELF_ATOL = 1e-4
# Log-probs of one engine against another, or against the transformers reference, on the same
# weights: measured 1.9e-6 at most between vllm (CPU build) and hf over the conformance prompts;
# docs/design.md §3 asks for agreement to 4 decimals, which is what this allows.
CROSS_ATOL = 1e-4


TINY = ""  # the default tiny model
REAL = "smollm2-135m-instruct"  # a real pretrained model (rollout.model_packages)
MODELS = {"tiny": TINY, "smollm2": REAL}
# Noise added to every weight to make "new weights" (perturbed_weights): a real model's 30 layers
# amplify it, and at the tiny model's 0.05 its log-probs fall to -20, where float32 rounding between
# two correct forwards reaches 2e-4; a tenth of it still moves every log-prob by far more than CROSS_ATOL.
PERTURBATION = {TINY: 0.05, REAL: 0.005}


def engine_config(kind: str, model: str = TINY) -> EngineConfig:
    """The one configuration every engine of the suite is built from (fp32)."""
    return EngineConfig(kind=kind, model=model, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)


def build_hf_engine(config: EngineConfig) -> PolicyEngine:
    from turnstile.rollout.engines.hf import HFEngine

    return HFEngine.from_config(config)


def build_vllm_engine(config: EngineConfig) -> PolicyEngine:
    from turnstile.rollout.engines.vllm import VllmEngine

    return VllmEngine.from_config(config)


ENGINE_FACTORIES: dict[str, Callable[[EngineConfig], PolicyEngine]] = {
    "hf": build_hf_engine,
    "vllm": build_vllm_engine,
}


def engine_params() -> list[ParameterSet]:
    """One pytest param per engine kind and model, as ``(kind, model)``; the vllm ones are
    integration tests (vLLM starts slowly)."""
    return [pytest.param((kind, model), id=f"{kind}-{name}",
                         marks=[pytest.mark.integration] if kind == "vllm" else [])
            for name, model in MODELS.items() for kind in ("hf", "vllm")]


class EnginePool:
    """Engines built on first use and kept for the session, one per kind and model; closed together."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, str], PolicyEngine] = {}
        self._version = 0

    async def get(self, kind: str, model: str = TINY) -> PolicyEngine:
        """The session's engine of ``kind`` on ``model``. Built inside the running loop: vLLM binds to it."""
        if (kind, model) not in self._engines:
            self._engines[kind, model] = ENGINE_FACTORIES[kind](engine_config(kind, model))
        return self._engines[kind, model]

    def next_version(self) -> int:
        """A weights version not used before in this session (engines only ever move forward)."""
        self._version += 1
        return self._version

    async def aclose(self) -> None:
        for engine in self._engines.values():
            await engine.aclose()
        self._engines.clear()


@functools.cache
def conformance_prompts(model: str = TINY) -> tuple[tuple[int, ...], ...]:
    """Prompts as the rollout builds them, through the model's own chat template.

    A first turn, a multi-turn context with a tool call and its response, and a long page (a few
    hundred tokens) so prefill and cache reuse are exercised.
    """
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    schemas = [{"type": "function", "function": {"name": name, "description": f"the {name} tool"}}
               for name in ("search", "visit")]
    page = " ".join(f"Varnholt was founded in {1200 + year} by the river guild of Osk." for year in
                    range(40))
    conversations = [
        [{"role": "user", "content": "Who founded the city of Varnholt?"}],
        [{"role": "system", "content": system_prompt(schemas)},
         {"role": "user", "content": "Who founded the city of Varnholt?"},
         {"role": "assistant", "content": render_tool_call(
             "search", {"query": ["Varnholt founder"]}, "I should search for the founder.")},
         {"role": "user", "content": render_tool_response("Varnholt — founded by the guild of Osk.")}],
        [{"role": "user", "content": f"Read this page and answer.\n{page}\nWho founded Varnholt?"}],
    ]
    prompts = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tuple(tokenizer.encode(text, add_special_tokens=False)))
    return tuple(prompts)


def vocab_size(model: str = TINY) -> int:
    return int(load_reference_model(model).config.vocab_size)


def original_weights(model: str = TINY) -> dict[str, torch.Tensor]:
    """The model's weights as its checkpoint stores them (both models tie ``lm_head.weight`` to the
    embedding, so it is left out, as the learner publishes them)."""
    return load_file(str(Path(resolve_model(model)) / "model.safetensors"))


def perturbed_weights(weights: Mapping[str, torch.Tensor], seed: int,
                      scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every floating tensor plus Gaussian noise: weights different enough to move every log-prob."""
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            if tensor.is_floating_point() else tensor.clone()
            for name, tensor in weights.items()}


@functools.cache
def load_reference_model(model: str = TINY) -> PreTrainedModel:
    """A plain transformers copy of the model (fp32, eager attention); never modified."""
    return fresh_reference_model(model)


def fresh_reference_model(model: str = TINY,
                          weights: Mapping[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """A new transformers model of the checkpoint, with ``weights`` loaded over it if given."""
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    if weights is not None:
        loaded.load_state_dict(dict(weights), strict=False)
        loaded.tie_weights()
    return loaded


def reference_logprobs(model: PreTrainedModel, sequence: Sequence[int],
                       span: tuple[int, int]) -> list[float]:
    """Log-probs of ``sequence[start:end]`` from one full forward pass (no cache, no batching)."""
    start, end = span
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(sequence)])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(list(sequence[start:end]))
    return logprobs[torch.arange(start - 1, end - 1), targets].tolist()


def max_abs_difference(left: Sequence[float], right: Sequence[float]) -> float:
    """Largest element-wise gap between two equally long log-prob lists (0 for empty lists)."""
    assert len(left) == len(right), f"{len(left)} vs {len(right)} log-probs"
    return max((abs(a - b) for a, b in zip(left, right, strict=True)), default=0.0)

"""The transformers policy engine: the slow, plainly written reference the other engines are held to.

vLLM is what serves rollouts; this engine exists so there is an implementation of the
:class:`~turnstile.rollout.engines.base.PolicyEngine` contract simple enough to trust by reading it. The
conformance suite (``tests/test_engine_conformance.py``) runs every engine against the same checks,
and compares vLLM's log-probs with this engine's on the same weights.

How it works:

- ``generate`` prefills the prompt once and then feeds one token per step with the model's KV cache
  (``past_key_values``), so a turn costs one forward over the prompt plus one per new token.
  Sampling is explicit: temperature (0 = greedy), top-k, then top-p, drawn with a per-request
  ``torch.Generator`` when the request has a seed (else one engine-wide generator seeded by
  ``EngineConfig.seed``). The log-prob reported for each token is the *raw* one, the log-softmax of
  the logits at temperature 1, before any filtering — what the learner's forward pass computes.
- ``score`` teacher-forces whole sequences, up to ``hf.max_batch`` per forward. Sequences are padded
  on the left so that spans at the end of sequences of different lengths (the information-gain case:
  an answer appended to each context) land in the same padded rows, and only those rows' logits are
  materialised.
- ``update_weights`` loads a full state dict in place with ``load_state_dict(strict=True)`` after
  checking every name and shape first, so a bad state dict changes nothing.

Concurrency: the model runs in a worker thread (``asyncio.to_thread``) so the event loop that drives
many episodes stays responsive, and one lock serialises every use of the model. Concurrent
``generate`` calls therefore run one after another, each to completion: fine for a CPU reference
and for tests, and it makes a seeded request reproducible however many run beside it. A cancelled
``generate`` stops its worker at the next token; ``aclose`` ends generations in flight with
``finish_reason="abort"``.

Run it: ``build_engine(EngineConfig(kind="hf"))`` (the default tiny model when ``model`` is empty).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from turnstile.rollout.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Probe,
    SamplingParams,
)
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.shape import follow_model
from turnstile.rollout.model_store import resolve_model

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for ``engine.dtype``; an unknown name is an error listing the known ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"engine.dtype={name!r} is not supported by the hf engine; use one of "
                         f"{', '.join(DTYPES)}") from None


def sample_token(logits: torch.Tensor, sampling: SamplingParams,
                 generator: torch.Generator) -> tuple[int, float]:
    """Pick the next token from one row of logits; return it with its raw log-prob.

    The log-prob is taken from the unmodified distribution (temperature 1, no top-k/top-p), because
    that is the policy the learner evaluates; temperature and filters only decide which token is
    drawn. Filters follow vLLM's order: temperature, then top-k (``top_k <= 0`` is off, as in
    vLLM), then top-p (the smallest set of most likely tokens whose mass reaches ``top_p``; the
    most likely token is always kept).
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(raw_logprobs[token])
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.numel():
        kth_largest = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[0] = False
        scaled = scaled.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    token = int(torch.multinomial(probs, num_samples=1, generator=generator))
    return token, float(raw_logprobs[token])


class HFEngine:
    """A :class:`~turnstile.rollout.engines.base.PolicyEngine` on a transformers causal LM, one request at a time.

    Build it with :meth:`from_config`; the constructor takes an already loaded model (tests use
    that to serve a model they built themselves).
    """

    probes: ClassVar[bool] = True  # information gain can be measured on it during rollout
    logprobs: ClassVar[bool] = True  # its log-probs are the sampling policy's (rollout correction)

    def __init__(self, model: PreTrainedModel, config: EngineConfig) -> None:
        self._model: PreTrainedModel | None = model.eval()
        self._config = config
        self._device = torch.device(config.hf.device)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]  # an int
        self._version = 0
        # Held by the worker thread for every use of the model: requests run one at a time, and a
        # weight update never lands in the middle of a generation.
        self._model_lock = threading.Lock()
        self._default_generator = torch.Generator(device=self._device).manual_seed(config.seed)
        self._closing = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> HFEngine:
        """Load ``config.model`` (the default tiny model when empty) on ``config.hf.device``."""
        if config.hf.max_batch < 1:
            raise ValueError(f"engine.hf.max_batch must be >= 1, got {config.hf.max_batch}")
        if config.max_model_len == 0:
            config = follow_model(config, resolve_model(config.model))
        if config.max_model_len < 2:
            raise ValueError(f"engine.max_model_len must be >= 2 (or 0: follow the model), got {config.max_model_len}")
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(config.model), dtype=torch_dtype(config.dtype),
            attn_implementation=config.hf.attn_implementation,
        )
        return cls(model.to(config.hf.device), config)  # type: ignore[arg-type]  # transformers' wrapped to()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        """Sample one turn after ``prompt_ids`` (``affinity`` is ignored: there is one replica)."""
        prompt = self._checked_ids(prompt_ids, "prompt")
        if len(prompt) >= self._config.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens but engine.max_model_len is "
                             f"{self._config.max_model_len} (at least one new token must fit); "
                             "shorten the context or raise engine.max_model_len")
        cancelled = threading.Event()
        try:
            return await asyncio.to_thread(self._generate_now, prompt, sampling, cancelled)
        except asyncio.CancelledError:
            cancelled.set()  # the worker thread stops at its next token and releases the model
            raise

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence's tokens in ``[start, end)`` of its span."""
        if len(sequences) != len(spans):
            raise ValueError(f"score got {len(sequences)} sequences but {len(spans)} spans")
        checked = [self._checked_ids(sequence, f"sequence {index}")
                   for index, sequence in enumerate(sequences)]
        for index, (sequence, (start, end)) in enumerate(zip(checked, spans, strict=True)):
            if not 1 <= start <= end <= len(sequence):
                raise ValueError(f"span {index} is [{start}, {end}) but sequence {index} has "
                                 f"{len(sequence)} tokens; a span needs 1 <= start <= end <= length "
                                 "(the first token has no prefix to be scored on)")
            if len(sequence) > self._config.max_model_len:
                raise ValueError(f"sequence {index} has {len(sequence)} tokens but "
                                 f"engine.max_model_len is {self._config.max_model_len}")
        return await asyncio.to_thread(self._score_now, checked, list(spans))

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        """One forward over ``context + continuation`` (this engine keeps no prefix cache, so it
        forwards every token); the version is read under the model's lock, with the forward."""
        start, end = span
        if not 0 <= start <= end <= len(continuation) or not context:
            raise ValueError(f"span {span} does not fit a continuation of {len(continuation)} ids after "
                             f"a context of {len(context)}")
        sequence = self._checked_ids([*context, *continuation], "probed sequence")
        if len(sequence) > self._config.max_model_len:
            raise ValueError(f"the probed sequence has {len(sequence)} tokens but engine.max_model_len "
                             f"is {self._config.max_model_len}")
        offset = len(context)
        logprobs, version = await asyncio.to_thread(self._probe_now, sequence, (offset + start, offset + end))
        return Probe(logprobs=tuple(logprobs), weights_version=version, prefill_tokens=len(sequence))

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Load a full state dict in place and serve ``version`` from then on.

        Every name and shape is checked before anything is copied: missing or unexpected names and
        wrong shapes are one ``ValueError`` naming them, and the served weights stay as they were.
        A tied parameter (``lm_head.weight`` of a model with tied embeddings) may be left out, as
        checkpoints do. Tensors of another dtype or device are converted while copying.
        """
        await asyncio.to_thread(self._update_weights_now, version, dict(weights))

    async def weights_version(self) -> int:
        return self._version

    async def aclose(self) -> None:
        """Abort generations in flight, then drop the model; calling it again does nothing."""
        self._closing = True
        await asyncio.to_thread(self._release_model)

    # The methods below run in a worker thread.

    def _generate_now(self, prompt: list[int], sampling: SamplingParams,
                      cancelled: threading.Event) -> Generation:
        with self._model_lock:
            model = self._open_model()
            version = self._version
            generator = self._default_generator
            if sampling.seed is not None:
                generator = torch.Generator(device=self._device).manual_seed(sampling.seed)
            stop_ids = frozenset(sampling.stop_token_ids)
            budget = min(sampling.max_new_tokens, self._config.max_model_len - len(prompt))
            token_ids: list[int] = []
            logprobs: list[float] = []
            finish_reason = FINISH_LENGTH
            if cancelled.is_set():  # cancelled while waiting for the model: skip the prefill
                return Generation(token_ids=(), logprobs=(), finish_reason=FINISH_ABORT,
                                  weights_version=version)
            with torch.inference_mode():
                output = model(input_ids=torch.tensor([prompt], device=self._device),
                               use_cache=True, logits_to_keep=1)
                while True:
                    if cancelled.is_set() or self._closing:
                        finish_reason = FINISH_ABORT
                        break
                    token, logprob = sample_token(output.logits[0, -1], sampling, generator)
                    token_ids.append(token)
                    logprobs.append(logprob)
                    if token in stop_ids:
                        finish_reason = FINISH_STOP
                        break
                    if len(token_ids) >= budget:
                        break
                    output = model(input_ids=torch.tensor([[token]], device=self._device),
                                   past_key_values=output.past_key_values, use_cache=True,
                                   logits_to_keep=1)
            return Generation(token_ids=tuple(token_ids), logprobs=tuple(logprobs),
                              finish_reason=finish_reason, weights_version=version)

    def _score_now(self, sequences: list[list[int]], spans: list[tuple[int, int]]) -> list[list[float]]:
        results: list[list[float]] = []
        batch_size = self._config.hf.max_batch
        with self._model_lock:
            model = self._open_model()
            with torch.inference_mode():
                for first in range(0, len(sequences), batch_size):
                    results.extend(self._score_batch(model, sequences[first:first + batch_size],
                                                     spans[first:first + batch_size]))
        return results

    def _probe_now(self, sequence: list[int], span: tuple[int, int]) -> tuple[list[float], int]:
        with self._model_lock:
            model = self._open_model()
            with torch.inference_mode():
                [logprobs] = self._score_batch(model, [sequence], [span])
            return logprobs, self._version

    def _score_batch(self, model: PreTrainedModel, sequences: list[list[int]],
                     spans: list[tuple[int, int]]) -> list[list[float]]:
        """One forward over left-padded sequences, keeping only the logits rows the spans need."""
        width = max(len(sequence) for sequence in sequences)
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, width - len(sequence):] = torch.tensor(sequence)
            attention_mask[row, width - len(sequence):] = 1
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        # Logits at padded column c predict the token at column c + 1.
        shifts = [width - len(sequence) for sequence in sequences]
        nonempty = [(shift, start, end) for shift, (start, end) in zip(shifts, spans, strict=True)
                    if end > start]
        if not nonempty:
            return [[] for _ in sequences]
        low = min(shift + start - 1 for shift, start, _ in nonempty)
        high = max(shift + end - 1 for shift, _, end in nonempty)
        output = model(input_ids=input_ids.to(self._device),
                       attention_mask=attention_mask.to(self._device),
                       position_ids=position_ids.to(self._device),
                       logits_to_keep=torch.arange(low, high, device=self._device))
        logprobs = torch.log_softmax(output.logits.float(), dim=-1).cpu()
        scored: list[list[float]] = []
        for row, (sequence, shift, (start, end)) in enumerate(zip(sequences, shifts, spans,
                                                                  strict=True)):
            rows = torch.arange(shift + start - 1, shift + end - 1) - low
            targets = torch.tensor(sequence[start:end], dtype=torch.long)
            scored.append(logprobs[row, rows, targets].tolist())
        return scored

    def _update_weights_now(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._model_lock:
            model = self._open_model()
            current = model.state_dict()
            full = dict(weights)
            problems: list[str] = []
            for group in _tied_groups(current):
                given = [name for name in group if name in full]
                if given:
                    for name in group:
                        full.setdefault(name, full[given[0]])
                if len(given) > 1 and not all(
                        isinstance(full[name], torch.Tensor) and torch.equal(full[name], full[given[0]])
                        for name in given[1:]):
                    problems.append(f"tied parameters {', '.join(given)} have different values")
            missing = sorted(set(current) - set(full))
            unexpected = sorted(set(full) - set(current))
            if missing:
                problems.append(f"missing {', '.join(missing)}")
            if unexpected:
                problems.append(f"unexpected {', '.join(unexpected)}")
            for name in sorted(set(current) & set(full)):
                value = full[name]
                if not isinstance(value, torch.Tensor):
                    problems.append(f"{name} is a {type(value).__name__}, not a tensor")
                elif value.shape != current[name].shape:
                    problems.append(f"{name} has shape {tuple(value.shape)}, expected "
                                    f"{tuple(current[name].shape)}")
            if problems:
                raise ValueError(f"update_weights(version={version}) got a state dict that does not "
                                 f"fit the served model: {'; '.join(problems)}; nothing was loaded")
            with torch.no_grad():
                model.load_state_dict(full, strict=True)
            self._version = version

    def _release_model(self) -> None:
        with self._model_lock:
            self._model = None

    def _open_model(self) -> PreTrainedModel:
        if self._model is None or self._closing:
            raise RuntimeError("this HFEngine is closed; build a new one with HFEngine.from_config")
        return self._model

    def _checked_ids(self, ids: Sequence[int], what: str) -> list[int]:
        checked = [int(token) for token in ids]
        if not checked:
            raise ValueError(f"the {what} is empty; it needs at least one token id")
        outside = [token for token in checked if not 0 <= token < self._vocab_size]
        if outside:
            raise ValueError(f"the {what} has token ids outside the model's vocabulary "
                             f"[0, {self._vocab_size}): {outside[:5]}")
        return checked


def _tied_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups of names in ``state`` that share one tensor (tied weights, e.g. embeddings and head)."""
    by_storage: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        by_storage.setdefault(key, []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]

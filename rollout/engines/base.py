"""The policy engine contract: token ids in, token ids and log-probs out, under a weights version.

Every engine (``vllm``, ``hf``, ``scripted``) implements :class:`PolicyEngine`; the same conformance
suite runs against each. Engines never see text: the rollout owns tokenisation, so what the policy
generated is exactly what is trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

FINISH_STOP = "stop"  # a stop token was generated (it is the last id of the generation)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_ABORT = "abort"  # the request was cancelled or the engine failed mid-request


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn.

    ``stop_token_ids`` end the generation; the stop token is included in the returned ids (it was
    generated and has a log-prob). ``seed`` makes a request reproducible on engines that support
    per-request seeds.
    """

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("sampling.temperature must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling.top_p must be in (0, 1]")


@dataclass(frozen=True)
class Generation:
    """One sampled turn: ids and their log-probs under the weights that sampled them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT
    weights_version: int

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"generation has {len(self.token_ids)} ids but {len(self.logprobs)} "
                             "log-probs")


class ProbeUnsupported(RuntimeError):
    """The engine has no model to probe (``PolicyEngine.probe``); the message says what to use."""


@dataclass(frozen=True)
class Probe:
    """Teacher-forced log-probs of a continuation after a context (an information-gain probe,
    :mod:`turnstile.rollout.probes`), under the one weights version that computed them.

    ``prefill_tokens``: the tokens the engine forwarded for it (its prefix cache's hits excluded).
    ``cache_miss``: the engine held less of the context in its prefix cache than the context's
    whole cache blocks (an evicted prefix, or an episode moved to another replica); always False
    for an engine without a prefix cache.
    """

    logprobs: tuple[float, ...]
    weights_version: int
    prefill_tokens: int
    cache_miss: bool = False


@runtime_checkable
class PolicyEngine(Protocol):
    """A policy that samples turns and scores sequences.

    Contract:
    - ``generate`` samples at most ``max_new_tokens`` ids after ``prompt_ids``; ``affinity`` (an
      episode id) lets a router send an episode's turns to the same replica so its prefix cache is
      reused. It returns the ids as generated (stop token included) with their log-probs and the
      weights version that produced them.
    - ``score`` returns, for each sequence, the log-probs of the tokens in ``[start, end)`` of its
      span, each conditioned on everything before it (teacher forcing).
    - ``probe`` returns the log-probs of ``continuation[start:end]`` after ``context`` + the
      continuation's earlier ids, all from one weights version, which it reports (a probe a weight
      update overlaps is run again). ``affinity`` routes it like the episode's turns, so that the
      context is found in the prefix cache. Engines without a model (scripted) raise
      :class:`ProbeUnsupported`; an engine class that can probe says so with ``probes = True``.
    - ``update_weights`` swaps in new weights (a full state dict by parameter name) in place,
      without restarting, and from then on reports ``version``. Requests in flight finish on either
      version; each generation reports the one it ran on.
    - ``weights_version`` is the version currently served.
    - ``aclose`` releases the engine; safe to call twice.
    """

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation: ...

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]: ...

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe: ...

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None: ...

    async def weights_version(self) -> int: ...

    async def aclose(self) -> None: ...

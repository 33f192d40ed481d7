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

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None: ...

    async def weights_version(self) -> int: ...

    async def aclose(self) -> None: ...

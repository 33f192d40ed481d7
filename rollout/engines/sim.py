"""A simulated policy engine: the scripted expert's turns at a model server's speed.

What is real: the turns (the synthetic world's expert, :mod:`turnstile.rollout.engines.scripted`, so every
episode runs the real environment, tools, workers, router and store), the token counts, and the
waiting. What is simulated: the time a model server would take. Each request holds one of
``concurrency`` sequence slots of the replica (a continuous-batching server's batch) for

    ``prefill_s_per_token`` × the prompt tokens not in the replica's prefix cache
    + ``decode_s_per_token`` × the generated tokens,

and waits for a slot when all are taken, so a replica has a throughput limit and a fleet's size
matters. The prefix cache is per episode (its ``affinity``): a replica that served the episode's
last turn prefills only the new tokens; a replica that did not (the episode moved) prefills the
whole context. Loading new weights takes ``load_s``. The engine is ``engine.kind=sim`` and reads
``engine.options``; the expert reads ``engine.scripted`` as the scripted engine does.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from turnstile.envs.plugins import typed_options
from turnstile.rollout.engines.base import Generation, Probe, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.scripted import ScriptedEngine

_CACHED_EPISODES = 4096  # episodes whose prefix a replica remembers


@dataclass
class SimOptions:
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.002
    concurrency: int = 32  # sequences a replica runs at once
    load_s: float = 0.0  # loading new weights

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "load_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")

    def seconds(self, new_prompt_tokens: int, generated_tokens: int) -> float:
        """How long one request holds its slot (the latency model; also the fleet simulator's)."""
        return self.prefill_s_per_token * new_prompt_tokens + self.decode_s_per_token * generated_tokens


class SimEngine:
    """See the module docstring."""

    Options = SimOptions

    def __init__(self, expert: ScriptedEngine, options: SimOptions) -> None:
        self.expert, self.options = expert, options
        self._slots = asyncio.Semaphore(options.concurrency)
        self._cached: OrderedDict[str, int] = OrderedDict()  # affinity -> prompt tokens cached
        self.busy_s = 0.0  # slot-seconds spent serving (utilisation = busy_s / (wall × concurrency))

    @classmethod
    def from_config(cls, config: EngineConfig) -> SimEngine:
        return cls(ScriptedEngine.from_config(config), typed_options(SimOptions, config.options, "engine 'sim'",
                                                                     error=ValueError))

    @classmethod
    def check_tasks(cls, config: EngineConfig, questions: Sequence[str]) -> None:
        typed_options(SimOptions, config.options, "engine 'sim'", error=ValueError)
        ScriptedEngine.check_tasks(config, questions)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        async with self._slots:
            generation = await self.expert.generate(prompt_ids, sampling, affinity)
            cached = self._cached.pop(affinity, 0) if affinity is not None else 0
            new_tokens = len(prompt_ids) - min(cached, len(prompt_ids))
            seconds = self.options.seconds(new_tokens, len(generation.token_ids))
            await asyncio.sleep(seconds)
            self.busy_s += seconds
            if affinity is not None:
                self._cached[affinity] = len(prompt_ids) + len(generation.token_ids)
                while len(self._cached) > _CACHED_EPISODES:
                    self._cached.popitem(last=False)
            return generation

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return await self.expert.score(sequences, spans)

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        return await self.expert.probe(context, continuation, span, affinity)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        await asyncio.sleep(self.options.load_s)
        await self.expert.update_weights(version, weights)

    async def weights_version(self) -> int:
        return await self.expert.weights_version()

    async def aclose(self) -> None:
        await self.expert.aclose()

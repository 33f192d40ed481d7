"""A policy engine that writes hostile turns, for run-level tests (loaded in the engine actor as
``engine.kind=tests.hostile:HostileEngine``).

It is the scripted expert, except that the second turn of every sample-0 episode is one of
:data:`HOSTILE_TURNS` (a tool call nested 1,200 deep, an escaped lone surrogate, a 3,000-character
unclosed call); the expert then carries on from the corrective observation.
:class:`FailsThenHostileEngine` also fails the first turn of every sample-0 episode and writes the
hostile turn in sample 1 instead; :class:`FailingEngine` fails every request.
:class:`PerturbedEngine` is an hf engine serving weights other than the learner's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.hf import HFEngine
from turnstile.rollout.engines.scripted import ScriptedEngine


def _call(body: str) -> str:
    return f"<think>\nlet me try this\n</think>\n<tool_call>\n{body}\n</tool_call>"


HOSTILE_TURNS = (
    _call('{"name": "search", "arguments": {"query": ' + "[" * 1200 + "]" * 1200 + "}}"),
    _call('{"name": "search", "arguments": {"query": "\\ud800 capital"}}'),
    _call("[" * 3_000),  # unclosed: RecursionError in json.loads
)


class HostileEngine(ScriptedEngine):
    hostile_sample = "/0"  # the affinity suffix of the episodes that get a hostile second turn
    failing_sample = ""  # the affinity suffix of the episodes whose first turn fails ("" = none)
    @classmethod
    def from_config(cls, config: EngineConfig) -> HostileEngine:
        engine = super().from_config(config)
        engine.__class__ = cls
        engine._turns_seen = {}
        engine._hostile_sent = 0
        return engine  # type: ignore[return-value]

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        seen = self._turns_seen.get(affinity, 0)
        self._turns_seen[affinity] = seen + 1
        if seen == 0 and self.failing_sample and affinity is not None and affinity.endswith(self.failing_sample):
            raise ConnectionError("replica lost (tests.hostile)")
        if seen == 1 and affinity is not None and affinity.endswith(self.hostile_sample):
            text = HOSTILE_TURNS[self._hostile_sent % len(HOSTILE_TURNS)]
            self._hostile_sent += 1
            ids = [*self.chat.encode(text), self.chat.turn_end_id]
            return self._limit(ids, [0.0] * len(ids), FINISH_STOP, sampling)
        return await super().generate(prompt_ids, sampling, affinity)


class FailsThenHostileEngine(HostileEngine):
    hostile_sample = "/1"
    failing_sample = "/0"


class FailingEngine(ScriptedEngine):
    """Fails every request, as an engine that cannot serve would."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        raise RuntimeError("this engine serves nothing (tests.hostile:FailingEngine)")


class UnstartableEngine(ScriptedEngine):
    """An engine whose start fails, as vLLM's does on a model or setting it cannot serve."""

    async def start(self) -> None:
        raise RuntimeError("this engine cannot start (tests.hostile:UnstartableEngine)")


class PerturbedEngine(HFEngine):
    """The hf engine with every weight matrix off by Gaussian noise of :attr:`SCALE` times its
    standard deviation, at load and after every update: engines serving other weights than the
    learner's (a publish gone wrong), the mismatch the guard is for (``engine.kind=tests.hostile:PerturbedEngine``)."""

    SCALE = 0.5

    @classmethod
    def from_config(cls, config: EngineConfig) -> PerturbedEngine:
        engine = super().from_config(config)
        assert isinstance(engine, PerturbedEngine)
        engine._perturb()
        return engine

    def _update_weights_now(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        super()._update_weights_now(version, weights)
        self._perturb()

    def _perturb(self) -> None:
        generator = torch.Generator().manual_seed(0)
        with self._model_lock, torch.no_grad():
            for parameter in self._open_model().parameters():
                if parameter.dim() == 2:
                    noise = torch.randn(parameter.shape, generator=generator)
                    parameter.add_(noise * parameter.float().std() * self.SCALE)

"""The ``information_gain`` reward plugin: ``v_s`` before every turn, scored by a policy model.

Wraps :func:`rewards.information_gain.information_gain_values` with the transformers scorer that
reuses one KV cache per segment (``O(L + T·R)``). ``model`` should be the weights that generated
the trajectories (the behaviour policy, ALGORITHMS.md §4); the training loop's reward service passes
the version it kept. The model is loaded on first use, inside the process that scores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from envs.tasks import Task
from rewards.base import RewardPlugin
from rewards.information_gain import GoldScorer, information_gain_values
from rollout.chat import ChatFormat
from rollout.model_store import resolve_model
from rollout.trajectory import Trajectory


@dataclass
class InformationGainConfig:
    model: str = ""  # weights directory of the behaviour policy; "" = the default tiny model
    dtype: str = "float32"
    scorer: str = "kv_cache"  # "kv_cache" (O(L + T·R)) or "per_prefix" (the naive reference)

    def __post_init__(self) -> None:
        if self.scorer not in ("kv_cache", "per_prefix"):
            raise ValueError(f"scorer={self.scorer!r}: use kv_cache or per_prefix")


class InformationGain(RewardPlugin):
    config_type: ClassVar[type] = InformationGainConfig
    writes: ClassVar[frozenset[str]] = frozenset({"turn.ig_value"})

    def __init__(self, config: InformationGainConfig) -> None:
        self.config = config
        self._parts: tuple[ChatFormat, GoldScorer] | None = None
        self._lock = asyncio.Lock()

    async def _ready(self) -> tuple[ChatFormat, GoldScorer]:
        async with self._lock:
            if self._parts is None:
                self._parts = await asyncio.to_thread(self._load)
        return self._parts

    def _load(self) -> tuple[ChatFormat, GoldScorer]:
        import torch
        from transformers import AutoModelForCausalLM

        from rewards.ig_scoring import HFInformationGainScorer, PerPrefixScorer

        path = resolve_model(self.config.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.config.dtype))
        model.eval()
        scorer_class = HFInformationGainScorer if self.config.scorer == "kv_cache" else PerPrefixScorer
        return ChatFormat.from_pretrained(path), scorer_class(model)

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        chat, scorer = await self._ready()
        await information_gain_values(trajectory, chat, scorer)

    async def score_group(self, group: Sequence[Trajectory], task: Task) -> None:
        for trajectory in group:  # one model: score one trajectory at a time
            await self.score(trajectory, task)

    async def aclose(self) -> None:
        self._parts = None

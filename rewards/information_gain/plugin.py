"""The ``information_gain`` reward plugin: ``v_s`` before every turn, scored by a policy model.

Wraps :func:`turnstile.rewards.information_gain.values.information_gain_values` with the transformers scorer that
reuses one KV cache per segment (``O(L + T·R)``). The scoring model should be the weights that
generated the trajectory (the behaviour policy, docs/algorithms.md §4):

- ``model``: one fixed model directory (scoring saved rollouts of a known policy);
- ``versions_dir``: a weights archive (``turnstile train`` keeps one under ``out/weights``, see
  ``learner.publish.WeightsArchive``, and points this option at it). Each trajectory is scored by the version that
  generated most of its turns (ties: the newer), or, when that one is no longer kept, the closest
  version kept; ``metadata["ig_weights_version"]`` records which. With partial rollouts a trajectory
  mixes versions; the staleness bound keeps them within η of each other.

Models are loaded on first use, inside the process that scores; the two most recent stay loaded.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardPlugin
from turnstile.rewards.information_gain.values import GoldScorer, information_gain_values
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.model_store import closest_version, resolve_model
from turnstile.rollout.trajectory import Trajectory


@dataclass
class InformationGainConfig:
    model: str = ""  # weights directory of the behaviour policy; "" = the default tiny model
    versions_dir: str = ""  # a weights archive (turnstile train's out/weights); overrides model
    dtype: str = "float32"
    scorer: str = "kv_cache"  # "kv_cache" (O(L + T·R)) or "per_prefix" (the naive reference)

    def __post_init__(self) -> None:
        if self.scorer not in ("kv_cache", "per_prefix"):
            raise ValueError(f"scorer={self.scorer!r}: use kv_cache or per_prefix")


class InformationGain(RewardPlugin):
    Options: ClassVar[type] = InformationGainConfig
    writes: ClassVar[frozenset[str]] = frozenset({"turn.ig_value"})
    scores_with_policy: ClassVar[bool] = True

    def __init__(self, config: InformationGainConfig) -> None:
        self.config = config
        self._loaded: OrderedDict[str, tuple[ChatFormat, GoldScorer]] = OrderedDict()
        self._lock = asyncio.Lock()

    async def _ready(self, path: str) -> tuple[ChatFormat, GoldScorer]:
        async with self._lock:
            if path not in self._loaded:
                self._loaded[path] = await asyncio.to_thread(self._load, path)
                while len(self._loaded) > 2:
                    self._loaded.popitem(last=False)
            self._loaded.move_to_end(path)
            return self._loaded[path]

    def _model_for(self, trajectory: Trajectory) -> str:
        if not self.config.versions_dir:
            return resolve_model(self.config.model)
        versions = Counter(turn.weights_version for turn in trajectory.turns)
        wanted = max(versions, key=lambda v: (versions[v], v)) if versions else 0
        version, path = closest_version(self.config.versions_dir, wanted)
        trajectory.metadata["ig_weights_version"] = version
        return str(path)

    def _load(self, path: str) -> tuple[ChatFormat, GoldScorer]:
        import torch
        from transformers import AutoModelForCausalLM

        from turnstile.rewards.information_gain.scorers import HFInformationGainScorer, PerPrefixScorer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.config.dtype))
        model.eval()
        scorer_class = HFInformationGainScorer if self.config.scorer == "kv_cache" else PerPrefixScorer
        return ChatFormat.from_pretrained(path), scorer_class(model)

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        chat, scorer = await self._ready(self._model_for(trajectory))
        await information_gain_values(trajectory, chat, scorer)

    async def score_group(self, group: Sequence[Trajectory], task: Task) -> None:
        for trajectory in group:  # one model: score one trajectory at a time
            await self.score(trajectory, task)

    async def aclose(self) -> None:
        self._loaded.clear()

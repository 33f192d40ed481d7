"""The ``information_gain`` reward plugin: ``v_s`` before every turn, from the policy's own weights.

Where ``v_s`` is computed (option ``scorer``, docs/algorithms.md §4):

- ``engine``: on the policy engines, during rollout (:mod:`turnstile.rollout.probes`): each boundary
  is probed on the replica that holds the episode's context in its prefix cache, by the weights
  serving at that moment, and the trajectory arrives with every ``turn.ig_value`` (and
  ``turn.ig_version``) filled, or its information gain marked missing. The plugin only checks that
  the rollout measured it. ``turnstile train`` uses this path whenever its engines can be probed
  (``vllm``, ``hf``): no model copy, no GPU of its own, about ``R`` extra tokens a boundary.
- ``kv_cache``: after the fact, with a transformers copy of the weights that generated the
  trajectory: one forward over each segment's context, its KV cache reused for every boundary
  (``O(L + T·R)``). For ``turnstile score`` on saved rollouts, rollouts of an engine that cannot be
  probed (scripted), and as the reference the engine path is tested against.
- ``per_prefix``: after the fact, one forward per boundary (the naive reference of ``kv_cache``).
- ``auto`` (the default): the values the rollout measured where a trajectory has them, else
  ``kv_cache``; with ``model`` or ``versions_dir`` set, always ``kv_cache`` with those weights.

The after-the-fact scorers load their model where ``device`` says (``auto``: a GPU when this process
sees one, which in a Ray actor means one it asked for, as a reward worker with
``reward_service.worker_gpus`` does; else the CPU), in ``dtype``:

- ``model``: one fixed model directory (scoring saved rollouts of a known policy);
- ``versions_dir``: a weights archive (``turnstile train`` keeps one under ``out/weights`` when it
  scores after the fact, see ``learner.publish.WeightsArchive``, and points this option at it).
  Each trajectory is scored by the version that generated most of its turns (ties: the newer),
  or, when that one is no longer kept, the closest version kept; ``metadata["ig_weights_version"]``
  and every ``turn.ig_version`` record which.

Models are loaded on first use, inside the process that scores; the two most recent stay loaded.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardError, RewardPlugin
from turnstile.rewards.information_gain.values import GoldScorer, information_gain_values
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.model_store import closest_version, resolve_model
from turnstile.rollout.probes import COST_KEY, MISSING_KEY
from turnstile.rollout.trajectory import Trajectory

SCORERS = ("auto", "engine", "kv_cache", "per_prefix")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class InformationGainConfig:
    scorer: str = "auto"  # auto | engine (during rollout) | kv_cache | per_prefix (after the fact)
    model: str = ""  # after the fact: the behaviour policy's weights directory; "" = the default tiny model
    versions_dir: str = ""  # after the fact: a weights archive (turnstile train's out/weights); overrides model
    device: str = "auto"  # after the fact: auto (a GPU this process sees, else cpu), cpu, cuda, cuda:N
    dtype: str = "float32"  # after the fact: float32, bfloat16 or float16

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer={self.scorer!r}: use one of {', '.join(SCORERS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r}: use auto, cpu, cuda or cuda:N")


def measured_on_engine(trajectory: Trajectory) -> bool:
    """Whether the rollout probed this trajectory's boundaries on its engine (values or missing)."""
    return COST_KEY in trajectory.metadata or MISSING_KEY in trajectory.metadata


class InformationGain(RewardPlugin):
    Options: ClassVar[type] = InformationGainConfig
    writes: ClassVar[frozenset[str]] = frozenset({"turn.ig_value", "turn.ig_version", "trajectory.metadata"})
    scores_with_policy: ClassVar[bool] = True

    def __init__(self, config: InformationGainConfig) -> None:
        self.config = config
        self._loaded: OrderedDict[str, tuple[ChatFormat, GoldScorer]] = OrderedDict()
        self._lock = asyncio.Lock()

    @classmethod
    def engine_options(cls, options: Mapping[str, object], engine_probes: bool) -> dict[str, object] | None:
        scorer = options.get("scorer", "auto")
        if scorer == "engine" and not engine_probes:
            raise RewardError("information_gain: scorer=engine measures v on the policy engines during "
                              "rollout, and this run's engine cannot be probed (it has no model, as the "
                              "scripted one): use rollout.engine.kind=vllm or hf, or score after the fact "
                              "with scorer=kv_cache")
        own_weights = bool(options.get("model") or options.get("versions_dir"))
        if scorer == "engine" or (scorer == "auto" and engine_probes and not own_weights):
            return {**options, "scorer": "engine"}
        return None

    async def _ready(self, path: str) -> tuple[ChatFormat, GoldScorer]:
        async with self._lock:
            if path not in self._loaded:
                self._loaded[path] = await asyncio.to_thread(self._load, path)
                while len(self._loaded) > 2:
                    self._loaded.popitem(last=False)
            self._loaded.move_to_end(path)
            return self._loaded[path]

    def _model_for(self, trajectory: Trajectory) -> tuple[str, int | None]:
        if not self.config.versions_dir:
            return resolve_model(self.config.model), None
        versions = Counter(turn.weights_version for turn in trajectory.turns)
        wanted = max(versions, key=lambda v: (versions[v], v)) if versions else 0
        version, path = closest_version(self.config.versions_dir, wanted)
        trajectory.metadata["ig_weights_version"] = version
        return str(path), version

    def _load(self, path: str) -> tuple[ChatFormat, GoldScorer]:
        import torch
        from transformers import AutoModelForCausalLM

        from turnstile.rewards.information_gain.scorers import HFInformationGainScorer, PerPrefixScorer

        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.config.dtype),
                                                     attn_implementation="sdpa")
        model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped to()
        scorer_class = HFInformationGainScorer if self.config.scorer in ("kv_cache", "auto") else PerPrefixScorer
        return ChatFormat.from_pretrained(path), scorer_class(model)

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        if not trajectory.turns:
            return  # an episode that failed before its first turn: no boundary to measure
        kind, own_weights = self.config.scorer, bool(self.config.model or self.config.versions_dir)
        if (kind == "engine" or (kind == "auto" and not own_weights)) and measured_on_engine(trajectory):
            return  # the rollout measured v on the engine (or marked it missing)
        if kind == "engine":
            raise RewardError(f"trajectory {trajectory.uid}/{trajectory.sample} carries no information gain "
                              "measured on the engines (rollout.episode.ig_probe was off when it ran): "
                              "score it after the fact with information_gain scorer=kv_cache")
        path, version = self._model_for(trajectory)
        chat, scorer = await self._ready(path)
        await information_gain_values(trajectory, chat, scorer)
        for turn in trajectory.turns:
            turn.ig_version = version if turn.ig_value is not None else None

    async def score_group(self, group: Sequence[Trajectory], task: Task) -> None:
        for trajectory in group:  # one model: score one trajectory at a time
            await self.score(trajectory, task)

    async def aclose(self) -> None:
        self._loaded.clear()

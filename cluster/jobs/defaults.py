"""The embedded default experiment, in one place: what ``turnstile train``, ``eval`` and ``sft`` run
with no config, and the task mixes and episode settings the warm-start recipes
(``cluster/recipes/warm_start.py``) built their models for. ``examples/train.yaml`` writes the same default
out (a test keeps them equal).

The library's jobs read their defaults from here; the recipes and benchmarks import it too; this
module imports no recipe.
"""

from __future__ import annotations

from typing import Any

from turnstile.cluster.jobs.session import RayConfig, RolloutJob
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.env import EnvConfig
from turnstile.rollout.episode import EpisodeConfig
from turnstile.rollout.model_store import WARM_MODEL

DEFAULT_TASKS: dict[str, Any] = {"min_hops": 1, "max_hops": 1, "entity_answer_fraction": 1.0,
                                 "aggregation_fraction": 0.0, "count": 1200}
"""The embedded default's question mix: the name one relation away ("What is the name of the
founder of Quorin Society?"), read on one page; 1,200 questions, 1,090 for training and 110 held
out. Questions whose answer is a value (a year, a colour) are left to the harder splits: the tiny
warm start copies a name it has read (rare tokens) but not a value (frequent tokens with a strong
prior; docs/benchmarks/learning.md)."""

MULTIHOP_TASKS: dict[str, Any] = {"min_hops": 2, "max_hops": 3, "entity_answer_fraction": 1.0,
                                  "aggregation_fraction": 0.0, "count": 2000}
"""The multi-hop split: the name two or three relations away, read on as many pages (five or seven
turns); 2,000 questions (195 held out: one evaluation within about ±5 points at 15%), the same
train/held-out rule as the default's (a question's id decides, so the recipe's 5,000 hold out the
same ones)."""
MULTIHOP_TURNS = 8  # three hops take seven turns; one more to recover from a missed search

WARM_CORPUS_PORT = 20011
"""The port the warm start's data was served on, and where the embedded default serves its corpus:
the tiny model writes the port of an address from memory (it copies the rest)."""


def default_episode() -> EpisodeConfig:
    """The embedded default's episode settings (training, evaluation and the expert's data)."""
    return EpisodeConfig(max_new_tokens=160, context_budget=3072, env=EnvConfig(max_turns=6))


def default_rollout() -> RolloutJob:
    """The embedded default (as examples/train.yaml): synthetic questions answered on one page, the
    warm start on vLLM with the corpus where its data was served, 4 samples per task, the scripted
    expert's episode settings."""
    rollout = RolloutJob()
    rollout.data = DatasetConfig(kind="synthetic", path="", split="train", options=dict(DEFAULT_TASKS))
    rollout.group_size = 4
    rollout.engine.model = WARM_MODEL
    rollout.corpus.port = WARM_CORPUS_PORT
    rollout.fleet.episodes_per_worker = 16
    rollout.episode = default_episode()
    rollout.ray = RayConfig(num_cpus=4)
    return rollout


def default_eval_data() -> DatasetConfig:
    """The embedded default's held-out questions (all 110)."""
    return DatasetConfig(kind="synthetic", path="", split="eval", options=dict(DEFAULT_TASKS))


def sft_eval_rollout() -> RolloutJob:
    """How ``turnstile sft`` evaluates by default: 8 held-out synthetic questions, 2 samples each, on
    the learner's own weights (published to the fleet before each evaluation) through transformers."""
    rollout = RolloutJob()
    rollout.data = DatasetConfig(kind="synthetic", path="", split="eval", limit=8)
    rollout.group_size = 2
    rollout.engine.kind = "hf"
    rollout.fleet.workers = 1
    rollout.fleet.episodes_per_worker = 16
    # The fleet waits beside the learner while it trains: with half a CPU for its engine, the default
    # job (one learner rank of one CPU) fits a Ray of two CPUs.
    rollout.fleet.engine_cpus = 0.5
    rollout.episode = EpisodeConfig(max_new_tokens=160, context_budget=2048, env=EnvConfig(max_turns=6))
    return rollout

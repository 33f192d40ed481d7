"""A user's own plugins, in a module of their own: each is named in config by import path
(``tests.user_plugins:Name``), registered nowhere (``tests/test_plugins.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from envs.datasets.registry import DatasetConfig
from envs.tasks import Task
from learner.credit.records import Group, TurnCredit
from learner.credit.registry import CreditResult, Estimator
from rewards.base import RewardPlugin
from rollout.engines.config import EngineConfig
from rollout.trajectory import Trajectory


@dataclass
class ConstantOptions:
    value: float = 1.0


class Constant(Estimator):
    """Every turn gets the same advantage."""

    name = "constant"
    Options = ConstantOptions

    def __init__(self, options: ConstantOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        return CreditResult(groups=[[[TurnCredit(advantage=self.options.value, reward=None) for _ in t.turns]
                                     for t in group.trajectories] for group in batch])


@dataclass
class LengthOptions:
    per_char: float = 0.01


class AnswerLength(RewardPlugin):
    """The outcome is the answer's length times ``per_char``."""

    config_type: ClassVar[type] = LengthOptions
    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome"})

    def __init__(self, options: LengthOptions) -> None:
        self.options = options

    async def score(self, trajectory: Trajectory, task: Task) -> None:  # noqa: ARG002
        trajectory.outcome = len(trajectory.answer or "") * self.options.per_char


def three_questions(cfg: DatasetConfig) -> list[Task]:
    return [Task(id=f"{cfg.path}{i}", question=f"question {i}?", answers=(str(i),)) for i in range(3)]


class NullEngine:
    """Builds from a config and remembers which."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @classmethod
    def from_config(cls, config: EngineConfig) -> NullEngine:
        return cls(config)

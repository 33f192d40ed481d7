"""A placebo control for learning runs: each group's outcomes, shuffled among its samples.

Listed last among the rewards (after the outcome plugins have written ``trajectory.outcome``), it
gives every group the same outcomes in a random order, so the update has the real run's advantage
distribution — the same number of +/− samples, the same magnitudes, the same noise — and no
information about which answer was right::

    turnstile train --config examples/train.yaml \\
        'rewards=[{kind: exact_match}, {kind: format}, {kind: "benchmarks.placebo:ShuffledOutcomes"}]'

If accuracy falls as fast under the placebo as under the real reward, the fall is the updates'
noise, not their signal. The permutation is drawn from the task id and the group's id, and the
true outcome is kept in ``metadata["placebo_true_outcome"]`` so scoring a group twice gives the
same result (the reward contract's idempotence).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import ClassVar

from turnstile.envs.tasks import Task
from turnstile.rewards.base import NoOptions, RewardPlugin
from turnstile.rollout.trajectory import Trajectory

TRUE_OUTCOME = "placebo_true_outcome"


class ShuffledOutcomes(RewardPlugin):
    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome", "trajectory.metadata"})

    def __init__(self, config: NoOptions) -> None:
        self.config = config

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        await self.score_group([trajectory], task)

    async def score_group(self, group: Sequence[Trajectory], task: Task) -> None:
        ordered = sorted(group, key=lambda trajectory: trajectory.sample)
        for trajectory in ordered:
            trajectory.metadata.setdefault(TRUE_OUTCOME, trajectory.outcome)
        outcomes = [trajectory.metadata[TRUE_OUTCOME] for trajectory in ordered]
        key = "|".join([task.id, *(f"{trajectory.uid}/{trajectory.sample}" for trajectory in ordered)])
        random.Random(hashlib.sha256(key.encode()).digest()).shuffle(outcomes)
        for trajectory, outcome in zip(ordered, outcomes, strict=True):
            trajectory.outcome = outcome

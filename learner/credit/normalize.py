"""Group normalisation and discounting: the arithmetic every estimator shares (docs/algorithms.md §5–7).

Kept apart from the estimators because the learner needs the same functions again after
downsampling (§8): the surviving samples of a group are re-normalised with :func:`group_normalize`,
and the numbers must match what the estimator would have produced on those samples alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

EPS = 1e-6  # in every normalisation denominator
VAR_FLOOR = 1e-8  # std = sqrt(var + VAR_FLOOR), so a group with no spread does not divide by zero


def group_std(values: Sequence[float]) -> float:
    """Population std (ddof 0) with the variance floor; a group of one has std 1 by convention."""
    if len(values) <= 1:
        return 1.0
    return float(math.sqrt(np.var(np.asarray(values, dtype=np.float64)) + VAR_FLOOR))


def group_normalize(values: Sequence[float]) -> list[float]:
    """``(r − mean) / (std + ε)`` over one group; ``[]`` for an empty group.

    Equal values give exactly zero, not rounding noise divided by the variance floor: a group
    whose members all scored the same carries no signal, and downstream code (the downsampler's
    zero-signal-first rule) relies on seeing a true zero.
    """
    if not values:
        return []
    array = np.asarray(values, dtype=np.float64)
    if np.all(array == array[0]):
        return [0.0] * len(values)
    normalized = (array - array.mean()) / (group_std(values) + EPS)
    return [float(x) for x in normalized]


def mean_abs(values: Sequence[float]) -> float:
    """Mean absolute value, 1 for no values (the IG-Scale convention for an empty batch)."""
    if not values:
        return 1.0
    return float(np.mean(np.abs(np.asarray(values, dtype=np.float64))))


def ig_scale(normalized_outcomes: Sequence[float], normalized_turn_rewards: Sequence[float],
             eta: float, s_max: float) -> float:
    """IG-Scale's batch-wide factor ``s = min(max(M_O, η) / (M_IG + ε), s_max)``.

    It brings the turn rewards to the size of the outcomes over the whole batch, so that
    information gain neither drowns the outcome nor vanishes beside it; ``η`` keeps the turn rewards
    alive when every outcome in the batch is the same (``M_O = 0``).
    """
    m_outcome = mean_abs(normalized_outcomes)
    m_turn = mean_abs(normalized_turn_rewards)
    return min(max(m_outcome, eta) / (m_turn + EPS), s_max)


def discount_over_boundaries(rewards: Sequence[float | None], gamma: float) -> list[float]:
    """Turn advantages from the normalised rewards of one trajectory's boundaries.

    ``rewards[t]`` is the normalised reward of turn ``t`` if it is a boundary, else ``None``.
    From the last boundary backwards ``A[b] = R̂[b] + γ·A[next boundary]``; every turn takes the
    advantage of the first boundary at or after it, so the turns of a segment that a boundary
    closes share its credit. Turns after the last boundary (none, when the last turn carries the
    outcome) get 0.
    """
    advantages = [0.0] * len(rewards)
    carried: float | None = None  # advantage of the next boundary, None before the first one
    for t in range(len(rewards) - 1, -1, -1):
        reward = rewards[t]
        if reward is not None:
            carried = reward + (gamma * carried if carried is not None else 0.0)
        advantages[t] = carried if carried is not None else 0.0
    return advantages

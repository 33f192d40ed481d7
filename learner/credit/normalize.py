"""Group normalisation and discounting: the arithmetic every estimator shares (docs/algorithms.md §5–7).

Kept apart from the estimators because the learner needs the same functions again after
downsampling (§8): the surviving samples of a group are re-normalised with :func:`group_normalize`,
and the numbers must match what the estimator would have produced on those samples alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import TypeVar

import numpy as np

EPS = 1e-6  # in every normalisation denominator
VAR_FLOOR = 1e-8  # std = sqrt(var + VAR_FLOOR), so a group with no spread does not divide by zero
EQUAL_TOLERANCE = 1e-9  # values this close (relative to max(1, |value|)) are one value: rounding only

Rewards = list[float | None]  # one entry per turn of a trajectory; None where the turn carries none
E = TypeVar("E", bound=StrEnum)


class Norm(StrEnum):
    """Which rewards of a group are normalised together (docs/algorithms.md §5–6)."""

    joint = "joint"  # every turn's reward in one pool, the last turn's (the outcome) included
    separate = "separate"  # last turns among last turns, the other turns among the other turns
    scaled_separate = "scaled_separate"  # separate, turn rewards then scaled by IG-Scale (igpo only)


def member(kind: type[E], value: str, name: str) -> E:
    """``value`` as a member of ``kind``, so that ``norm="joint"`` works as well as ``Norm.joint``."""
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(item.value for item in kind)
        raise ValueError(f"{name}={value}: must be one of {known}") from None


def group_std(values: Sequence[float]) -> float:
    """Population std (ddof 0) with the variance floor; a group of one has std 1 by convention."""
    if len(values) <= 1:
        return 1.0
    return float(math.sqrt(np.var(np.asarray(values, dtype=np.float64)) + VAR_FLOOR))


def all_equal(values: Sequence[float]) -> bool:
    """Whether ``values`` are one value up to rounding: their spread within :data:`EQUAL_TOLERANCE`
    of their size (``0.1 + 0.2`` and ``0.3`` are equal). True for no values."""
    if not values:
        return True
    return max(values) - min(values) <= EQUAL_TOLERANCE * max(1.0, max(abs(v) for v in values))


def group_normalize(values: Sequence[float]) -> list[float]:
    """``(r − mean) / (std + ε)`` over one group; ``[]`` for an empty group.

    Equal values give exactly zero, not rounding noise divided by the variance floor: a group
    whose members all scored the same carries no signal, and downstream code (the downsampler's
    zero-signal-first rule) relies on seeing a true zero. Values that differ only by rounding
    (``0.1 + 0.2`` and ``0.3``: a spread within :data:`EQUAL_TOLERANCE` of their size) are equal.
    """
    if not values:
        return []
    array = np.asarray(values, dtype=np.float64)
    if all_equal(values):
        return [0.0] * len(values)
    normalized = (array - array.mean()) / (group_std(values) + EPS)
    return [float(x) for x in normalized]


def normalize_pooled(rows: Sequence[Rewards]) -> list[Rewards]:
    """Normalise the non-None entries of all ``rows`` as one group; keep the shape (None stays None).

    Only the rewards that exist are pooled: a short trajectory adds no padded zeros to the pool.
    """
    normalized = iter(group_normalize([r for row in rows for r in row if r is not None]))
    return [[None if r is None else next(normalized) for r in row] for row in rows]


def normalize_separately(rows: Sequence[Rewards]) -> tuple[list[Rewards], list[Rewards]]:
    """The rows' non-final rewards normalised among themselves, and their last rewards among
    themselves: ``(turns, lasts)``, each shaped like ``rows`` with None where the other one has its
    values. :func:`join_separate` puts them back together.

    A pool per kind keeps the baseline of one kind out of the other: pooled with the outcomes, the
    turn rewards of a group whose outcomes are low would all be above the pool's mean, and every
    extra turn would earn a bonus (docs/algorithms.md §5, "length").
    """
    turns = normalize_pooled([[*row[:-1], None] for row in rows])
    lasts = normalize_pooled([[*([None] * (len(row) - 1)), row[-1]] for row in rows])
    return turns, lasts


def join_separate(turns: Sequence[Rewards], lasts: Sequence[Rewards]) -> list[Rewards]:
    """The inverse of :func:`normalize_separately`'s split: non-final entries from ``turns``, the
    last one from ``lasts``."""
    return [[*turn_row[:-1], last_row[-1]] for turn_row, last_row in zip(turns, lasts, strict=True)]


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

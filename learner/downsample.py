"""Minimal-loss downsampling to the data-parallel size (docs/algorithms.md §8).

veRL splits a batch evenly over the data-parallel ranks and each rank's share evenly into
mini-batches, so a step trains on a multiple of ``m = lcm(dp, mini_batch)`` samples. Rather than pad
with duplicated samples (which would count them twice in the gradient), :func:`downsample` drops the
``N mod m`` samples that carry the least policy-gradient signal, and :func:`renormalise` then
recomputes the group statistics over the survivors, so the advantages the policy trains on are those
the estimator would have produced on the surviving samples alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from turnstile.learner.batch import Sample, check_unique_trajectories
from turnstile.learner.credit.assign import assign_credit, token_advantages
from turnstile.learner.credit.registry import Estimator
from turnstile.rollout.trajectory import Segment, Trajectory


def kept_count(n: int, dp: int, mini_batch: int) -> int:
    """How many of ``n`` samples train: ``⌊n / m⌋ · m`` with ``m = lcm(dp, mini_batch)``."""
    if dp < 1 or mini_batch < 1:
        raise ValueError(f"dp={dp}, mini_batch={mini_batch}: both must be at least 1")
    if n < 0:
        raise ValueError(f"n={n}: a sample count cannot be negative")
    m = math.lcm(dp, mini_batch)
    return n // m * m


@dataclass(frozen=True)
class Downsampled:
    """What :func:`downsample` decided. ``kept``, ``dropped`` and ``waiting`` partition the input."""

    kept: list[Sample]  # in input order
    dropped: list[Sample]  # least signal first; discarded for good
    waiting: list[Sample]  # all of them when there are fewer than m: they train next step
    lost_fraction: float  # share of the batch's total |advantage| carried by ``dropped``

    @property
    def dropped_count(self) -> int:
        return len(self.dropped)


def downsample(samples: Sequence[Sample], dp: int, mini_batch: int, seed: int) -> Downsampled:
    """Keep :func:`kept_count` of ``samples``, dropping the ``N mod m`` with the least signal.

    Signal is the sum over tokens of |advantage|, so zero-signal samples go first. Equal signals are
    ordered by a draw seeded by ``seed`` and the sample's key (uid, sample, segment): the choice is
    the same for the same seed whatever order the samples arrived in, and may differ between seeds.
    With fewer than ``m`` samples nothing trains: all of them are returned as ``waiting``.
    """
    _check_unique_samples(samples)
    keep = kept_count(len(samples), dp, mini_batch)
    if keep == 0:
        return Downsampled(kept=[], dropped=[], waiting=list(samples), lost_fraction=0.0)
    signals = [sample.signal for sample in samples]
    order = sorted(range(len(samples)), key=lambda i: (signals[i], _tie_break(samples[i], seed)))
    dropped = order[:len(samples) - keep]
    dropped_set = set(dropped)
    total = sum(signals)
    lost = sum(signals[i] for i in dropped)
    return Downsampled(kept=[s for i, s in enumerate(samples) if i not in dropped_set],
                       dropped=[samples[i] for i in dropped], waiting=[],
                       lost_fraction=lost / total if total > 0 else 0.0)


def _tie_break(sample: Sample, seed: int) -> float:
    # A string seed goes through SHA-512, so the draw is stable across processes and Python versions.
    uid, index, segment = sample.key
    return random.Random(f"{seed}/{uid}/{index}/{segment}").random()


@dataclass(frozen=True)
class Renormalised:
    """Credit recomputed over the survivors of downsampling."""

    trajectories: list[Trajectory]  # survivor views (copies) carrying the new turn credit
    samples: list[Sample]  # the kept samples, same order, with the new advantages
    stats: dict[str, float]  # the estimator's batch statistics over the survivors (e.g. ig_scale)


def renormalise(trajectories: Sequence[Trajectory], kept: Sequence[Sample],
                estimator: Estimator) -> Renormalised:
    """Re-run credit assignment on the survivors so group statistics cover only what trains.

    The survivor view of a trajectory is a copy restricted to its segments that have a kept sample;
    a trajectory with none leaves its group (in mono context that is how a trajectory is dropped;
    with ``gspo_round`` on iter_research each round is a segment, so the group is normalised over
    the surviving rounds). The copies are new ``Trajectory``, ``Segment`` and ``Turn`` objects made
    with ``dataclasses.replace``, so the caller's trajectories keep their credit; they share the
    unchanged fields (token id lists, metadata), which must not be mutated through them.

    Estimators that read a trajectory's turn sequence (``igpo``'s information-gain telescoping and
    discounting, ``abc_grpo``'s discounting) see only the surviving turns: exact for mono context
    (whole trajectories survive or leave) and for ``grpo``/``gspo_round``.
    """
    check_unique_trajectories(trajectories)
    _check_unique_samples(kept)
    survivors = {sample.key for sample in kept}
    views: list[Trajectory] = []
    view_segments: dict[tuple[str, int, int], Segment] = {}  # sample key -> its survivor copy
    for trajectory in trajectories:
        segments = []
        for index, segment in enumerate(trajectory.segments):
            key = (trajectory.uid, trajectory.sample, index)
            if key in survivors:
                copy = replace(segment, turns=[replace(turn) for turn in segment.turns])
                segments.append(copy)
                view_segments[key] = copy
        if segments:
            views.append(replace(trajectory, segments=segments))
    unknown = survivors - view_segments.keys()
    if unknown:
        raise ValueError(f"kept samples {sorted(unknown)[:3]} match no segment of the trajectories given; "
                         "pass the batch the samples were built from")

    result = assign_credit(views, estimator)
    samples = []
    for sample in kept:
        segment = view_segments[sample.key]
        if segment.flat_ids() != sample.prompt_ids + sample.response_ids:
            raise ValueError(f"sample {sample.key} does not hold the tokens of its segment; rebuild the "
                             "samples from these trajectories")
        samples.append(replace(sample, advantages=token_advantages(segment)[len(segment.prompt_ids):]))
    return Renormalised(trajectories=views, samples=samples, stats=dict(result.stats))


def _check_unique_samples(samples: Sequence[Sample]) -> None:
    seen: set[tuple[str, int, int]] = set()
    for sample in samples:
        if sample.key in seen:
            raise ValueError(f"sample {sample.key} (uid, sample, segment) appears twice; a batch never "
                             "holds the same segment twice")
        seen.add(sample.key)

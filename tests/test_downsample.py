"""Minimal-loss downsampling (docs/algorithms.md §8, E6) and renormalisation over the survivors (§7, E5)."""

from __future__ import annotations

import copy
import random

import pytest

from tests.test_batch import trajectory, turn
from tests.test_credit_assign import scored
from turnstile.learner.batch import Sample, samples_from_trajectories
from turnstile.learner.credit import build_estimator
from turnstile.learner.credit.assign import assign_credit
from turnstile.learner.downsample import downsample, kept_count, renormalise
from turnstile.rollout.trajectory import Segment, Trajectory

TOLERANCE = 1e-5


def sample(name: str, advantages: list[float], observation: int = 0) -> Sample:
    """A sample keyed (name, 0, 0) whose response is ``advantages``' tokens then ``observation`` more."""
    length = len(advantages) + observation
    return Sample(uid=name, trajectory=(name, 0), segment=0, prompt_ids=[1], response_ids=[2] * length,
                  response_mask=[1] * len(advantages) + [0] * observation,
                  advantages=advantages + [0.0] * observation, old_log_probs=[0.0] * length,
                  loss_weights=[1.0] * length, weights_version=0)


def names(samples: list[Sample]) -> list[str]:
    return [s.uid for s in samples]


# ---- how many, and which ---------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "dp", "mini_batch", "kept"), [
    (21, 4, 4, 20), (21, 2, 4, 20), (1237, 32, 32, 1216), (1237, 8, 32, 1216), (64, 64, 64, 64),
    (64, 8, 64, 64), (7, 8, 8, 0), (7, 4, 8, 0), (12, 4, 6, 12), (11, 4, 6, 0), (0, 2, 2, 0),
])
def test_kept_count_is_a_multiple_of_lcm(n: int, dp: int, mini_batch: int, kept: int) -> None:
    assert kept_count(n, dp, mini_batch) == kept  # E6: (21, 4) -> 20, (1237, 32) -> 1216, ...


def test_kept_count_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        kept_count(10, 0, 4)
    with pytest.raises(ValueError, match="cannot be negative"):
        kept_count(-1, 2, 2)


def test_least_signal_goes_first_and_zero_signal_before_any() -> None:
    batch = [sample("long-zero", [0.0] * 50), sample("small", [0.001]), sample("a", [0.5]),
             sample("short-zero", [0.0], observation=3), sample("b", [1.0]), sample("c", [-2.0]),
             sample("d", [3.0])]
    result = downsample(batch, dp=4, mini_batch=2, seed=0)  # m = 4: drop 3 of 7
    assert set(names(result.dropped[:2])) == {"long-zero", "short-zero"}
    assert names(result.dropped)[2] == "small"
    assert names(result.kept) == ["a", "b", "c", "d"]  # input order
    assert result.dropped_count == 3 and not result.waiting
    assert result.lost_fraction == pytest.approx(0.001 / 6.501)


def test_lost_fraction_by_hand() -> None:
    # signals 1, 2, 3 (|advantage| summed over tokens); m = 2 drops the one carrying 1 of 6
    batch = [sample("x", [1.5, -0.5]), sample("y", [0.5, -0.5]), sample("z", [3.0])]
    result = downsample(batch, dp=2, mini_batch=1, seed=3)
    assert names(result.dropped) == ["y"] and names(result.kept) == ["x", "z"]
    assert result.lost_fraction == pytest.approx(1 / 6)


def test_nothing_is_lost_when_there_is_no_signal() -> None:
    result = downsample([sample(str(i), [0.0, 0.0]) for i in range(5)], dp=2, mini_batch=2, seed=0)
    assert result.dropped_count == 1 and result.lost_fraction == 0.0


def test_too_few_samples_wait() -> None:
    batch = [sample(str(i), [1.0]) for i in range(7)]
    result = downsample(batch, dp=8, mini_batch=8, seed=0)  # E6: (7, 8) -> 0
    assert result.kept == [] and result.dropped == [] and result.dropped_count == 0
    assert names(result.waiting) == names(batch) and result.lost_fraction == 0.0


def test_ties_are_broken_by_the_seed_reproducibly() -> None:
    batch = [sample(f"s{i}", [0.0]) for i in range(10)]  # all tied at zero; m = 4 drops 2

    def dropped(seed: int, samples: list[Sample]) -> frozenset[str]:
        return frozenset(names(downsample(samples, dp=4, mini_batch=4, seed=seed).dropped))

    assert dropped(7, batch) == dropped(7, batch)
    shuffled = list(batch)
    random.Random(1).shuffle(shuffled)
    assert dropped(7, shuffled) == dropped(7, batch)  # arrival order does not matter
    assert len({dropped(seed, batch) for seed in range(10)}) > 1


def test_every_sample_is_kept_or_dropped_exactly_once() -> None:
    rng = random.Random(5)
    batch = [sample(f"s{i}", [rng.choice([0.0, 0.5, 1.0, -1.0]) for _ in range(rng.randint(1, 4))])
             for i in range(37)]
    result = downsample(batch, dp=4, mini_batch=8, seed=11)
    assert len(result.kept) == 32 and result.dropped_count == 5
    assert sorted(names(result.kept) + names(result.dropped)) == sorted(names(batch))
    assert max(s.signal for s in result.dropped) <= min(s.signal for s in result.kept)
    with pytest.raises(ValueError, match="appears twice"):
        downsample(batch + batch[:1], dp=2, mini_batch=2, seed=0)


# ---- renormalisation ---------------------------------------------------------------------------------

def rounds_trajectory(sample_index: int, response_lengths: list[int], outcome: float) -> Trajectory:
    """iter_research: every round (turn) is its own segment; the last round answers."""
    segments = []
    for index, length in enumerate(response_lengths):
        final = index == len(response_lengths) - 1
        segments.append(Segment(prompt_ids=[1, 2, 3, 100 + index], turns=[
            turn(index, [10 + index] * length, None if final else [9, 9],
                 action="answer" if final else "tool_call", tool="search")]))
    return trajectory("e5", sample_index, segments, outcome=outcome, context_manager="iter_research")


def e5_batch() -> list[Trajectory]:
    """E5: rounds T = [4, 2, 3], outcomes [1, 0, 1]. Round 0 of trajectory 1 is the shortest, so it
    carries the least signal."""
    return [rounds_trajectory(0, [1, 2, 2, 2], 1.0), rounds_trajectory(1, [1, 1], 0.0),
            rounds_trajectory(2, [2, 2, 2], 1.0)]


def generated_advantages(s: Sample) -> list[float]:
    return [a for a, m in zip(s.advantages, s.response_mask, strict=True) if m]


def assert_all_close(values: list[float], expected: float) -> None:
    assert values and all(abs(v - expected) <= TOLERANCE for v in values), (values, expected)


def test_e5_round_level_gspo_through_downsampling() -> None:
    trajectories = e5_batch()
    gspo = build_estimator("gspo_round")
    assign_credit(trajectories, gspo)
    samples = samples_from_trajectories(trajectories)
    assert len(samples) == 9
    for s in samples:
        assert_all_close(generated_advantages(s), 0.534521 if s.trajectory[1] != 1 else -1.870824)

    result = downsample(samples, dp=4, mini_batch=8, seed=0)  # m = 8: one round goes
    assert [s.key for s in result.dropped] == [("e5", 0, 0)]
    renormalised = renormalise(trajectories, result.kept, gspo)
    assert len(renormalised.samples) == 8
    for s in renormalised.samples:
        assert_all_close(generated_advantages(s), 0.577349 if s.trajectory[1] != 1 else -1.732047)
        assert all(a == 0.0 for a, m in zip(s.advantages, s.response_mask, strict=True) if not m)
    assert [s.key for s in renormalised.samples] == [s.key for s in result.kept]
    assert [len(t.segments) for t in renormalised.trajectories] == [3, 2, 3]
    # the caller's trajectories and samples still hold the credit of the full batch
    assert_all_close([t.advantage for t in trajectories[0].turns], 0.534521)
    assert_all_close(generated_advantages(result.kept[0]), 0.534521)
    assert all(view is not original for view, original in zip(renormalised.trajectories, trajectories,
                                                                strict=True))
    assert renormalised.trajectories[0].segments[0].turns[0] is not trajectories[0].segments[1].turns[0]


def test_e5_dropping_a_middle_round_renormalises_the_same() -> None:
    trajectories = e5_batch()
    gspo = build_estimator("gspo_round")
    assign_credit(trajectories, gspo)
    kept = [s for s in samples_from_trajectories(trajectories) if s.key != ("e5", 0, 2)]
    renormalised = renormalise(trajectories, kept, gspo)
    expected = {0: 0.577349, 1: -1.732047, 2: 0.577349}
    for s in renormalised.samples:
        assert_all_close(generated_advantages(s), expected[s.trajectory[1]])
    assert [s.segment for s in renormalised.samples[:3]] == [0, 1, 3]  # original segment indices


def test_a_trajectory_without_survivors_leaves_its_group() -> None:
    trajectories = e5_batch()
    gspo = build_estimator("gspo_round")
    assign_credit(trajectories, gspo)
    kept = [s for s in samples_from_trajectories(trajectories) if s.trajectory != ("e5", 1)]
    renormalised = renormalise(trajectories, kept, gspo)
    assert [t.sample for t in renormalised.trajectories] == [0, 2]
    for s in renormalised.samples:  # only outcome-1 rounds remain: no signal is left
        assert generated_advantages(s) == [0.0] * len(generated_advantages(s))


def mono_batch() -> list[Trajectory]:
    """Two groups of mono-context trajectories with information-gain values and outcomes."""
    return [scored("q", 0, 1.0, [-2.0, -1.0]), scored("q", 1, 0.0, [-2.0, -2.5]),
            scored("q", 2, 1.0, [-2.0, -1.9]), scored("q", 3, 0.0, [-2.0, -1.2]),
            scored("r", 0, 1.0, [-1.0, -0.5]), scored("r", 1, 1.0, [-1.0, -0.4]),
            scored("r", 2, 0.0, [-1.0, -1.3])]


@pytest.mark.parametrize("name", ["grpo", "igpo"])
def test_group_statistics_are_those_of_the_survivors(name: str) -> None:
    estimator = build_estimator(name)
    trajectories = mono_batch()
    assign_credit(trajectories, estimator)
    samples = samples_from_trajectories(trajectories)
    result = downsample(samples, dp=2, mini_batch=4, seed=1)  # m = 4: 7 -> 4, three trajectories leave
    assert result.dropped_count == 3
    renormalised = renormalise(trajectories, result.kept, estimator)

    survivors = {s.trajectory for s in result.kept}
    direct = [copy.deepcopy(t) for t in mono_batch() if (t.uid, t.sample) in survivors]
    direct_stats = assign_credit(direct, estimator).stats
    expected = {s.key: s.advantages for s in samples_from_trajectories(direct)}
    changed = False
    for before, after in zip(result.kept, renormalised.samples, strict=True):
        assert after.advantages == pytest.approx(expected[after.key], abs=1e-12)
        changed |= after.advantages != pytest.approx(before.advantages, abs=1e-6)
    assert changed, "dropping trajectories must move the group statistics"
    assert renormalised.stats == pytest.approx(direct_stats)


def test_renormalise_rejects_samples_from_elsewhere() -> None:
    trajectories = e5_batch()
    gspo = build_estimator("gspo_round")
    assign_credit(trajectories, gspo)
    stranger = sample("nobody", [1.0])
    with pytest.raises(ValueError, match="match no segment"):
        renormalise(trajectories, [stranger], gspo)

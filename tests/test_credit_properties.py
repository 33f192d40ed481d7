"""Properties every estimator must keep, on random groups (hypothesis)."""

from __future__ import annotations

import math
import random as random_module

from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.learner.credit import (
    ESTIMATORS,
    Estimator,
    Group,
    IgpoOptions,
    IgType,
    Norm,
    build_estimator,
    discount_over_boundaries,
    group_by_uid,
    group_normalize,
    trajectory_from_object,
)

SETTINGS = settings(max_examples=60, deadline=None)
TOOLS = st.sampled_from(["search", "visit", "python"])


@st.composite
def trajectory_objects(draw: st.DrawFn, uid: str = "q") -> dict:
    """One turn record with every field any estimator reads; the last turn is the answer."""
    length = draw(st.integers(1, 6))
    turns = []
    for index in range(length):
        final = index == length - 1
        format_ok = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else True
        turns.append({
            "tool": None if final or not format_ok else draw(TOOLS),
            "format_ok": format_ok,
            "ig_value": draw(st.floats(-12.0, 0.0)),
            "step_score": draw(st.floats(0.0, 2.0)),
        })
    return {"uid": uid, "outcome": draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)),
            "answered": draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else True, "turns": turns}


GROUP = st.lists(trajectory_objects(), min_size=1, max_size=6)


def estimators() -> list[Estimator]:
    built = [build_estimator(name) for name in ESTIMATORS.names()]
    built += [build_estimator("igpo", IgpoOptions(norm=norm)) for norm in (Norm.joint, Norm.separate)]
    built += [build_estimator("igpo", IgpoOptions(ig_tools=[], ig_type=IgType.prob_diff))]
    return built


def group_of(objects: list[dict]) -> Group:
    [group] = group_by_uid(trajectory_from_object(obj, line) for line, obj in enumerate(objects, start=1))
    return group


def advantages(estimator: Estimator, group: Group) -> list[list[float]]:
    [credit] = estimator.assign([group]).groups
    return [[turn.advantage for turn in trajectory] for trajectory in credit]


@SETTINGS
@given(GROUP)
def test_advantages_are_finite(objects: list[dict]) -> None:
    group = group_of(objects)
    for estimator in estimators():
        values = advantages(estimator, group)
        assert [len(row) for row in values] == [len(t.turns) for t in group.trajectories]
        assert all(math.isfinite(a) for row in values for a in row), estimator.name


@SETTINGS
@given(st.floats(-1e6, 1e6), st.integers(1, 50))
def test_equal_rewards_normalise_to_zero(value: float, size: int) -> None:
    assert group_normalize([value] * size) == [0.0] * size


@SETTINGS
@given(GROUP, st.sampled_from([0.0, 1.0]), st.floats(0.0, 2.0))
def test_a_group_with_equal_rewards_gets_zero_advantages(
        objects: list[dict], outcome: float, score: float) -> None:
    for obj in objects:
        obj["outcome"], obj["answered"] = outcome, True
        for turn in obj["turns"]:
            turn["step_score"], turn["format_ok"] = score, True
    group = group_of(objects)
    for name in ("grpo", "gspo_round", "abc_grpo"):
        assert all(a == 0.0 for row in advantages(build_estimator(name), group) for a in row), name


@SETTINGS
@given(GROUP, st.randoms(use_true_random=False))
def test_permuting_a_group_permutes_its_advantages(objects: list[dict], random: random_module.Random) -> None:
    order = list(range(len(objects)))
    random.shuffle(order)
    group, permuted = group_of(objects), group_of([objects[i] for i in order])
    for estimator in estimators():
        original, shuffled = advantages(estimator, group), advantages(estimator, permuted)
        for position, source in enumerate(order):
            assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
                       for a, b in zip(shuffled[position], original[source], strict=True)), estimator.name


@SETTINGS
@given(st.lists(st.one_of(st.none(), st.floats(-5, 5)), min_size=1, max_size=8), st.floats(0.0, 1.0))
def test_a_turn_takes_the_advantage_of_the_next_boundary(rewards: list[float | None], gamma: float) -> None:
    rewards[-1] = 0.5 if rewards[-1] is None else rewards[-1]  # the last turn always carries the outcome
    result = discount_over_boundaries(rewards, gamma)
    for turn, reward in enumerate(rewards):
        following = [r for r in rewards[turn:] if r is not None]
        expected = sum(gamma ** k * r for k, r in enumerate(following))
        assert math.isclose(result[turn], expected, rel_tol=1e-9, abs_tol=1e-9)
        if reward is None:
            assert result[turn] == result[turn + 1]

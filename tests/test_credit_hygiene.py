"""Estimator hygiene: what every estimator must not do, whatever its rewards (issue 36, item 3).

- Normalise over the turns that exist: a short trajectory adds no padded zeros to its group's pool.
- Pay no bonus for extra turns when the turn rewards carry no information: no baseline whose number
  of terms depends on where the trajectory stopped (the length bias of verl-project/verl#7244).
  Pooling outcomes with turn rewards (``norm=joint``, IGPO's and ABSeeker's papers as written) has
  exactly that bias; the test measures it there too, which shows that the test can fail.
- A group whose rewards are all equal, up to rounding, gets exactly zero, not rounding noise
  divided by a tiny deviation.

The loss side (the denominator does not reward writing fewer tokens per turn) is checked on veRL's
trainer in ``tests/test_learner_direction.py``.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.learner.credit import (
    AbcGrpoOptions,
    Estimator,
    Group,
    GrpoOptions,
    GspoRoundOptions,
    IgpoOptions,
    Norm,
    build_estimator,
    group_by_uid,
    group_normalize,
    trajectory_from_object,
)
from turnstile.learner.credit.normalize import normalize_pooled


def group_of(objects: list[dict]) -> Group:
    [group] = group_by_uid(trajectory_from_object(obj, line) for line, obj in enumerate(objects, start=1))
    return group


def advantages(estimator: Estimator, groups: list[Group]) -> list[list[list[float]]]:
    result = estimator.assign(groups)
    return [[[turn.advantage for turn in trajectory] for trajectory in group] for group in result.groups]


# ---- the turns that exist -----------------------------------------------------------------------

@st.composite
def every_turn_a_boundary(draw: st.DrawFn) -> list[dict]:
    """A group of 2-6 answered trajectories of 1-7 turns, every turn scored (IG and step score).
    Values on a grid, so that a spread is either none or well above the variance floor."""
    group = []
    for _ in range(draw(st.integers(2, 6))):
        length = draw(st.integers(1, 7))
        values = [v / 4 for v in draw(st.lists(st.integers(-36, 0), min_size=length, max_size=length))]
        scores = [s / 5 for s in draw(st.lists(st.integers(0, 10), min_size=length, max_size=length))]
        group.append({"uid": "q", "outcome": draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])), "turns": [
            {"tool": "search" if t < length - 1 else None, "ig_value": v, "step_score": s}
            for t, (v, s) in enumerate(zip(values, scores, strict=True))]})
    return group


def assert_normalised(values: list[float]) -> None:
    """Mean 0 and population std 1 over exactly these values, or all 0 (no spread)."""
    if not values:
        return
    if all(v == 0.0 for v in values):
        return
    assert statistics.fmean(values) == pytest.approx(0.0, abs=1e-6)
    assert statistics.pstdev(values) == pytest.approx(1.0, abs=1e-3)


@settings(max_examples=80, deadline=None)
@given(every_turn_a_boundary())
def test_a_group_is_normalised_over_the_turns_its_trajectories_have(objects: list[dict]) -> None:
    """With γ = 0 a turn's advantage is its own normalised reward: over the group's non-final turns
    (and, apart, its last turns) those have mean 0 and std 1, whatever the lengths. A pool padded to
    the longest trajectory would have neither."""
    group = group_of(objects)
    for estimator in (build_estimator("igpo", IgpoOptions(norm=Norm.separate, gamma=0.0, ig_tools=[])),
                      build_estimator("abc_grpo", AbcGrpoOptions(gamma=0.0))):
        [rows] = advantages(estimator, [group])
        assert_normalised([a for row in rows for a in row[:-1]])
        assert_normalised([row[-1] for row in rows])
    for estimator in (build_estimator("igpo", IgpoOptions(norm=Norm.joint, gamma=0.0, ig_tools=[])),
                      build_estimator("abc_grpo", AbcGrpoOptions(gamma=0.0, norm=Norm.joint))):
        [rows] = advantages(estimator, [group])
        assert_normalised([a for row in rows for a in row])


def test_pooling_skips_the_slots_a_short_trajectory_does_not_have() -> None:
    rows: list[list[float | None]] = [[1.0, None, 3.0], [5.0]]
    assert normalize_pooled(rows) == [[*group_normalize([1.0, 3.0, 5.0])[:1], None,
                                       group_normalize([1.0, 3.0, 5.0])[1]], group_normalize([1.0, 3.0, 5.0])[2:]]


# ---- no bonus for extra turns -------------------------------------------------------------------

def uninformative_groups(seed: int, right: float, groups: int = 300, size: int = 8) -> list[Group]:
    """Groups whose turn rewards say nothing: every reward has the same distribution wherever it
    falls and whatever the trajectory's length. Lengths 2-8 drawn alone; the answer right with
    probability ``right`` whatever the length (0.1: most groups all wrong, the regime of issue 36;
    0: every group); v rises by
    a draw of N(0.3, 0.5) after each visit (a gain that is positive on average, as reading tends to
    give) and stays after a search, so the browse-aware gain of every visit and the gain of every
    turn boundary are each drawn alike; step scores 1.0 (nothing established) or 1.8 (a clue) at
    random on non-final turns, the answer's 2.0 or 0.0."""
    rng = np.random.default_rng(seed)
    built = []
    for g in range(groups):
        objects = []
        for _ in range(size):
            length = int(rng.integers(2, 9))
            correct = bool(rng.random() < right)
            tools = [str(rng.choice(["search", "visit"])) for _ in range(length - 1)]
            values = [-5.0]
            for tool in tools:
                values.append(values[-1] + (float(rng.normal(0.3, 0.5)) if tool == "visit" else 0.0))
            turns = [{"tool": tool, "ig_value": value, "step_score": 1.8 if rng.random() < 0.3 else 1.0}
                     for tool, value in zip(tools, values, strict=False)]
            turns.append({"tool": None, "ig_value": values[-1], "step_score": 2.0 if correct else 0.0})
            objects.append({"uid": f"g{g}", "outcome": float(correct), "turns": turns})
        built.append(group_of(objects))
    return built


def continue_bonus(estimator: Estimator, groups: list[Group]) -> tuple[float, float]:
    """What taking another turn earns over answering: in each group, the mean advantage of the
    non-final turns (each chose to go on) minus that of the last turns (each chose to stop),
    averaged over the groups (independent draws), and that mean over its standard error."""
    gaps = []
    for rows in advantages(estimator, groups):
        gaps.append(statistics.fmean(a for row in rows for a in row[:-1]) - statistics.fmean(row[-1] for row in rows))
    mean = statistics.fmean(gaps)
    error = (statistics.variance(gaps) / len(gaps)) ** 0.5
    return mean, (mean / error if error else 0.0)


UNBIASED = {
    "grpo": ("grpo", None),
    "igpo": ("igpo", IgpoOptions()),
    "igpo separate": ("igpo", IgpoOptions(norm=Norm.separate)),
    "igpo every turn": ("igpo", IgpoOptions(ig_tools=[])),
    "abc_grpo": ("abc_grpo", AbcGrpoOptions()),
    "gspo_round": ("gspo_round", None),
}


@pytest.mark.parametrize("arm", sorted(UNBIASED))
def test_no_estimator_pays_for_extra_turns_that_carry_no_information(arm: str) -> None:
    name, options = UNBIASED[arm]
    estimator = build_estimator(name, options)
    for seed, right in ((0, 0.1), (1, 0.0), (2, 0.3)):
        bonus, z = continue_bonus(estimator, uninformative_groups(seed, right))
        assert abs(z) < 3.5, f"{arm}, right {right}: going on earns {bonus:+.4f} over answering (z = {z:+.1f})"


@pytest.mark.parametrize(("name", "options"), [
    ("igpo", IgpoOptions(norm=Norm.joint)),
    ("abc_grpo", AbcGrpoOptions(norm=Norm.joint)),
])
@pytest.mark.parametrize(("seed", "right"), [(0, 0.1), (1, 0.0)])
def test_pooling_outcomes_with_turn_rewards_pays_for_going_on(name: str, options: IgpoOptions | AbcGrpoOptions,
                                                              seed: int, right: float) -> None:
    """The papers' pooled normalisation, on the same groups where most or all answers are wrong: the
    pool's mean sits between the wrong outcomes and the turn rewards, every non-final turn is
    credited above it, and going on pays. Kept as an option for replication (docs/algorithms.md)."""
    bonus, z = continue_bonus(build_estimator(name, options), uninformative_groups(seed, right))
    assert bonus > 0 and z > 6, f"{name} joint, right {right}: {bonus:+.4f} (z = {z:+.1f})"


# ---- equal rewards ------------------------------------------------------------------------------

def test_rewards_equal_up_to_rounding_normalise_to_exactly_zero() -> None:
    assert group_normalize([0.1 + 0.2, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_normalize([-7.25, -7.25 + 1e-12, -7.25 - 1e-12]) == [0.0, 0.0, 0.0]
    assert group_normalize([1e6, 1e6 + 1e-4]) == [0.0, 0.0]  # a spread of 1e-10 of the values' size
    spread = group_normalize([0.0, 1e-3])  # a small spread that is not rounding keeps its sign
    assert spread[0] < -0.9 and spread[1] > 0.9


def test_a_group_whose_information_gains_differ_only_by_rounding_gets_no_turn_credit() -> None:
    """Outcomes all 1 and IG values equal up to rounding: every advantage is exactly 0, IG-Scale
    included (it would multiply rounding noise by s_max)."""
    objects = [{"uid": "q", "outcome": 1.0, "turns": [
        {"tool": "visit", "ig_value": -3.0}, {"tool": "visit", "ig_value": -2.5 + jitter},
        {"tool": None, "ig_value": -2.0}]} for jitter in (0.0, 1e-13, -1e-13)]
    for options in (IgpoOptions(), IgpoOptions(ig_tools=[]), IgpoOptions(norm=Norm.separate)):
        [rows] = advantages(build_estimator("igpo", options), [group_of(objects)])
        assert all(a == 0.0 for row in rows for a in row), (options.norm, rows)


# ---- an episode cut by the limits ---------------------------------------------------------------

def all_wrong_group() -> Group:
    """The all-wrong group of the multi-hop campaign: two wrong answers after three turns, two
    episodes the turn limit ended after eight (well formed throughout), one malformed answer attempt."""
    def episode(length: int, stop: str, last_ok: bool = True) -> dict:
        turns = [{"tool": "search", "ig_value": -4.0} for _ in range(length - 1)]
        return {"uid": "q", "outcome": 0.0 if stop == "answered" else -1.0, "stop_reason": stop,
                "turns": [*turns, {"tool": None, "ig_value": -4.0, "format_ok": last_ok}]}
    return group_of([episode(3, "answered"), episode(3, "answered"), episode(8, "no_answer"),
                     episode(8, "no_answer"), episode(2, "malformed_answer", last_ok=False)])


@pytest.mark.parametrize(("name", "options"), [
    ("grpo", GrpoOptions), ("gspo_round", GspoRoundOptions), ("igpo", IgpoOptions)])
def test_a_cut_episode_can_score_as_a_wrong_answer(name: str, options: type) -> None:
    """By default an episode the limits ended unanswered pays the format penalty, so in a group
    whose answers are all wrong answering sooner is credited above searching on (what GRPO learnt on
    the multi-hop split, docs/benchmarks/learning.md). ``penalise_unanswered=false`` scores it 0, as
    the wrong answers: they get the same advantage; the malformed attempt still pays."""
    group = all_wrong_group()
    [rows] = advantages(build_estimator(name, options()), [group])
    wrong, cut, malformed = rows[0][0], rows[2][0], rows[4][0]
    assert wrong > 0 > cut
    [rows] = advantages(build_estimator(name, options(penalise_unanswered=False)), [group])
    assert rows[0][0] == pytest.approx(rows[2][0]) and rows[0][0] > 0 > rows[4][0]
    assert malformed < 0

"""Credit on rollout trajectories: records from turns, advantages back on turns, tokens broadcast."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.test_trajectory import sample_trajectory
from turnstile.learner.credit import build_estimator
from turnstile.learner.credit.assign import assign_credit, response_mask, token_advantages


def scored(uid: str, sample: int, outcome: float, v: list[float]):  # noqa: ANN201
    trajectory = sample_trajectory(uid, sample)
    trajectory.turns[0].tool = "visit"
    trajectory.outcome = outcome
    for turn, value in zip(trajectory.turns, v, strict=True):
        turn.ig_value = value
    return trajectory


def test_igpo_credit_lands_on_turns_and_tokens() -> None:
    batch = [scored("q", 0, 1.0, [-2.0, -1.0]), scored("q", 1, 0.0, [-2.0, -2.5]),
             scored("r", 0, 1.0, [-1.0, -0.5]), scored("r", 1, 1.0, [-1.0, -0.4])]
    result = assign_credit(batch, build_estimator("igpo"))
    assert "ig_scale" in result.stats
    assert batch[0].turns[0].ig == pytest.approx(1.0) and batch[1].turns[0].ig == pytest.approx(-0.5)
    assert batch[0].turns[0].advantage > batch[1].turns[0].advantage
    assert all(turn.advantage is not None for t in batch for turn in t.turns)
    segment = batch[0].segments[0]
    tokens, mask = token_advantages(segment), response_mask(segment)
    assert len(tokens) == len(mask) == len(segment.flat_ids())
    first, last = segment.turns
    assert tokens == [0.0] * 4 + [first.advantage] * 3 + [0.0] * 2 + [last.advantage] * 2
    assert mask == [0] * 4 + [1] * 3 + [0] * 2 + [1] * 2


def test_missing_outcome_or_advantage_is_explained() -> None:
    trajectory = sample_trajectory()
    with pytest.raises(ValueError, match="no outcome yet"):
        assign_credit([trajectory], build_estimator("grpo"))
    with pytest.raises(ValueError, match="assign credit before"):
        token_advantages(trajectory.segments[0])


@pytest.mark.parametrize("name", ["grpo", "igpo", "gspo_round"])
def test_a_cut_episode_scores_as_a_wrong_answer_in_training_too(name: str) -> None:
    """``penalise_unanswered=false`` on the rollout's own trajectories (the training path, not a
    turn-record file): a wrong answer and an episode the turn limit cut get the same advantage, a
    malformed answer attempt still pays. (A first version read the stop reason only from turn-record
    files, so in training a malformed answer paid nothing.)"""
    from turnstile.learner.credit import build_estimator as build
    from turnstile.learner.credit.registry import estimator_class
    from turnstile.rollout.trajectory import StopReason

    batch = [scored("q", sample, 0.0, [-2.0, -2.0]) for sample in range(3)]
    for trajectory, stop in zip(batch, (StopReason.ANSWERED, StopReason.NO_ANSWER, StopReason.MALFORMED_ANSWER),
                                strict=True):
        trajectory.stop_reason = stop
        trajectory.turns[-1].format_ok = stop is not StopReason.MALFORMED_ANSWER
    assign_credit(batch, build(name, estimator_class(name).Options(penalise_unanswered=False)))
    wrong, cut, malformed = (t.turns[0].advantage for t in batch)
    assert wrong == pytest.approx(cut) and wrong is not None and malformed is not None and wrong > malformed


def test_a_failed_call_can_be_left_without_information_gain() -> None:
    """Browse-aware IG credits a visit with the rise of v since the previous visit, searches between
    them included: a visit to a page that does not exist, after a search that listed the answer,
    collects that search's gain (what IGPO paid most for on the multi-hop split,
    docs/benchmarks/learning.md). With ``credit_failed_calls=false`` it is no boundary, and the gain
    goes to the next visit that read a page."""
    from turnstile.learner.credit import IgpoOptions

    def episode(sample: int):  # noqa: ANN202
        trajectory = scored("q", sample, 0.0, [-5.0, -5.0])
        first, last = trajectory.turns
        trajectory.segments[0].turns = [first, replace(first, index=1), replace(first, index=2), last]
        search, failed, visit, answer = trajectory.turns
        answer.index = 3
        search.tool, failed.tool, visit.tool = "search", "visit", "visit"
        failed.tool_ok = False
        for turn, v in zip(trajectory.turns, [-5.0, -2.0, -2.0, -1.5], strict=True):  # the search lifts v by 3
            turn.ig_value = v
        return trajectory

    credited = [episode(0), episode(1)]
    assign_credit(credited, build_estimator("igpo"))
    assert [t.ig for t in credited[0].turns] == [None, pytest.approx(3.0), pytest.approx(0.5), None]
    left = [episode(0), episode(1)]
    assign_credit(left, build_estimator("igpo", IgpoOptions(credit_failed_calls=False)))
    assert [t.ig for t in left[0].turns] == [None, None, pytest.approx(3.5), None]

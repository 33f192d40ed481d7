"""The scores of ``turnstile eval`` against their definitions: pass@k against every k-subset,
maj@k's votes and ties, the bootstrap interval."""

from __future__ import annotations

import itertools
import random

import pytest

from turnstile.cluster.jobs.eval_metrics import benchmark_scores, maj_at_k, mean_interval, pass_at_k


@pytest.mark.parametrize("seed", range(6))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    correct = [rng.random() < 0.3 for _ in range(n)]
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(correct[i] for i in subset) for subset in subsets) / len(subsets)
        assert pass_at_k(n, sum(correct), k) == pytest.approx(brute, abs=1e-12), (correct, k)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in ((4, 5, 1), (4, 2, 0), (4, 2, 5), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_maj_at_k_votes_over_normalised_answers_and_splits_ties() -> None:
    # "The Paris" and "paris" are one answer: it wins 2 to 1.
    assert maj_at_k(["The Paris", "Lyon", "paris."], [True, False, True], 3) == 1.0
    # Only the first k samples vote; unanswered and empty ones do not vote.
    assert maj_at_k(["Lyon", None, "", "Paris", "Paris"], [False, False, False, True, True], 3) == 0.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    # A tie between a right and a wrong answer scores 1/2; a three-way tie with one right, 1/3.
    assert maj_at_k(["Paris", "Lyon"], [True, False], 2) == 0.5
    assert maj_at_k(["Paris", "Lyon", "Nice"], [True, False, False], 3) == pytest.approx(1 / 3)
    # A tie that the vote breaks with one more sample.
    assert maj_at_k(["Paris", "Lyon", "Lyon"], [True, False, False], 3) == 0.0


def test_benchmark_scores_average_over_questions_with_an_interval_around_the_mean() -> None:
    questions = [(["p", "p", "q", "q"], [True, True, False, False]),
                 (["x", None, "y", "x"], [False, False, True, False])]
    scores = benchmark_scores(questions, 4)
    assert list(scores) == ["pass@1", "pass@2", "pass@3", "pass@4", "avg@4", "maj@4"]
    assert scores["pass@1"][0] == pytest.approx((0.5 + 0.25) / 2)
    assert scores["pass@4"][0] == 1.0 and scores["avg@4"][0] == pytest.approx(0.375)
    assert scores["maj@4"][0] == pytest.approx((0.5 + 0.0) / 2)
    mean, low, high = mean_interval([0.0] * 50 + [1.0] * 50)
    assert mean == 0.5 and 0.38 < low < 0.45 and 0.55 < high < 0.62
    assert mean_interval([]) == (0.0, 0.0, 0.0)

"""The scores of ``turnstile eval``: pass@k, avg@k and maj@k per question, and their means over a
benchmark with a 95% interval.

- **pass@k** is the unbiased estimator of Chen et al. (2021): with ``n`` samples of which ``c`` are
  correct, the chance that ``k`` of them drawn without replacement hold at least one correct,
  ``1 - C(n-c, k) / C(n, k)``. It uses all ``n`` samples, not only the first ``k``.
- **avg@k** is the share of correct samples among the first ``k``.
- **maj@k** votes over the normalised answers (:func:`turnstile.envs.answers.normalize_answer`) of the first
  ``k`` samples; samples without an answer do not vote. A tie between answers scores the share of
  the tied answers that are correct: the expected score of breaking the tie at random, without the
  randomness.

The interval is a percentile bootstrap over questions (questions resampled with replacement,
2,000 times, a fixed seed), since the per-question scores are not binary.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

from turnstile.envs.answers import normalize_answer

BOOTSTRAP_RESAMPLES = 2000


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one question with ``n`` samples, ``correct`` of them right."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n; got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """Majority vote over the first ``k`` samples' answers (see the module docstring for ties)."""
    votes: Counter[str] = Counter()
    right: dict[str, bool] = {}
    for answer, ok in zip(answers[:k], correct[:k], strict=True):
        if answer is None or not normalize_answer(answer):
            continue
        key = normalize_answer(answer)
        votes[key] += 1
        right[key] = right.get(key, False) or ok
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [key for key, count in votes.items() if count == top]
    return sum(right[key] for key in tied) / len(tied)


def mean_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """The mean of per-question scores and its 95% percentile-bootstrap interval."""
    if not values:
        return 0.0, 0.0, 0.0
    mean = sum(values) / len(values)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(BOOTSTRAP_RESAMPLES))
    return mean, means[int(0.025 * BOOTSTRAP_RESAMPLES)], means[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]


def question_scores(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> dict[str, float]:
    """One question's pass@1..k, avg@k and maj@k from its samples (in sample order; at least ``k``)."""
    n = len(correct)
    scores = {f"pass@{j}": pass_at_k(n, sum(correct), j) for j in range(1, k + 1)}
    scores[f"avg@{k}"] = sum(correct[:k]) / k
    scores[f"maj@{k}"] = maj_at_k(answers, correct, k)
    return scores


def benchmark_scores(questions: Sequence[tuple[Sequence[str | None], Sequence[bool]]], k: int) -> dict[str, object]:
    """Every score's mean over the questions with its interval: ``{"pass@1": [mean, low, high], ...}``."""
    per_question = [question_scores(answers, correct, k) for answers, correct in questions]
    names = list(per_question[0]) if per_question else []
    return {name: list(mean_interval([scores[name] for scores in per_question])) for name in names}

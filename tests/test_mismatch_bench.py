"""benchmarks/mismatch.py's arithmetic: turns found from the mask, veRL's k1 and k3 per range of turns."""

from __future__ import annotations

import math

import pytest

from benchmarks import mismatch


def test_turns_are_runs_of_policy_tokens_and_a_tool_result_belongs_to_its_turn() -> None:
    assert mismatch.turn_index([1, 1, 0, 0, 1, 0, 1, 1]) == [0, 0, 0, 0, 1, 1, 2, 2]


def test_gap_statistics_by_hand() -> None:
    # two turns; the observation token (mask 0) is left out whatever its values
    engine = [math.log(0.5), math.log(0.8), 0.0, math.log(0.9)]
    learner = [math.log(0.5), math.log(0.4), -5.0, math.log(0.9)]
    mask = [1, 1, 0, 1]
    (first, whole) = mismatch.gap(engine, learner, mask, mismatch.turn_index(mask))
    assert first["turns"] == "0-9" and whole["turns"] == "all" and whole["tokens"] == 3
    assert whole["k1"] == pytest.approx(math.log(2) / 3)  # mean of log(engine / learner)
    assert whole["k3"] == pytest.approx((0.5 - 1 + math.log(2)) / 3)  # mean of r - 1 - log r, r = learner / engine
    assert whole["ratio_min"] == pytest.approx(0.5) and whole["ratio_max"] == pytest.approx(1.0)
    assert whole["diff_abs_max"] == pytest.approx(math.log(2))
    assert whole["unsure"] == 2 and whole["k3_unsure"] == pytest.approx((0.5 - 1 + math.log(2)) / 2)
    assert whole["learner_mean"] == pytest.approx(math.log(0.5 * 0.4 * 0.9) / 3)
    assert whole["positions"] == [0, 3]

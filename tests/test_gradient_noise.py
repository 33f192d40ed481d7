"""benchmarks/gradient_noise.py cuts whole groups into batches, keeping two files' groups apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import gradient_noise
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn, save_trajectories


def episode(uid: str, sample: int) -> Trajectory:
    turn = Turn(index=0, response_ids=[5, 2], response_logprobs=[-0.1, -0.2], weights_version=0, context_len=0,
                finish_reason="stop", action="answer", tool=None, format_ok=True, observation_ids=[], advantage=1.0)
    return Trajectory(uid=uid, sample=sample, task_id=uid, question="Who?", answers=["Ada"],
                      segments=[Segment(prompt_ids=[1, 2], turns=[turn])], stop_reason=StopReason.ANSWERED,
                      answer="Ada", context_manager="mono", outcome=1.0)


def test_two_runs_groups_of_the_same_name_stay_two_groups(tmp_path: Path) -> None:
    # two seeds of one arm both trained on task q0 at step 3: the same uid in both files
    for name in ("seed0.jsonl", "seed1.jsonl"):
        save_trajectories([episode("s3-q0", k) for k in range(4)] + [episode("s3-q1", k) for k in range(4)],
                          tmp_path / name)
    loaded = gradient_noise.load([str(tmp_path / "seed0.jsonl"), str(tmp_path / "seed1.jsonl")])
    assert len({t.uid for t in loaded}) == 4
    cut = gradient_noise.batches(loaded, 8)
    assert [len(batch) for batch in cut] == [8, 8]
    assert all(len({t.uid for t in batch}) == 2 for batch in cut)  # whole groups of 4, none merged
    assert [len(batch) for batch in gradient_noise.batches(loaded, 6)] == [8, 8]  # whole groups, never split


def test_the_shared_term_and_its_bound_come_from_the_pairs_of_batches() -> None:
    equal = torch.full((4, 4), 0.5) + torch.eye(4)  # every pair agrees by 0.5: no spread, bound = estimate
    assert gradient_noise.shared_upper(equal, 2.0) == (pytest.approx(0.5), pytest.approx(0.5))
    # batch 0 agrees with both others (dot 1), they not with each other: mean 2/3, jackknife error 2/3
    one = torch.tensor([[5.0, 1.0, 1.0], [1.0, 5.0, 0.0], [1.0, 0.0, 5.0]])
    shared, upper = gradient_noise.shared_upper(one, 2.0)
    assert shared == pytest.approx(2 / 3) and upper == pytest.approx(2 / 3 + 2 * 2 / 3)

"""The sign of the update on veRL's real trainer: what a positive advantage does, and a negative one.

A sign error anywhere between the reward and the optimiser would leave every other test green and
the policy untrained, so this checks the direction itself: one PPO step with advantage +1 on some
responses and -1 on others raises the first ones' log-probs and lowers the second ones'; advantages
placed on observation tokens move nothing; and the train/inference ratio the learner reports is
exp(learner log-prob - rollout log-prob) on the response tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from turnstile.learner.batch import Sample
from turnstile.learner.trainer import Learner, LearnerConfig

pytestmark = [pytest.mark.integration]


def sample(index: int, advantage: float, *, on_observations: bool = False, seed: int = 0,
           turn_tokens: int = 8) -> Sample:
    """A prompt, then 3 turns of ``turn_tokens`` policy tokens each followed by 6 observation tokens."""
    rng = random.Random(seed * 100 + index)
    mask = ([1] * turn_tokens + [0] * 6) * 3
    response = [rng.randint(20, 2000) for _ in mask]
    where = [1 - m for m in mask] if on_observations else mask
    return Sample(uid=f"u{index}", trajectory=(f"u{index}", 0), segment=0,
                  prompt_ids=[rng.randint(20, 2000) for _ in range(10)], response_ids=response,
                  response_mask=mask, advantages=[advantage * w for w in where],
                  old_log_probs=[0.0] * len(mask), loss_weights=[float(m) for m in mask], weights_version=0)


def with_rollout_log_probs(samples: list[Sample], values: torch.Tensor, shift: float = 0.0) -> list[Sample]:
    """The samples with ``old_log_probs`` set as a rollout engine would: its log-prob of each
    policy token (``values``, plus ``shift``), 0 on observations."""
    return [replace(s, old_log_probs=[float(values[i, j]) + shift if m else 0.0
                                      for j, m in enumerate(s.response_mask)])
            for i, s in enumerate(samples)]


def policy_mean(values: torch.Tensor, samples: list[Sample]) -> list[float]:
    """Each sample's mean log-prob over its policy tokens."""
    out = []
    for i, s in enumerate(samples):
        mask = torch.tensor(s.response_mask, dtype=torch.bool)
        out.append(float(values[i, :len(mask)][mask].mean()))
    return out


@pytest.fixture(scope="module")
def learner(ray_local: None) -> Iterator[Learner]:
    # One mini-batch per update: every token is scored before the optimiser step (ratio = mismatch).
    learner = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=3e-3, max_length=512)).start()
    yield learner
    learner.close()


def test_positive_advantages_raise_and_negative_lower_log_probs(learner: Learner) -> None:
    samples = [sample(0, 1.0), sample(1, 1.0), sample(2, -1.0), sample(3, -1.0)]
    before = learner.log_probs(samples)
    samples = with_rollout_log_probs(samples, before)
    report = learner.train_rl(samples)
    after = learner.log_probs(samples)
    moved = [a - b for a, b in zip(policy_mean(after, samples), policy_mean(before, samples), strict=True)]
    assert report.trained and report.metrics["grad_norm"] > 0
    assert moved[0] > 1e-3 and moved[1] > 1e-3, moved
    assert moved[2] < -1e-3 and moved[3] < -1e-3, moved


def test_advantages_on_observation_tokens_move_nothing(learner: Learner) -> None:
    samples = [sample(i, 1.0 if i % 2 else -1.0, on_observations=True, seed=1) for i in range(4)]
    samples = with_rollout_log_probs(samples, learner.log_probs(samples))
    report = learner.train_rl(samples)
    assert report.metrics["grad_norm"] == pytest.approx(0.0, abs=1e-9)
    assert report.metrics["loss"] == pytest.approx(0.0, abs=1e-9)


def test_the_loss_weighs_every_policy_token_alike_however_long_its_turn(learner: Learner) -> None:
    """The vanilla loss's denominator is the mini-batch's policy-token count (veRL's token-mean over
    the whole mini-batch, not each sequence's or micro-batch's mean): a turn of 2 tokens weighs no
    more per token than a turn of 12, so writing shorter turns earns nothing. At ratio 1 the PPO
    loss is then exactly -(sum of the tokens' advantages) / (their count)."""
    samples = [sample(0, 1.0, turn_tokens=2, seed=3), sample(1, 1.0, turn_tokens=12, seed=3),
               sample(2, -1.0, turn_tokens=12, seed=3), sample(3, 0.5, turn_tokens=2, seed=3)]
    samples = with_rollout_log_probs(samples, learner.log_probs(samples))
    report = learner.train_rl(samples)
    token_mean = -sum(sum(s.advantages) for s in samples) / sum(sum(s.response_mask) for s in samples)
    sequence_mean = -sum(s.advantages[0] for s in samples) / len(samples)
    assert token_mean == pytest.approx(-(6 + 36 - 36 + 3) / 84)
    assert abs(token_mean - sequence_mean) > 0.25  # the two denominators are told apart
    assert report.metrics["loss"] == pytest.approx(token_mean, abs=1e-5)


def test_the_reported_ratio_is_learner_over_rollout(learner: Learner) -> None:
    samples = [sample(i, 0.5 if i % 2 else -0.5, seed=2) for i in range(4)]
    current = learner.log_probs(samples)
    same = learner.train_rl(with_rollout_log_probs(samples, current)).metrics
    assert same["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert same["mismatch/ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert same["mismatch/clipped"] == 0.0
    # A rollout engine that gave every token twice the learner's probability: ratio 1/2, all clipped.
    current = learner.log_probs(samples)
    skewed = learner.train_rl(with_rollout_log_probs(samples, current, shift=math.log(2.0))).metrics
    assert skewed["mismatch/ratio_mean"] == pytest.approx(0.5, rel=1e-3)
    assert skewed["mismatch/clipped"] == 1.0


@pytest.mark.parametrize("mini_batch", [8, 4])
def test_gspo_with_its_defaults_moves_each_sequence_the_way_its_advantage_says(
        ray_local: None, mini_batch: int) -> None:
    """Round-level GSPO's loss (sequence ratio, its own clip range, recomputed old log-probs): in one
    mini-batch every sequence with +1 gains log-prob and every one with -1 loses it; over two
    mini-batches (the second one's ratios moved by the first update, mostly clipped) on average."""
    gspo = Learner(LearnerConfig(dp=1, mini_batch=mini_batch, micro_batch=2, lr=3e-3, max_length=512,
                                 loss="gspo")).start()
    try:
        samples = [sample(i, 1.0 if i % 2 == 0 else -1.0, seed=7) for i in range(8)]
        before = gspo.log_probs(samples)
        samples = with_rollout_log_probs(samples, before)
        report = gspo.train_rl(samples)
        after = gspo.log_probs(samples)
    finally:
        gspo.close()
    moved = [a - b for a, b in zip(policy_mean(after, samples), policy_mean(before, samples), strict=True)]
    assert report.trained
    if mini_batch == 8:
        assert min(moved[0::2]) > 0 and max(moved[1::2]) < 0, moved
    else:
        assert sum(moved[0::2]) > 0 > sum(moved[1::2]), moved

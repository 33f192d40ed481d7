"""veRL's rollout correction on turnstile's samples (learner/correction.py).

The values on hand-made log-probs are those veRL's functions document (TIS: ``min(ratio, bound)``;
IcePop: 0 outside its bounds; token_k1 rejection: ratios outside ``[lower, upper]`` masked; a
sequence-level weight is the product of its tokens' ratios), per token, per turn and per sample;
the settings that cannot work are refused in one line each; on veRL's real trainer, rejected tokens
carry no gradient and leave the loss's token count, and TIS weights scale the loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from turnstile.learner.batch import Sample
from turnstile.learner.correction import (
    CorrectionConfig,
    CorrectionError,
    correct,
    guard_message,
    summary,
    turn_rows,
)
from turnstile.learner.trainer import Learner, LearnerConfig

LOG2 = math.log(2.0)


def hand_made() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two samples. Sample 0: a turn of 3 tokens, an observation, a turn of 2; sample 1: one turn of
    4 tokens, then padding. Behaviour (the engine) against proximal (the learner) log-ratios:
    sample 0's first turn +log 2 per token (the learner gives each token twice the engine's
    probability), its second turn 0; sample 1's tokens -log 4, 0, 0, +log 1.2."""
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    log_ratio = torch.tensor([[LOG2, LOG2, LOG2, 0.0, 0.0, 0.0],
                              [-math.log(4.0), 0.0, 0.0, math.log(1.2), 0.0, 0.0]])
    behaviour = torch.full_like(mask, -2.0) * mask
    return behaviour + log_ratio * mask, behaviour, mask


def test_turn_rows_lay_out_each_run_of_generated_tokens() -> None:
    _, _, mask = hand_made()
    row, column, width = turn_rows(mask)
    assert row.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert column.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert int(width) == 4
    # a sample that ends in a generated token and one that starts with one are two turns
    row, _, _ = turn_rows(torch.tensor([[0, 1], [1, 0]]))
    assert row.tolist() == [0, 1]


def test_token_tis_truncates_each_ratio_at_the_bound() -> None:
    proximal, behaviour, mask = hand_made()
    weights, kept, metrics = correct(proximal, behaviour, mask,
                                     CorrectionConfig(rollout_is="token", rollout_is_threshold="1.5"))
    assert weights is not None and torch.equal(kept, mask)
    expected = torch.tensor([[1.5, 1.5, 1.5, 0, 1, 1], [0.25, 1, 1, 1.2, 0, 0]])
    assert torch.allclose(weights, expected, atol=1e-6)
    assert metrics["correction/is_weight_max"] == pytest.approx(1.5)
    # truncated: the three tokens at ratio 2
    assert metrics["correction/truncated"] == pytest.approx(3 / 9)
    assert metrics["correction/is_weight_mean"] == pytest.approx(float(expected.sum()) / 9, rel=1e-5)
    # veRL's KL(engine || learner) per token: mean of behaviour - proximal
    assert metrics["rollout_corr/kl"] == pytest.approx(-(3 * LOG2 - math.log(4.0) + math.log(1.2)) / 9, rel=1e-5)
    assert metrics["rollout_corr/k3_kl"] > 0


def test_icepop_zeroes_weights_outside_its_bounds() -> None:
    proximal, behaviour, mask = hand_made()
    weights, _, metrics = correct(proximal, behaviour, mask,
                                  CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_1.8"))
    assert weights is not None
    assert torch.allclose(weights, torch.tensor([[0, 0, 0, 0, 1, 1], [0, 1, 1, 1.2, 0, 0]]), atol=1e-6)
    assert metrics["correction/truncated"] == pytest.approx(4 / 9)  # 3 above 1.8, 1 below 0.5


def test_turn_level_weights_are_each_turns_product_of_ratios() -> None:
    proximal, behaviour, mask = hand_made()
    weights, _, _ = correct(proximal, behaviour, mask, CorrectionConfig(rollout_is="turn", rollout_is_threshold="4"))
    assert weights is not None
    # turn 1: 2^3 = 8, truncated at 4; turn 2: 1; sample 1's turn: 1/4 x 1.2 = 0.3
    assert torch.allclose(weights, torch.tensor([[4, 4, 4, 0, 1, 1], [0.3] * 4 + [0, 0]]), atol=1e-5)
    sequence, _, _ = correct(proximal, behaviour, mask,
                             CorrectionConfig(rollout_is="sequence", rollout_is_threshold="4"))
    assert sequence is not None  # the whole sample's product: 8 for sample 0, truncated at 4
    assert torch.allclose(sequence, torch.tensor([[4, 4, 4, 0, 4, 4], [0.3] * 4 + [0, 0]]), atol=1e-5)


def test_rejection_masks_tokens_turns_or_samples_and_only_those() -> None:
    """veRL's k1 statistic is -log r: its bounds apply to π_engine / π_learner (1 / r)."""
    proximal, behaviour, mask = hand_made()
    _, kept, metrics = correct(proximal, behaviour, mask,
                               CorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.8"))
    assert kept.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0]]  # 1/r = 0.5 and 4 go
    assert metrics["correction/masked"] == pytest.approx(4 / 9)
    # per turn: turn 1's mean -log r is -log 2 (0.5, out); sample 1's turn: (log 4 - log 1.2) / 4 (1.35, in)
    _, kept, _ = correct(proximal, behaviour, mask,
                         CorrectionConfig(rollout_rs="turn_mean_k1", rollout_rs_threshold="0.6_1.8"))
    assert kept.tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]
    # per sample: sample 0's mean -log r is -3 log 2 / 5 (0.66): out of [0.7, 1.4], the whole sample
    _, kept, _ = correct(proximal, behaviour, mask,
                         CorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.7_1.4"))
    assert kept.tolist() == [[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]


def test_nothing_configured_measures_without_weighting() -> None:
    proximal, behaviour, mask = hand_made()
    weights, kept, metrics = correct(proximal, behaviour, mask, CorrectionConfig())
    assert weights is None and torch.equal(kept, mask)
    assert "rollout_corr/kl" in metrics and "correction/is_weight_mean" not in metrics
    assert summary({}) == {}


@pytest.mark.parametrize(("settings", "says"), [
    ({"rollout_is": "token", "rollout_is_threshold": "0.8"}, "below 1"),
    ({"rollout_is_threshold": "0.8"}, "below 1"),  # unused, and still checked
    ({"rollout_is": "token", "rollout_is_threshold": "1.2_3.0"}, "must enclose 1"),
    ({"rollout_is": "token", "rollout_is_threshold": "big"}, "neither a number"),
    ({"rollout_is": "tokens"}, "is not one of token, turn, sequence"),
    ({"rollout_rs": "token_k9", "rollout_rs_threshold": "2"}, "'token_k9' is not one of"),
    ({"rollout_rs": "turn_mean_k3,token_k1", "rollout_rs_threshold": "2"}, "choose one level"),
    ({"rollout_rs": "token_k3"}, "needs rollout_rs_threshold"),
    ({"loss_type": "dpo"}, "loss_type='dpo' is not one of"),
    ({"on_excess": "panic"}, "on_excess='panic'"),
    ({"max_kl": 0.0}, "max_kl=0.0 must be"),
])
def test_bad_settings_get_one_line_each(settings: dict[str, object], says: str) -> None:
    with pytest.raises(CorrectionError) as error:
        CorrectionConfig(**settings)  # type: ignore[arg-type]
    assert says in str(error.value) and "\n" not in str(error.value)


def test_what_bypass_mode_cannot_do_is_refused_with_the_fix() -> None:
    turn = CorrectionConfig(rollout_is="turn")
    with pytest.raises(CorrectionError, match="recompute_old_log_probs=true"):
        LearnerConfig(rollout_correction=turn)  # vanilla's default: no recomputed proximal log-probs
    LearnerConfig(rollout_correction=turn, recompute_old_log_probs=True)
    with pytest.raises(CorrectionError, match="PPO-clip and REINFORCE losses only"):
        LearnerConfig(loss="gspo", recompute_old_log_probs=False,
                      rollout_correction=CorrectionConfig(rollout_is="token"))
    LearnerConfig(loss="gspo", rollout_correction=turn)  # GSPO recomputes by default: decoupled


def test_the_guard_speaks_above_its_bound_and_names_the_fix() -> None:
    quiet = guard_message({"rollout_corr/kl": 0.05, "rollout_corr/k3_kl": 0.04}, CorrectionConfig(), step=3)
    assert quiet is None and guard_message({}, CorrectionConfig(), step=3) is None
    loud = guard_message({"rollout_corr/kl": -0.3, "rollout_corr/k3_kl": 0.2}, CorrectionConfig(), step=3)
    assert loud is not None and "step 3" in loud and "KL -0.3" in loud and "max_kl=0.1" in loud
    assert "rollout_correction.rollout_is=token" in loud  # uncorrected: turn it on
    corrected = guard_message({"rollout_corr/kl": 0.3}, CorrectionConfig(rollout_is="token"), step=1)
    assert corrected is not None and "failed publish" in corrected


# ---- on veRL's real trainer ----------------------------------------------------------------------

def sample(index: int, advantage: float) -> Sample:
    """A prompt and 2 turns of 6 policy tokens, each followed by 4 observation tokens."""
    mask = ([1] * 6 + [0] * 4) * 2
    return Sample(uid=f"u{index}", trajectory=(f"u{index}", 0), segment=0,
                  prompt_ids=[30 + index + 7 * i for i in range(8)],
                  response_ids=[100 + 13 * index + 5 * i for i in range(len(mask))], response_mask=mask,
                  advantages=[advantage * m for m in mask], old_log_probs=[0.0] * len(mask),
                  loss_weights=[float(m) for m in mask], weights_version=0)


def engine_log_probs(samples: list[Sample], learner: Learner, shifts: list[float]) -> list[Sample]:
    """The samples as an engine that gave each token exp(-shift) times the learner's probability
    would return them: learner log-prob - shift (so ratio learner / engine = exp(shift))."""
    values = learner.log_probs(samples)
    return [replace(s, old_log_probs=[float(values[i, j]) - shifts[i] if m else 0.0
                                      for j, m in enumerate(s.response_mask)])
            for i, s in enumerate(samples)]


@pytest.fixture(scope="module")
def learners(ray_local: None) -> Iterator[dict[str, Learner]]:
    base = {"dp": 1, "mini_batch": 4, "micro_batch": 2, "lr": 1e-3, "max_length": 256}
    built = {
        "tis": Learner(LearnerConfig(**base, recompute_old_log_probs=True,  # type: ignore[arg-type]
                                     rollout_correction=CorrectionConfig(rollout_is="token",
                                                                         rollout_is_threshold="1.5"))).start(),
        "rs": Learner(LearnerConfig(**base, recompute_old_log_probs=True,  # type: ignore[arg-type]
                                    rollout_correction=CorrectionConfig(rollout_rs="turn_mean_k1",
                                                                        rollout_rs_threshold="0.5_2.0"))).start(),
        "bypass": Learner(LearnerConfig(**base,  # type: ignore[arg-type]
                                        rollout_correction=CorrectionConfig(rollout_rs="token_k1",
                                                                            rollout_rs_threshold="0.5_2.0"))).start(),
    }
    yield built
    for learner in built.values():
        learner.close()


@pytest.mark.integration
def test_tis_weights_scale_the_loss_where_the_engine_gave_less(learners: dict[str, Learner]) -> None:
    """Decoupled: proximal = current before the update, so PPO's ratio is 1 and the loss is
    -sum(w x advantage) / tokens; a sample whose engine gave half the learner's probability has
    weight 2, truncated at 1.5."""
    learner = learners["tis"]
    samples = engine_log_probs([sample(i, 1.0) for i in range(4)], learner, [LOG2, LOG2, 0.0, 0.0])
    report = learner.train_rl(samples)
    assert report.metrics["loss"] == pytest.approx(-(1.5 + 1.5 + 1 + 1) / 4, rel=1e-3)
    assert report.metrics["correction/is_weight_max"] == pytest.approx(1.5, rel=1e-4)
    assert report.metrics["correction/truncated"] == pytest.approx(0.5, abs=1e-6)
    assert report.metrics["rollout_corr/kl"] == pytest.approx(-LOG2 / 2, rel=1e-3)


@pytest.mark.integration
def test_rejected_turns_carry_no_gradient_and_leave_the_token_count(learners: dict[str, Learner]) -> None:
    learner = learners["rs"]
    # samples 0 and 1: the engine gave each token a quarter of the learner's probability (ratio 4,
    # outside [0.5, 2]: every turn rejected), with advantage +1; samples 2 and 3 agree, advantage 0.
    samples = [sample(0, 1.0), sample(1, 1.0), sample(2, 0.0), sample(3, 0.0)]
    report = learner.train_rl(engine_log_probs(samples, learner, [2 * LOG2, 2 * LOG2, 0.0, 0.0]))
    assert report.metrics["correction/masked"] == pytest.approx(0.5, abs=1e-6)
    assert report.metrics["grad_norm"] == pytest.approx(0.0, abs=1e-9)  # only rejected tokens had advantages
    assert report.metrics["loss"] == pytest.approx(0.0, abs=1e-9)
    # the same with agreeing engines trains
    report = learner.train_rl(engine_log_probs(samples, learner, [0.0] * 4))
    assert report.metrics["grad_norm"] > 1e-4 and report.metrics["correction/masked"] == 0.0
    # the loss is averaged over the kept tokens only: -(24 x 1) / 24, not / 48
    mixed = [sample(0, 1.0), sample(1, 1.0), sample(2, -1.0), sample(3, -1.0)]
    report = learner.train_rl(engine_log_probs(mixed, learner, [0.0, 0.0, 2 * LOG2, 2 * LOG2]))
    assert report.metrics["loss"] == pytest.approx(-1.0, rel=1e-3)


@pytest.mark.integration
def test_bypass_mode_masks_inside_verls_loss(learners: dict[str, Learner]) -> None:
    learner = learners["bypass"]
    samples = [sample(i, 1.0) for i in range(4)]
    report = learner.train_rl(engine_log_probs(samples, learner, [2 * LOG2] * 4))
    assert report.metrics["grad_norm"] == pytest.approx(0.0, abs=1e-9)
    assert report.metrics["correction/masked"] == pytest.approx(1.0)
    assert report.metrics["rollout_corr/kl"] == pytest.approx(-2 * LOG2, rel=1e-3)
    report = learner.train_rl(engine_log_probs(samples, learner, [0.0] * 4))
    assert report.metrics["grad_norm"] > 1e-4 and abs(report.metrics["rollout_corr/kl"]) < 1e-4


@pytest.mark.integration
def test_gspo_with_turn_weights_and_the_chunked_head_trains(ray_local: None) -> None:
    learner = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-3, max_length=256, loss="gspo",
                                    head_chunk=8, rollout_correction=CorrectionConfig(rollout_is="turn"))).start()
    try:
        samples = [sample(0, 1.0), sample(1, -1.0), sample(2, 1.0), sample(3, -1.0)]
        report = learner.train_rl(engine_log_probs(samples, learner, [0.1, -0.1, 0.0, 0.0]))
    finally:
        learner.close()
    assert report.trained and report.metrics["grad_norm"] > 0
    # each turn's weight is the product of its 6 tokens' ratios: exp(0.6), exp(-0.6), 1, 1
    assert report.metrics["correction/is_weight_max"] == pytest.approx(math.exp(0.6), rel=1e-3)
    assert report.metrics["correction/is_weight_mean"] == pytest.approx((math.exp(0.6) + math.exp(-0.6) + 2) / 4,
                                                                        rel=1e-3)

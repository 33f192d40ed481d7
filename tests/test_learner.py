"""The learner on veRL's real trainer (FSDP2 engine, CPU platform plugin) with the tiny model.

Learners start in Ray (session cluster): about 25 s each on these two cores. One DP=1 learner serves
the module; the DP=2 and resume tests start their own.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from tests.test_score import EXAMPLE, saved  # noqa: F401 - fixture
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.score import ScoreJob, score_saved
from turnstile.learner.batch import Sample
from turnstile.learner.credit.registry import build_estimator, estimator_class
from turnstile.learner.publish import PublishError, publish, write_checkpoint
from turnstile.learner.trainer import Learner, LearnerConfig, LearnerError, rank_major_layout
from turnstile.rollout.engines.base import SamplingParams
from turnstile.rollout.trajectory import load_trajectories

pytestmark = [pytest.mark.integration]


def random_samples(count: int, seed: int = 0, weight: float = 1.0) -> list[Sample]:
    """Samples shaped like segments: a prompt, then policy tokens interleaved with observations."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        response = [rng.randint(10, 400) for _ in range(rng.randint(6, 40))]
        mask = [1 if j % 7 < 5 else 0 for j in range(len(response))]
        samples.append(Sample(
            uid=f"u{i // 4}", trajectory=(f"u{i // 4}", i % 4), segment=0,
            prompt_ids=[rng.randint(10, 400) for _ in range(rng.randint(4, 12))],
            response_ids=response, response_mask=mask,
            advantages=[rng.uniform(-1, 1) * m for m in mask],
            old_log_probs=[-rng.uniform(3, 7) * m for m in mask],
            loss_weights=[weight * m for m in mask], weights_version=0))
    return samples


@pytest.fixture(scope="module")
def learner(ray_local: None) -> Iterator[Learner]:
    learner = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-3,
                                    recompute_old_log_probs=True)).start()
    yield learner
    learner.close()


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(LearnerError, match=r"mini_batch=6 must be a multiple of learner.dp=4"):
        LearnerConfig(dp=4, mini_batch=6)
    with pytest.raises(LearnerError, match="micro_batch=3 must divide"):
        LearnerConfig(dp=2, mini_batch=8, micro_batch=3)
    with pytest.raises(LearnerError, match=r"learner.loss='ppo'"):
        LearnerConfig(loss="ppo")
    with pytest.raises(LearnerError, match=r"learner.threads must be >= 0"):
        LearnerConfig(threads=-1)
    with pytest.raises(LearnerError, match=r"loss_agg_mode='seq-mean' is not one of token-mean, .*seq-mean-token-mean"):
        LearnerConfig(loss_agg_mode="seq-mean")
    assert LearnerConfig(loss_agg_mode="seq-mean-token-mean").loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(LearnerError, match=r"'Adamw' is not an optimiser of torch.optim"):
        LearnerConfig(optimizer="Adamw")
    with pytest.raises(LearnerError, match=r"eps is not an argument of torch.optim.SGD"):
        LearnerConfig(optimizer="SGD", optimizer_options={"eps": 1e-3})
    with pytest.raises(LearnerError, match=r"set lr with learner.lr"):
        LearnerConfig(optimizer_options={"lr": 1e-3})
    with pytest.raises(LearnerError, match=r"max_tokens_per_gpu=4096 cannot hold a sample of "
                                           r"learner.max_length=8192 .* at least 8192 or raise sequence_parallel"):
        LearnerConfig(max_tokens_per_gpu=4096, max_length=8192)
    LearnerConfig(max_tokens_per_gpu=4096, max_length=8192, sequence_parallel=2)  # two GPUs hold it
    with pytest.raises(LearnerError, match=r"sequence_parallel > 1 .* needs learner.gpu"):
        LearnerConfig(sequence_parallel=2, gpu=False)
    with pytest.raises(LearnerError, match=r"sequence_parallel must be at least 1"):
        LearnerConfig(sequence_parallel=0)
    with pytest.raises(LearnerError, match="not started"):
        Learner(LearnerConfig()).full_weights()


def test_a_learner_that_cannot_run_here_is_refused_at_start(ray_local: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence parallelism on a CPU learner, and a GPU learner without flash-attention (whose
    variable-length kernel keeps packed samples apart), stop before any worker starts."""
    import importlib.util

    import ray

    actors = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(LearnerError, match=r"sequence_parallel=2 splits samples across GPUs, and this "
                                           r"learner runs on CPU"):
        Learner(LearnerConfig(sequence_parallel=2)).start()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "flash_attn" else find_spec(name, *args))
    with pytest.raises(LearnerError, match=r"needs flash-attention .*pip install flash-attn"):
        Learner(LearnerConfig(gpu=True)).start()
    assert len(ray.util.list_named_actors(all_namespaces=True)) == actors


def test_rank_major_layout_gives_each_rank_its_share_of_every_mini_batch() -> None:
    samples = random_samples(8)
    batches = [samples[:4], samples[4:]]
    layout = rank_major_layout(batches, dp=2)
    rank0, rank1 = layout[:4], layout[4:]
    # veRL walks each rank's half in mini-batches of 2: the k-th of both ranks is our k-th batch.
    assert {s.key for s in rank0[:2] + rank1[:2]} == {s.key for s in batches[0]}
    assert {s.key for s in rank0[2:] + rank1[2:]} == {s.key for s in batches[1]}
    assert sorted(s.key for s in layout) == sorted(s.key for s in samples)


def test_dp2_update_equals_dp1(learner: Learner) -> None:
    """Same batch, same initial weights: the same loss and gradient norm with two ranks as with one,
    and with token-budget batching (a forward takes as many samples as fit in 64 tokens: one to
    three of these) as with a fixed number of samples per forward."""
    samples = random_samples(8, seed=3)
    assert max(len(s.prompt_ids) + len(s.response_ids) for s in samples) <= 64
    learners = [Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-3)),
                Learner(LearnerConfig(dp=2, mini_batch=4, micro_batch=1, lr=1e-3)),
                Learner(LearnerConfig(dp=1, mini_batch=4, max_tokens_per_gpu=64, max_length=64, lr=1e-3))]
    try:
        a, b, c = (learner.start().train_rl(samples, seed=7).metrics for learner in learners)
    finally:
        for learner in learners:
            learner.close()
    assert a["loss"] != 0.0 and a["grad_norm"] > 0.0
    for other in (b, c):
        assert other["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert other["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_sft_loss_weights_and_masks(learner: Learner) -> None:
    doubled = learner.train_sft(random_samples(4, seed=5, weight=2.0)).metrics
    # Same forward: the weighted token mean is twice the unweighted one.
    assert doubled["loss"] == pytest.approx(2 * doubled["sft/nll"], rel=1e-4)
    zero = learner.train_sft(random_samples(4, seed=5, weight=0.0)).metrics
    assert zero["loss"] == 0.0 and zero["grad_norm"] == 0.0


def test_resume_continues_exactly(learner: Learner, tmp_path: Path) -> None:
    first, second = random_samples(4, seed=11), random_samples(4, seed=12)
    learner.train_rl(first)
    learner.weights_version = 3
    step = learner.step
    learner.save(tmp_path / "ckpt")
    expected = learner.train_rl(second, seed=99).metrics
    resumed = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-3,
                                    recompute_old_log_probs=True)).start()
    try:
        with pytest.raises(LearnerError, match="not a learner checkpoint"):
            resumed.load(tmp_path)
        resumed.load(tmp_path / "ckpt")
        assert (resumed.step, resumed.weights_version) == (step, 3)
        again = resumed.train_rl(second, seed=99).metrics
    finally:
        resumed.close()
    assert again["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert again["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)


def test_write_checkpoint_replaces_atomically(tmp_path: Path) -> None:
    write_checkpoint({"a": torch.ones(2)}, tmp_path)
    write_checkpoint({"a": torch.zeros(2)}, tmp_path)
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "model.safetensors"))["a"].sum() == 0
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_engine():  # noqa: ANN201
    from turnstile.rollout.engines.config import EngineConfig, VllmEngineConfig
    from turnstile.rollout.engines.vllm import VllmEngine

    engine = VllmEngine.from_config(EngineConfig(
        kind="vllm", model="", dtype="float32", seed=0, max_model_len=4096,
        vllm=VllmEngineConfig(kv_cache_memory_bytes=64 << 20, max_num_seqs=8)))
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest.mark.asyncio(loop_scope="session")
async def test_rl_step_on_scored_trajectories_then_publish_to_vllm(
        learner: Learner, saved: Path, tmp_path: Path, vllm_engine) -> None:  # noqa: ANN001, F811
    """turnstile score's output → an RL step → the vLLM engine serves the new version."""
    config = load_config(ScoreJob, EXAMPLE)
    await score_saved(config, saved, tmp_path / "scored.jsonl")
    trajectories = load_trajectories(tmp_path / "scored.jsonl")
    assert len(trajectories) == 3
    assert config.estimator.kind == "igpo"
    estimator = build_estimator("igpo", estimator_class("igpo").Options(**config.estimator.options))
    report = learner.rl_step(trajectories, estimator)
    # Three segments, mini-batches of 4: nothing trains yet, all three wait (never padded).
    assert not report.trained and report.waiting == 3
    more = load_trajectories(tmp_path / "scored.jsonl")
    for trajectory in more:
        trajectory.uid += "-b"  # a second group
    report = learner.rl_step([*trajectories, *more], estimator)
    assert report.trained and report.samples == 4 and report.dropped == 2
    assert 0.0 <= report.lost_fraction < 0.5
    assert report.metrics["grad_norm"] > 0.0

    segment = trajectories[0].segments[0]
    ids = [*segment.prompt_ids, *segment.turns[0].response_ids]
    span = (len(segment.prompt_ids), len(ids))
    before = (await vllm_engine.score([ids], [span]))[0]
    weights = learner.full_weights()
    done = await publish(vllm_engine, weights, version=1)
    assert done.version == 1 and not done.behind and await vllm_engine.weights_version() == 1
    after = (await vllm_engine.score([ids], [span]))[0]
    assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-3
    # The engine now computes what the learner computes on the same tokens.
    probe = Sample(uid="p", trajectory=("p", 0), segment=0, prompt_ids=list(segment.prompt_ids),
                   response_ids=list(segment.turns[0].response_ids),
                   response_mask=[1] * len(segment.turns[0].response_ids),
                   advantages=[0.0] * len(segment.turns[0].response_ids),
                   old_log_probs=[0.0] * len(segment.turns[0].response_ids),
                   loss_weights=[1.0] * len(segment.turns[0].response_ids), weights_version=1)
    learner_side = learner.log_probs([probe])[0, :len(after)].tolist()
    assert max(abs(x - y) for x, y in zip(after, learner_side, strict=True)) < 1e-3
    generation = await vllm_engine.generate(ids[:span[0]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert generation.weights_version == 1
    with pytest.raises(PublishError, match="checkpoint_dir"):
        await publish(vllm_engine, weights, version=2, mode="checkpoint")


def test_each_loss_has_its_own_clip_range_and_aggregation_unless_set() -> None:
    vanilla, gspo = LearnerConfig().loss_settings(), LearnerConfig(loss="gspo").loss_settings()
    assert (vanilla.clip_ratio_low, vanilla.clip_ratio_high, vanilla.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not vanilla.recompute_old_log_probs
    assert (gspo.clip_ratio_low, gspo.clip_ratio_high, gspo.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert gspo.recompute_old_log_probs
    mine = LearnerConfig(loss="gspo", clip_ratio_low=0.1, recompute_old_log_probs=False).loss_settings()
    assert (mine.clip_ratio_low, mine.clip_ratio_high, mine.recompute_old_log_probs) == (0.1, 4e-4, False)
    with pytest.raises(LearnerError, match=r"clip_ratio_high=-0.1 must be a number > 0"):
        LearnerConfig(clip_ratio_high=-0.1)


def test_gspo_loss_with_kl_to_the_reference(ray_local: None) -> None:
    """GSPO's sequence-level ratio, with its own clip range, aggregation and recomputed old
    log-probs (nothing set), and low_var_kl to a frozen reference, through veRL's ppo_loss."""
    gspo = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-2, loss="gspo", kl_coef=0.1,
                                 entropy_coeff=1e-3)).start()
    try:
        samples = random_samples(4, seed=21)
        learner_own = gspo.log_probs(samples)
        # As a rollout engine would write them: the learner's log-probs, 0.01 nats lower a token.
        samples = [replace(s, old_log_probs=[float(learner_own[i, j]) - 0.01 if m else 0.0
                                             for j, m in enumerate(s.response_mask)])
                   for i, s in enumerate(samples)]
        first = gspo.train_rl(samples).metrics
        second = gspo.train_rl(samples).metrics
    finally:
        gspo.close()
    # On-policy first step: the policy is the reference (KL 0) and the loss's ratio is 1 (the old
    # log-probs are recomputed: nothing clipped).
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/pg_clipfrac"] == 0.0
    # The train/inference mismatch is the rollout's log-probs against the recomputed ones: every
    # sequence's ratio exp(0.01), outside GSPO's 3e-4 / 4e-4.
    assert first["mismatch/ratio_mean"] == pytest.approx(math.exp(0.01), abs=1e-5)
    assert first["mismatch/clipped"] == 1.0
    # After an update the policy has moved away from the reference.
    assert second["kl_loss"] > 1e-6
    # entropy_coeff > 0 reaches the loss (veRL adds it only when the forward computed the entropy).
    assert first["actor/entropy_loss"] > 0


def test_cpu_log_probs_match_verl_row_loop() -> None:
    """The CPU learner's token log-probs (one log_softmax) equal veRL's row-by-row logsumexp,
    values and gradients."""
    from verl.utils import torch_functional

    from turnstile.learner import verl_cpu

    verl_cpu._whole_tensor_log_probs()
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(300, 8192, generator=generator) * 4).requires_grad_()
    labels = torch.randint(0, 8192, (300,), generator=generator)
    ours = torch_functional.logprobs_from_logits(logits, labels)
    (ours_grad,) = torch.autograd.grad(ours.sum(), logits)
    reference = logits.gather(-1, labels[:, None]).squeeze(-1) - torch.stack([torch.logsumexp(row, -1)
                                                                               for row in logits])
    (reference_grad,) = torch.autograd.grad(reference.sum(), logits)
    assert getattr(torch_functional.logprobs_from_logits_v2, "turnstile_cpu", False)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_grad, reference_grad, atol=1e-5, rtol=0)  # float32 rounding


def test_optimizer_setting_reaches_the_update(ray_local: None) -> None:
    """``learner.optimizer`` and its options build veRL's optimiser: Adam's first step moves every
    weight with a gradient by the learning rate (its sign), plain SGD moves each by lr x gradient."""
    samples = random_samples(4, seed=8)
    moves = {}
    for name, options in (("AdamW", {"eps": 1e-12}), ("SGD", {"momentum": 0.0})):
        learner = Learner(LearnerConfig(dp=1, mini_batch=4, micro_batch=2, lr=1e-3, grad_clip=1e6,
                                        optimizer=name, optimizer_options=options)).start()
        try:
            before = learner.full_weights()
            learner.train_rl(samples)
            after = learner.full_weights()
        finally:
            learner.close()
        moves[name] = torch.cat([(after[key] - before[key]).abs().flatten() for key in before])
    adam, sgd = moves["AdamW"], moves["SGD"]
    moved = adam[adam > 0]
    assert moved.numel() > 0.5 * adam.numel()
    off_lr = (moved - 1e-3).abs() > 1e-5  # ±lr: the sign of the gradient (float32 rounding aside)
    assert off_lr.float().mean() < 1e-3 and moved.max() < 1.01e-3
    assert sgd.max() > 0 and sgd.max() > 50 * sgd[sgd > 0].median()  # proportional to the gradient


def test_one_update_of_a_real_pretrained_model(ray_local: None) -> None:
    """A pretrained Llama with tied embeddings and a 49k vocabulary (SmolLM2-135M-Instruct, from its
    package) loads in veRL's trainer, takes an SFT step on a turn written in its own template, and
    the weights it publishes (no separate LM head: it is the embedding) are the model the learner
    now computes: a transformers copy loaded with them gives the learner's log-probs."""
    from transformers import AutoModelForCausalLM

    from tests.test_sft import ROW
    from turnstile.learner.sft import chat_trajectories
    from turnstile.rollout.chat import ChatFormat
    from turnstile.rollout.model_store import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    (trajectory,) = chat_trajectories([(1, ROW)], ChatFormat.from_pretrained(path))
    segment = trajectory.segments[0]
    response = [token for turn in segment.turns for token in [*turn.response_ids, *turn.observation_ids]]
    mask = [flag for turn in segment.turns
            for flag in [1] * len(turn.response_ids) + [0] * len(turn.observation_ids)]
    sample = Sample(uid="r", trajectory=("r", 0), segment=0, prompt_ids=list(segment.prompt_ids),
                    response_ids=response, response_mask=mask, advantages=[0.0] * len(mask),
                    old_log_probs=[0.0] * len(mask), loss_weights=[float(m) for m in mask], weights_version=0)
    learner = Learner(LearnerConfig(model=path, dp=1, mini_batch=2, micro_batch=1, lr=1e-4,
                                    max_length=512)).start()
    try:
        before = learner.log_probs([sample])[0]
        report = learner.train_sft([sample, sample])
        after = learner.log_probs([sample])[0]
        weights = learner.full_weights()
    finally:
        learner.close()
    assert math.isfinite(report.metrics["loss"]) and report.metrics["grad_norm"] > 0
    trained = torch.tensor(mask, dtype=torch.bool)
    assert after[trained].mean() > before[trained].mean()  # the step made its own tokens likelier
    assert "lm_head.weight" not in weights or torch.equal(weights["lm_head.weight"],
                                                          weights["model.embed_tokens.weight"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    ids = torch.tensor([[*sample.prompt_ids, *sample.response_ids]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1]
    reference = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(sample.prompt_ids):, None])[:, 0]
    assert (reference[trained] - after[:len(mask)][trained]).abs().max() < 1e-3


class UpdatingEngine:
    """An engine whose weight update sleeps ``seconds`` or raises ``error``; it serves ``serves``."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None, serves: int | None = None) -> None:
        self.seconds, self.error, self.serves, self.version = seconds, error, serves, 0

    async def update_weights(self, version: int, weights: object) -> None:
        await asyncio.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        self.version = version if self.serves is None else self.serves

    async def weights_version(self) -> int:
        return self.version


async def test_publishing_to_one_engine_has_a_deadline_and_checks_the_version() -> None:
    assert (await publish(UpdatingEngine(), {}, 3, timeout_s=5)).version == 3  # type: ignore[arg-type]
    with pytest.raises(PublishError, match=r"did not take version 3 within 0\.1 s"):
        await publish(UpdatingEngine(seconds=30), {}, 3, timeout_s=0.1)  # type: ignore[arg-type]
    with pytest.raises(PublishError, match="serve version 2 after publishing version 3"):
        await publish(UpdatingEngine(serves=2), {}, 3)  # type: ignore[arg-type]
    # the engine's own time-out is its error, not the deadline's, with or without a limit
    with pytest.raises(TimeoutError, match="its own"):
        await publish(UpdatingEngine(error=TimeoutError("its own")), {}, 3)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="its own"):
        await publish(UpdatingEngine(error=TimeoutError("its own")), {}, 3, timeout_s=5)  # type: ignore[arg-type]

"""The learner's chunked LM head (learner/head.py): only trained positions are projected onto the
vocabulary, a chunk at a time, and log-probs, entropy, the RL loss (with KL and the entropy bonus),
the SFT loss and the gradients are those of veRL's whole-logits path, to float rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.test_learner import random_samples
from turnstile.learner.batch import collate
from turnstile.learner.head import head_values, trained_positions
from turnstile.learner.trainer import Learner, LearnerConfig


def micro_batch(samples: list) -> object:
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    padded = collate(samples, pad_token_id=0)
    return left_right_2_no_padding(DataProto.from_single_dict(padded.single_dict()).to_tensordict())


def test_the_trained_positions_are_those_that_predict_a_policy_token() -> None:
    samples = random_samples(3, seed=4)
    flat = trained_positions(micro_batch(samples))
    expected: list[bool] = []
    for sample in samples:
        # Position t predicts token t + 1: the prompt's last position predicts the first response token.
        targets = [0] * len(sample.prompt_ids) + list(sample.response_mask)
        expected += [bool(targets[t + 1]) if t + 1 < len(targets) else False for t in range(len(targets))]
    assert flat.tolist() == expected
    assert 0 < sum(expected) < len(expected)  # observation positions are left out


@pytest.mark.parametrize("chunk", [1, 3, 64, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_chunks_give_the_whole_tensor_values_and_gradients(chunk: int, entropy: bool) -> None:
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from turnstile.learner import verl_cpu

    verl_cpu._whole_tensor_log_probs()  # as on the CPU learner
    generator = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(200, 32, generator=generator, requires_grad=True)
    weight = (torch.randn(500, 32, generator=generator) * 0.3).requires_grad_()
    labels = torch.randint(0, 500, (200,), generator=generator)
    upstream = torch.randn(200, generator=generator)

    logits = torch.nn.functional.linear(hidden, weight)
    whole = logprobs_from_logits(logits, labels)
    whole_total = (whole * upstream).sum() + (entropy_from_logits(logits).sum() if entropy else 0)
    whole_grads = torch.autograd.grad(whole_total, (hidden, weight))

    log_probs, entropies = head_values(hidden, labels, weight, None, chunk, entropy)
    total = (log_probs * upstream).sum() + (entropies.sum() if entropies is not None else 0)
    grads = torch.autograd.grad(total, (hidden, weight))

    torch.testing.assert_close(log_probs, whole, rtol=0, atol=1e-5)
    if entropy:
        torch.testing.assert_close(entropies, entropy_from_logits(logits), rtol=0, atol=1e-5)
    for ours, theirs in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # the weight's sums run in another order


@pytest.mark.integration
@pytest.mark.parametrize("settings", [
    {"loss": "vanilla", "micro_batch": 1, "recompute_old_log_probs": True},
    {"loss": "gspo", "micro_batch": 2, "kl_coef": 0.1, "entropy_coeff": 1e-3},
], ids=["vanilla-micro1", "gspo-kl-entropy-micro2"])
def test_the_learner_trains_the_same_with_the_chunked_head(ray_local: None, tmp_path: object,
                                                           settings: dict) -> None:
    """One learner, both paths: the worker keeps the head installed, and a batch takes veRL's
    whole-logits path where the learner's ``head_chunk`` is 0 (the batch key it sets)."""
    samples = random_samples(8, seed=31)
    learner = Learner(LearnerConfig(dp=1, mini_batch=4, lr=1e-3, head_chunk=7, **settings)).start()
    chunked_config, whole_config = learner.config, replace(learner.config, head_chunk=0)
    results = {}
    try:
        learner.save(tmp_path / "start")  # type: ignore[operator]
        for name, config in (("whole", whole_config), ("chunked", chunked_config)):
            learner.load(tmp_path / "start")  # type: ignore[operator]
            learner.config = config
            log_probs = learner.log_probs(samples)
            rl = learner.train_rl(samples, seed=5).metrics
            sft = learner.train_sft(samples, seed=6).metrics
            results[name] = (log_probs, rl, sft)
    finally:
        learner.close()
    (whole_lp, whole_rl, whole_sft), (chunked_lp, chunked_rl, chunked_sft) = results["whole"], results["chunked"]
    mask = collate(samples, pad_token_id=0).tensors["response_mask"].bool()
    torch.testing.assert_close(chunked_lp[mask], whole_lp[mask], rtol=0, atol=1e-5)
    assert (chunked_lp[~mask] == 0).all()  # observations are not projected
    keys = ["loss", "grad_norm", "actor/pg_loss"]
    if settings["loss"] == "gspo":
        keys += ["kl_loss", "actor/entropy_loss"]
    for key in keys:
        assert chunked_rl[key] == pytest.approx(whole_rl[key], rel=1e-4, abs=1e-6), key
    assert whole_rl["grad_norm"] > 0
    for key in ("loss", "grad_norm", "sft/nll"):  # the second update starts from the first's weights
        assert chunked_sft[key] == pytest.approx(whole_sft[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("sequence_parallel", [2, 3])
@pytest.mark.parametrize("static_pad", [0, 5])
def test_with_sequence_parallelism_each_rank_marks_its_slice_of_the_labels(
        monkeypatch: pytest.MonkeyPatch, sequence_parallel: int, static_pad: int) -> None:
    """Each rank's mask lines up with the labels veRL gives that rank (the rolled packed ids, padded,
    then sliced), and the ranks together mark exactly the trained targets."""
    from types import SimpleNamespace

    from verl.utils import ulysses

    from turnstile.learner.head import packed_trained

    batch = micro_batch(random_samples(3, seed=9))
    flat = trained_positions(batch)
    rolled = torch.roll(batch["input_ids"].values(), shifts=-1).unsqueeze(0)
    padded = torch.nn.functional.pad(rolled, (0, static_pad))  # the engine's bucket padding
    marked = []
    for rank in range(sequence_parallel):
        monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_group", lambda: "sp")
        monkeypatch.setattr(ulysses, "dist", SimpleNamespace(get_world_size=lambda _group: sequence_parallel,
                                                             get_rank=lambda _group, r=rank: r))
        labels, _, sp_pad = ulysses.ulysses_pad_and_slice_inputs(padded, None, sp_size=sequence_parallel)
        mask = packed_trained(flat, static_pad + sp_pad, sequence_parallel)
        assert mask.shape == labels.shape
        marked.append(labels[mask])
    assert torch.equal(torch.cat(marked), rolled[0][flat])
    assert 0 < int(flat.sum()) < flat.numel()

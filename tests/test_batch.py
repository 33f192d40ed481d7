"""Samples from segments, their padded veRL layout, truncation counts and data-parallel balance."""

from __future__ import annotations

import random

import pytest
import torch

from turnstile.learner.batch import (
    Sample,
    abc_sft_turn_weight,
    balance_for_ranks,
    collate,
    samples_from_trajectories,
)
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn


def turn(index: int, response: list[int], observation: list[int] | None = None, *,
         advantage: float | None = None, version: int = 1, logprobs: list[float] | None = None,
         step_score: float | None = None, action: str = "tool_call", tool: str | None = "search") -> Turn:
    if logprobs is None:
        logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return Turn(index=index, response_ids=response, response_logprobs=logprobs,
                weights_version=version, context_len=0, finish_reason="stop", action=action,
                tool=tool if action == "tool_call" else None, format_ok=True,
                observation_ids=observation or [], advantage=advantage, step_score=step_score)


def trajectory(uid: str, sample: int, segments: list[Segment], outcome: float | None = None,
               context_manager: str = "mono") -> Trajectory:
    return Trajectory(uid=uid, sample=sample, task_id=uid, question="Who?", answers=["Ada"],
                      segments=segments, stop_reason=StopReason.ANSWERED, answer="Ada",
                      context_manager=context_manager, outcome=outcome)


def two_turn_trajectory(uid: str = "q", sample: int = 0) -> Trajectory:
    """Prompt [1, 2, 3, 4]; a search turn [5, 6, 2] + observation [9, 9]; an answer turn [7, 2]."""
    first = turn(0, [5, 6, 2], [9, 9], advantage=0.5, version=3, logprobs=[-0.5, -1.25, -0.1])
    last = turn(1, [7, 2], advantage=-1.0, version=4, logprobs=[-0.3, -0.2], action="answer")
    return trajectory(uid, sample, [Segment(prompt_ids=[1, 2, 3, 4], turns=[first, last])])


def short_trajectory(uid: str = "r", sample: int = 0) -> Trajectory:
    """Prompt [11, 12]; one turn [13, 14] + observation [15]."""
    only = turn(0, [13, 14], [15], advantage=2.0, logprobs=[-0.7, -0.8])
    return trajectory(uid, sample, [Segment(prompt_ids=[11, 12], turns=[only])])


def test_a_segment_becomes_one_sample_with_per_token_fields() -> None:
    [sample] = samples_from_trajectories([two_turn_trajectory()])
    assert sample.uid == "q" and sample.trajectory == ("q", 0) and sample.segment == 0
    assert sample.prompt_ids == [1, 2, 3, 4]
    assert sample.response_ids == [5, 6, 2, 9, 9, 7, 2]
    assert sample.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert sample.advantages == [0.5, 0.5, 0.5, 0.0, 0.0, -1.0, -1.0]
    assert sample.old_log_probs == [-0.5, -1.25, -0.1, 0.0, 0.0, -0.3, -0.2]
    assert sample.loss_weights == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert sample.weights_version == 3  # the oldest of its turns
    assert sample.signal == pytest.approx(3 * 0.5 + 2 * 1.0)
    assert sample.num_tokens == 11


def test_every_segment_with_turns_is_a_sample() -> None:
    rounds = [Segment(prompt_ids=[1, 2], turns=[turn(i, [3 + i, 2], [8], advantage=0.1 * i, version=5 - i)])
              for i in range(3)]
    rounds.append(Segment(prompt_ids=[1, 2]))  # opened just before the episode stopped
    samples = samples_from_trajectories([trajectory("q", 1, rounds)])
    assert [s.key for s in samples] == [("q", 1, 0), ("q", 1, 1), ("q", 1, 2)]
    assert [s.response_ids for s in samples] == [[3, 2, 8], [4, 2, 8], [5, 2, 8]]
    assert [s.weights_version for s in samples] == [5, 4, 3]


def test_missing_advantage_is_an_error_unless_not_required() -> None:
    plain = two_turn_trajectory()
    for t in plain.turns:
        t.advantage = None
    with pytest.raises(ValueError, match="assign credit before"):
        samples_from_trajectories([plain])
    [sample] = samples_from_trajectories([plain], require_advantage=False)
    assert sample.advantages == [0.0] * 7 and sample.signal == 0.0


def test_abc_sft_weights_are_per_turn() -> None:
    scored = two_turn_trajectory()
    scored.turns[0].step_score = 1.8  # E3: one clue found -> w = 1.664037
    [sample] = samples_from_trajectories([scored], require_advantage=False, turn_weight=abc_sft_turn_weight)
    assert sample.loss_weights == pytest.approx([1.664037] * 3 + [0.0, 0.0] + [1.0, 1.0], abs=1e-6)


def test_inconsistent_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="uid/sample"):
        samples_from_trajectories([two_turn_trajectory("q", 0), two_turn_trajectory("q", 0)])
    broken = two_turn_trajectory()
    broken.turns[0].response_logprobs.pop()
    with pytest.raises(ValueError, match="2 log-probs for 3 tokens"):
        samples_from_trajectories([broken])
    with pytest.raises(ValueError, match="advantages has 1 entries for 2"):
        Sample(uid="q", trajectory=("q", 0), segment=0, prompt_ids=[1], response_ids=[2, 3],
               response_mask=[1, 1], advantages=[0.0], old_log_probs=[0.0, 0.0], loss_weights=[1.0, 1.0],
               weights_version=0)


# ---- collate -------------------------------------------------------------------------------------

def test_collate_pads_prompts_left_and_responses_right() -> None:
    samples = samples_from_trajectories([two_turn_trajectory(), short_trajectory()])
    batch = collate(samples, pad_token_id=0)
    t = batch.tensors
    assert t["prompts"].tolist() == [[1, 2, 3, 4], [0, 0, 11, 12]]
    assert t["responses"].tolist() == [[5, 6, 2, 9, 9, 7, 2], [13, 14, 15, 0, 0, 0, 0]]
    assert t["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 2, 9, 9, 7, 2],
                                       [0, 0, 11, 12, 13, 14, 15, 0, 0, 0, 0]]
    assert t["attention_mask"].tolist() == [[1] * 11, [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert t["position_ids"].tolist() == [list(range(11)), [0, 0, 0, 1, 2, 3, 4, 4, 4, 4, 4]]
    assert t["response_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert t["advantages"].tolist() == [[0.5, 0.5, 0.5, 0, 0, -1, -1], [2, 2, 0, 0, 0, 0, 0]]
    assert t["old_log_probs"] == pytest.approx(torch.tensor([[-0.5, -1.25, -0.1, 0, 0, -0.3, -0.2],
                                                             [-0.7, -0.8, 0, 0, 0, 0, 0]]))
    assert t["loss_weights"].tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert batch.uid == ["q", "r"]
    assert (batch.truncated_samples, batch.truncated_tokens, batch.truncated_policy_tokens) == (0, 0, 0)
    for name in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert t[name].dtype == torch.int64, name
    for name in ("advantages", "old_log_probs", "loss_weights"):
        assert t[name].dtype == torch.float32 and t[name].shape == t["responses"].shape, name


def test_collate_pad_id_never_leaks_into_masks() -> None:
    trajectories = [short_trajectory("r", 0), short_trajectory("r", 1), two_turn_trajectory()]
    samples = samples_from_trajectories(trajectories)
    t = collate(samples, pad_token_id=7).tensors  # 7 is also a real token of the long sample
    response_attention = t["attention_mask"][:, t["prompts"].shape[1]:]
    assert torch.all(t["response_mask"] <= response_attention)
    for name in ("advantages", "old_log_probs", "loss_weights"):
        assert torch.all(t[name][response_attention == 0] == 0), name
    assert t["responses"][0].tolist() == [13, 14, 15, 7, 7, 7, 7]


def test_collate_truncates_the_response_tail_and_counts_it() -> None:
    samples = samples_from_trajectories([two_turn_trajectory(), short_trajectory()])
    batch = collate(samples, pad_token_id=0, max_length=8)
    t = batch.tensors
    assert t["responses"].tolist() == [[5, 6, 2, 9], [13, 14, 15, 0]]
    assert t["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert t["input_ids"].shape == (2, 8)
    # cut from the long sample: observation 9 and answer tokens 7, 2
    assert (batch.truncated_samples, batch.truncated_tokens, batch.truncated_policy_tokens) == (1, 3, 2)
    with pytest.raises(ValueError, match="prompt has 4 tokens, more than max_length=3"):
        collate(samples, pad_token_id=0, max_length=3)
    with pytest.raises(ValueError, match="at least one sample"):
        collate([], pad_token_id=0)


def test_collated_batch_is_what_verl_takes() -> None:
    protocol = pytest.importorskip("verl.protocol")
    padding = pytest.importorskip("verl.workers.utils.padding")
    from tensordict import TensorDict

    samples = samples_from_trajectories([two_turn_trajectory(), short_trajectory()])
    batch = collate(samples, pad_token_id=0)
    proto = protocol.DataProto.from_single_dict(batch.single_dict())
    assert len(proto) == 2 and list(proto.non_tensor_batch["uid"]) == ["q", "r"]
    unpadded = padding.left_right_2_no_padding(TensorDict(dict(batch.tensors), batch_size=[2]))
    ids = unpadded["input_ids"]
    assert ids.offsets().tolist() == [0, 11, 16]
    assert ids.values().tolist() == [token for s in samples for token in s.prompt_ids + s.response_ids]
    assert unpadded["position_ids"].values().tolist() == list(range(11)) + list(range(5))


# ---- balance over data-parallel ranks --------------------------------------------------------------

def sized_sample(index: int, prompt: int, response: int) -> Sample:
    return Sample(uid=f"q{index // 4}", trajectory=(f"q{index // 4}", index % 4), segment=0,
                  prompt_ids=[1] * prompt, response_ids=[2] * response, response_mask=[1] * response,
                  advantages=[0.0] * response, old_log_probs=[0.0] * response, loss_weights=[1.0] * response,
                  weights_version=0)


def chunk_tokens(samples: list[Sample], dp: int) -> list[int]:
    size = len(samples) // dp
    return [sum(s.num_tokens for s in samples[rank * size:(rank + 1) * size]) for rank in range(dp)]


def skewed_samples(count: int, seed: int = 0) -> list[Sample]:
    """Long-tailed lengths, longest first: a contiguous split puts every long sample on rank 0."""
    rng = random.Random(seed)
    lengths = sorted((min(16_000, int(rng.lognormvariate(7.0, 1.0))) for _ in range(count)), reverse=True)
    return [sized_sample(i, 50, length) for i, length in enumerate(lengths)]


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_balance_for_ranks_evens_out_tokens(dp: int) -> None:
    samples = skewed_samples(64)
    before = chunk_tokens(samples, dp)
    assert max(before) / min(before) > 2.0  # the input is badly unbalanced
    balanced = balance_for_ranks(samples, dp)
    after = chunk_tokens(balanced, dp)
    # veRL's Karmarkar-Karp alone gives 1.51 at dp=8 here; the swap pass brings it to 1.02
    assert max(after) / min(after) < 1.05, after
    assert sorted(s.key for s in balanced) == sorted(s.key for s in samples)
    assert len({id(s) for s in balanced}) == len(samples)


def test_balance_needs_a_multiple_of_dp() -> None:
    with pytest.raises(ValueError, match="10 samples do not split evenly over dp=4"):
        balance_for_ranks(skewed_samples(10), 4)
    assert balance_for_ranks([], 4) == []
    assert len(balance_for_ranks(skewed_samples(3), 1)) == 3

"""Training samples from credited trajectories, and the padded batch veRL trains on.

A *sample* is one segment of a trajectory (docs/algorithms.md §2): mono context gives one per trajectory,
iter_research one per round, discard_all one per context. Its response is the segment's turns laid
end to end, each turn's generated tokens followed by its observation tokens, so that the policy is
trained on exactly the token context it generated from. Per response token a sample carries:

- ``response_mask``: 1 on tokens the policy generated, 0 on observation tokens (never trained on);
- ``advantages``: the turn's advantage on its generated tokens, 0 on observations (§5);
- ``old_log_probs``: the rollout's log-probs on generated tokens, 0 on observations;
- ``loss_weights``: a per-turn weight on generated tokens (1 for RL; the ABC-SFT weight for SFT, §6),
  0 on observations.

:func:`collate` pads samples into veRL's left/right padded ``DataProto`` layout, and
:func:`balance_for_ranks` orders them so that veRL's even split over data-parallel ranks gives each
rank about the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from turnstile.learner.credit.estimators import abc_sft_weight
from turnstile.rollout.trajectory import Segment, Trajectory, Turn

TurnWeight = Callable[[Turn], float]


def importance_ratios(log_prob: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                      per_sequence: bool) -> torch.Tensor:
    """``exp(log_prob - old)`` on the response tokens ``mask`` marks (padded rows): one per token, or
    one per sequence, the geometric mean over its tokens (GSPO's ratio)."""
    keep = mask.to(torch.bool)
    log_ratio = (log_prob - old.to(log_prob.dtype)).masked_fill(~keep, 0.0)
    if per_sequence:
        rows = keep.any(dim=1)
        return torch.exp(log_ratio.sum(dim=1)[rows] / keep.sum(dim=1)[rows])
    return torch.exp(log_ratio)[keep]


def ratio_metrics(log_prob: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, *, per_sequence: bool,
                  clip_low: float, clip_high: float) -> dict[str, float]:
    """``mismatch/ratio_mean``, ``ratio_max`` and ``clipped`` (the share outside ``[1 - clip_low,
    1 + clip_high]``) of :func:`importance_ratios`; empty when ``mask`` marks no token. Rows may be
    wider on one side (padding): the common width is compared."""
    width = min(log_prob.shape[1], old.shape[1])
    ratio = importance_ratios(log_prob[:, :width], old[:, :width], mask[:, :width], per_sequence)
    if not ratio.numel():
        return {}
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return {"mismatch/ratio_mean": ratio.mean().item(), "mismatch/ratio_max": ratio.max().item(),
            "mismatch/clipped": outside.float().mean().item()}


def unit_weight(turn: Turn) -> float:  # noqa: ARG001 - a TurnWeight
    """Every generated token counts once: the loss weight of RL samples."""
    return 1.0


def abc_sft_turn_weight(turn: Turn) -> float:
    """ABC-SFT (§6): ``w(step_score)`` for a scored turn, 1 for a turn without a step score."""
    return 1.0 if turn.step_score is None else abc_sft_weight(turn.step_score)


@dataclass(frozen=True)
class Sample:
    """One segment as a training sample. The per-token lists all have one entry per response token."""

    uid: str  # group id: normalisation and GRPO-style grouping use it
    trajectory: tuple[str, int]  # (uid, sample index within the group)
    segment: int  # index of the segment within its trajectory
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    advantages: list[float]
    old_log_probs: list[float]
    loss_weights: list[float]
    weights_version: int  # the oldest weights version that generated any of its turns

    def __post_init__(self) -> None:
        length = len(self.response_ids)
        for name in ("response_mask", "advantages", "old_log_probs", "loss_weights"):
            if len(getattr(self, name)) != length:
                raise ValueError(f"sample {self.key}: {name} has {len(getattr(self, name))} entries for "
                                 f"{length} response tokens")

    @property
    def key(self) -> tuple[str, int, int]:
        """(uid, sample index, segment index): unique within a batch."""
        return (*self.trajectory, self.segment)

    @property
    def signal(self) -> float:
        """Policy-gradient signal: the sum over tokens of |advantage| (§8)."""
        return float(sum(abs(a) for a in self.advantages))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def samples_from_trajectories(trajectories: Sequence[Trajectory], *, require_advantage: bool = True,
                              turn_weight: TurnWeight = unit_weight) -> list[Sample]:
    """One sample per segment, in trajectory then segment order.

    ``require_advantage``: a turn without an advantage is an error (RL: credit must be assigned
    first); with ``False`` (SFT) such a turn gets advantage 0. ``turn_weight`` gives each turn's loss
    weight (:func:`abc_sft_turn_weight` for ABC-SFT). A segment without turns (a context opened just
    before the episode stopped) holds no generated token and gives no sample.
    """
    check_unique_trajectories(trajectories)
    return [segment_sample(trajectory, index, require_advantage=require_advantage, turn_weight=turn_weight)
            for trajectory in trajectories
            for index, segment in enumerate(trajectory.segments) if segment.turns]


def segment_sample(trajectory: Trajectory, index: int, *, require_advantage: bool = True,
                   turn_weight: TurnWeight = unit_weight) -> Sample:
    """The sample of ``trajectory.segments[index]`` (see :func:`samples_from_trajectories`)."""
    segment: Segment = trajectory.segments[index]
    if not segment.turns:
        raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample} segment {index} has no turns: "
                         "there is nothing to train on")
    response: list[int] = []
    mask: list[int] = []
    advantages: list[float] = []
    log_probs: list[float] = []
    weights: list[float] = []
    for turn in segment.turns:
        if len(turn.response_logprobs) != len(turn.response_ids):
            raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample} turn {turn.index}: "
                             f"{len(turn.response_logprobs)} log-probs for {len(turn.response_ids)} tokens")
        if turn.advantage is None and require_advantage:
            raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample} turn {turn.index} has no "
                             "advantage: assign credit before building samples")
        generated, observed = len(turn.response_ids), len(turn.observation_ids)
        response += turn.response_ids + turn.observation_ids
        mask += [1] * generated + [0] * observed
        advantages += [turn.advantage or 0.0] * generated + [0.0] * observed
        log_probs += turn.response_logprobs + [0.0] * observed
        weights += [turn_weight(turn)] * generated + [0.0] * observed
    return Sample(uid=trajectory.uid, trajectory=(trajectory.uid, trajectory.sample), segment=index,
                  prompt_ids=list(segment.prompt_ids), response_ids=response, response_mask=mask,
                  advantages=advantages, old_log_probs=log_probs, loss_weights=weights,
                  weights_version=min(turn.weights_version for turn in segment.turns))


def check_unique_trajectories(trajectories: Sequence[Trajectory]) -> None:
    """Samples are identified by (uid, sample index); two trajectories sharing one are an error."""
    seen: set[tuple[str, int]] = set()
    for trajectory in trajectories:
        key = (trajectory.uid, trajectory.sample)
        if key in seen:
            raise ValueError(f"two trajectories are both {key[0]}/{key[1]} (uid/sample); give each "
                             "member of a group its own sample index")
        seen.add(key)


# ---- padding -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PaddedBatch:
    """Samples padded into veRL's ``DataProto`` layout, and what truncation cut to get there.

    ``tensors`` (batch size B, prompt length P, response length R):
    ``prompts`` (B, P) left-padded; ``responses`` (B, R) right-padded; ``input_ids`` (B, P + R) =
    prompts then responses; ``attention_mask`` (B, P + R), 1 on every real token; ``position_ids``
    (B, P + R) = cumsum(attention_mask) − 1, clipped at 0; ``response_mask``, ``advantages``,
    ``old_log_probs`` and ``loss_weights`` (B, R), 0 on padding. Ids and masks are int64, the rest
    float32.
    """

    tensors: dict[str, torch.Tensor]
    uid: list[str]  # group id of each row
    truncated_samples: int  # samples whose response was cut by ``max_length``
    truncated_tokens: int  # response tokens cut (generated and observation tokens)
    truncated_policy_tokens: int  # of those, tokens the policy generated (gradient lost)

    def single_dict(self) -> dict[str, torch.Tensor | np.ndarray]:
        """The form ``DataProto.from_single_dict`` takes: the tensors and ``uid`` as an object array."""
        return {**self.tensors, "uid": np.array(self.uid, dtype=object)}


def collate(samples: Sequence[Sample], pad_token_id: int, *, max_length: int | None = None) -> PaddedBatch:
    """Pad ``samples`` into one batch, rows in the order given.

    ``max_length`` caps prompt + response per sample: a longer sample keeps its whole prompt and the
    start of its response, and the tail is cut (counted in the result's ``truncated_*`` fields). A
    prompt alone longer than ``max_length`` is an error: cutting the prompt would train on a context
    the policy never saw.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length}: must be a positive number of tokens (or None)")
    kept = [_response_length(sample, max_length) for sample in samples]
    prompt_len = max(len(sample.prompt_ids) for sample in samples)
    response_len = max(kept)
    size = len(samples)

    prompts = torch.full((size, prompt_len), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((size, prompt_len), dtype=torch.int64)
    responses = torch.full((size, response_len), pad_token_id, dtype=torch.int64)
    response_attention = torch.zeros((size, response_len), dtype=torch.int64)
    response_mask = torch.zeros((size, response_len), dtype=torch.int64)
    advantages = torch.zeros((size, response_len), dtype=torch.float32)
    old_log_probs = torch.zeros((size, response_len), dtype=torch.float32)
    loss_weights = torch.zeros((size, response_len), dtype=torch.float32)
    for row, (sample, length) in enumerate(zip(samples, kept, strict=True)):
        start = prompt_len - len(sample.prompt_ids)
        prompts[row, start:] = torch.tensor(sample.prompt_ids, dtype=torch.int64)
        prompt_mask[row, start:] = 1
        responses[row, :length] = torch.tensor(sample.response_ids[:length], dtype=torch.int64)
        response_attention[row, :length] = 1
        response_mask[row, :length] = torch.tensor(sample.response_mask[:length], dtype=torch.int64)
        advantages[row, :length] = torch.tensor(sample.advantages[:length], dtype=torch.float32)
        old_log_probs[row, :length] = torch.tensor(sample.old_log_probs[:length], dtype=torch.float32)
        loss_weights[row, :length] = torch.tensor(sample.loss_weights[:length], dtype=torch.float32)

    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "loss_weights": loss_weights,
    }
    cut = [(sample, length) for sample, length in zip(samples, kept, strict=True)
           if length < len(sample.response_ids)]
    return PaddedBatch(
        tensors=tensors, uid=[sample.uid for sample in samples], truncated_samples=len(cut),
        truncated_tokens=sum(len(sample.response_ids) - length for sample, length in cut),
        truncated_policy_tokens=sum(sum(sample.response_mask[length:]) for sample, length in cut))


def _response_length(sample: Sample, max_length: int | None) -> int:
    """How many response tokens of ``sample`` fit in ``max_length``."""
    if max_length is None:
        return len(sample.response_ids)
    if len(sample.prompt_ids) > max_length:
        raise ValueError(f"sample {sample.key}: its prompt has {len(sample.prompt_ids)} tokens, more than "
                         f"max_length={max_length}; raise max_length or lower the rollout's context budget")
    return min(len(sample.response_ids), max_length - len(sample.prompt_ids))


# ---- data-parallel balance -----------------------------------------------------------------------

def balance_for_ranks(samples: Sequence[Sample], dp: int) -> list[Sample]:
    """``samples`` reordered so that cutting the list into ``dp`` equal contiguous chunks (what veRL's
    dispatch does) gives each data-parallel rank about the same number of tokens (prompt + response).

    veRL's equal-size Karmarkar–Karp partitioning, then swaps between the heaviest and the lightest
    chunk: with few samples per rank and long-tailed lengths, Karmarkar–Karp alone left the heaviest
    rank up to 37% above a lower bound on the best achievable (lognormal lengths, 8 per rank); the
    swaps bring that within 6%. Each sample appears exactly once. ``len(samples)`` must be a multiple of ``dp``
    (downsample first, docs/algorithms.md §8).
    """
    if dp < 1:
        raise ValueError(f"dp={dp}: the data-parallel size must be at least 1")
    if len(samples) % dp:
        raise ValueError(f"{len(samples)} samples do not split evenly over dp={dp} ranks; downsample to "
                         "a multiple of the data-parallel size first (learner.downsample)")
    if not samples:
        return []
    # Imported here: veRL's module pulls in Ray and transformers, which building samples never needs.
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    lengths = [sample.num_tokens for sample in samples]
    chunks = get_seqlen_balanced_partitions(lengths, k_partitions=dp, equal_size=True)
    _narrow_by_swaps(lengths, chunks)
    return [samples[index] for chunk in chunks for index in chunk]


def _narrow_by_swaps(lengths: list[int], chunks: list[list[int]]) -> None:
    """Swap one item between the heaviest and the lightest chunk, in place, while that narrows them.

    Each swap moves ``0 < d < gap`` tokens from the heaviest to the lightest chunk, which strictly
    lowers the sum of squared chunk sizes, so the loop ends; the cap only bounds the cost.
    """
    sums = [sum(lengths[i] for i in chunk) for chunk in chunks]
    for _ in range(len(lengths)):
        heavy = max(range(len(chunks)), key=sums.__getitem__)
        light = min(range(len(chunks)), key=sums.__getitem__)
        gap = sums[heavy] - sums[light]
        best: tuple[int, int, int] | None = None  # (remaining gap, heavy item, light item)
        for a in chunks[heavy]:
            for b in chunks[light]:
                moved = lengths[a] - lengths[b]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                    best = (abs(gap - 2 * moved), a, b)
        if best is None:
            return
        _, a, b = best
        chunks[heavy][chunks[heavy].index(a)] = b
        chunks[light][chunks[light].index(b)] = a
        sums[heavy] -= lengths[a] - lengths[b]
        sums[light] += lengths[a] - lengths[b]

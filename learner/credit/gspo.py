"""GSPO's sequence-level importance ratio (docs/algorithms.md §7), for the round-level policy loss.

Separate from the rest of :mod:`learner.credit` because it works on autograd tensors (the loss
differentiates through it) and importing torch would slow down ``turnstile credit``, which needs
none of it.
"""

from __future__ import annotations

import torch


def gspo_sequence_ratio(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(mean(new − old))`` over the response tokens of each sequence (the last dimension).

    Length-normalised, so a long round and a short one move the policy by comparable amounts.
    ``mask`` (same shape; 1 for a response token, 0 for observation or padding) restricts the mean;
    a sequence without tokens gets ratio 1. Differentiable in ``new_logprobs``.
    """
    if new_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"new log-probs {tuple(new_logprobs.shape)} and old {tuple(old_logprobs.shape)} "
                         f"must have the same shape (one entry per token)")
    difference = new_logprobs - old_logprobs.detach()
    if mask is None:
        return torch.exp(difference.mean(dim=-1))
    if mask.shape != difference.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the log-probs' shape {tuple(difference.shape)}")
    weights = mask.to(difference.dtype)
    tokens = weights.sum(dim=-1)
    mean = (difference * weights).sum(dim=-1) / tokens.clamp(min=1.0)
    return torch.exp(mean)

"""Gold-answer log-probs on a transformers model: the KV-cached scorer and its per-prefix reference.

Scoring every boundary with its own forward pass costs ``Σ_s (prefix_s + R)`` token forwards — for a
200-turn mono trajectory of ``L`` tokens that is ``O(T·L)``, about 100 contexts' worth. But all the
boundaries of a segment share one context: boundary ``s`` is a prefix of it. So
:class:`HFInformationGainScorer` runs each segment's context once (up to its last boundary, with that
boundary's pseudo-response on the end) and keeps its KV cache; the other boundaries' pseudo-responses
(``R`` ids each) then go through together, packed into one sequence on top of that cache, each block
seeing only its own prefix of the cache and its own earlier ids (a 4-D attention mask) at its own
positions (``prefix_s + j``). Total: ``L + T·R`` token forwards, exactly, in ``1 + ⌈T / B⌉`` forwards.

The mask is ``B·R × (L + B·R)``: boundaries go in chunks whose mask stays under
``max_mask_elements`` (32 Mi entries: 32 MB as booleans for SDPA, 128 MB as floats for eager
attention), so memory stays bounded at any ``L`` (at 80k context tokens a chunk is about 400 ids,
some 20 boundaries). After each chunk the cache is cut back to the context (a view, no copy). An
earlier version forwarded one boundary at a time over a cropped cache: the same token forwards, but a
forward's fixed cost per boundary and a copy of the prefix's keys and values per boundary made it
slower per token than the naive scorer (``benchmarks/ig_scoring.py``). Models whose cache cannot be
cut back (sliding-window or recurrent layers) are refused with a pointer to :class:`PerPrefixScorer`;
flash-attention kernels take no custom mask and are refused the same way.

:class:`PerPrefixScorer` is the naive computation (one full forward per boundary), kept as the
reference the cached scorer is tested and benchmarked against (``benchmarks/ig_scoring.py``).

Both run the model in a worker thread under a lock (like ``HFEngine``): the event loop stays free and
one model is never used by two threads at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from turnstile.rewards.information_gain.values import SegmentBoundaries


class HFInformationGainScorer:
    """A :class:`~turnstile.rewards.information_gain.values.GoldScorer` that reuses each segment's KV cache.

    ``model`` is a transformers causal LM holding the behaviour policy's weights; it is put in eval
    mode and used as it is (device and dtype included).
    """

    def __init__(self, model: PreTrainedModel, max_mask_elements: int = 1 << 25) -> None:
        attention = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if "flash" in attention:
            raise ValueError(f"{attention} takes no custom attention mask; load the model with "
                             "attn_implementation='sdpa' or 'eager', or score it with "
                             "turnstile.rewards.information_gain.scorers.PerPrefixScorer")
        self.model = model.eval()
        self.max_mask_elements = max_mask_elements
        self._additive_mask = attention == "eager"  # eager adds the mask; SDPA takes booleans
        self._lock = threading.Lock()

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        return await asyncio.to_thread(self.gold_logprobs_now, segments)

    def gold_logprobs_now(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        """:meth:`gold_logprobs` in the calling thread (benchmarks and synchronous callers)."""
        scored: list[list[float]] = []
        with self._lock, torch.inference_mode():
            for segment in segments:
                scored.extend(self._segment(segment))
        return scored

    def _segment(self, segment: SegmentBoundaries) -> list[list[float]]:
        # The last boundary's prefix is the whole context: its pseudo-response rides along with the
        # prefill, which saves a forward per segment (iter_research segments have one boundary).
        last = max(range(len(segment.prefix_lens)), key=segment.prefix_lens.__getitem__)
        scored: list[list[float]] = [[] for _ in segment.prefix_lens]
        context = len(segment.context_ids)
        device = self.model.device
        pseudo = segment.pseudo[last]
        rows = torch.arange(context + pseudo.gold_start - 1, context + pseudo.gold_end - 1, device=device)
        output = self.model(input_ids=torch.tensor([[*segment.context_ids, *pseudo.ids]], device=device),
                            use_cache=True, logits_to_keep=rows)
        scored[last] = _target_logprobs(output.logits[0], pseudo.ids[pseudo.gold_start:pseudo.gold_end])
        cache = _croppable(output.past_key_values, type(self.model).__name__)
        others = [boundary for boundary in range(len(segment.prefix_lens)) if boundary != last]
        for chunk in self._chunks(others, segment, context):
            cache.crop(context - cache.get_seq_length())  # drop what the last forward appended
            for boundary, row in zip(chunk, self._packed(segment, chunk, cache, context), strict=True):
                scored[boundary] = row
        return scored

    def _chunks(self, boundaries: list[int], segment: SegmentBoundaries, context: int) -> list[list[int]]:
        """Consecutive runs of boundaries whose packed mask stays under ``max_mask_elements``."""
        chunks: list[list[int]] = []
        current: list[int] = []
        width = 0
        for boundary in boundaries:
            size = len(segment.pseudo[boundary].ids)
            if current and (width + size) * (context + width + size) > self.max_mask_elements:
                chunks.append(current)
                current, width = [], 0
            current.append(boundary)
            width += size
        if current:
            chunks.append(current)
        return chunks

    def _packed(self, segment: SegmentBoundaries, chunk: list[int], cache: DynamicCache,
                context: int) -> list[list[float]]:
        """One forward of the chunk's pseudo-responses, packed, on top of the context's cache."""
        device = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int]] = []
        for boundary in chunk:
            pseudo, prefix = segment.pseudo[boundary], segment.prefix_lens[boundary]
            start = len(ids)
            ids.extend(pseudo.ids)
            positions.extend(range(prefix, prefix + len(pseudo.ids)))
            keep.extend(range(start + pseudo.gold_start - 1, start + pseudo.gold_end - 1))
            spans.append((start, len(ids)))
        width = len(ids)
        allowed = torch.zeros(width, context + width, dtype=torch.bool, device=device)
        for boundary, (start, end) in zip(chunk, spans, strict=True):
            allowed[start:end, :segment.prefix_lens[boundary]] = True  # its own prefix of the context
            allowed[start:end, context + start:context + end] = torch.ones(
                end - start, end - start, dtype=torch.bool, device=device).tril()  # itself, causally
        mask = allowed[None, None]
        if self._additive_mask:
            dtype = self.model.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        output = self.model(input_ids=torch.tensor([ids], device=device),
                            position_ids=torch.tensor([positions], device=device), attention_mask=mask,
                            past_key_values=cache, use_cache=True,
                            logits_to_keep=torch.tensor(keep, device=device))
        logprobs = iter(_target_logprobs(output.logits[0], [ids[k + 1] for k in keep]))
        return [[next(logprobs) for _ in range(segment.pseudo[b].gold_end - segment.pseudo[b].gold_start)]
                for b in chunk]


class PerPrefixScorer:
    """The naive :class:`~turnstile.rewards.information_gain.values.GoldScorer`: one full forward per boundary.

    ``O(T·L)`` token forwards; the reference :class:`HFInformationGainScorer` must equal (1e-4).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self._lock = threading.Lock()

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        return await asyncio.to_thread(self.gold_logprobs_now, segments)

    def gold_logprobs_now(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        scored: list[list[float]] = []
        for segment in segments:
            scored.extend(self.boundary_now(segment, boundary)
                          for boundary in range(len(segment.prefix_lens)))
        return scored

    def boundary_now(self, segment: SegmentBoundaries, boundary: int) -> list[float]:
        """The gold log-probs of one boundary from a forward over its whole sequence."""
        device = self.model.device
        sequence = segment.sequence(boundary)
        start, end = segment.gold_span(boundary)
        with self._lock, torch.inference_mode():
            output = self.model(input_ids=torch.tensor([sequence], device=device), use_cache=False,
                                logits_to_keep=torch.arange(start - 1, end - 1, device=device))
        return _target_logprobs(output.logits[0], sequence[start:end])


def _target_logprobs(logits: torch.Tensor, targets: Sequence[int]) -> list[float]:
    """``log_softmax(logits[i])[targets[i]]`` for each row, in float32 whatever the model's dtype."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), device=logits.device).unsqueeze(-1)
    return logprobs.gather(-1, index).squeeze(-1).tolist()


def _croppable(cache: object, model_name: str) -> DynamicCache:
    """The prefill's cache, checked to be one whose every layer can be cut back to a prefix."""
    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers or not all(
            getattr(layer, "is_croppable", False) and not getattr(layer, "is_sliding", False)
            for layer in layers):
        raise ValueError(f"{model_name} keeps a {type(cache).__name__} whose layers cannot be cut "
                         "back to a prefix (sliding-window or recurrent attention); score it with "
                         "rewards.information_gain.scorers.PerPrefixScorer instead")
    return cache

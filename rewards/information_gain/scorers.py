"""Gold-answer log-probs on a transformers model: the KV-cached scorer and its per-prefix reference.

Scoring every boundary with its own forward pass costs ``Σ_s (prefix_s + R)`` token forwards — for a
200-turn mono trajectory of ``L`` tokens that is ``O(T·L)``, about 100 contexts' worth. But all the
boundaries of a segment share one context: boundary ``s`` is a prefix of it. So
:class:`HFInformationGainScorer` runs each segment's context once (up to its last boundary, with that
boundary's pseudo-response on the end) and keeps its KV cache; for each other boundary it cuts the
cache back to the boundary's prefix and forwards only the ``R`` pseudo-response ids on top. Total:
``L + T·R`` token forwards, exactly.

Why a cropped cache, not one packed forward with a block attention mask: the packed sequence
``L + T·R`` long needs a dense ``(T·R) × (L + T·R)`` mask (hundreds of MB at 80k tokens, per head
in eager attention) and, with SDPA, leaves the memory-efficient causal kernel; the cache needs
memory for one context only. Boundaries run from the last to the first, so every crop only drops
ids (a view, no copy); each pseudo-response then appends ``R`` ids, which transformers' dynamic
cache does by concatenation (one copy of the prefix's keys and values per boundary — memory
traffic, not token forwards). Models whose cache cannot be cut back (sliding-window or recurrent
layers) are refused with a pointer to :class:`PerPrefixScorer`.

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

from rewards.information_gain.values import PseudoResponse, SegmentBoundaries


class HFInformationGainScorer:
    """A :class:`~rewards.information_gain.values.GoldScorer` that reuses each segment's KV cache.

    ``model`` is a transformers causal LM holding the behaviour policy's weights; it is put in eval
    mode and used as it is (device and dtype included).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
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
        scored[last], prefilled = self._forward(segment.context_ids, segment.pseudo[last], None)
        cache = _croppable(prefilled, type(self.model).__name__)
        others = sorted((boundary for boundary in range(len(segment.prefix_lens)) if boundary != last),
                        key=segment.prefix_lens.__getitem__, reverse=True)
        for boundary in others:  # longest first, so that each crop only drops ids
            prefix = segment.prefix_lens[boundary]
            cache.crop(prefix - cache.get_seq_length())  # a negative count drops ids from the end
            scored[boundary], _ = self._forward((), segment.pseudo[boundary], cache)  # appends R ids
        return scored

    def _forward(self, context: Sequence[int], pseudo: PseudoResponse,
                 cache: DynamicCache | None) -> tuple[list[float], object]:
        """Forward ``context + pseudo`` on top of ``cache``; the gold log-probs and the new cache."""
        device = self.model.device
        offset = len(context)
        rows = torch.arange(offset + pseudo.gold_start - 1, offset + pseudo.gold_end - 1, device=device)
        output = self.model(input_ids=torch.tensor([[*context, *pseudo.ids]], device=device),
                            past_key_values=cache, use_cache=True, logits_to_keep=rows)
        targets = pseudo.ids[pseudo.gold_start:pseudo.gold_end]
        return _target_logprobs(output.logits[0], targets), output.past_key_values


class PerPrefixScorer:
    """The naive :class:`~rewards.information_gain.values.GoldScorer`: one full forward per boundary.

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

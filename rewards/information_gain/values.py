"""Information-gain values ``v_s`` of a trajectory (docs/algorithms.md §4): how sure the policy is of the
gold answer before each turn.

``v_s`` is the mean teacher-forced log-probability of the gold answer's tokens (first alternative),
written as if the policy answered right away at boundary ``s``: the exact ids the policy had before
turn ``s`` (recorded at rollout time, never re-tokenised), then a pseudo-response, then nothing else.
``v_0`` — before the first turn, the first segment's prompt — is the question-only baseline. In a
trajectory with several segments (``iter_research``, ``discard_all``) each turn's context is its own
segment's ids up to that turn. The browse-aware assignment and the normalisation of the resulting
gains belong to the estimator; this module only measures ``v``.

How the pseudo-response is appended. Every recorded context ends with the chat template's
generation prompt (for ChatML ``<|im_start|>assistant\\n``), so what follows is the start of the
policy's own turn. The policy's turns open with ``<think>\\n`` (``envs.protocol.render_tool_call``),
and the §4 text starts inside the think block (``"Now there's enough information to answer\\n
</think>\\n<answer>\\n" + gold + "\\n</answer>"``). So, after the context come: ``<think>\\n`` —
left out when the context already ends inside an open ``<think>``, as thinking models' templates
leave it — then the §4 text, then the template's end-of-turn token. The three pieces (text before the
gold, the gold, the text after it) are tokenised separately and joined: the gold span is then exact
by construction, and "the gold has no tokens" means ``encode(gold) == []``. Joined pieces can differ
from tokenising the whole string where the gold's last character would merge with the newline after
it (``"Inc.\\n"`` in Qwen's pre-tokeniser); the model is scored on a valid split of the same text.

The pseudo-response is defined in :mod:`turnstile.rollout.probes`, whose probes measure the same
``v_s`` on the policy engines while an episode runs (the ``information_gain`` plugin's
``scorer=engine``); this module measures it after the fact.

Scorers (:class:`GoldScorer`) compute the gold log-probs of every boundary of a trajectory:

- :class:`~turnstile.rewards.information_gain.scorers.HFInformationGainScorer`: transformers, one forward over
  each segment's context and its KV cache reused for every boundary — ``O(L + T·R)`` token forwards.
- :class:`EngineGoldScorer`: any :class:`~turnstile.rollout.engines.base.PolicyEngine` (the vLLM path): one
  ``score`` request per boundary (context prefix + pseudo-response), the longest first so that the
  others find the segment's context in vLLM's prefix cache. vLLM 0.32 turns the cache off for
  prompt log-prob requests by default; ``VllmEngine.score`` turns it back on and reruns a request in
  full when its cached prefix reaches the scored span, so the vLLM path forwards about
  ``O(L + T·R)`` tokens too.

Run it: ``await information_gain_values(trajectory, chat, HFInformationGainScorer(model))``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import PolicyEngine
from turnstile.rollout.probes import PseudoResponse, pseudo_response, think_is_open
from turnstile.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SegmentBoundaries:
    """The boundaries that fall in one segment: what a scorer needs to score them together.

    ``context_ids`` are the segment's recorded ids up to its last boundary; boundary ``i`` is the
    context ``context_ids[:prefix_lens[i]]`` followed by ``pseudo[i]``, measured before turn
    ``turns[i]`` (its index in the trajectory).
    """

    context_ids: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    pseudo: tuple[PseudoResponse, ...]
    turns: tuple[int, ...]

    def __post_init__(self) -> None:
        count = len(self.prefix_lens)
        if count == 0 or len(self.pseudo) != count or len(self.turns) != count:
            raise ValueError(f"a segment needs one prefix, pseudo-response and turn per boundary; got "
                             f"{count}, {len(self.pseudo)} and {len(self.turns)}")
        if min(self.prefix_lens) < 1 or max(self.prefix_lens) != len(self.context_ids):
            raise ValueError(f"prefix lengths {min(self.prefix_lens)}..{max(self.prefix_lens)} must be "
                             f">= 1 and end at the context's {len(self.context_ids)} ids")

    def sequence(self, boundary: int) -> list[int]:
        """The whole scored sequence of one boundary (what a per-prefix scorer forwards)."""
        return [*self.context_ids[:self.prefix_lens[boundary]], *self.pseudo[boundary].ids]

    def gold_span(self, boundary: int) -> tuple[int, int]:
        """``[start, end)`` of the gold answer within :meth:`sequence`."""
        prefix, pseudo = self.prefix_lens[boundary], self.pseudo[boundary]
        return prefix + pseudo.gold_start, prefix + pseudo.gold_end


class GoldScorer(Protocol):
    """Teacher-forced log-probs of the gold answer at every boundary.

    Contract: returns one list per boundary — segments in order, each segment's boundaries in
    order — holding ``log p(gold token | everything before it)`` for each gold token, exactly as a
    full forward over :meth:`SegmentBoundaries.sequence` would give them. The scorer must use the
    behaviour policy's weights (the version that generated the trajectory).
    """

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]: ...


def segment_boundaries(trajectory: Trajectory, chat: ChatFormat,
                       gold: str) -> list[SegmentBoundaries] | None:
    """Every turn's boundary, grouped by segment; None when ``gold`` has no tokens.

    The context of a turn is its segment's prompt, responses and observations before it; the
    length found that way must equal the turn's recorded ``context_len`` (else the trajectory is
    inconsistent and scoring it would measure the wrong context).
    """
    closed = pseudo_response(chat, gold, think_open=False)
    opened = pseudo_response(chat, gold, think_open=True)
    if closed is None or opened is None:
        return None
    grouped: list[SegmentBoundaries] = []
    for number, segment in enumerate(trajectory.segments):
        if not segment.turns:
            continue
        if not segment.prompt_ids:
            raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample}: segment {number} has "
                             "no prompt ids, so its first turn has no context to score")
        ids = segment.flat_ids()
        prefix_lens: list[int] = []
        length = len(segment.prompt_ids)
        for turn in segment.turns:
            if turn.context_len != length:
                raise ValueError(f"trajectory {trajectory.uid}/{trajectory.sample}: turn {turn.index} "
                                 f"records context_len={turn.context_len} but its segment holds "
                                 f"{length} ids before it; the trajectory is inconsistent")
            prefix_lens.append(length)
            length += len(turn.response_ids) + len(turn.observation_ids)
        pseudo = tuple(opened if think_is_open(chat, ids[max(prefix - 4, 0):prefix]) else closed
                       for prefix in prefix_lens)
        grouped.append(SegmentBoundaries(
            context_ids=tuple(ids[:max(prefix_lens)]), prefix_lens=tuple(prefix_lens), pseudo=pseudo,
            turns=tuple(turn.index for turn in segment.turns)))
    return grouped


async def information_gain_values(trajectory: Trajectory, chat: ChatFormat,
                                  scorer: GoldScorer) -> list[float] | None:
    """Measure ``v_s`` before every turn, write it to ``turn.ig_value``, and return ``[v_0, ...]``.

    One value per turn, in trajectory order (a trajectory cut off after a tool call has no boundary
    after its last observation: its last turn carries the outcome instead). Returns None — and
    leaves every ``ig_value`` None — when there is no gold answer or it has no tokens: IG is off
    for this trajectory (outcome only), with a warning.
    """
    gold = trajectory.answers[0] if trajectory.answers else ""
    grouped = segment_boundaries(trajectory, chat, gold)
    turns = trajectory.turns
    if grouped is None:
        logger.warning("trajectory %s/%s (task %s): the gold answer %r has no tokens; information "
                       "gain is off for it (outcome reward only)", trajectory.uid,
                       trajectory.sample, trajectory.task_id, gold)
        for turn in turns:
            turn.ig_value = None
        return None
    scored = await scorer.gold_logprobs(grouped)
    order = [turn for segment in grouped for turn in segment.turns]
    if len(scored) != len(order):
        raise RuntimeError(f"{type(scorer).__name__} returned {len(scored)} boundaries for "
                           f"{len(order)}; it breaks the GoldScorer contract")
    values = [math.fsum(logprobs) / len(logprobs) for logprobs in scored]
    by_index = {turn.index: turn for turn in turns}
    for index, value in zip(order, values, strict=True):
        by_index[index].ig_value = value
    return values


class EngineGoldScorer:
    """Scores through :meth:`PolicyEngine.score`: one sequence per boundary (context + pseudo).

    Works with every engine. Per segment, the last boundary (the longest prefix) is scored first,
    alone, and the others after it, concurrently: an engine with a prefix cache (vLLM) has the
    segment's context cached by then and forwards only each boundary's pseudo-response, about
    ``O(L + T·R)`` tokens in all (cached in blocks, so up to one block more per boundary).
    """

    def __init__(self, engine: PolicyEngine) -> None:
        self.engine = engine

    async def gold_logprobs(self, segments: Sequence[SegmentBoundaries]) -> list[list[float]]:
        results: list[list[float]] = []
        for segment in segments:
            count = len(segment.prefix_lens)
            order = sorted(range(count), key=lambda b: segment.prefix_lens[b], reverse=True)
            longest = order[0]
            [first] = await self.engine.score([segment.sequence(longest)], [segment.gold_span(longest)])
            rest = await self.engine.score([segment.sequence(b) for b in order[1:]],
                                           [segment.gold_span(b) for b in order[1:]])
            by_boundary = dict(zip(order, [first, *rest], strict=True))
            results.extend(by_boundary[b] for b in range(count))
        return results

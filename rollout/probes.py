"""Information-gain values measured on the policy engines while an episode runs (docs/algorithms.md §4).

``v_s`` is how sure the policy is of the gold answer just before turn ``s``: the mean teacher-forced
log-probability of the gold tokens, written as a pseudo-response after the exact ids the policy had.
This module defines the pseudo-response (the after-the-fact scorers in
``turnstile.rewards.information_gain`` use the same one) and :class:`IgProbes`, which measures
``v_s`` on the engine that runs the episode, one *probe* per boundary:

- **When.** The probe of boundary ``s`` is sent as soon as turn ``s`` has been generated from that
  context, and runs while the environment runs the turn's tool and the next turn is generated. The
  engine has just prefilled the context for that turn, so the probe finds it in its prefix cache
  and forwards only the last, partly filled cache block and the pseudo-response (``R`` ids). Sent
  earlier, beside the turn's own request, it would prefill the new observation a second time: vLLM
  shares no prefix between two requests in flight.
- **Where.** With the episode's ``affinity``, so a router sends it to the replica that holds the
  episode's context. If that replica died, the router sends it to the one that takes the episode
  over (a cold prefix there: still correct, only slower, and counted as a cache miss).
- **Never in the policy's way.** A probe is an asyncio task of its own; the episode awaits its
  probes only once the episode is over (at most ``timeout_s``). The gold answer is only in the
  probe's own sequence, never in the context the policy continues.
- **Which weights.** Each probe records the weights version that computed it (``turn.ig_version``):
  the version serving when the turn had just been generated. An engine reruns a probe that a
  weight update overlapped, so one probe's log-probs come from one version.
- **Failures.** A probe that fails or does not finish in time leaves the trajectory's information
  gain missing: every ``turn.ig_value`` null and ``metadata["ig_missing"]`` saying why, never a 0.
  The episode itself is not affected. The estimator then trains that trajectory on its outcome and
  format penalties only (docs/algorithms.md §5).
- **Checkpoints.** Values already measured go into each episode checkpoint; an episode resumed on
  another worker probes again only the boundaries that had no value, so none is missing or doubled.

``metadata["ig_probes"]`` counts what the probes cost: ``boundaries``, ``prefill_tokens`` (tokens
the engines forwarded, the prefix cache's hits excluded), ``pseudo_tokens`` (``R`` per boundary:
the least any probe can forward), ``cache_misses`` (probes that found less of the context cached
than its whole blocks: an evicted or moved prefix) and ``wait_s`` (how long the finished episode
waited for its last probes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from turnstile.envs.protocol import THINK_OPEN
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import PolicyEngine, Probe
from turnstile.rollout.errors import describe_error
from turnstile.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

# docs/algorithms.md §4: the pseudo-response around the gold answer.
LEAD_TEXT = "Now there's enough information to answer\n</think>\n<answer>\n"
TAIL_TEXT = "\n</answer>"
THINK_PREFIX = THINK_OPEN + "\n"  # how the policy's own turns open (envs.protocol.render_tool_call)

MISSING_KEY = "ig_missing"  # trajectory metadata: why its information gain is missing
COST_KEY = "ig_probes"  # trajectory metadata: what its probes cost


@dataclass(frozen=True)
class PseudoResponse:
    """The ids appended after a boundary's context; the gold answer is ``ids[gold_start:gold_end]``."""

    ids: tuple[int, ...]
    gold_start: int
    gold_end: int

    def __post_init__(self) -> None:
        if not 1 <= self.gold_start < self.gold_end <= len(self.ids):
            raise ValueError(f"gold span [{self.gold_start}, {self.gold_end}) does not fit a "
                             f"pseudo-response of {len(self.ids)} ids after a non-empty lead")


def pseudo_response(chat: ChatFormat, gold: str, think_open: bool) -> PseudoResponse | None:
    """The pseudo-response for ``gold`` (None when the gold has no tokens).

    ``think_open``: the context already ends inside ``<think>``, so the lead starts in it. The three
    pieces (text before the gold, the gold, the text after it) are tokenised separately and joined,
    so the gold span is exact by construction.
    """
    gold_ids = chat.encode(gold.strip())
    if not gold_ids:
        return None
    lead = chat.encode(("" if think_open else THINK_PREFIX) + LEAD_TEXT)
    tail = [*chat.encode(TAIL_TEXT), chat.turn_end_id]
    return PseudoResponse(ids=(*lead, *gold_ids, *tail), gold_start=len(lead),
                          gold_end=len(lead) + len(gold_ids))


def think_is_open(chat: ChatFormat, context: Sequence[int]) -> bool:
    """Whether a context ends inside an open ``<think>``, as the generation prompt of a thinking
    model's template does (its last few ids are enough)."""
    return chat.decode(context[max(len(context) - 4, 0):]).rstrip().endswith(THINK_OPEN)


@dataclass
class IgProbeConfig:
    """Information gain measured on the engines during rollout (``rollout.episode.ig_probe``).
    ``turnstile train`` turns it on when its ``information_gain`` reward scores on the engines."""

    enabled: bool = False
    timeout_s: float = 120.0  # the most a finished episode waits for its last probes

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"ig_probe.timeout_s={self.timeout_s} must be > 0")


class IgProbes:
    """The probes of one episode (see the module docstring)."""

    def __init__(self, engine: PolicyEngine, chat: ChatFormat, gold: str, affinity: str,
                 config: IgProbeConfig) -> None:
        self.engine, self.chat, self.affinity, self.config = engine, chat, affinity, config
        self.gold = gold.strip()
        self._pseudo = {opened: pseudo_response(chat, self.gold, opened) for opened in (False, True)}
        self._running: dict[int, asyncio.Task[Probe]] = {}  # turn index -> its boundary's probe
        self._done: dict[int, Probe] = {}
        self._pseudo_len: dict[int, int] = {}  # R of each probed boundary
        self._failed: dict[int, str] = {}

    async def issue(self, turn: int, context: Sequence[int]) -> None:
        """Probe the boundary before ``turn``, whose context is ``context`` (copied). Returns once
        the probe has been sent (its task has run to its first wait), not when it is answered."""
        pseudo = self._pseudo[think_is_open(self.chat, context)]
        if pseudo is None or turn in self._done or turn in self._running:
            return
        self._failed.pop(turn, None)
        self._pseudo_len[turn] = len(pseudo.ids)
        task = asyncio.get_running_loop().create_task(self.engine.probe(
            list(context), list(pseudo.ids), (pseudo.gold_start, pseudo.gold_end), self.affinity))
        task.add_done_callback(lambda finished: self._collect(turn, finished))
        self._running[turn] = task
        await asyncio.sleep(0)  # let it send its request before the episode goes on

    async def issue_missing(self, trajectory: Trajectory) -> None:
        """Probe every boundary of ``trajectory`` that has no value yet (a resumed episode)."""
        for segment in trajectory.segments:
            ids = segment.flat_ids()
            for turn in segment.turns:
                if turn.ig_value is None:
                    await self.issue(turn.index, ids[:turn.context_len])

    def _collect(self, turn: int, task: asyncio.Task[Probe]) -> None:
        """Take a finished probe's result (idempotent: its done-callback may come after)."""
        if self._running.get(turn) is task:
            del self._running[turn]
        if task.cancelled():
            self._failed[turn] = f"not measured within {self.config.timeout_s:g} s"
            return
        error = task.exception()
        if error is not None:
            self._failed[turn] = describe_error(error) if isinstance(error, Exception) else repr(error)
        else:
            self._done[turn] = task.result()

    def record(self, trajectory: Trajectory) -> None:
        """Write the values measured so far onto their turns (before an episode checkpoint)."""
        for turn in trajectory.turns:
            probe = self._done.get(turn.index)
            if probe is not None and turn.ig_value is None:
                turn.ig_value, turn.ig_version = _mean(probe.logprobs), probe.weights_version

    async def finish(self, trajectory: Trajectory) -> None:
        """Wait for the last probes (at most ``timeout_s``, outside the episode's own time-out), then
        write every turn's value, or mark the trajectory's information gain missing."""
        started = time.monotonic()
        pending = list(self._running.values())
        if pending:
            try:
                _, late = await asyncio.wait(pending, timeout=self.config.timeout_s)
            except asyncio.CancelledError:
                self.cancel()
                raise
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        for index, task in list(self._running.items()):  # done, but their callbacks not run yet
            self._collect(index, task)
        self.record(trajectory)
        turns = trajectory.turns
        probed = [self._done[t] for t in sorted(self._done)]
        trajectory.metadata[COST_KEY] = {
            "boundaries": len(probed), "prefill_tokens": sum(p.prefill_tokens for p in probed),
            "pseudo_tokens": sum(self._pseudo_len[t] for t in self._done),
            "cache_misses": sum(p.cache_miss for p in probed),
            "wait_s": round(time.monotonic() - started, 4)}
        why = self._missing_reason(trajectory)
        if why:
            for turn in turns:
                turn.ig_value = turn.ig_version = None
            trajectory.metadata[MISSING_KEY] = why
            log.warning("episode %s: information gain missing (%s); it trains on outcome and format "
                        "only", self.affinity, why)
        elif turns and self._pseudo[False] is None:
            log.warning("episode %s: the gold answer %r has no tokens; information gain is off for it "
                        "(outcome and format only)", self.affinity, self.gold)

    def _missing_reason(self, trajectory: Trajectory) -> str:
        turns = trajectory.turns
        if not turns or self._pseudo[False] is None:  # no turn, or no gold to measure: IG is off, not missing
            return ""
        absent = [turn.index for turn in turns if turn.ig_value is None]
        if not absent:
            return ""
        first = absent[0]
        reason = self._failed.get(first, "never probed")
        return f"{len(absent)} of {len(turns)} boundaries not measured; boundary {first}: {reason}"

    def cancel(self) -> None:
        """Stop probes still running (the episode was cancelled)."""
        for task in list(self._running.values()):
            task.cancel()


def _mean(logprobs: Sequence[float]) -> float:
    return math.fsum(logprobs) / len(logprobs)

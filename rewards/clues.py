"""Clue-based step scores (docs/algorithms.md §6, ABSeeker's ABC): which turns made progress on the facts
a solution must establish.

Three parts:

- **Clue recovery** (:mod:`turnstile.rewards.clue_recovery`) for a task that ships no clues; tasks that carry
  clues (the synthetic world's chains, HotpotQA's supporting facts) skip it.
- **Step judges** label each turn with events: :func:`heuristic_events` matches clue strings in the
  turn's text and observation; :class:`LlmStepJudge` asks an OpenAI-compatible endpoint for JSON
  labels per turn. Events are strings ``kind`` or ``kind:detail`` (``clue_found:hop2``).
- **Scores**: ``r_t = clip(1 + Σ event values, 0, 2)`` (:func:`step_score`), written with the events
  to ``turn.step_score`` and ``turn.events`` by the ``clue_steps`` plugin (:class:`ClueSteps`).

The ABC-SFT weight ``w(r)`` and the ABC-GRPO advantages are the learner's (``learner/credit``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from turnstile.envs.answers import answer_matches, normalize_answer
from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage, clip_text, json_object_in
from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.toolset import ToolsConfig, build_toolbox
from turnstile.rewards.base import RewardPlugin
from turnstile.rewards.clue_recovery import ClueRecoverer, ClueRecoveryConfig
from turnstile.rollout.trajectory import Trajectory, Turn

log = logging.getLogger(__name__)

# ---- events and scores -------------------------------------------------------------------------

CLUE_FOUND = "clue_found"  # +0.8, first discovery of a clue
CLUE_VERIFIED = "clue_verified"  # +0.8, the clue read on one of its evidence pages
CANDIDATE_EXCLUDED = "candidate_excluded"  # +0.4, a wrong candidate ruled out
CLUE_DISCARDED = "clue_discarded"  # -0.8, a correct clue ruled out
ANSWER_CORRECT = "answer_correct"  # +1.0
ANSWER_WRONG = "answer_wrong"  # -1.0; an unanswered trajectory's last turn too
JUDGE_UNPARSEABLE = "judge_unparseable"  # the judge's reply could not be read: score 1.0

EVENT_VALUES: dict[str, float] = {
    CLUE_FOUND: 0.8, CLUE_VERIFIED: 0.8, CANDIDATE_EXCLUDED: 0.4, CLUE_DISCARDED: -0.8,
    ANSWER_CORRECT: 1.0, ANSWER_WRONG: -1.0, JUDGE_UNPARSEABLE: 0.0,
}


def event_value(event: str) -> float:
    kind = event.partition(":")[0]
    if kind not in EVENT_VALUES:
        raise ValueError(f"unknown step event {event!r}; events are {sorted(EVENT_VALUES)}")
    return EVENT_VALUES[kind]


def step_score(events: Sequence[str]) -> float:
    """``clip(1 + Σ values, 0, 2)``: 1 is a neutral step."""
    return min(max(1.0 + sum(event_value(event) for event in events), 0.0), 2.0)


def answer_event(trajectory: Trajectory, task: Task) -> str:
    """The last turn's answer event; an unanswered trajectory counts as a wrong answer."""
    correct = trajectory.answered and answer_matches(trajectory.answer, task.answers)
    return ANSWER_CORRECT if correct else ANSWER_WRONG


# ---- the heuristic judge -----------------------------------------------------------------------

_STOPWORDS = frozenset({"of", "in", "on", "at", "by", "for", "to", "and", "or", "is", "was", "has",
                        "had", "its", "it", "with", "from", "as"})
_DISMISS_BEFORE = re.compile(
    r"\b(?:rul(?:e|es|ed|ing)\s+out|exclud(?:e|es|ed|ing)|eliminat(?:e|es|ed|ing)|"
    r"discard(?:s|ed|ing)?|reject(?:s|ed|ing)?)\s+(?P<x>[^.;,\n]{1,80})", re.IGNORECASE)
_DISMISS_AFTER = re.compile(
    r"(?P<x>[^.;,\n]{1,80}?)\s+(?:is|was)\s+(?:(?:not|n't)\s+(?:the\s+)?(?:answer|correct|right|"
    r"a\s+match|the\s+one)|wrong|incorrect|ruled\s+out|excluded|eliminated)\b", re.IGNORECASE)


_TAG = re.compile(r"</?[a-z_]+>")


def _padded(text: str) -> str:
    return f" {normalize_answer(text)} "


def _words(text: str) -> set[str]:
    return set(normalize_answer(text).split())


@dataclass(frozen=True)
class ClueMatcher:
    """When a text establishes a clue: every anchor word and at least one key appear in it.

    For a clue written ``"<subject and relation>: <value>"`` the keys are the value and the aliases
    that are not just the subject again (``"Born of Ada Varn: 1931"`` with alias ``"Ada Varn"`` is
    shown by ``1931`` next to ``born``, ``ada``, ``varn``, not by her name alone); the anchors are the
    content words left of the colon. A clue without a colon is keyed by its aliases and anchored by
    its other words.
    """

    keys: tuple[str, ...]  # normalised
    anchors: frozenset[str]

    @classmethod
    def of(cls, clue: Clue) -> ClueMatcher:
        left, colon, value = clue.text.rpartition(":")
        subject = left if colon else clue.text
        anchors = _words(subject) - _STOPWORDS
        keys = [normalize_answer(value)] if colon and normalize_answer(value) else []
        keys += [normalize_answer(alias) for alias in clue.aliases
                 if normalize_answer(alias) and not _words(alias) <= anchors]
        if not keys and not colon and clue.aliases:
            keys = [normalize_answer(alias) for alias in clue.aliases if normalize_answer(alias)]
        key_words = set().union(*(set(key.split()) for key in keys)) if keys else set()
        return cls(tuple(dict.fromkeys(keys)), frozenset(anchors - key_words))

    def matches(self, padded: str) -> bool:
        """``padded`` is ``_padded(text)``: normalised, with a space at each end."""
        if not all(f" {word} " in padded for word in self.anchors):
            return False
        return not self.keys or any(f" {key} " in padded for key in self.keys)

    def mentioned(self, padded: str) -> bool:
        """A key of the clue appears (the model names the clue's value)."""
        return any(f" {key} " in padded for key in self.keys)


def model_text(turn: Turn) -> str:
    """What the model wrote, less its final answer (answers are scored by their own event)."""
    text = turn.response_text
    start = text.find("<answer>")
    text = text[:start] if start != -1 else text
    return _TAG.sub("\n", text)  # a tag ends a phrase: "<think>Bo Lund" is about "Bo Lund"


def visited_urls(turn: Turn) -> set[str]:
    if turn.tool != "visit" or turn.arguments is None:
        return set()
    url = turn.arguments.get("url")
    urls = url if isinstance(url, list) else [url]
    return {u.rstrip("/") for u in urls if isinstance(u, str)}


def heuristic_events(trajectory: Trajectory, task: Task, clues: Sequence[Clue]) -> list[list[str]]:
    """Events per turn, from clue strings matched in each turn's text and observation.

    A clue is *found* the first time it is matched in a turn's text or observation and *verified* the
    first time it is matched in the observation of a visit to one of its evidence pages (a first
    discovery on an evidence page is one ``clue_verified`` event). A phrase the model dismisses
    ("rules out X", "X is not the answer") is a wrongly discarded clue when it names a clue's value or
    a gold answer, else an excluded wrong candidate (each candidate once).
    """
    matchers = [(clue, ClueMatcher.of(clue)) for clue in clues]
    answer_clue = next((clue.id for clue in clues if clue.role == "answer"), "answer")
    gold = [_padded(answer) for answer in task.answers]
    found: set[str] = set()
    verified: set[str] = set()
    excluded: set[str] = set()
    turns = trajectory.turns
    events_T: list[list[str]] = []
    for turn in turns:
        events: list[str] = []
        written = model_text(turn)
        seen = _padded(f"{written}\n{turn.observation_text}")
        observed = _padded(turn.observation_text)
        evidence_visit = visited_urls(turn)
        for clue, matcher in matchers:
            on_evidence = bool(evidence_visit & {u.rstrip("/") for u in clue.evidence_urls})
            if clue.id not in verified and on_evidence and matcher.matches(observed):
                events.append(f"{CLUE_VERIFIED}:{clue.id}")
                verified.add(clue.id)
                found.add(clue.id)
            elif clue.id not in found and matcher.matches(seen):
                events.append(f"{CLUE_FOUND}:{clue.id}")
                found.add(clue.id)
        for phrase in _dismissed(written):
            padded = _padded(phrase)
            hit = [clue.id for clue, matcher in matchers if matcher.mentioned(padded)]
            if not hit and any(answer.strip() and answer in padded for answer in gold):
                hit = [answer_clue]
            if hit:
                events.extend(f"{CLUE_DISCARDED}:{clue_id}" for clue_id in dict.fromkeys(hit))
            elif padded.strip() and padded.strip() not in excluded:
                excluded.add(padded.strip())
                events.append(f"{CANDIDATE_EXCLUDED}:{padded.strip()}")
        events_T.append(events)
    if events_T:
        events_T[-1].append(answer_event(trajectory, task))
    return events_T


def _dismissed(text: str) -> list[str]:
    phrases = [match["x"] for match in _DISMISS_BEFORE.finditer(text)]
    phrases += [match["x"] for match in _DISMISS_AFTER.finditer(text)]
    return [phrase.strip() for phrase in phrases if phrase.strip()]


# ---- the LLM judge -----------------------------------------------------------------------------

STEP_JUDGE_PROMPT = """You audit the steps of a research agent against the clues any correct \
solution must establish.

Question: {question}
Verified answer: {answer}

Clues (id, role, fact):
{clues}

For each step below, list what the step did, using only these event types:
- clue_found: the step discovered a clue (by reading it in a tool result or stating it); give its id
- clue_verified: the step explicitly checked a clue on an evidence page; give its id
- candidate_excluded: the step correctly ruled out a wrong candidate; give the candidate
- clue_discarded: the step wrongly ruled out a correct clue; give its id
A step may have no events. Do not judge the final answer.

Steps:
{steps}

Reply with JSON only:
{{"turns": [{{"turn": <step number>, "events": [{{"type": "clue_found", "clue": "<id>"}}, \
{{"type": "candidate_excluded", "candidate": "<name>"}}]}}]}}"""

_LLM_EVENTS = (CLUE_FOUND, CLUE_VERIFIED, CANDIDATE_EXCLUDED, CLUE_DISCARDED)


@dataclass
class LlmStepJudgeConfig:
    turns_per_call: int = 20  # long trajectories are judged in windows of this many turns
    max_text_chars: int = 1500  # of each turn's own text shown to the judge
    max_observation_chars: int = 3000


class LlmStepJudge:
    """Labels turns through an OpenAI-compatible endpoint. The code, not the judge, keeps each
    clue's found/verified credit to its first occurrence and adds the answer event; turns whose
    window got no readable reply score 1.0 (event ``judge_unparseable``)."""

    def __init__(self, config: LlmStepJudgeConfig, client: ChatClient) -> None:
        if config.turns_per_call < 1:
            raise ValueError("llm.turns_per_call must be >= 1")
        self.config = config
        self.client = client

    async def events(self, trajectory: Trajectory, task: Task, clues: Sequence[Clue]
                     ) -> list[list[str]]:
        turns = trajectory.turns
        size = self.config.turns_per_call
        windows = [turns[start:start + size] for start in range(0, len(turns), size)]
        replies = await asyncio.gather(*(self.client.complete(self._messages(task, clues, window))
                                         for window in windows))
        ids = {clue.id for clue in clues}
        credited: set[str] = set()
        events_T: list[list[str]] = []
        unreadable: set[int] = set()
        for window, reply in zip(windows, replies, strict=True):
            labels = parse_step_labels(reply, ids)
            for turn in window:
                if labels is None:
                    unreadable.add(turn.index)
                    events_T.append([JUDGE_UNPARSEABLE])
                    continue
                kept = []
                for event in labels.get(turn.index, []):
                    kind = event.partition(":")[0]
                    if kind in (CLUE_FOUND, CLUE_VERIFIED):
                        if event in credited:
                            continue
                        credited.add(event)
                    kept.append(event)
                events_T.append(kept)
        if events_T and turns[-1].index not in unreadable:
            events_T[-1].append(answer_event(trajectory, task))
        return events_T

    def _messages(self, task: Task, clues: Sequence[Clue], window: Sequence[Turn]) -> list[ChatMessage]:
        clue_lines = "\n".join(f"- {clue.id} ({clue.role}): {clue.text}" for clue in clues) or "(none)"
        steps = "\n\n".join(
            f"Step {turn.index}:\n[agent] {clip_text(model_text(turn), self.config.max_text_chars)}\n"
            f"[tool result] {clip_text(turn.observation_text, self.config.max_observation_chars)}"
            for turn in window)
        prompt = STEP_JUDGE_PROMPT.format(question=task.question, answer=task.answers[0] if
                                          task.answers else "", clues=clue_lines, steps=steps)
        return [ChatMessage("user", prompt)]


def parse_step_labels(reply: str, clue_ids: set[str]) -> dict[int, list[str]] | None:
    """``{turn index: events}`` from the judge's JSON; None when the reply holds no such JSON.
    Unknown event types and clue ids are dropped (the judge cannot invent clues)."""
    document = json_object_in(reply)
    turns = document.get("turns") if document is not None else None
    if not isinstance(turns, list):
        return None
    labels: dict[int, list[str]] = {}
    for item in turns:
        if not isinstance(item, dict):
            continue
        turn, item_events = item.get("turn"), item.get("events")
        if isinstance(turn, bool) or not isinstance(turn, int) or not isinstance(item_events, list):
            continue
        events = labels.setdefault(turn, [])
        for event in item_events:
            if not isinstance(event, dict) or event.get("type") not in _LLM_EVENTS:
                continue
            if event["type"] == CANDIDATE_EXCLUDED:
                candidate = normalize_answer(str(event.get("candidate", "")))
                events.append(f"{CANDIDATE_EXCLUDED}:{candidate}" if candidate else CANDIDATE_EXCLUDED)
            elif event.get("clue") in clue_ids:
                events.append(f"{event['type']}:{event['clue']}")
    return labels


# ---- the plugin --------------------------------------------------------------------------------

@dataclass
class ClueStepsConfig:
    judge: str = "heuristic"  # "heuristic" | "llm"
    client: ChatClientConfig = field(default_factory=ChatClientConfig)  # llm judge and recovery
    llm: LlmStepJudgeConfig = field(default_factory=LlmStepJudgeConfig)
    recovery: ClueRecoveryConfig = field(default_factory=ClueRecoveryConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)  # what recovery searches and visits

    def __post_init__(self) -> None:
        if self.judge not in ("heuristic", "llm"):
            raise ValueError(f"clue_steps.judge={self.judge!r}: use 'heuristic' or 'llm'")


class ClueSteps(RewardPlugin):
    """Writes ``turn.events`` and ``turn.step_score`` for every turn (docs/algorithms.md §6).

    The client and the toolbox are built on first need (a task without clues, or the llm judge);
    tests and the reward service may pass their own.
    """

    Options = ClueStepsConfig
    writes: ClassVar[frozenset[str]] = frozenset({"turn.events", "turn.step_score"})

    def __init__(self, config: ClueStepsConfig, client: ChatClient | None = None,
                 toolbox: Toolbox | None = None) -> None:
        self.config = config
        self._client = client
        self._toolbox = toolbox
        self._built: list[ChatClient | Toolbox] = []  # closed by aclose; the callers' are theirs
        self._recoverer: ClueRecoverer | None = None

    @property
    def client(self) -> ChatClient:
        if self._client is None:
            self._client = ChatClient(self.config.client)
            self._built.append(self._client)
        return self._client

    @property
    def recoverer(self) -> ClueRecoverer:
        if self._recoverer is None:
            if self._toolbox is None:
                self._toolbox = build_toolbox(self.config.tools)
                self._built.append(self._toolbox)
            self._recoverer = ClueRecoverer(self.config.recovery, self.client, self._toolbox)
        return self._recoverer

    async def clues(self, task: Task) -> tuple[Clue, ...]:
        return task.clues if task.clues is not None else await self.recoverer.clues(task)

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        clues = await self.clues(task)
        if self.config.judge == "llm":
            judge = LlmStepJudge(self.config.llm, self.client)
            events_T = await judge.events(trajectory, task, clues)
        else:
            events_T = heuristic_events(trajectory, task, clues)
        for turn, events in zip(trajectory.turns, events_T, strict=True):
            turn.events = events
            turn.step_score = step_score(events)

    async def aclose(self) -> None:
        built, self._built = self._built, []
        for resource in built:
            await resource.aclose()

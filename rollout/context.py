"""Context managers: what the policy sees each turn (docs/algorithms.md §2), as token ids.

After every turn the episode loop asks its :class:`ContextManager` for the next context: either
ids to :class:`Append` to the current segment, or a :class:`NewSegment` with freshly rendered prompt
ids (a new model context, hence a new training sample). The loop owns the budget: when the plan would
not leave room for a full turn, it asks :meth:`ContextManager.on_overflow` for an alternative
(``discard_all`` resets; the others have none) and otherwise forces the final answer.

- ``mono``: one growing context; each observation is appended as delta ids.
- ``iter_research``: every turn starts a new segment whose prompt is a rebuilt workspace: the
  question and the latest ``<report>``, then the last action (think dropped) and its observation.
  Its context length stays about constant however long the episode runs.
- ``discard_all``: like mono until the budget is reached; then, at most ``max_resets`` times, a new
  segment from the question and a short carried summary (the latest report, else the latest think,
  capped), with the last action and its observation so that the call is not wasted.

Managers are chosen by name (``context.kind``) from :data:`CONTEXT_MANAGERS`; a new one registers
with :func:`register_context_manager`, or is named by import path (``context.kind=mypkg.ctx:Mine``).
An instance holds one episode's state: build one per episode with :func:`build_context_manager`,
like an environment.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from turnstile.envs.plugins import Registry
from turnstile.envs.protocol import REPORT_CLOSE, REPORT_OPEN, THINK_CLOSE, ParsedTurn
from turnstile.rollout.chat import ChatFormat, Message

REPORT_HEADER = "Your report so far:"
NOTES_HEADER = "Earlier context was discarded to free space. Notes carried over from it:"


@dataclass
class ContextConfig:
    """Which context manager, and the discard_all limits."""

    kind: str = "mono"  # mono | iter_research | discard_all, or package.module:Class
    max_resets: int = 3  # discard_all: the k of "at most k resets" (k+1 segments at most)
    summary_max_chars: int = 2000  # discard_all: cap on the carried summary

    def __post_init__(self) -> None:
        if self.max_resets < 0:
            raise ValueError("context.max_resets must be >= 0")
        if self.summary_max_chars < 0:
            raise ValueError("context.summary_max_chars must be >= 0")


@dataclass(frozen=True)
class Exchange:
    """A generated turn and the observation that answers it: what the next context is built from."""

    response_ids: Sequence[int]
    response_text: str
    parsed: ParsedTurn
    observation: str


@dataclass(frozen=True)
class Append:
    """Continue the current segment with these ids (the observation's delta)."""

    ids: list[int]


@dataclass(frozen=True)
class NewSegment:
    """Start a new segment (a new model context) from these prompt ids."""

    prompt_ids: list[int]


ContextPlan = Append | NewSegment


def planned_length(plan: ContextPlan, context_len: int) -> int:
    """The context length the next turn would be generated from under ``plan``."""
    return context_len + len(plan.ids) if isinstance(plan, Append) else len(plan.prompt_ids)


class ContextManager(abc.ABC):
    """Decides the prompt of each turn and when a segment starts. One instance per episode.

    Contract: ``start`` is called once with the episode's chat format and the environment's first
    messages and returns the first segment's prompt ids; then after each turn that did not end the
    episode, ``next_context`` gets the turn and its observation and returns a plan. If the plan
    does not fit the budget, the loop calls ``on_overflow`` (None = no alternative), and failing
    that forces the final answer and calls ``next_context`` again with the instruction as the
    observation. Methods never raise on what the policy wrote.
    """

    name: ClassVar[str]
    expect_report: ClassVar[bool] = False  # turns carry a <report> (the env checks it)

    def __init__(self, config: ContextConfig) -> None:
        self.config = config
        self._chat: ChatFormat | None = None
        self._system: list[Message] = []
        self._question = ""

    @property
    def chat(self) -> ChatFormat:
        if self._chat is None:
            raise RuntimeError(f"context manager {self.name!r} was not started: call start() first")
        return self._chat

    def start(self, chat: ChatFormat, messages: Sequence[Message]) -> list[int]:
        if self._chat is not None:
            raise RuntimeError(f"context manager {self.name!r} is single use: build one per episode")
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("the first messages must end with the user's question")
        self._chat = chat
        self._system = [dict(m) for m in messages[:-1]]
        self._question = messages[-1]["content"]
        return self.chat.prompt_ids(messages)

    @abc.abstractmethod
    def next_context(self, exchange: Exchange) -> ContextPlan: ...

    def snapshot(self) -> dict[str, object]:
        """What this manager carries between turns (JSON), for an episode checkpoint."""
        return {}

    def restore(self, state: dict[str, object]) -> None:  # noqa: B027 - nothing to restore by default
        """Continue from :meth:`snapshot`'s state (after ``start``)."""

    def on_overflow(self, exchange: Exchange) -> ContextPlan | None:
        """A plan that fits when ``next_context``'s did not, or None to force the final answer."""
        return None

    def _workspace(self, carried: str | None, exchange: Exchange) -> NewSegment:
        """A fresh context: question (+ carried text), the last action, its observation."""
        question = self._question if not carried else f"{self._question}\n\n{carried}"
        messages = [*self._system,
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": action_text(exchange.response_text)},
                    {"role": "user", "content": exchange.observation}]
        return NewSegment(self.chat.prompt_ids(messages))


def action_text(response: str) -> str:
    """A turn without its think and report blocks: the action as the policy wrote it."""
    for close in (REPORT_CLOSE, THINK_CLOSE):
        if close in response:
            return response[response.rfind(close) + len(close):].strip()
    return response.strip()


CONTEXT_MANAGERS: Registry[type[ContextManager]] = Registry(
    "context.kind", "turnstile.context_managers", error=ValueError, expected="a ContextManager class",
    accepts=lambda found: isinstance(found, type) and issubclass(found, ContextManager))
_Manager = TypeVar("_Manager", bound=type[ContextManager])


def register_context_manager(name: str) -> Callable[[_Manager], _Manager]:
    def register(cls: _Manager) -> _Manager:
        cls.name = name
        CONTEXT_MANAGERS.add(name, cls)
        return cls
    return register


def context_manager_class(kind: str) -> type[ContextManager]:
    """The manager ``kind`` names: registered (mono, iter_research, discard_all) or ``package.module:Class``."""
    return CONTEXT_MANAGERS.load(kind)


def build_context_manager(config: ContextConfig) -> ContextManager:
    """A fresh context manager of ``config.kind`` for one episode."""
    return context_manager_class(config.kind)(config)


@register_context_manager("mono")
class Mono(ContextManager):
    """ReAct: one context; every observation appended."""

    def next_context(self, exchange: Exchange) -> ContextPlan:
        return Append(self.chat.delta_ids(exchange.observation, exchange.response_ids))


@register_context_manager("iter_research")
class IterResearch(ContextManager):
    """WebResearcher: each turn a rebuilt workspace (question + report + last action + result)."""

    expect_report = True

    def __init__(self, config: ContextConfig) -> None:
        super().__init__(config)
        self._report: str | None = None

    def next_context(self, exchange: Exchange) -> ContextPlan:
        if exchange.parsed.report:  # a turn without a valid report keeps the previous one
            self._report = exchange.parsed.report
        carried = (f"{REPORT_HEADER}\n{REPORT_OPEN}\n{self._report}\n{REPORT_CLOSE}"
                   if self._report else None)
        return self._workspace(carried, exchange)

    def snapshot(self) -> dict[str, object]:
        return {"report": self._report}

    def restore(self, state: dict[str, object]) -> None:
        report = state.get("report")
        self._report = report if isinstance(report, str) else None


@register_context_manager("discard_all")
class DiscardAll(ContextManager):
    """Mono until the budget; then a fresh context with a carried summary, at most k times."""

    def __init__(self, config: ContextConfig) -> None:
        super().__init__(config)
        self.resets = 0
        self._summary = ""

    def next_context(self, exchange: Exchange) -> ContextPlan:
        summary = exchange.parsed.report or exchange.parsed.think
        if summary:
            self._summary = summary
        return Append(self.chat.delta_ids(exchange.observation, exchange.response_ids))

    def snapshot(self) -> dict[str, object]:
        return {"resets": self.resets, "summary": self._summary}

    def restore(self, state: dict[str, object]) -> None:
        resets, summary = state.get("resets", 0), state.get("summary", "")
        self.resets = resets if isinstance(resets, int) and resets >= 0 else 0
        self._summary = summary if isinstance(summary, str) else ""

    def on_overflow(self, exchange: Exchange) -> ContextPlan | None:
        if self.resets >= self.config.max_resets:
            return None
        self.resets += 1
        cap = self.config.summary_max_chars
        summary = self._summary if len(self._summary) <= cap else self._summary[:cap].rstrip() + " …"
        summary = summary if cap else ""
        return self._workspace(f"{NOTES_HEADER}\n{summary}" if summary else NOTES_HEADER, exchange)

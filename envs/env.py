"""The environment contract, how a config chooses an environment, and the search/browse environment.

An :class:`Env` is async and single use: ``reset`` once, ``step`` until ``done``, then ``close``
(safe to call twice). Beside those the episode loop needs three things of every environment:
``force_final_answer`` (the context budget is about to overflow: make the next turn the last),
``snapshot``/``restore`` (an episode checkpoint continues elsewhere). That is the whole contract:
the loop knows no other method, so any class that keeps it runs through ``turnstile rollout`` and
``turnstile train`` unchanged. ``tests/env_conformance.py`` checks an environment against it.

The config names the environment in ``episode.env.kind`` (:data:`ENVS`: ``search_browse``, the
default; ``calculator``, a small arithmetic one; or ``package.module:Class``). An environment is
built per episode as ``Class(task, toolbox, config)``: the toolbox is the worker's shared one
(search index, HTTP pools, browser, cache), built once; an environment that brings its own tools
ignores it.

:class:`ProtocolEnv` is the agent protocol of docs/algorithms.md §1 for any set of tools. Whatever
the policy writes and whatever the tools do, ``step`` returns an observation: malformed turns get a
corrective observation, tool failures an error text the agent can read. The last allowed turn gets
the forced-answer instruction instead of a tool result. :class:`SearchBrowseEnv` is that protocol
over the toolbox's search and visit, with per-episode tool budgets.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from turnstile.envs.plugins import Registry
from turnstile.envs.protocol import (
    FINAL_ANSWER_INSTRUCTION,
    MAX_CALL_CHARS,
    RESEARCH_ROLE,
    ParsedTurn,
    StopReason,
    TurnKind,
    parse_turn,
    render_correction,
    render_stall_warning,
    render_tool_response,
    system_prompt,
)
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import Fault, JsonObject, fault_of
from turnstile.envs.tools.cache import cache_key
from turnstile.envs.tools.toolbox import Toolbox

Message = dict[str, str]


@dataclass
class EnvConfig:
    kind: str = "search_browse"  # a registered environment (ENVS) or package.module:Class
    max_turns: int = 200  # assistant turns, the answer turn included
    tool_budget: int = 0  # tool calls per episode; 0 = max_turns - 1
    per_tool_budget: dict[str, int] = field(default_factory=dict)  # e.g. {"visit": 50}
    require_think: bool = True
    expect_report: bool = False  # iter_research turns carry a <report>
    today: str = ""  # shown in the system prompt when set
    max_tool_call_chars: int = MAX_CALL_CHARS  # a longer tool call is a malformed turn, never parsed
    # A stalled agent: after this many tool calls in a row that bring nothing new (the same tool and
    # arguments as an earlier call, or a result already seen), the response carries a warning; after
    # as many more, the episode ends ``stalled``. 0 = never.
    stall_turns: int = 4

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns} must be >= 1")
        if self.tool_budget < 0:
            raise ValueError(f"tool_budget={self.tool_budget} must be >= 0 (0 = max_turns - 1)")
        bad = {name: limit for name, limit in self.per_tool_budget.items() if limit < 0}
        if bad:
            raise ValueError(f"per_tool_budget={bad}: budgets must be >= 0")
        if self.max_tool_call_chars < 64:
            raise ValueError(f"max_tool_call_chars={self.max_tool_call_chars} must be >= 64")
        if self.stall_turns < 0:
            raise ValueError(f"stall_turns={self.stall_turns} must be >= 0 (0 = never)")


@dataclass(frozen=True)
class StepInfo:
    turn: int
    parsed: ParsedTurn
    tool: str | None = None  # the tool that ran (None for answers and malformed turns)
    tool_ok: bool | None = None
    tool_error: str | None = None
    tool_cached: bool = False
    tool_seconds: float = 0.0
    forced_final: bool = False  # the observation is the forced-answer instruction
    end: StopReason | None = None
    tool_fault: Fault | None = None  # whose doing a failed call was; None: by its error kind

    @property
    def format_ok(self) -> bool:
        return self.parsed.format_ok

    @property
    def fault(self) -> Fault | None:
        """Whose doing the tool's failure was (None when no tool failed)."""
        if self.tool_ok is not False:
            return None
        return self.tool_fault if self.tool_fault is not None else fault_of(self.tool_error or "")

    @property
    def answer(self) -> str | None:
        return self.parsed.answer


@dataclass(frozen=True)
class StepResult:
    observation: str  # the user message content that follows the turn ("" when done)
    done: bool
    info: StepInfo


class Env(abc.ABC):
    """Async, single-use episode; the loop uses nothing else (see the module docstring).

    - ``reset()`` returns the first observation as chat messages; call it exactly once.
    - ``step(action)`` takes the assistant's text and returns the next observation; it must not
      raise on anything the policy writes or any tool failure, and must end the episode
      (``done``) by the ``max_turns``-th step.
    - ``force_final_answer()`` makes the next step the last and returns the text to show the policy
      instead of the observation it was about to get.
    - ``snapshot()`` returns the state (JSON) that ``restore(state)``, called on a fresh
      environment right after ``reset()``, continues from; ``restore`` raises ValueError on a
      state it cannot use.
    - ``close()`` releases what the episode holds; safe to call twice.

    A registered environment is built as ``Class(task, toolbox, config)`` (:func:`build_env`).
    """

    @abc.abstractmethod
    def __init__(self, task: Task, toolbox: Toolbox, config: EnvConfig) -> None: ...

    @abc.abstractmethod
    async def reset(self) -> list[Message]: ...

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult: ...

    @abc.abstractmethod
    def force_final_answer(self) -> str: ...

    @abc.abstractmethod
    def snapshot(self) -> dict[str, object]: ...

    @abc.abstractmethod
    def restore(self, state: dict[str, object]) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


ENVS: Registry[type[Env]] = Registry(
    "env.kind", "turnstile.envs", error=ValueError, expected="an Env class",
    accepts=lambda found: isinstance(found, type) and issubclass(found, Env))
_EnvClass = TypeVar("_EnvClass", bound=type[Env])


def register_env(name: str) -> Callable[[_EnvClass], _EnvClass]:
    """Decorator: make the decorated class the environment ``name``."""

    def decorate(cls: _EnvClass) -> _EnvClass:
        ENVS.add(name, cls)
        return cls

    return decorate


def env_class(kind: str) -> type[Env]:
    """The environment ``kind`` names (registered, an entry point, or ``package.module:Class``)."""
    return ENVS.load(kind)


def build_env(task: Task, toolbox: Toolbox, config: EnvConfig) -> Env:
    """A fresh environment of ``config.kind`` for one episode of ``task``."""
    return env_class(config.kind)(task, toolbox, config)


class ProtocolEnv(Env):
    """The agent protocol (docs/algorithms.md §1) over some tools; a subclass says which tools
    (``tool_schemas``, ``tool_names``) and runs a call (``call_tool``). It may end the tool phase
    early (``tools_spent``) and add to the checkpoint state (``tool_state``/``restore_tools``)."""

    role = RESEARCH_ROLE  # the first paragraph of the system prompt

    def __init__(self, task: Task, config: EnvConfig) -> None:
        self.task = task
        self.config = config
        self.turn = 0
        self._started = False
        self._done = False
        self._final_next = False
        self._closed = False
        self._seen: set[str] = set()  # digests of the calls made and the results read so far
        self._stale = 0  # tool calls in a row that brought nothing new

    @abc.abstractmethod
    def tool_schemas(self) -> list[JsonObject]: ...

    @abc.abstractmethod
    def tool_names(self) -> list[str]: ...

    @abc.abstractmethod
    async def call_tool(self, turn: int, parsed: ParsedTurn) -> tuple[StepInfo, str]:
        """Run the well-formed tool call ``parsed``; the info and the tool's text (never raises)."""

    @property
    def tool_budget(self) -> int:
        """Tool calls this episode allows (``config.tool_budget``; 0 means ``max_turns - 1``)."""
        return self.config.tool_budget or max(self.config.max_turns - 1, 0)

    def tools_spent(self) -> bool:
        """True when no tool call is left: the next turn must answer."""
        return False

    def tool_state(self) -> dict[str, object]:
        return {}

    def restore_tools(self, state: dict[str, object]) -> None:
        """Continue from ``tool_state()``'s part of a snapshot (ValueError when unusable)."""

    async def reset(self) -> list[Message]:
        if self._started:
            raise RuntimeError(f"{type(self).__name__} is single use: reset() was already called")
        self._started = True
        question = self.task.question
        if self.config.max_turns == 1:
            self._final_next = True
            question = f"{question}\n\n{FINAL_ANSWER_INSTRUCTION}"
        return [
            {"role": "system",
             "content": system_prompt(self.tool_schemas(), self.config.today or None,
                                      report=self.config.expect_report, role=self.role)},
            {"role": "user", "content": question},
        ]

    def force_final_answer(self) -> str:
        self._final_next = True
        return FINAL_ANSWER_INSTRUCTION

    async def step(self, action: str) -> StepResult:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; build a new environment for the next one")
        turn = self.turn
        self.turn += 1
        parsed = parse_turn(action, require_think=self.config.require_think,
                            expect_report=self.config.expect_report,
                            max_call_chars=self.config.max_tool_call_chars)

        if parsed.kind is TurnKind.ANSWER:
            end = StopReason.ANSWERED if parsed.format_ok else StopReason.MALFORMED_ANSWER
            return self._finish(turn, parsed, end)
        if self._final_next:
            return self._finish(turn, parsed, StopReason.NO_ANSWER)

        if parsed.kind is TurnKind.MALFORMED:
            info = StepInfo(turn, parsed)
            observation = render_correction(parsed.errors, self.tool_names())
        else:
            info, result = await self.call_tool(turn, parsed)
            observation = render_tool_response(result + self._stall_note(parsed, result, info))
            if self._stale >= 2 * self.config.stall_turns > 0:
                self._done = True
                return StepResult("", True, replace(info, end=StopReason.STALLED))

        if self.turn >= self.config.max_turns - 1 or self.tools_spent():
            self._final_next = True
            return StepResult(FINAL_ANSWER_INSTRUCTION, False, replace(info, forced_final=True))
        return StepResult(observation, False, info)

    def call_key(self, parsed: ParsedTurn) -> str:
        """What makes two calls the same call: the tool and its arguments (a subclass may
        normalise them as its tools do)."""
        return json.dumps([parsed.tool, parsed.arguments], sort_keys=True, ensure_ascii=False)

    def _stall_note(self, parsed: ParsedTurn, result: str, info: StepInfo) -> str:
        """Count a call that brings nothing new; the warning to add to its response when the count
        reaches ``stall_turns``, else "". Nothing new: a call that worked before, a result read
        before, or a call that failed by the policy's doing (its arguments, its address). A call the
        environment failed neither counts nor resets the count: retrying it is sensible."""
        if not self.config.stall_turns or info.fault is Fault.environment:
            return ""
        made, read = _digest("call", self.call_key(parsed)), _digest("result", result)
        fresh = info.tool_ok is not False and made not in self._seen and read not in self._seen
        self._stale = 0 if fresh else self._stale + 1
        if info.tool_ok is not False:
            self._seen |= {made, read}
        return render_stall_warning(self._stale) if self._stale == self.config.stall_turns else ""

    def snapshot(self) -> dict[str, object]:
        return {"turn": self.turn, "final_next": self._final_next, "stale": self._stale,
                "seen": sorted(self._seen), **self.tool_state()}

    def restore(self, state: dict[str, object]) -> None:
        if not self._started or self.turn:
            raise RuntimeError("restore() goes right after reset(), before any step()")
        turn = state.get("turn")
        if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
            raise ValueError(f"not an environment snapshot: {state!r}")
        stale, seen = state.get("stale", 0), state.get("seen", [])
        if not isinstance(stale, int) or not isinstance(seen, list) or not all(isinstance(d, str) for d in seen):
            raise ValueError(f"not an environment snapshot: {state!r}")
        self.restore_tools(state)
        self.turn = turn
        self._final_next = bool(state.get("final_next", False))
        self._stale, self._seen = stale, set(seen)

    def _finish(self, turn: int, parsed: ParsedTurn, end: StopReason) -> StepResult:
        self._done = True
        return StepResult("", True, StepInfo(turn, parsed, end=end))

    async def close(self) -> None:
        self._closed = True


def _digest(kind: str, text: str) -> str:
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


@register_env("search_browse")
class SearchBrowseEnv(ProtocolEnv):
    """Search and visit from the worker's toolbox, within the episode's tool budgets."""

    def __init__(self, task: Task, toolbox: Toolbox, config: EnvConfig | None = None) -> None:
        super().__init__(task, config or EnvConfig())
        self.toolbox = toolbox
        unknown = sorted(set(self.config.per_tool_budget) - set(toolbox.names))
        if unknown:
            raise ValueError(f"env.per_tool_budget names unknown tools {unknown}; "
                             f"tools are {toolbox.names}")
        self.tool_calls: Counter[str] = Counter()

    def tool_schemas(self) -> list[JsonObject]:
        return self.toolbox.schemas()

    def tool_names(self) -> list[str]:
        return self.toolbox.names

    async def call_tool(self, turn: int, parsed: ParsedTurn) -> tuple[StepInfo, str]:
        name = parsed.tool or ""
        limit = self.config.per_tool_budget.get(name)
        if limit is not None and self.tool_calls[name] >= limit:
            text = (f"[{name}] not run: this episode's budget of {limit} {name} calls is used up. "
                    "Use another tool or answer.")
            return StepInfo(turn, parsed, tool=name, tool_ok=False, tool_error="budget"), text
        self.tool_calls[name] += 1
        started = time.monotonic()
        outcome = await self.toolbox.run(name, parsed.arguments)
        info = StepInfo(turn, parsed, tool=name, tool_ok=outcome.ok, tool_error=outcome.error,
                        tool_cached=outcome.cached, tool_seconds=time.monotonic() - started,
                        tool_fault=outcome.fault)
        return info, outcome.text

    def tools_spent(self) -> bool:
        return sum(self.tool_calls.values()) >= self.tool_budget

    def call_key(self, parsed: ParsedTurn) -> str:
        """The toolbox's cache key: the arguments as the tool normalises them (a query list of one
        string is the string), so a rephrased-but-equal call is the same call."""
        tool = self.toolbox.tools.get(parsed.tool or "")
        if tool is not None:
            with contextlib.suppress(Exception):  # arguments the tool refuses: compared as written
                return cache_key(tool.name, tool.normalize(parsed.arguments))
        return super().call_key(parsed)

    def tool_state(self) -> dict[str, object]:
        return {"tool_calls": dict(self.tool_calls)}

    def restore_tools(self, state: dict[str, object]) -> None:
        calls = state.get("tool_calls")
        if not isinstance(calls, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in calls.items()):
            raise ValueError(f"not an environment snapshot: {state!r}")
        self.tool_calls = Counter(calls)

    async def close(self) -> None:
        # The toolbox is shared by the worker's episodes and closed by its owner, not here.
        await super().close()

"""The environment contract and the search/browse environment.

An :class:`Env` is async and single use: ``reset`` once, ``step`` until ``done``, then ``close``
(safe to call twice). Builders are cheap, picklable specs; the heavy parts (HTTP pools, browser,
cache) live in the shared :class:`~envs.tools.toolbox.Toolbox` a worker builds once.

:class:`SearchBrowseEnv` speaks the agent protocol of docs/algorithms.md §1. Whatever the policy writes
and whatever the tools do, ``step`` returns an observation: malformed turns get a corrective
observation, tool failures an error text the agent can read. The last allowed turn gets the
forced-answer instruction instead of a tool result.
"""

from __future__ import annotations

import abc
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from envs.protocol import (
    FINAL_ANSWER_INSTRUCTION,
    MAX_CALL_CHARS,
    ParsedTurn,
    StopReason,
    TurnKind,
    parse_turn,
    render_correction,
    render_tool_response,
    system_prompt,
)
from envs.tasks import Task
from envs.tools.toolbox import Toolbox

Message = dict[str, str]


@dataclass
class EnvConfig:
    max_turns: int = 200  # assistant turns, the answer turn included
    tool_budget: int = 0  # tool calls per episode; 0 = max_turns - 1
    per_tool_budget: dict[str, int] = field(default_factory=dict)  # e.g. {"visit": 50}
    require_think: bool = True
    expect_report: bool = False  # iter_research turns carry a <report>
    today: str = ""  # shown in the system prompt when set
    max_tool_call_chars: int = MAX_CALL_CHARS  # a longer tool call is a malformed turn, never parsed

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

    @property
    def format_ok(self) -> bool:
        return self.parsed.format_ok

    @property
    def answer(self) -> str | None:
        return self.parsed.answer


@dataclass(frozen=True)
class StepResult:
    observation: str  # the user message content that follows the turn ("" when done)
    done: bool
    info: StepInfo


class Env(abc.ABC):
    """Async, single-use episode.

    - ``reset()`` returns the first observation as chat messages; call it exactly once.
    - ``step(action)`` takes the assistant's text and returns the next observation; it must not
      raise on anything the policy writes or any tool failure.
    - ``close()`` releases what the episode holds; safe to call twice.
    """

    @abc.abstractmethod
    async def reset(self) -> list[Message]: ...

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class SearchBrowseEnv(Env):
    def __init__(self, task: Task, toolbox: Toolbox, config: EnvConfig | None = None) -> None:
        self.task = task
        self.toolbox = toolbox
        self.config = config or EnvConfig()
        unknown = sorted(set(self.config.per_tool_budget) - set(toolbox.names))
        if unknown:
            raise ValueError(f"env.per_tool_budget names unknown tools {unknown}; "
                             f"tools are {toolbox.names}")
        self.turn = 0
        self.tool_calls: Counter[str] = Counter()
        self._started = False
        self._done = False
        self._final_next = False
        self._closed = False

    @property
    def tool_budget(self) -> int:
        return self.config.tool_budget or max(self.config.max_turns - 1, 0)

    async def reset(self) -> list[Message]:
        if self._started:
            raise RuntimeError("SearchBrowseEnv is single use: reset() was already called")
        self._started = True
        question = self.task.question
        if self.config.max_turns == 1:
            self._final_next = True
            question = f"{question}\n\n{FINAL_ANSWER_INSTRUCTION}"
        return [
            {"role": "system",
             "content": system_prompt(self.toolbox.schemas(), self.config.today or None,
                                      report=self.config.expect_report)},
            {"role": "user", "content": question},
        ]

    def force_final_answer(self) -> str:
        """Make the next turn the last one and return the instruction to show instead of the
        observation (the rollout calls this when the next context would overflow its budget)."""
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
            observation = render_correction(parsed.errors, self.toolbox.names)
        else:
            info, observation = await self._call_tool(turn, parsed)

        if self.turn >= self.config.max_turns - 1 or self._budget_spent():
            self._final_next = True
            return StepResult(FINAL_ANSWER_INSTRUCTION, False, replace(info, forced_final=True))
        return StepResult(observation, False, info)

    async def _call_tool(self, turn: int, parsed: ParsedTurn) -> tuple[StepInfo, str]:
        name = parsed.tool or ""
        limit = self.config.per_tool_budget.get(name)
        if limit is not None and self.tool_calls[name] >= limit:
            text = (f"[{name}] not run: this episode's budget of {limit} {name} calls is used up. "
                    "Use another tool or answer.")
            info = StepInfo(turn, parsed, tool=name, tool_ok=False, tool_error="budget")
            return info, render_tool_response(text)
        self.tool_calls[name] += 1
        started = time.monotonic()
        outcome = await self.toolbox.run(name, parsed.arguments)
        info = StepInfo(turn, parsed, tool=name, tool_ok=outcome.ok, tool_error=outcome.error,
                        tool_cached=outcome.cached, tool_seconds=time.monotonic() - started)
        return info, render_tool_response(outcome.text)

    def snapshot(self) -> dict[str, object]:
        """The state an episode checkpoint needs to continue this environment elsewhere (JSON)."""
        return {"turn": self.turn, "tool_calls": dict(self.tool_calls), "final_next": self._final_next}

    def restore(self, state: dict[str, object]) -> None:
        """Continue from :meth:`snapshot`'s state; call after ``reset()`` and before any ``step``."""
        if not self._started or self.turn:
            raise RuntimeError("restore() goes right after reset(), before any step()")
        turn, calls = state.get("turn"), state.get("tool_calls")
        if not isinstance(turn, int) or turn < 0 or not isinstance(calls, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in calls.items()):
            raise ValueError(f"not an environment snapshot: {state!r}")
        self.turn = turn
        self.tool_calls = Counter(calls)
        self._final_next = bool(state.get("final_next", False))

    def _budget_spent(self) -> bool:
        return sum(self.tool_calls.values()) >= self.tool_budget

    def _finish(self, turn: int, parsed: ParsedTurn, end: StopReason) -> StepResult:
        self._done = True
        return StepResult("", True, StepInfo(turn, parsed, end=end))

    async def close(self) -> None:
        # The toolbox is shared by the worker's episodes and closed by its owner, not here.
        self._closed = True


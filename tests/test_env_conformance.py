"""The Env contract (envs/env.py), checked the same way on every environment the loop can be given.

Parametrized over the built-in environments (``search_browse`` over test tools, ``calculator``) and
a user's own, loaded by import path (``tests.user_plugins:GuessEnv``, written on the bare contract).
Each case says how to build the environment and which action is a tool call it accepts; the checks
use nothing else: the first observation, misuse, hostile actions, the turn limit, the forced answer,
the checkpoint round trip and close.

A new environment joins by adding a case to :data:`CASES`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.hostile import HOSTILE_TURNS
from tests.tools_for_tests import EchoTool
from turnstile.envs.env import Env, EnvConfig, build_env, env_class
from turnstile.envs.protocol import StopReason, render_answer, render_tool_call
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig


@dataclass(frozen=True)
class Case:
    kind: str  # episode.env.kind
    task: Task
    tool_action: str  # a well-formed turn that calls one of the environment's tools

    def build(self, max_turns: int = 6) -> Env:
        toolbox = Toolbox([EchoTool("search"), EchoTool("visit")], ToolboxConfig(backoff_s=0.001))
        return build_env(self.task, toolbox, EnvConfig(kind=self.kind, max_turns=max_turns))


CASES = [
    Case("search_browse", Task(id="s", question="Who founded X?", answers=("Ada",)),
         render_tool_call("search", {"text": "founder of X"}, "search first")),
    Case("calculator", Task(id="c", question="What is 6 * 7?", answers=("42",)),
         render_tool_call("calculate", {"expression": "6 * 7"}, "compute")),
    Case("tests.user_plugins:GuessEnv", Task(id="g", question="Guess my number (1-10).", answers=("7",)),
         render_tool_call("guess", {"n": 5}, "halve the range")),
]
GARBAGE = ["", "no tags at all", "<answer>", "<think>x</think><tool_call>{not json}</tool_call>",
           "<think>x</think><tool_call>" + json.dumps({"name": "nope", "arguments": {}}) + "</tool_call>",
           "\x00\ud7ff" * 50, *HOSTILE_TURNS]

cases = pytest.mark.parametrize("case", CASES, ids=[case.kind for case in CASES])


async def started(case: Case, max_turns: int = 6) -> Env:
    env = case.build(max_turns)
    await env.reset()
    return env


@cases
def test_the_kind_loads_an_env_class(case: Case) -> None:
    assert issubclass(env_class(case.kind), Env)


def test_an_unknown_kind_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown env.kind 'serch_browse'; known: .*calculator.*search_browse"):
        env_class("serch_browse")
    with pytest.raises(ValueError, match="not an Env class"):
        env_class("tests.user_plugins:three_questions")


@cases
async def test_reset_gives_chat_messages_once(case: Case) -> None:
    env = case.build()
    with pytest.raises(RuntimeError):
        await env.step(case.tool_action)  # before reset
    messages = await env.reset()
    assert messages and all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
    assert messages[-1]["role"] == "user" and case.task.question in messages[-1]["content"]
    with pytest.raises(RuntimeError):
        await env.reset()


@cases
async def test_a_tool_call_continues_and_an_answer_ends(case: Case) -> None:
    env = await started(case)
    result = await env.step(case.tool_action)
    assert not result.done and result.observation and result.info.format_ok and result.info.turn == 0
    final = await env.step(render_answer(case.task.answers[0], "done"))
    assert final.done and final.info.end is StopReason.ANSWERED and final.info.answer == case.task.answers[0]
    with pytest.raises(RuntimeError):
        await env.step(case.tool_action)  # after the end
    await env.close()
    await env.close()  # twice is fine


@cases
async def test_hostile_actions_get_observations_and_the_turn_limit_holds(case: Case) -> None:
    max_turns = 4
    for action in GARBAGE:
        env = await started(case, max_turns)
        for _ in range(max_turns):
            result = await env.step(action)
            assert isinstance(result.observation, str)
            if result.done:
                break
        assert result.done, f"{case.kind} did not end within {max_turns} turns"
        assert result.info.end in (StopReason.NO_ANSWER, StopReason.MALFORMED_ANSWER)


@cases
async def test_the_last_turn_is_forced_to_answer(case: Case) -> None:
    env = await started(case, max_turns=3)
    results = [await env.step(case.tool_action) for _ in range(2)]
    assert not results[0].done and not results[1].done and results[1].info.forced_final
    last = await env.step(case.tool_action)
    assert last.done and last.info.end is StopReason.NO_ANSWER


@cases
async def test_force_final_answer_makes_the_next_turn_the_last(case: Case) -> None:
    env = await started(case)
    await env.step(case.tool_action)
    instruction = env.force_final_answer()
    assert isinstance(instruction, str) and instruction
    result = await env.step(case.tool_action)
    assert result.done and result.info.end is StopReason.NO_ANSWER
    answered = await started(case)
    answered.force_final_answer()
    assert (await answered.step(render_answer("x", "guess"))).info.end is StopReason.ANSWERED


@cases
async def test_a_snapshot_continues_on_a_fresh_env(case: Case) -> None:
    max_turns = 4
    original = await started(case, max_turns)
    for _ in range(2):
        await original.step(case.tool_action)
    state = json.loads(json.dumps(original.snapshot()))  # JSON, as a checkpoint stores it
    copy = await started(case, max_turns)
    copy.restore(state)
    for env in (original, copy):  # both allow the same turns, with the same index, and then end
        result = await env.step(case.tool_action)
        assert result.info.turn == 2 and not result.done and result.info.forced_final
        assert (await env.step(case.tool_action)).done
    forced = await started(case)
    forced.force_final_answer()
    resumed = await started(case)
    resumed.restore(json.loads(json.dumps(forced.snapshot())))
    assert (await resumed.step(case.tool_action)).done  # the forced answer survives the checkpoint


@cases
async def test_restore_refuses_what_it_cannot_use(case: Case) -> None:
    env = await started(case)
    with pytest.raises(ValueError):
        env.restore({"turn": "three"})
    await env.step(case.tool_action)
    with pytest.raises(RuntimeError):
        env.restore(env.snapshot())  # only right after reset

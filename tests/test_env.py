"""SearchBrowseEnv: the protocol loop, corrective observations, forced answer, budgets, misuse."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tools_for_tests import EchoTool, FlakyTool
from turnstile.envs.env import EnvConfig, SearchBrowseEnv
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, StopReason, render_answer, render_tool_call
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import ToolError
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig

TASK = Task(id="t1", question="Who?", answers=("Ada",))


def make_env(config: EnvConfig | None = None, tools: list | None = None) -> SearchBrowseEnv:
    box = Toolbox(tools or [EchoTool("search"), EchoTool("visit")], ToolboxConfig(backoff_s=0.001))
    return SearchBrowseEnv(TASK, box, config)


def call(tool: str = "search", text: str = "hi") -> str:
    return render_tool_call(tool, {"text": text}, "thinking")


async def test_reset_gives_system_and_question() -> None:
    env = make_env()
    messages = await env.reset()
    assert [m["role"] for m in messages] == ["system", "user"]
    assert '"name": "search"' in messages[0]["content"] and messages[1]["content"] == "Who?"
    assert "<report>" not in messages[0]["content"]
    report_env = make_env(EnvConfig(expect_report=True))
    assert "<report></report>" in (await report_env.reset())[0]["content"]


async def test_tool_turn_then_answer() -> None:
    env = make_env()
    await env.reset()
    result = await env.step(call("search", "abc"))
    assert not result.done and result.info.format_ok and result.info.tool == "search"
    assert result.observation == "<tool_response>\necho: abc\n</tool_response>"
    final = await env.step(render_answer("Ada", "done"))
    assert final.done and final.info.end is StopReason.ANSWERED and final.info.answer == "Ada"
    assert final.observation == ""


async def test_malformed_turn_gets_correction_and_no_tool() -> None:
    env = make_env()
    await env.reset()
    result = await env.step("I will search now")
    assert not result.done and not result.info.format_ok and result.info.tool is None
    assert result.observation.startswith("<tool_response>") and "<think>" in result.observation


async def test_malformed_answer_ends_episode() -> None:
    env = make_env()
    await env.reset()
    result = await env.step("<think>x</think>The answer is <answer>Ada</answer>")
    assert result.done and result.info.end is StopReason.MALFORMED_ANSWER and not result.info.format_ok


async def test_last_allowed_turn_gets_forced_answer_instruction() -> None:
    env = make_env(EnvConfig(max_turns=3))
    await env.reset()
    first = await env.step(call())
    assert not first.info.forced_final
    second = await env.step(call())
    assert second.info.forced_final and second.observation == FINAL_ANSWER_INSTRUCTION
    third = await env.step(call())  # ignores the instruction
    assert third.done and third.info.end is StopReason.NO_ANSWER and third.info.tool is None
    with pytest.raises(RuntimeError, match="episode is over"):
        await env.step(call())


async def test_single_turn_episode_asks_for_answer_up_front() -> None:
    env = make_env(EnvConfig(max_turns=1))
    messages = await env.reset()
    assert FINAL_ANSWER_INSTRUCTION in messages[-1]["content"]
    assert (await env.step(render_answer("Ada", "x"))).info.end is StopReason.ANSWERED


async def test_overflow_forces_final_answer() -> None:
    env = make_env()
    await env.reset()
    await env.step(call())
    assert env.force_final_answer() == FINAL_ANSWER_INSTRUCTION
    result = await env.step(call())
    assert result.done and result.info.end is StopReason.NO_ANSWER


async def test_total_tool_budget() -> None:
    env = make_env(EnvConfig(tool_budget=2))
    await env.reset()
    assert not (await env.step(call())).info.forced_final
    spent = await env.step(call())
    assert spent.info.forced_final and spent.observation == FINAL_ANSWER_INSTRUCTION
    assert (await env.step(render_answer("Ada", "x"))).info.end is StopReason.ANSWERED


async def test_per_tool_budget() -> None:
    visit = EchoTool("visit")
    env = make_env(EnvConfig(per_tool_budget={"visit": 1}), [EchoTool("search"), visit])
    await env.reset()
    await env.step(call("visit"))
    refused = await env.step(call("visit"))
    assert refused.info.tool_error == "budget" and "budget of 1 visit calls" in refused.observation
    assert visit.calls == 1
    assert (await env.step(call("search"))).info.tool_ok


def test_per_tool_budget_must_name_real_tools() -> None:
    with pytest.raises(ValueError, match="unknown tools"):
        make_env(EnvConfig(per_tool_budget={"browse": 1}))


async def test_tool_failure_is_an_observation() -> None:
    flaky = FlakyTool("visit", failures=10, error=ToolError("timeout", "slow", retryable=True))
    env = make_env(tools=[EchoTool("search"), flaky])
    await env.reset()
    result = await env.step(call("visit"))
    assert not result.done and result.info.tool_ok is False and result.info.tool_error == "timeout"
    assert "[visit] failed" in result.observation


async def test_misuse_raises() -> None:
    env = make_env()
    with pytest.raises(RuntimeError, match="reset"):
        await env.step(call())
    await env.reset()
    with pytest.raises(RuntimeError, match="single use"):
        await env.reset()
    await env.close()
    await env.close()


TURN_PARTS = st.sampled_from([
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<tool_response>",
    '{"name": "search", "arguments": {"text": "q"}}', '{"name": "visit"', '"arguments": 5}', "{",
    "}", "\n", "Ada", '{"name": "nope", "arguments": {}}', '{"name": "search", "arguments": {"text": 1}}',
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.one_of(TURN_PARTS, st.text(max_size=6)), max_size=12).map("".join),
                min_size=1, max_size=6))
def test_generated_turns_never_raise(turns: list[str]) -> None:
    async def episode() -> None:
        env = make_env(EnvConfig(max_turns=4))
        await env.reset()
        for text in turns:
            result = await env.step(text)
            assert isinstance(result.observation, str)
            assert result.info.format_ok == (not result.info.parsed.errors)
            if result.done:
                assert result.info.end is not None
                break
        await env.close()

    asyncio.run(episode())


# ---- hostile output against the real tools (the search index, the cache) -------------------------

HOSTILE_CALLS = [
    '{"name": "search", "arguments": {"query": "\\ud800"}}',  # escaped lone surrogate
    '{"name": "search", "arguments": {"query": ["a\\u0000b", "\\u0000"]}}',  # NUL
    '{"name": "search", "arguments": {"query": ' + "[" * 1000 + "]" * 1000 + "}}",
    "[" * 100_000,
    "{'name': 'search', 'arguments': {'query': '" + "q" * 1_000_000 + "'}}",  # 1 MB only json5 reads
    '{"name": "visit", "arguments": {"url": "http://\\ud800.example/", "goal": "\\udfff"}}',
    '{"name": "search", "arguments": {"query": "' + "\\u00e9" * 5000 + '"}}',
]


@pytest.mark.parametrize("body", HOSTILE_CALLS, ids=range(len(HOSTILE_CALLS)))
def test_hostile_calls_get_an_observation_from_the_real_tools(toolbox, body: str) -> None:  # noqa: ANN001
    async def episode() -> None:
        env = SearchBrowseEnv(TASK, toolbox, EnvConfig(max_turns=4))
        await env.reset()
        result = await env.step(f"<think>t</think>\n<tool_call>\n{body}\n</tool_call>")
        assert not result.done and result.observation.startswith("<tool_response>")
        result.observation.encode("utf-8")
        if not result.info.format_ok:
            assert "could not be executed" in result.observation
        following = await env.step(render_tool_call("search", {"query": ["Ada"]}, "again"))
        assert following.info.format_ok and following.info.tool == "search"

    asyncio.run(episode())


def test_cache_key_of_unencodable_arguments_is_stable() -> None:
    from turnstile.envs.tools.cache import cache_key

    assert cache_key("search", {"query": "\ud800"}) == cache_key("search", {"query": "\ud800"})
    assert cache_key("search", {"query": "\ud800"}) != cache_key("search", {"query": "\udfff"})


def test_tool_call_size_limit_is_a_setting() -> None:
    async def episode() -> str:
        env = make_env(EnvConfig(max_tool_call_chars=64))
        await env.reset()
        return (await env.step(call(text="x" * 100))).observation

    assert "at most 64" in asyncio.run(episode())
    with pytest.raises(ValueError, match="max_tool_call_chars=10 must be >= 64"):
        EnvConfig(max_tool_call_chars=10)


async def test_an_agent_that_repeats_itself_is_warned_then_stopped() -> None:
    """stall_turns=2: the repeats of a call count (" hi " is "hi" once normalised), a new call resets
    the count; the second repeat in a row gets the warning, the fourth ends the episode stalled."""
    env = make_env(EnvConfig(stall_turns=2))
    await env.reset()
    assert "[note]" not in (await env.step(call("search", "hi"))).observation
    assert "[note]" not in (await env.step(call("search", " hi "))).observation  # 1 stale
    assert "[note]" not in (await env.step(call("search", "new"))).observation  # something new: 0
    assert "[note]" not in (await env.step(call("search", "hi"))).observation  # 1
    warned = await env.step(call("search", "new"))  # 2: warned
    assert not warned.done and "Your last 2 tool calls brought nothing new" in warned.observation
    assert warned.observation.endswith("</tool_response>")  # the warning is inside the response
    assert not (await env.step(call("search", "hi"))).done  # 3
    stalled = await env.step(call("search", "hi"))  # 4 = 2 x stall_turns
    assert stalled.done and stalled.info.end is StopReason.STALLED and stalled.observation == ""


async def test_a_result_already_seen_is_nothing_new_and_the_count_survives_a_checkpoint() -> None:
    env = make_env(EnvConfig(stall_turns=2), tools=[EchoTool("search"), EchoTool("visit")])
    await env.reset()
    await env.step(call("search", "x"))
    await env.step(call("visit", "x"))  # another call, the same text back: 1 stale
    snapshot = env.snapshot()
    resumed = make_env(EnvConfig(stall_turns=2))
    await resumed.reset()
    resumed.restore(snapshot)
    assert "[note]" in (await resumed.step(call("search", "x"))).observation  # 2, counted across the restore
    off = make_env(EnvConfig(stall_turns=0, max_turns=50))
    await off.reset()
    assert not any([(await off.step(call())).done for _ in range(20)])  # 0: never
    with pytest.raises(ValueError, match="stall_turns"):
        EnvConfig(stall_turns=-1)


async def test_retrying_an_outage_is_not_a_stall_and_repeating_a_refused_call_is() -> None:
    """A call the environment failed neither counts nor resets (retrying a time-out is sensible);
    a call that failed by the policy's doing counts as nothing new."""
    down = FlakyTool("visit", failures=5, error=ToolError("timeout", "no answer"))
    env = SearchBrowseEnv(TASK, Toolbox([EchoTool("search"), down], ToolboxConfig(max_attempts=1)),
                          EnvConfig(stall_turns=2))
    await env.reset()
    await env.step(call("search", "a"))
    await env.step(call("search", "a"))  # 1 stale
    for _ in range(5):  # the outage: neither counted (no warning) nor reset (see below)
        assert "[note]" not in (await env.step(call("visit", "page"))).observation
    assert "Your last 2 tool calls" in (await env.step(call("search", "a"))).observation  # 2
    assert "[note]" not in (await env.step(call("visit", "page"))).observation  # it works now: new, 0
    refused = FlakyTool("visit", failures=99, error=ToolError("blocked", "private address"))
    env = make_env(EnvConfig(stall_turns=2), tools=[EchoTool("search"), refused])
    await env.reset()
    await env.step(call("visit", "http://10.0.0.1/"))  # refused: nothing new, 1
    assert "Your last 2 tool calls" in (await env.step(call("visit", "http://10.0.0.2/"))).observation

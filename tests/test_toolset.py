"""The real tool set end to end: HotpotQA paragraphs served over loopback HTTP, searched with the
local index and read with the visit tool, inside SearchBrowseEnv."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.envs.corpus_server import CorpusServer
from turnstile.envs.datasets.hotpotqa import HotpotQA, read_hotpotqa
from turnstile.envs.env import EnvConfig, SearchBrowseEnv
from turnstile.envs.protocol import StopReason, render_answer, render_tool_call
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.toolset import ToolsConfig, build_toolbox

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hotpot(shared_data: Path) -> HotpotQA:
    return read_hotpotqa(shared_data / "multihop" / "hotpotqa_dev500.jsonl", "http://placeholder/wiki/")


@pytest.fixture(scope="module")
def server(hotpot: HotpotQA) -> Iterator[CorpusServer]:
    with CorpusServer(hotpot.corpus) as running:
        yield running


@pytest.fixture
async def toolbox(server: CorpusServer) -> AsyncIterator[Toolbox]:
    host = urlsplit(server.base_url).netloc
    box = build_toolbox(ToolsConfig(), server.documents(), allow_hosts=[host])
    yield box
    await box.aclose()


async def test_search_visit_answer_through_real_http(hotpot: HotpotQA, toolbox: Toolbox) -> None:
    task = hotpot.tasks[0]  # Corliss Archer -> Shirley Temple -> Chief of Protocol
    env = SearchBrowseEnv(task, toolbox)
    await env.reset()
    found = await env.step(render_tool_call("search", {"query": "Shirley Temple"}, "who is she"))
    assert found.info.tool_ok, found.observation
    url = re.search(r"\]\((http[^)]+)\)", found.observation).group(1)  # type: ignore[union-attr]
    assert url.endswith("/wiki/Shirley_Temple")
    page = await env.step(render_tool_call("visit", {"url": url, "goal": "positions held"}, "read"))
    assert page.info.tool_ok and "Chief of Protocol" in page.observation
    again = await env.step(render_tool_call("visit", {"url": [url], "goal": "positions held"}, "again"))
    assert again.info.tool_cached
    done = await env.step(render_answer("Chief of Protocol", "found"))
    assert done.info.end is StopReason.ANSWERED


async def test_ssrf_guard_still_refuses_other_loopback_ports(hotpot: HotpotQA, toolbox: Toolbox) -> None:
    env = SearchBrowseEnv(hotpot.tasks[1], toolbox)
    await env.reset()
    result = await env.step(render_tool_call("visit", {"url": "http://127.0.0.1:1/", "goal": "x"}, "t"))
    assert result.info.tool_ok is False and result.info.tool_error == "blocked"
    assert "allow" in result.observation


TURNS = st.sampled_from([
    '<think>a</think>\n<tool_call>\n{"name": "search", "arguments": {"query": ["Shirley Temple"]}}\n</tool_call>',
    '<think>a</think>\n<tool_call>\n{"name": "search", "arguments": {"query": []}}\n</tool_call>',
    '<think>a</think>\n<tool_call>\n{"name": "visit", "arguments": {"url": "ftp://x", "goal": "g"}}\n</tool_call>',
    '<think>a</think>\n<tool_call>\n{"name": "visit", "arguments": {"url": "http://10.0.0.1/", "goal": "g"}}\n</tool_call>',  # noqa: E501
    '<think>a</think>\n<tool_call>\n{"name": "visit", "arguments": {"goal": 5}}\n</tool_call>',
    '<think>a</think>\n<tool_call>\n{"name": "browse", "arguments": {}}\n</tool_call>',
    "<think>a</think><tool_call>{", "<answer>x</answer>", "", "<think>", "</think></think>",
])


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(TURNS, st.text(max_size=20)), min_size=1, max_size=5))
def test_generated_turns_never_raise_with_real_tools(hotpot: HotpotQA, server: CorpusServer,
                                                      turns: list[str]) -> None:
    import asyncio

    async def episode() -> None:
        box = build_toolbox(ToolsConfig(), server.documents(),
                            allow_hosts=[urlsplit(server.base_url).netloc])
        env = SearchBrowseEnv(hotpot.tasks[2], box, EnvConfig(max_turns=4))
        await env.reset()
        try:
            for text in turns:
                result = await env.step(text)
                assert isinstance(result.observation, str)
                if result.done:
                    break
        finally:
            await box.aclose()

    asyncio.run(episode())

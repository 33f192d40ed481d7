"""LLM extractor against a real chat-completions server on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.tools.base import ToolError
from turnstile.envs.visit.summarize import ExtractorConfig, LlmExtractor, parse_reply

pytestmark = pytest.mark.integration

GOOD = {"rational": "the page names the cape", "evidence": "42 ships passed the cape.",
        "summary": "Forty-two ships."}


class ChatServer(QuietHandler):
    """Answers each POST with the next scripted (status, content) and records the requests."""

    script: ClassVar[list[tuple[int, str]]] = []
    requests: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body,
                                    "auth": self.headers.get("Authorization")})
        status, content = type(self).script.pop(0)
        reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
        self.send_body(status, json.dumps(reply).encode(), content_type="application/json")


@pytest.fixture
def chat() -> Iterator[str]:
    ChatServer.requests = []
    with serve(ChatServer) as base:
        yield f"{base}/v1"


def extractor(base_url: str, **overrides: object) -> LlmExtractor:
    config = ExtractorConfig(enabled=True, base_url=base_url, model="tiny", backoff_s=0.01,
                             api_key_env="TURNSTILE_TEST_KEY", **overrides)  # type: ignore[arg-type]
    return LlmExtractor(config)


async def test_good_json(chat: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_TEST_KEY", "sk-test")
    ChatServer.script = [(200, json.dumps(GOOD))]
    client = extractor(chat)
    result = await client.extract("https://x.test/a", "how many ships?", "page text about ships")
    await client.aclose()
    assert result is not None and result.evidence == GOOD["evidence"]
    assert result.summary == GOOD["summary"]
    request = ChatServer.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert isinstance(body, dict) and body["model"] == "tiny"
    assert "how many ships?" in body["messages"][0]["content"]
    assert "page text about ships" in body["messages"][0]["content"]


async def test_fenced_json5(chat: str) -> None:
    ChatServer.script = [(200, "Sure!\n```json\n{evidence: 'a, b', summary: 'c', rational: 'r',}\n```")]
    client = extractor(chat)
    result = await client.extract("https://x.test/a", "goal", "text")
    await client.aclose()
    assert result is not None and (result.evidence, result.summary) == ("a, b", "c")


async def test_garbage_reply_returns_none(chat: str) -> None:
    ChatServer.script = [(200, "I cannot help with that.")]
    client = extractor(chat)
    assert await client.extract("https://x.test/a", "goal", "text") is None
    await client.aclose()


async def test_500_then_success_retries(chat: str) -> None:
    ChatServer.script = [(500, ""), (503, ""), (200, json.dumps(GOOD))]
    client = extractor(chat, max_attempts=3)
    result = await client.extract("https://x.test/a", "goal", "text")
    await client.aclose()
    assert result is not None and len(ChatServer.requests) == 3


async def test_gives_up_after_max_attempts(chat: str) -> None:
    ChatServer.script = [(500, "")] * 5
    client = extractor(chat, max_attempts=2)
    with pytest.raises(ToolError) as caught:
        await client.extract("https://x.test/a", "goal", "text")
    await client.aclose()
    # The client retried; the toolbox must not retry on top of it (one retry layer).
    assert caught.value.kind == "extractor_unavailable" and not caught.value.retryable
    assert len(ChatServer.requests) == 2


async def test_client_error_is_not_retried(chat: str) -> None:
    ChatServer.script = [(400, "bad model")] * 3
    client = extractor(chat)
    with pytest.raises(ToolError) as caught:
        await client.extract("https://x.test/a", "goal", "text")
    await client.aclose()
    assert caught.value.kind == "extractor" and not caught.value.retryable
    assert len(ChatServer.requests) == 1


def test_parse_reply_variants() -> None:
    assert parse_reply('{"evidence": ["a", "b"], "summary": "s"}').evidence == "a\nb"  # type: ignore[union-attr]
    assert parse_reply('{"rational": "only this"}') is None
    assert parse_reply("[1, 2]") is None
    assert parse_reply("") is None


def test_enabled_without_model_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"visit.extractor.model"):
        LlmExtractor(ExtractorConfig(enabled=True))


def test_retries_that_cannot_fit_the_toolbox_timeout_are_refused() -> None:
    from turnstile.envs.tools.toolbox import ToolboxConfig
    from turnstile.envs.toolset import ToolsConfig, build_toolbox
    from turnstile.envs.visit.tool import VisitConfig

    slow = ExtractorConfig(enabled=True, model="m", timeout_s=40.0, max_attempts=2, backoff_s=1.0)
    assert slow.worst_case_s() == 81.0
    config = ToolsConfig(visit=VisitConfig(extractor=slow), toolbox=ToolboxConfig(timeout_s=60.0))
    with pytest.raises(ValueError, match=r"visit.extractor .* 81 s .* toolbox.timeout_s=60"):
        build_toolbox(config, documents=[])

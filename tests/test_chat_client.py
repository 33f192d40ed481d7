"""The OpenAI-compatible chat client against a real local server: replies, retries, timeouts, the
concurrency limit and the cache."""

from __future__ import annotations

import asyncio

import pytest

from tests.openai_server import Reply, chat_server, replies_in_order
from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage, ChatUnavailable


def client_for(base_url: str, **options: float | str) -> ChatClient:
    config = ChatClientConfig(base_url=base_url, model="judge-test", api_key_env="", backoff_s=0.01,
                              backoff_max_s=0.02, **options)  # type: ignore[arg-type]
    return ChatClient(config)


def ask(text: str) -> list[ChatMessage]:
    return [ChatMessage("user", text)]


async def test_reply_and_request_body() -> None:
    with chat_server(replies_in_order(["hello"])) as server:
        client = client_for(server.base_url, temperature=0.05, max_tokens=64)
        assert await client.complete(ask("hi")) == "hello"
        await client.aclose()
    (body,) = server.log.requests
    assert body["model"] == "judge-test" and body["temperature"] == 0.05 and body["max_tokens"] == 64
    assert body["messages"] == [{"role": "user", "content": "hi"}]


async def test_server_errors_are_retried_then_succeed() -> None:
    script = [Reply("overloaded", status=500), Reply("busy", status=429), Reply("fine")]
    with chat_server(replies_in_order(script)) as server:
        client = client_for(server.base_url)
        assert await client.complete(ask("x")) == "fine"
        await client.aclose()
    assert server.log.count == 3
    assert client.stats.retries == 2 and client.stats.errors == {"http_500": 1, "http_429": 1}


async def test_retries_are_capped() -> None:
    with chat_server(replies_in_order([], then=Reply("down", status=503))) as server:
        client = client_for(server.base_url, max_attempts=3)
        with pytest.raises(ChatUnavailable, match=r"after 3 attempts.*http_503"):
            await client.complete(ask("x"))
        await client.aclose()
    assert server.log.count == 3 and client.stats.failures == 1


async def test_a_client_error_is_not_retried() -> None:
    with chat_server(replies_in_order([Reply("no such model", status=404)])) as server:
        client = client_for(server.base_url)
        with pytest.raises(ChatUnavailable, match=r"answered 404.*client.model"):
            await client.complete(ask("x"))
        await client.aclose()
    assert server.log.count == 1


async def test_timeouts_are_retried_and_bounded() -> None:
    slow = Reply("late", delay_s=1.0)
    with chat_server(replies_in_order([slow, "quick"])) as server:
        client = client_for(server.base_url, timeout_s=0.2, max_attempts=2)
        assert await client.complete(ask("x")) == "quick"
        assert client.stats.errors == {"timeout": 1}
        await client.aclose()
    with chat_server(replies_in_order([], then=slow)) as server:
        client = client_for(server.base_url, timeout_s=0.2, max_attempts=2)
        with pytest.raises(ChatUnavailable, match="timeout"):
            await client.complete(ask("x"))
        await client.aclose()


async def test_concurrency_limit_is_honoured() -> None:
    with chat_server(lambda messages: Reply(messages[0]["content"], delay_s=0.15)) as server:
        client = client_for(server.base_url, max_concurrency=2)
        replies = await asyncio.gather(*(client.complete(ask(f"q{i}")) for i in range(8)))
        await client.aclose()
    assert replies == [f"q{i}" for i in range(8)]
    assert server.log.max_in_flight == 2


async def test_the_same_request_is_sent_once() -> None:
    with chat_server(lambda _messages: Reply("same", delay_s=0.1)) as server:
        client = client_for(server.base_url)
        first = await asyncio.gather(*(client.complete(ask("q")) for _ in range(5)))  # in flight
        again = await client.complete(ask("q"))  # cached
        other = await client.complete(ask("q"), temperature=0.1)  # another request
        await client.aclose()
    assert first == ["same"] * 5 and again == other == "same"
    assert server.log.count == 2 and client.stats.cache_hits == 5


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match=r"client.model is empty"):
        ChatClient(ChatClientConfig())
    with pytest.raises(ValueError, match="max_attempts"):
        ChatClientConfig(max_attempts=0)

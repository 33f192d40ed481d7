"""The Serper client against a real local HTTP server speaking Serper's protocol."""

from __future__ import annotations

import json
import pickle
import socket
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.search.base import SearchBackend, SearchHit
from turnstile.envs.search.serper import SerperConfig, SerperSearch
from turnstile.envs.tools.base import Fault, ToolError

KEY_ENV = "TURNSTILE_TEST_SERPER_KEY"
ORGANIC = [
    {"title": "Varny Bridge - Wikipedia", "link": "https://en.wikipedia.org/wiki/Varny_Bridge",
     "snippet": "Varny Bridge is a bridge.", "position": 1},
    {"title": "No snippet here", "link": "https://example.org/b", "position": 2},
    {"title": "No link, skipped", "snippet": "x"},
    {"title": "Third", "link": "https://example.org/c", "snippet": "c", "position": 3},
]


class SerperHandler(QuietHandler):
    """Answers by query: the query text picks the behaviour under test."""

    requests: ClassVar[list[tuple[dict[str, str], object]]] = []

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SerperHandler.requests.append((dict(self.headers), body))
        if self.path != "/search":
            self.send_body(404, b"not found")
            return
        query = body["q"]
        if query.startswith("status "):
            self.send_body(int(query.split()[1]), b'{"message": "nope"}', "application/json")
        elif query == "sleep":
            time.sleep(1.0)
            try:
                self.send_body(200, b'{"organic": []}', "application/json")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting, as the test wants
        elif query == "garbage":
            self.send_body(200, b"<html>not json", "application/json")
        elif query == "wrong shape":
            self.send_body(200, b'{"organic": "many"}', "application/json")
        elif query == "nothing":
            self.send_body(200, b'{"searchParameters": {}}', "application/json")
        else:
            self.send_body(200, json.dumps({"organic": ORGANIC}).encode(), "application/json")


@pytest.fixture(scope="module")
def serper_url() -> Iterator[str]:
    with serve(SerperHandler) as url:
        yield url


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, "secret-key")
    return "secret-key"


def client(base_url: str, timeout_s: float = 5.0) -> SerperSearch:
    return SerperSearch(SerperConfig(base_url=base_url, api_key_env=KEY_ENV, timeout_s=timeout_s))


def test_missing_api_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=KEY_ENV):
        client("http://127.0.0.1:1")
    monkeypatch.setenv(KEY_ENV, "  ")
    with pytest.raises(ValueError, match=KEY_ENV):
        client("http://127.0.0.1:1")


@pytest.mark.integration
async def test_search_sends_key_and_parses_organic(serper_url: str, api_key: str) -> None:
    backend = client(serper_url + "/")
    assert isinstance(backend, SearchBackend)
    SerperHandler.requests.clear()
    hits = await backend.search("varny bridge", 10)
    headers, body = SerperHandler.requests[-1]
    assert headers["X-API-KEY"] == api_key
    assert body == {"q": "varny bridge", "num": 10}
    assert hits == [
        SearchHit("Varny Bridge - Wikipedia", "https://en.wikipedia.org/wiki/Varny_Bridge",
                  "Varny Bridge is a bridge."),
        SearchHit("No snippet here", "https://example.org/b", ""),
        SearchHit("Third", "https://example.org/c", "c"),
    ]
    assert len(await backend.search("varny bridge", 2)) == 2
    assert await backend.search("nothing", 5) == []
    await backend.aclose()
    await backend.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("status, retryable", [(429, True), (500, True), (503, True),
                                               (400, False), (401, False), (403, False), (404, False)])
async def test_http_status_errors(serper_url: str, api_key: str, status: int, retryable: bool) -> None:
    backend = client(serper_url)
    with pytest.raises(ToolError) as info:
        await backend.search(f"status {status}", 5)
    assert info.value.kind == "http_status"
    assert info.value.retryable is retryable
    assert str(status) in info.value.message
    # the service's trouble (overload, failure, a refused key) is the environment's; a bad request the policy's
    assert info.value.fault is (Fault.policy if status in (400, 404) else Fault.environment)
    await backend.aclose()


@pytest.mark.integration
async def test_timeout_is_retryable(serper_url: str, api_key: str) -> None:
    backend = client(serper_url, timeout_s=0.2)
    with pytest.raises(ToolError) as info:
        await backend.search("sleep", 5)
    assert (info.value.kind, info.value.retryable) == ("timeout", True)
    await backend.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("query", ["garbage", "wrong shape"])
async def test_malformed_answer_is_bad_response(serper_url: str, api_key: str, query: str) -> None:
    backend = client(serper_url)
    with pytest.raises(ToolError) as info:
        await backend.search(query, 5)
    assert (info.value.kind, info.value.retryable) == ("bad_response", False)
    await backend.aclose()


async def test_unreachable_server_is_retryable(api_key: str) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = client(f"http://127.0.0.1:{port}")
    with pytest.raises(ToolError) as info:
        await backend.search("anything", 5)
    assert (info.value.kind, info.value.retryable) == ("network", True)
    await backend.aclose()


@pytest.mark.integration
async def test_pickled_backend_works_after_use(serper_url: str, api_key: str) -> None:
    backend = client(serper_url)
    await backend.search("varny", 1)
    copy = pickle.loads(pickle.dumps(backend))
    assert len(await copy.search("varny", 1)) == 1
    await backend.aclose()
    await copy.aclose()

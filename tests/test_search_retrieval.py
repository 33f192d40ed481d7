"""The retrieval-server client against a real local HTTP server speaking the Search-R1 protocol."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.search.base import SearchBackend, SearchHit
from turnstile.envs.search.retrieval import RetrievalServerConfig, RetrievalServerSearch
from turnstile.envs.tools.base import ToolError

LONG_BODY = "word " * 200

ANSWERS: dict[str, object] = {
    "contents": {"result": [[
        {"document": {"id": "123", "contents": '"Varny Bridge"\nVarny Bridge is a bridge over the river.'},
         "score": 0.91},
        {"document": {"id": "9", "contents": f'"Long Page"\n{LONG_BODY}'}, "score": 0.5},
    ]]},
    "fields": {"result": [[
        {"document": {"id": "x1", "title": "Morton Castle", "text": "A castle.",
                      "url": "https://example.org/mc"}, "score": 3.0},
    ]]},
    "unwrapped": {"result": [[{"id": "7", "contents": "Plain Title\nBody text."}]]},
    "empty": {"result": [[]]},
    "no result": {"hits": []},
    "bad document": {"result": [[{"document": {"id": "1"}, "score": 1.0}]]},
}


class RetrievalHandler(QuietHandler):
    requests: ClassVar[list[tuple[str, object]]] = []

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RetrievalHandler.requests.append((self.path, body))
        query = body["queries"][0]
        if query.startswith("status "):
            self.send_body(int(query.split()[1]), b'{"detail": "no"}', "application/json")
        elif query == "sleep":
            time.sleep(1.0)
            try:
                self.send_body(200, b'{"result": [[]]}', "application/json")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting, as the test wants
        elif query == "garbage":
            self.send_body(200, b"Internal thing{", "application/json")
        else:
            self.send_body(200, json.dumps(ANSWERS[query]).encode(), "application/json")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with serve(RetrievalHandler) as url:
        yield url


def client(server_url: str, timeout_s: float = 5.0) -> RetrievalServerSearch:
    return RetrievalServerSearch(RetrievalServerConfig(url=f"{server_url}/retrieve", url_scheme="wiki://",
                                                       timeout_s=timeout_s))


@pytest.mark.integration
async def test_contents_format_and_request_payload(server_url: str) -> None:
    backend = client(server_url)
    assert isinstance(backend, SearchBackend)
    RetrievalHandler.requests.clear()
    hits = await backend.search("contents", 3)
    payload = {"queries": ["contents"], "topk": 3, "return_scores": True}
    assert RetrievalHandler.requests[-1] == ("/retrieve", payload)
    assert hits[0] == SearchHit("Varny Bridge", "wiki://123", "Varny Bridge is a bridge over the river.")
    assert hits[1].title == "Long Page" and hits[1].url == "wiki://9"
    assert hits[1].snippet.endswith("…") and len(hits[1].snippet) <= 301
    assert len(await backend.search("contents", 1)) == 1
    await backend.aclose()
    await backend.aclose()


@pytest.mark.integration
async def test_title_text_fields_url_and_unwrapped_documents(server_url: str) -> None:
    backend = client(server_url)
    castle = SearchHit("Morton Castle", "https://example.org/mc", "A castle.")
    assert await backend.search("fields", 3) == [castle]
    assert await backend.search("unwrapped", 3) == [SearchHit("Plain Title", "wiki://7", "Body text.")]
    assert await backend.search("empty", 3) == []
    await backend.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("query", ["garbage", "no result", "bad document"])
async def test_malformed_answers_are_bad_response(server_url: str, query: str) -> None:
    backend = client(server_url)
    with pytest.raises(ToolError) as info:
        await backend.search(query, 3)
    assert (info.value.kind, info.value.retryable) == ("bad_response", False)
    await backend.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("status, retryable", [(429, True), (502, True), (422, False)])
async def test_status_errors(server_url: str, status: int, retryable: bool) -> None:
    backend = client(server_url)
    with pytest.raises(ToolError) as info:
        await backend.search(f"status {status}", 3)
    assert info.value.retryable is retryable
    await backend.aclose()


@pytest.mark.integration
async def test_timeout_is_retryable(server_url: str) -> None:
    backend = client(server_url, timeout_s=0.2)
    with pytest.raises(ToolError) as info:
        await backend.search("sleep", 3)
    assert (info.value.kind, info.value.retryable) == ("timeout", True)
    await backend.aclose()


@pytest.mark.integration
async def test_pickle_round_trip(server_url: str) -> None:
    backend = client(server_url)
    await backend.search("fields", 1)
    copy = pickle.loads(pickle.dumps(backend))
    assert len(await copy.search("fields", 1)) == 1
    await backend.aclose()
    await copy.aclose()

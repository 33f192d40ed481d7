"""The corpus server over real HTTP on loopback: pages, plain-text documents, 404, HEAD, load."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from turnstile.cluster.cli.commands import serve_corpus
from turnstile.envs.corpus_server import CorpusServer, CorpusServerConfig, page_path
from turnstile.envs.search.base import Document

pytestmark = pytest.mark.integration

DOCS = [
    Document("alpha", "Alpha page", "unused", "", html="<html><body><p>Alpha body</p></body></html>"),
    Document("Beta Page/2", "Beta <b>", "First line & more.\nSecond line.", ""),
]


@pytest.fixture(scope="module")
def server() -> Iterator[CorpusServer]:
    with CorpusServer(DOCS) as running:
        yield running


def test_serves_html_as_is_and_rewrites_urls(server: CorpusServer) -> None:
    docs = server.documents()
    assert docs[0].url == f"{server.base_url}/wiki/alpha"
    response = httpx.get(docs[0].url)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.text == DOCS[0].html


def test_renders_plain_documents_escaped(server: CorpusServer) -> None:
    url = server.url_for("Beta Page/2")
    assert url.endswith(page_path("Beta Page/2")) and "%2F" in url and " " not in url
    text = httpx.get(url).text
    assert "<h1>Beta &lt;b&gt;</h1>" in text
    assert "<p>First line &amp; more.</p>" in text and "<p>Second line.</p>" in text


def test_unknown_page_is_a_404_page(server: CorpusServer) -> None:
    response = httpx.get(server.base_url + "/wiki/<nope>")
    assert response.status_code == 404
    assert "There is no page at /wiki/&lt;nope&gt;" in response.text
    assert httpx.get(server.base_url + "/elsewhere").status_code == 404


def test_head_has_headers_and_no_body(server: CorpusServer) -> None:
    response = httpx.head(server.url_for("alpha"))
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len((DOCS[0].html or "").encode())
    assert response.content == b""
    assert httpx.head(server.base_url + "/wiki/none").status_code == 404


def test_index_lists_every_page(server: CorpusServer) -> None:
    text = httpx.get(server.base_url + "/").text
    assert '<a href="/wiki/alpha">Alpha page</a>' in text and "Beta &lt;b&gt;" in text


def test_stop_is_idempotent_and_base_url_needs_a_running_server() -> None:
    server = CorpusServer(DOCS)
    with pytest.raises(RuntimeError, match="start"):
        _ = server.base_url
    server.start()
    server.stop()
    server.stop()


def test_refuses_empty_corpus_and_duplicate_ids() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CorpusServer([])
    with pytest.raises(ValueError, match="share the id"):
        CorpusServer([DOCS[0], DOCS[0]])


def test_busy_port_error_says_what_to_do(server: CorpusServer) -> None:
    port = urlsplit(server.base_url).port
    assert port is not None
    with pytest.raises(OSError, match="pick another port"):
        CorpusServer(DOCS, CorpusServerConfig(port=port, host="127.0.0.1")).start()


def test_a_client_that_resets_is_not_a_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """A visit cancelled mid-request resets its connection (RST): the server stays quiet about it
    and goes on serving."""
    import socket
    import struct

    with CorpusServer(DOCS) as server:
        port = urlsplit(server.base_url).port
        assert port is not None
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"GET /wiki/alpha HTTP/1.1\r\nHost: x")  # the request is not finished
            time.sleep(0.05)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # SO_LINGER 0: the close is a reset
        time.sleep(0.3)  # the handler threads meet the reset
        assert httpx.get(server.url_for("alpha")).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Connection reset" not in err, err


async def test_many_concurrent_connections() -> None:
    docs = [Document(f"d{i}", f"Doc {i}", f"text {i}", "") for i in range(300)]
    with CorpusServer(docs) as server:
        host, port = "127.0.0.1", urlsplit(server.base_url).port

        async def get(doc_id: str) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"GET /wiki/{doc_id} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data

        started = time.monotonic()
        replies = await asyncio.gather(*(get(doc.doc_id) for doc in docs))
        assert all(reply.startswith(b"HTTP/1.1 200") for reply in replies)
        assert all(f"Doc {i}".encode() in reply for i, reply in enumerate(replies))
        assert time.monotonic() - started < 10


def test_keep_alive_requests_are_fast(server: CorpusServer) -> None:
    with httpx.Client() as client:
        started = time.monotonic()
        for _ in range(50):
            assert client.get(server.url_for("alpha")).status_code == 200
        assert time.monotonic() - started < 2.0, "keep-alive responses must not stall (Nagle)"


def test_serve_corpus_command_serves_a_jsonl_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": "a", "title": "Page A", "text": "Hello there."}) + "\n")
    parser = argparse.ArgumentParser()
    serve_corpus.add_arguments(parser)
    args = parser.parse_args(["--corpus", str(path), "--port", "0"])
    assert serve_corpus.NAME == "serve-corpus"

    stop = threading.Event()

    def interrupted_when_stopped() -> None:
        stop.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_corpus, "wait_until_interrupted", interrupted_when_stopped)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(serve_corpus.run(args)))
    runner.start()
    deadline = time.monotonic() + 10
    while "serving" not in (out := capsys.readouterr().out) and time.monotonic() < deadline:
        time.sleep(0.05)
    url = out.split(" at ", 1)[1].split("/ ", 1)[0]
    assert "Hello there." in httpx.get(url + "/wiki/a").text
    stop.set()
    runner.join(10)
    assert result == [0]

"""A local server speaking ``POST /v1/chat/completions`` with scripted replies, for tests.

Tests give it a *responder*: a function from the request's messages to a :class:`Reply` (text, an
HTTP status, a delay). :func:`replies_in_order` turns a list into one. The server records every
request body and the highest number of requests it served at once, so tests can check retries,
caching and concurrency limits against a real HTTP exchange on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tests.loopback import QuietHandler, serve

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Reply:
    content: str = ""
    status: int = 200
    delay_s: float = 0.0  # wait before answering (timeouts, concurrency)


Responder = Callable[[Messages], Reply]


@dataclass
class ServerLog:
    requests: list[dict[str, object]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def count(self) -> int:
        return len(self.requests)


@dataclass
class ChatServer:
    base_url: str  # ends with /v1, as ChatClientConfig.base_url wants
    log: ServerLog


def replies_in_order(replies: Sequence[Reply | str], then: Reply | None = None) -> Responder:
    """Answer the n-th request with ``replies[n]``; after the list, with ``then`` (else an error)."""
    queue = [reply if isinstance(reply, Reply) else Reply(reply) for reply in replies]
    lock = threading.Lock()

    def respond(messages: Messages) -> Reply:
        with lock:
            if queue:
                return queue.pop(0)
        return then or Reply("the scripted replies are used up", status=599)

    return respond


@contextlib.contextmanager
def chat_server(responder: Responder) -> Iterator[ChatServer]:
    """Serve ``responder`` on a free loopback port for the ``with`` block."""
    log = ServerLog()

    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                self.send_body(404, b'{"error": "not found"}', "application/json")
                return
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            with log.lock:
                log.requests.append(body)
                log.in_flight += 1
                log.max_in_flight = max(log.max_in_flight, log.in_flight)
            try:
                reply = responder(list(body.get("messages", [])))
                if reply.delay_s:
                    time.sleep(reply.delay_s)
            finally:
                with log.lock:
                    log.in_flight -= 1
            if reply.status != 200:
                self.send_body(reply.status, json.dumps({"error": reply.content}).encode(),
                               "application/json")
                return
            payload = {
                "id": f"chatcmpl-{log.count}",
                "object": "chat.completion",
                "model": body.get("model", ""),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": reply.content}}],
            }
            try:
                self.send_body(200, json.dumps(payload).encode(), "application/json")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test)

    with serve(Handler) as url:
        yield ChatServer(f"{url}/v1", log)

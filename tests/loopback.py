"""Real HTTP servers on 127.0.0.1 for tests: a handler class in, a base URL out."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler without per-request logging to stderr."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def send_body(self, status: int, body: bytes, content_type: str = "text/html; charset=utf-8",
                  headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> Iterator[str]:
    """Run ``handler`` on a free port of ``host`` in a thread; yields ``http://host:port``."""
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{shown}:{port}"
    finally:
        server.shutdown()
        server.server_close()


class AcceptCounter:
    """A TCP server that counts every connection it accepts, whether or not a request follows.

    A browser can open a connection (preconnect, a speculative socket) without sending a request, so
    counting requests would miss what a port scan needs; every accepted connection is answered with
    ``body`` as an HTTP 200 page, so a test also sees whether that text ever reaches the agent.
    """

    def __init__(self, host: str, body: bytes) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self.body = body
        self.accepts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=2)

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.authority}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepts += 1
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(1.0)
            try:
                connection.recv(65536)
                head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: "
                        f"{len(self.body)}\r\nAccess-Control-Allow-Origin: *\r\nConnection: close"
                        f"\r\n\r\n").encode()
                connection.sendall(head + self.body)
            except OSError:
                pass


@contextlib.contextmanager
def count_accepts(host: str = "127.0.0.2", body: bytes = b"<p>refused page</p>"
                  ) -> Iterator[AcceptCounter]:
    """Run an :class:`AcceptCounter` on a free port of ``host`` (127.0.0.2: loopback, not 127.0.0.1)."""
    counter = AcceptCounter(host, body)
    counter.start()
    try:
        yield counter
    finally:
        counter.stop()

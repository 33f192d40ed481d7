"""A loopback web server for an offline corpus, so the visit tool reads pages over real HTTP.

Training and tests must exercise the same path as the open web (fetch, SSRF guard, extraction,
the browser for JavaScript-only pages) without the internet. :class:`CorpusServer` serves any list
of :class:`~turnstile.envs.search.base.Document` — the synthetic world, or a JSONL corpus with
``id``/``title``/``text`` and optional ``html`` — at ``/wiki/<id>``. A document without HTML is
rendered from its title and text (escaped). ``/`` lists every page; unknown pages get a 404 page;
GET and HEAD are supported.

Run it in a background thread::

    with CorpusServer(documents) as server:
        docs = server.documents()   # the same documents, with url = where this server serves them
        ...

or from the command line: ``turnstile serve-corpus --world synthetic --seed 0``.
"""

from __future__ import annotations

import html
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import quote, unquote, urlsplit

from turnstile.envs.search.base import Document

PAGE_PREFIX = "/wiki/"


class CorpusServerError(OSError):
    """The server cannot listen where it was told (a busy port, an address not on this host); the
    message says what to change. The commands that serve a corpus report it in one line."""


@dataclass
class CorpusServerConfig:
    """Where the server listens. ``port=0`` picks a free port (read it from ``base_url``)."""

    host: str = "127.0.0.1"
    port: int = 0
    request_queue_size: int = 1024  # the listen backlog: many episodes connect at once
    log_requests: bool = False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], pages: _Pages, queue_size: int, log: bool) -> None:
        self.request_queue_size = queue_size
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.pages = pages
        self.log_requests = log
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away (a visit cancelled at its timeout, an episode stopped) resets
        the connection: that is the client's business, not an error of the server to print with
        a traceback. Anything else is reported as the standard library does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Pages:
    """The served bytes: pages encoded once, on first request."""

    def __init__(self, documents: Sequence[Document]) -> None:
        self._by_id: dict[str, Document] = {}
        for doc in documents:
            if doc.doc_id in self._by_id:
                raise ValueError(f"two documents share the id {doc.doc_id!r}: ids must be unique")
            self._by_id[doc.doc_id] = doc
        self._encoded: dict[str, bytes] = {}
        self._index: bytes | None = None

    def __len__(self) -> int:
        return len(self._by_id)

    def page(self, doc_id: str) -> bytes | None:
        cached = self._encoded.get(doc_id)
        if cached is not None:
            return cached
        doc = self._by_id.get(doc_id)
        if doc is None:
            return None
        body = (doc.html if doc.html is not None else plain_page(doc.title, doc.text)).encode("utf-8")
        self._encoded[doc_id] = body
        return body

    def index(self) -> bytes:
        if self._index is None:
            items = "\n".join(
                f'<li><a href="{page_path(doc.doc_id)}">{html.escape(doc.title or doc.doc_id)}</a></li>'
                for doc in self._by_id.values()
            )
            self._index = _page("Index", f"<h1>Index</h1>\n<p>{len(self._by_id)} pages.</p>\n"
                                         f"<ul>\n{items}\n</ul>").encode("utf-8")
        return self._index


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK stall

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path in ("/", "/index.html"):
            self._send(200, self.server.pages.index())
            return
        if path.startswith(PAGE_PREFIX):
            body = self.server.pages.page(path[len(PAGE_PREFIX):].rstrip("/"))
            if body is not None:
                self._send(200, body)
                return
        missing = html.escape(path)
        self._send(404, _page("Not found", f"<h1>Not found</h1>\n<p>There is no page at {missing}. "
                                           'See the <a href="/">index</a>.</p>').encode("utf-8"))

    def do_HEAD(self) -> None:
        self.do_GET()

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        if self.server.log_requests:
            super().log_message(format, *args)


def page_path(doc_id: str) -> str:
    """The path a document is served at."""
    return PAGE_PREFIX + quote(doc_id, safe="")


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def plain_page(title: str, text: str) -> str:
    """A page for a document that has only title and text: one paragraph per non-blank line."""
    paragraphs = "\n".join(f"<p>{html.escape(line.strip())}</p>" for line in text.splitlines()
                           if line.strip())
    return _page(title, f"<article>\n<h1>{html.escape(title)}</h1>\n{paragraphs}\n</article>")


class CorpusServer:
    """Serves documents over HTTP from a background thread; see the module docstring.

    ``start`` returns the base URL; ``stop`` is safe to call twice. Used as a context manager it
    starts on enter and stops on exit.
    """

    def __init__(self, documents: Sequence[Document], config: CorpusServerConfig | None = None) -> None:
        if not documents:
            raise ValueError("the corpus server needs at least one document: check the corpus")
        self.config = config or CorpusServerConfig()
        self._documents = list(documents)
        self._pages = _Pages(self._documents)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        if self._server is not None:
            return self.base_url
        cfg = self.config
        try:
            self._server = _Server((cfg.host, cfg.port), self._pages, cfg.request_queue_size,
                                   cfg.log_requests)
        except OSError as exc:
            raise CorpusServerError(f"the corpus server cannot listen on {cfg.host}:{cfg.port} ({exc}); "
                                    "pick another port (0 = any free port) or stop what is using it") from exc
        self._thread = threading.Thread(target=self._server.serve_forever, name="corpus-server",
                                        daemon=True)
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the corpus server is not running: call start() first")
        host, port = str(self._server.server_address[0]), self._server.server_address[1]  # bound: (str, int)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def url_for(self, doc_id: str) -> str:
        return self.base_url + page_path(doc_id)

    def documents(self) -> list[Document]:
        """The served documents with ``url`` set to where this server serves each one."""
        return [replace(doc, url=self.url_for(doc.doc_id)) for doc in self._documents]

    def __enter__(self) -> CorpusServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

"""Small in-process tools for testing the environment's and toolbox's own logic."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from turnstile.envs.search.base import Document
from turnstile.envs.search.tool import SearchConfig, SearchTool
from turnstile.envs.tools.base import JsonObject, ToolError
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.visit.extract import extract_text


def write_corpus(documents: Sequence[Document], path: Path) -> int:
    """Documents as the corpus JSONL that ``envs.corpus.read_corpus`` reads; returns how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": d.doc_id, "title": d.title, "text": d.text, "url": d.url, **({"html": d.html} if d.html else {})}
            for d in documents]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return len(rows)


class EchoTool:
    """Returns its 'text' argument; counts calls."""

    description = "echo the text back"
    parameters: ClassVar[JsonObject] = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __init__(self, name: str = "search") -> None:
        self.name = name
        self.calls = 0
        self.closed = 0

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        text = arguments.get("text", "")
        if not isinstance(text, str):
            raise ToolError("bad_arguments", "'text' must be a string")
        return {"text": text.strip()}

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        return f"echo: {arguments['text']}"

    async def aclose(self) -> None:
        self.closed += 1


class FlakyTool(EchoTool):
    """Fails with a given error the first ``failures`` calls, then echoes."""

    def __init__(self, name: str, failures: int, error: Exception) -> None:
        super().__init__(name)
        self.failures = failures
        self.error = error

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return f"echo: {arguments['text']}"


class SlowTool(EchoTool):
    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(name)
        self.seconds = seconds

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        await asyncio.sleep(self.seconds)
        return "late"


class MemoryVisit:
    """A visit tool answering from documents in memory, in the real tool's output format.

    ``extract=False`` shows each page's readable text; ``extract=True`` runs trafilatura on the
    served HTML, decoding a JavaScript-only page's payload as the browser would have built it.
    """

    name = "visit"
    description = "Visit a page."
    parameters: ClassVar[JsonObject] = {"type": "object"}

    def __init__(self, documents: Sequence[Document], extract: bool = False) -> None:
        self._by_url = {doc.url: doc for doc in documents}
        self._extract = extract

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        return {"url": str(arguments.get("url")), "goal": str(arguments.get("goal"))}

    async def call(self, arguments: JsonObject) -> str:
        doc = self._by_url.get(str(arguments["url"]))
        if doc is None:
            raise ToolError("http_status", "404 Not Found")
        return f"Content of {doc.url} (goal: {arguments['goal']}):\n{self._text(doc)}"

    def _text(self, doc: Document) -> str:
        if not self._extract:
            return doc.text
        page = doc.html or ""
        payload = re.search(r'atob\("([^"]+)"\)', page)
        if payload:
            page = f"<html><body>{json.loads(base64.b64decode(payload.group(1)))['body']}</body></html>"
        return extract_text(page)

    async def aclose(self) -> None:
        pass


def memory_toolbox(documents: Sequence[Document], extract: bool = False) -> Toolbox:
    """The real search tool over ``documents`` and a :class:`MemoryVisit` of them."""
    return Toolbox([SearchTool.from_config(SearchConfig(), documents), MemoryVisit(documents, extract)])


class WorkerKiller:
    """A thread that kills the first named rollout worker whose name ends with ``suffix`` once the
    rollout's output file ``out`` holds a trajectory (episodes are running); ``killed`` names it.
    ``for_good`` kills it with no restart, as a lost node would."""

    def __init__(self, out: Path, suffix: str = "-worker-0", for_good: bool = False) -> None:
        import threading

        self.out, self.suffix, self.for_good = out, suffix, for_good
        self.killed: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerKiller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._thread.join(timeout=5)
        assert self.killed, f"the test never found a worker named *{self.suffix} to kill"

    def _run(self) -> None:
        import time

        import ray

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not self.killed:
            names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors()]
            victims = sorted(n for n in names if n.endswith(self.suffix))
            if victims and self.out.exists() and self.out.stat().st_size > 0:
                ray.kill(ray.get_actor(victims[0]), no_restart=self.for_good)
                self.killed.append(victims[0])
            time.sleep(0.1)

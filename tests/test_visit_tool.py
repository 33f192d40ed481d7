"""The visit tool end to end on loopback: arguments, output formats, partial failure, budgets."""

from __future__ import annotations

import json
import pickle
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import pytest

from tests.loopback import QuietHandler, serve
from turnstile.envs.tools.base import Tool, ToolError
from turnstile.envs.visit import VisitConfig, VisitTool
from turnstile.envs.visit.guard import GuardConfig
from turnstile.envs.visit.summarize import ExtractorConfig

PARAGRAPH = "The northern lighthouse was built in 1871 from granite quarried on the island. "
ARTICLE = f"<html><body><article><h1>Lighthouse</h1><p>{PARAGRAPH * 8}</p><p>{PARAGRAPH * 8}</p>" \
          f"</article></body></html>".encode()


class Site(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/article":
            self.send_body(200, ARTICLE)
        elif self.path == "/long":
            words = " ".join(f"word{i}" for i in range(3000))
            self.send_body(200, words.encode(), content_type="text/plain")
        elif self.path == "/empty":
            self.send_body(200, b"<html><body></body></html>")
        elif self.path == "/missing":
            self.send_body(404, b"gone")
        elif self.path == "/pdf":
            self.send_body(200, b"%PDF-1.7", content_type="application/pdf")
        else:
            self.send_body(404, b"")


class Chat(QuietHandler):
    content = ""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        reply = {"choices": [{"message": {"content": type(self).content}}]}
        self.send_body(200, json.dumps(reply).encode(), content_type="application/json")


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve(Site) as base:
        yield base


@pytest.fixture
async def tool(site: str) -> AsyncIterator[VisitTool]:
    visit = VisitTool(VisitConfig(guard=GuardConfig(allow_hosts=[urlsplit(site).netloc]),
                                  render="never"))
    yield visit
    await visit.aclose()


def test_is_a_tool_and_pickles() -> None:
    visit = VisitTool()
    assert isinstance(visit, Tool) and visit.name == "visit"
    clone = pickle.loads(pickle.dumps(visit))
    assert clone.config == visit.config


def test_normalize_canonicalises() -> None:
    visit = VisitTool()
    one = visit.normalize({"url": " https://a.test/x ", "goal": " find x "})
    many = visit.normalize({"url": ["https://a.test/x", "https://a.test/x", " "], "goal": "find x"})
    assert one == many == {"url": ["https://a.test/x"], "goal": "find x"}


@pytest.mark.parametrize(("arguments", "needle"), [
    ({"goal": "g"}, '"url"'),
    ({"url": 3, "goal": "g"}, '"url"'),
    ({"url": [], "goal": "g"}, "no URL"),
    ({"url": "example.com/page", "goal": "g"}, "https://example.com/page"),
    ({"url": "ftp://a.test/", "goal": "g"}, "http(s)"),
    ({"url": "https://a.test/"}, '"goal"'),
    ({"url": "https://a.test/", "goal": "  "}, '"goal"'),
    ({"url": [f"https://a.test/{i}" for i in range(6)], "goal": "g"}, "at most 5"),
])
def test_normalize_rejects_bad_arguments(arguments: dict[str, object], needle: str) -> None:
    with pytest.raises(ToolError) as caught:
        VisitTool().normalize(arguments)
    assert caught.value.kind == "bad_arguments" and needle in caught.value.message


@pytest.mark.integration
async def test_content_format(tool: VisitTool, site: str) -> None:
    text = await tool.call(tool.normalize({"url": f"{site}/article", "goal": "when was it built"}))
    header = f"Content of {site}/article (goal: when was it built):\n"
    assert text.startswith(header) and "built in 1871" in text


@pytest.mark.integration
async def test_budget_truncates_with_marker(site: str) -> None:
    config = VisitConfig(guard=GuardConfig(allow_hosts=[urlsplit(site).netloc]), max_tokens=100)
    visit = VisitTool(config)
    text = await visit.call(visit.normalize({"url": f"{site}/long", "goal": "g"}))
    await visit.aclose()
    assert text.endswith("word99\n[... page truncated to 100 tokens]")


@pytest.mark.integration
async def test_one_failure_among_several(tool: VisitTool, site: str) -> None:
    urls = [f"{site}/article", f"{site}/missing", f"{site}/empty", "http://10.0.0.1/"]
    text = await tool.call(tool.normalize({"url": urls, "goal": "g"}))
    sections = text.split("\n=======\n")
    assert len(sections) == 4
    assert sections[0].startswith(f"Content of {site}/article")
    assert sections[1].startswith(f"Failed to visit {site}/missing: ") and "404" in sections[1]
    assert sections[2] == f"The page {site}/empty has no readable text."
    assert sections[3].startswith("Failed to visit http://10.0.0.1/: refused")


@pytest.mark.integration
async def test_all_failing_raises(tool: VisitTool, site: str) -> None:
    with pytest.raises(ToolError) as caught:
        await tool.call(tool.normalize({"url": [f"{site}/pdf", f"{site}/missing"], "goal": "g"}))
    assert caught.value.kind == "unsupported_content"


@pytest.mark.integration
@pytest.mark.parametrize(("reply", "expect_extractor_format"), [
    (json.dumps({"rational": "r", "evidence": "Built in 1871.", "summary": "1871"}), True),
    ("no json here", False),
])
async def test_extractor_output_and_fallback(site: str, reply: str, expect_extractor_format: bool) -> None:
    Chat.content = reply
    with serve(Chat) as chat:
        config = VisitConfig(guard=GuardConfig(allow_hosts=[urlsplit(site).netloc]), render="never",
                             extractor=ExtractorConfig(enabled=True, base_url=chat, model="tiny"))
        visit = VisitTool(config)
        text = await visit.call(visit.normalize({"url": f"{site}/article", "goal": "year built"}))
        await visit.aclose()
    if expect_extractor_format:
        assert text == (f"The useful information in {site}/article for user goal year built as "
                        f"follows:\n\nEvidence in page:\nBuilt in 1871.\n\nSummary:\n1871")
    else:
        assert text.startswith(f"Content of {site}/article (goal: year built):\n")
        assert "built in 1871" in text

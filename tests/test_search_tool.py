"""The search tool: argument normalisation, observation format, failures, and the backend registry."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from turnstile.envs.search import tool as search_tool
from turnstile.envs.search.base import Document, SearchBackend, SearchHit
from turnstile.envs.search.local import LocalIndex
from turnstile.envs.search.tool import (
    LocalIndexConfig,
    SearchConfig,
    SearchTool,
    SerperConfig,
    build_search_backend,
    register_search_backend,
    search_backend_names,
)
from turnstile.envs.tools.base import Tool, ToolError


class ScriptedBackend:
    """Answers from a table; a query mapped to a ToolError raises it."""

    def __init__(self, answers: dict[str, list[SearchHit] | ToolError]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int]] = []
        self.closed = 0

    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        self.calls.append((query, top_k))
        answer = self.answers[query]
        if isinstance(answer, ToolError):
            raise answer
        return answer[:top_k]

    async def aclose(self) -> None:
        self.closed += 1


HITS = [SearchHit("Varny Bridge", "https://w.org/varny", "A bridge over the Varny."),
        SearchHit("Morton Castle", "https://w.org/morton", "")]


def tool(answers: dict[str, list[SearchHit] | ToolError] | None = None, **kwargs: int) -> SearchTool:
    return SearchTool(ScriptedBackend(answers or {}), **kwargs)


def test_is_a_tool_with_a_query_array_schema() -> None:
    search = tool()
    assert isinstance(search, Tool)
    assert search.name == "search"
    query = search.parameters["properties"]["query"]  # type: ignore[index]
    assert query["type"] == "array" and query["items"] == {"type": "string"}  # type: ignore[index]
    assert search.parameters["required"] == ["query"]


@pytest.mark.parametrize("arguments, expected", [
    ({"query": ["a", "b"]}, ["a", "b"]),
    ({"query": "  bare string  "}, ["bare string"]),
    ({"queries": ["alias"]}, ["alias"]),
    ({"query": [" x ", "", "   ", "y"]}, ["x", "y"]),
    ({"query": ["q"], "queries": ["ignored"]}, ["q"]),
])
def test_normalize(arguments: dict[str, object], expected: list[str]) -> None:
    search = tool()
    assert search.normalize(arguments) == {"query": expected}
    assert search.normalize(search.normalize(arguments)) == {"query": expected}


@pytest.mark.parametrize("arguments, fix", [
    ({}, '"query"'),
    ({"q": "x"}, '"query"'),
    ({"query": []}, "at least one"),
    ({"query": ["", "  "]}, "at least one"),
    ({"query": "   "}, "at least one"),
    ({"query": ["ok", 3]}, "list of strings"),
    ({"query": 42}, "list of strings"),
    ({"query": {"text": "x"}}, "list of strings"),
    ({"query": [f"q{i}" for i in range(6)]}, "at most 5"),
])
def test_normalize_rejects_with_a_fix(arguments: dict[str, object], fix: str) -> None:
    with pytest.raises(ToolError) as info:
        tool().normalize(arguments)
    assert info.value.kind == "bad_arguments"
    assert fix in info.value.message


async def test_output_format_for_several_queries() -> None:
    search = tool({"varny": HITS, "nothing": []}, top_k=3)
    text = await search.call({"query": ["varny", "nothing"]})
    assert text == (
        "A search for 'varny' found 2 results:\n\n## Web Results\n"
        "1. [Varny Bridge](https://w.org/varny)\nA bridge over the Varny.\n\n"
        "2. [Morton Castle](https://w.org/morton)"
        "\n=======\n"
        "No results found for 'nothing'. Try a shorter or more general query."
    )


async def test_top_k_is_passed_to_the_backend() -> None:
    search = tool({"varny": HITS}, top_k=1)
    text = await search.call({"query": ["varny"]})
    assert search._backend.calls == [("varny", 1)]  # type: ignore[attr-defined]
    assert "found 1 results" in text and "Morton" not in text


async def test_one_failed_query_is_reported_in_its_section() -> None:
    search = tool({"ok": HITS, "bad": ToolError("timeout", "Serper did not answer", retryable=True)})
    sections = (await search.call({"query": ["ok", "bad"]})).split("\n=======\n")
    assert sections[0].startswith("A search for 'ok' found 2 results")
    assert sections[1] == "The search for 'bad' failed: Serper did not answer"


async def test_all_queries_failing_raises_the_tool_error() -> None:
    error = ToolError("http_status", "HTTP 503", retryable=True)
    search = tool({"a": error, "b": ToolError("timeout", "slow", retryable=True)})
    with pytest.raises(ToolError) as info:
        await search.call({"query": ["a", "b"]})
    assert info.value is error


async def test_a_bug_in_a_backend_is_not_disguised() -> None:
    class Broken(ScriptedBackend):
        async def search(self, query: str, top_k: int) -> list[SearchHit]:
            raise KeyError("bug")

    with pytest.raises(KeyError):
        await SearchTool(Broken({})).call({"query": ["a", "b"]})


async def test_queries_run_concurrently() -> None:
    started = 0
    all_started = asyncio.Event()

    class Barrier(ScriptedBackend):
        async def search(self, query: str, top_k: int) -> list[SearchHit]:
            nonlocal started
            started += 1
            if started == 3:
                all_started.set()
            await all_started.wait()  # a sequential tool would wait here forever
            return HITS

    text = await asyncio.wait_for(SearchTool(Barrier({})).call({"query": ["a", "b", "c"]}), timeout=5)
    assert text.count("## Web Results") == 3


async def test_aclose_closes_the_backend() -> None:
    search = tool()
    await search.aclose()
    assert search._backend.closed == 1  # type: ignore[attr-defined]


def test_registry_lists_builtin_backends() -> None:
    assert {"local", "serper", "retrieval"} <= set(search_backend_names())


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown search.backend 'bing'; known: local, retrieval, serper"):
        build_search_backend(SearchConfig(backend="bing"))


def test_a_users_backend_by_import_path() -> None:
    backend = build_search_backend(SearchConfig(backend="tests.user_plugins:one_page_search"))
    assert isinstance(backend, SearchBackend)


def test_registered_backend_is_built_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # leave no test plugin behind
    monkeypatch.setattr(search_tool.SEARCH_BACKENDS, "_registered", dict(search_tool.SEARCH_BACKENDS._registered))
    backend = ScriptedBackend({})

    @register_search_backend("scripted-for-test")
    def scripted(cfg: SearchConfig) -> SearchBackend:
        return backend

    assert build_search_backend(SearchConfig(backend="scripted-for-test")) is backend
    with pytest.raises(ValueError, match="already registered"):
        register_search_backend("scripted-for-test")(lambda _cfg: backend)


@pytest.mark.parametrize("name", search_backend_names())
async def test_every_registered_backend_builds_and_closes_twice(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "T", "text": "body", "url": "u"}) + "\n")
    monkeypatch.setenv("TURNSTILE_CONTRACT_KEY", "k")
    cfg = SearchConfig(backend=name, local=LocalIndexConfig(corpus=str(corpus)),
                       serper=SerperConfig(api_key_env="TURNSTILE_CONTRACT_KEY"))
    backend = build_search_backend(cfg)
    assert isinstance(backend, SearchBackend)
    await backend.aclose()
    await backend.aclose()


def test_local_backend_needs_a_corpus_or_documents() -> None:
    with pytest.raises(ValueError, match=r"search.local.corpus"):
        build_search_backend(SearchConfig())


def test_serper_backend_without_key_says_which_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TURNSTILE_NO_SUCH_KEY", raising=False)
    cfg = SearchConfig(backend="serper", serper=SerperConfig(api_key_env="TURNSTILE_NO_SUCH_KEY"))
    with pytest.raises(ValueError, match="TURNSTILE_NO_SUCH_KEY"):
        build_search_backend(cfg)


async def test_local_backend_from_corpus_file(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "v", "title": "Varny Bridge", "text": "A bridge."}) + "\n")
    cfg = SearchConfig(local=LocalIndexConfig(corpus=str(corpus), engine="bm25s", url_prefix="http://c/"))
    backend = build_search_backend(cfg)
    assert isinstance(backend, LocalIndex) and backend.engine == "bm25s"
    assert (await backend.search("varny", 1))[0].url == "http://c/v"


async def test_tool_over_given_documents_end_to_end() -> None:
    docs = [Document("1", "Varny Bridge", "Varny Bridge crosses the Varny river.", "http://w/1"),
            Document("2", "Morton Castle", "A castle near Varny Bridge.", "http://w/2")]
    search = SearchTool.from_config(SearchConfig(backend="serper", top_k=1), documents=docs)
    text = await search.call(search.normalize({"query": "Varny Bridge"}))
    assert text == ("A search for 'Varny Bridge' found 1 results:\n\n## Web Results\n"
                    "1. [Varny Bridge](http://w/1)\nVarny Bridge crosses the Varny river.")
    await search.aclose()

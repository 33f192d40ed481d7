"""The trajectory formats ``turnstile data clean`` reads, each turned into one chat.

Public search-agent trajectories come in more than one shape. Each format here turns a row into the
chat the cleaning steps work on (``[{role, content}]``: the question as the first user message, then
assistant turns in the protocol of docs/algorithms.md §1, each tool call answered by a user
``<tool_response>``), so that every later step, and the training rows written, are the same whatever
the source. A format is chosen per row from the fields it has, or forced with ``--format``.

``chat`` — ``{messages, answer}``: WebDancer, WebSailor, DR-Venus. ``messages`` is used as it is.

``r1_searcher`` — ``{question, answer, pred_ans, gen_text_store}``: the published rollouts of
R1-Searcher (RUCAIBox/R1-Searcher, ``data/eval_results/*.jsonl``, written by
``evaluation/eval_search_loacl.py``). ``gen_text_store`` is everything the model wrote after a prompt
ending in ``Assistant: <think>``, with the retriever's results spliced in: one think block in which
each search is ``<|begin_of_query|> keywords<|end_of_query|>`` followed by
``<|begin_of_documents|>\\n(1)passage\\n(2)...<|end_of_documents|>`` (``None`` when nothing was
found), then ``</think>`` and ``<answer> ... </answer>``. A passage is ``Title: T Text: abstract``
(its HotpotQA abstract corpus) or ``T``, three spaces and a 100-word chunk (its KILT Wikipedia).
``pred_ans`` is a copy of the answer (``"I don't know."`` for a rollout that did not finish, which
has no answer in ``gen_text_store``, or no ``gen_text_store`` at all) and is not read.

Each query becomes a turn: the reasoning before it as the think block and a ``search`` call with the
query (tabs, which the prompt asks for between keywords, read as spaces, as the retriever read
them); its documents become the search tool's result list, each passage a hit whose URL is its
Wikipedia page (R1-Searcher retrieves from Wikipedia dumps). The reasoning after the last search and
the answer become the answer turn. Documents in any other form (the online variant's summaries) are
kept as written and counted by step 1 as an unknown result format; a rollout cut off before its
answer fails step 4 as any other does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from turnstile.envs.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    render_answer,
    render_tool_call,
    render_tool_response,
)
from turnstile.envs.search.base import SearchHit
from turnstile.envs.search.tool import format_results
from turnstile.envs.tools.base import JsonObject

Message = dict[str, str]
RowChat = list[Message] | str  # the chat of a row, or why the row cannot be read


@dataclass(frozen=True)
class TrajectoryFormat:
    """One input format: how to recognise a row of it, and how to turn the row into a chat."""

    name: str
    shape: str  # the fields a row holds, as users know the format
    sources: str  # who publishes it
    marks: tuple[str, ...]  # a row with any of these fields is of this format
    chat: Callable[[JsonObject], RowChat]

    def describe(self) -> str:
        return f"{self.name} ({self.shape}: {self.sources})"


def chat_messages(fields: JsonObject) -> RowChat:
    """A ``chat`` row's ``messages``, checked to be ``[{"role": str, "content": str}]``."""
    messages = fields.get("messages")
    if messages is None:
        return "no 'messages' field"
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return "'messages' must be a list of {\"role\": str, \"content\": str}"
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages if isinstance(m, dict)]


# ---- R1-Searcher ----------------------------------------------------------------------------------

QUERY_OPEN, QUERY_CLOSE = "<|begin_of_query|>", "<|end_of_query|>"
DOCUMENTS_OPEN, DOCUMENTS_CLOSE = "<|begin_of_documents|>", "<|end_of_documents|>"
WIKIPEDIA_PAGE = "https://en.wikipedia.org/wiki/"
_DOCUMENTS = re.compile(r"\s*" + re.escape(DOCUMENTS_OPEN) + r"(.*?)" + re.escape(DOCUMENTS_CLOSE), re.DOTALL)
_PASSAGE_START = re.compile(r"^(?=\(\d+\))", re.MULTILINE)
# The two corpora of R1-Searcher's retriever, each line "rank" + passage: the HotpotQA abstracts,
# "Title: T Text: abstract" (CSV-quoted, quotes doubled, where the abstract holds a quote), and the
# KILT Wikipedia in 100-word chunks, "T" + three spaces + chunk.
_ABSTRACT = re.compile(r'\((?P<rank>\d+)\)(?P<quote>"?)Title: (?P<title>.*?) Text:(?P<text>.*)', re.DOTALL)
_CHUNK = re.compile(r"\((?P<rank>\d+)\)(?P<title>[^\n]*?\S) {3}(?P<text>\S.*)", re.DOTALL)
_ANSWER = re.compile(r"\s*" + re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE) + r"\s*", re.DOTALL)


def r1_searcher_messages(fields: JsonObject) -> RowChat:
    """The chat of an ``r1_searcher`` row (see the module docstring)."""
    question = fields.get("question")
    if not isinstance(question, str) or not question.strip():
        return "field 'question' must be a non-empty string"
    generated = fields.get("gen_text_store", "")
    if not isinstance(generated, str):
        return "field 'gen_text_store' must be a string"
    messages = [{"role": "user", "content": question.strip()}]
    if generated.strip():  # an unfinished rollout may have none: no turn, which step 4 drops
        messages += r1_searcher_turns(generated)
    return messages


def r1_searcher_turns(generated: str) -> list[Message]:
    """Assistant turns and tool responses for one ``gen_text_store``."""
    text = generated.lstrip()
    text = text[len(THINK_OPEN):] if text.startswith(THINK_OPEN) else text
    messages: list[Message] = []
    position = 0
    while (start := text.find(QUERY_OPEN, position)) != -1:
        end = text.find(QUERY_CLOSE, start)
        query = " ".join(text[start + len(QUERY_OPEN):end if end != -1 else len(text)].split())
        call = render_tool_call("search", {"query": [query]}, text[position:start].strip())
        messages.append({"role": "assistant", "content": call})
        if end == -1:  # cut off inside the query: no result and no answer follow
            return messages
        position = end + len(QUERY_CLOSE)
        documents = _DOCUMENTS.match(text, position)
        if documents is None:  # a query nothing answered: the call keeps no response (step 4 drops it)
            continue
        messages.append({"role": "user", "content": render_tool_response(
            search_results(query, documents.group(1)))})
        position = documents.end()
    messages.append({"role": "assistant", "content": _answer_turn(text[position:])})
    return messages


def search_results(query: str, documents: str) -> str:
    """R1-Searcher's documents as the search tool's result list; as written when they are not the
    numbered passages its local retriever returns."""
    body = documents.strip()
    if body == "None":
        return format_results(query, [])
    hits: list[SearchHit] = []
    for rank, chunk in enumerate((c.strip() for c in _PASSAGE_START.split(body) if c.strip()), start=1):
        hit = _passage_hit(chunk)
        if hit is None or not chunk.startswith(f"({rank})"):
            return body
        hits.append(hit)
    return format_results(query, hits) if hits else body


def _passage_hit(chunk: str) -> SearchHit | None:
    abstract = _ABSTRACT.fullmatch(chunk)
    if abstract is not None:
        title, text = abstract.group("title").strip(), abstract.group("text").strip()
        if abstract.group("quote") and text.endswith('"'):
            title, text = title.replace('""', '"'), text[:-1].rstrip().replace('""', '"')
    elif (kilt := _CHUNK.fullmatch(chunk)) is not None:
        title, text = kilt.group("title").strip(), kilt.group("text").strip()
    else:
        return None
    return SearchHit(title, wikipedia_url(title), text)


def wikipedia_url(title: str) -> str:
    return WIKIPEDIA_PAGE + quote(title.replace(" ", "_"), safe="()_,.'!:/-")


def _answer_turn(rest: str) -> str:
    """The last turn: the reasoning up to ``</think>`` and the answer, written as the protocol wants
    it; left as it stands (for step 4 to judge) when it is not one think block and one answer."""
    think, closed, after = rest.rpartition(THINK_CLOSE)
    if not closed:
        return f"{THINK_OPEN}\n{rest.strip()}"
    answer = _ANSWER.fullmatch(after)
    if answer is None:
        return f"{THINK_OPEN}\n{think.strip()}\n{THINK_CLOSE}\n{after.strip()}"
    return render_answer(answer.group(1).strip(), think.strip())


# ---- the registry --------------------------------------------------------------------------------

CHAT = TrajectoryFormat("chat", "{messages, answer}", "WebDancer, WebSailor, DR-Venus", ("messages",),
                        chat_messages)
R1_SEARCHER = TrajectoryFormat("r1_searcher", "{question, answer, gen_text_store}", "R1-Searcher",
                               ("gen_text_store", "pred_ans"), r1_searcher_messages)
FORMATS: dict[str, TrajectoryFormat] = {fmt.name: fmt for fmt in (CHAT, R1_SEARCHER)}
AUTO = "auto"


def known_formats() -> str:
    """The formats, as an error message lists them."""
    return "; ".join(fmt.describe() for fmt in FORMATS.values())


def check_format_name(name: str) -> None:
    if name != AUTO and name not in FORMATS:
        raise ValueError(f"unknown input format {name!r}; use {AUTO} or one of: {known_formats()}")


def row_format(fields: JsonObject, name: str = AUTO) -> TrajectoryFormat | str:
    """The format ``name`` names, or (``auto``) the first whose marking field the row has; else why
    the row is of no known format."""
    if name != AUTO:
        return FORMATS[name]
    for fmt in FORMATS.values():
        if any(mark in fields for mark in fmt.marks):
            return fmt
    return "no " + " or ".join(f"{_quoted(fmt.marks)} field ({fmt.name})" for fmt in FORMATS.values())


def _quoted(marks: Sequence[str]) -> str:
    return "/".join(f"'{mark}'" for mark in marks)

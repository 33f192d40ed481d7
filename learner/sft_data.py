"""Data preparation for SFT (docs/algorithms.md §10): raw agent trajectories in, training rows out.

Public trajectories (WebDancer, WebSailor, DR-Venus, ...) were written against other system prompts,
other tool schemas and other search-result formats. Trained on as they are, they would teach the
policy an environment it never meets at rollout time, so every row is rewritten into this project's
protocol (§1) and what cannot be trusted is dropped, each step counted::

    turnstile data clean --in raw.jsonl --out sft.jsonl                  # exact match only
    turnstile data clean --in raw.jsonl --out sft.jsonl --judge-url http://127.0.0.1:8000/v1 \\
        --judge-model qwen3-32b
    turnstile data clean --in raw.jsonl --out sft.jsonl --no-require-correct --resample 50:1,inf:3

Input: one JSON object per line in one of the formats of ``learner/sft_formats.py``, recognised per
row by its fields or forced with ``--format``; each becomes a chat before step 1. ``chat`` rows
(WebDancer, WebSailor, DR-Venus) hold ``messages`` (``[{role, content}]``: system prompt, the user
question, then assistant turns, each followed by its tool response as a user ``<tool_response>``
message; role ``tool`` is accepted) and ``answer`` (the reference: a string or a list of
alternatives; nested lists are flattened). ``r1_searcher`` rows (R1-Searcher's rollouts) hold
``question``, ``answer`` and ``gen_text_store``, whose ``<|begin_of_query|>`` searches and
``<|begin_of_documents|>`` results become search calls and tool responses. A question embedded in a
prompt that also carries the tool list (WebDancer's ``... </tools> ... User: question``) is cut out
of it. The row's own tool schemas (``functions``, ``<tools>`` blocks) are only read to count where
they disagree with the calls. A file without one readable row is an error (:class:`NoReadableRows`).

Output: one training row per line, ``{"messages", "answer", "source_line", "turns"}``, where
``messages`` is the chat the policy's chat template tokenises (this project's system prompt, the
question, assistant turns and user ``<tool_response>`` turns) and ``turns`` counts assistant turns.

Steps, in order: 1 align the environment, 2 keep allowed tools, 3 remove repeated calls, 4 check the
structure (§1), 5 keep accepted answers (exact match, else the LLM judge when one is configured;
without one, ``require_correct`` says whether an unverified answer is dropped — the default, so that
no unchecked answer is trained on), 6 turn-aware resampling (each row written ``copies`` times in a
row; the trainer shuffles).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.envs.answers import answer_matches
from turnstile.envs.chat_client import ChatClient, ChatClientConfig
from turnstile.envs.protocol import (
    CALL_CLOSE,
    CALL_OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    TurnKind,
    parse_call_body,
    parse_turn,
    render_tool_response,
    strip_stop,
    system_prompt,
)
from turnstile.envs.search.base import SearchHit
from turnstile.envs.search.tool import QUERY_SEPARATOR, SearchConfig, SearchTool, format_results
from turnstile.envs.tools.base import JsonObject, JsonValue, Tool, ToolError
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.visit.tool import VisitTool
from turnstile.learner.credit.records import write_records
from turnstile.learner.sft_formats import AUTO, CHAT, check_format_name, known_formats, row_format
from turnstile.rewards.outcome import judge_messages, parse_verdict

KNOWN_TOOLS = ("search", "visit")
PROGRESS_EVERY = 5_000  # input lines between progress reports

# What the steps count, and why they drop rows; printed as they are.
QUERIES_RENAMED = "calls whose 'queries' key was renamed to 'query'"  # step 1
QUERY_WRAPPED = "calls whose bare query string was wrapped in a list"
# A row whose own tool schema (its ``functions`` field, or a ``<tools>`` block in its prompt) names
# the search parameter one way while its calls write the other: the calls are normalised and the
# schema replaced, and these count it (rows, calls) for each direction, declared name first.
SCHEMA_MISMATCHES = {
    ("queries", "query"): ("rows whose schema says 'queries', calls use 'query'",
                           "calls using 'query' where the schema says 'queries'"),
    ("query", "queries"): ("rows whose schema says 'query', calls use 'queries'",
                           "calls using 'queries' where the schema says 'query'"),
}
SEARCH_NORMALISED = "search responses normalised"
SEARCH_UNRECOGNISED = "search responses in an unknown format (kept as written)"
DISALLOWED_TURNS = "turns removed (disallowed tool)"  # step 2
REPEATED_TURNS = "turns removed (repeated calls)"  # step 3
REPEATED_CALLS = "repeated calls removed"
EXACT_MATCH = "exact matches"  # step 5, kept
JUDGE_ACCEPTED = "accepted by the judge"
KEPT_UNVERIFIED = "kept unverified"
NOT_VERIFIED = "answer not an exact match, no judge"  # step 5, dropped
NO_REFERENCE = "no reference answer"
JUDGE_REJECTED = "rejected by the judge"
JUDGE_UNREADABLE = "judge reply unreadable"
RESAMPLED_ROWS = "rows written more than once"  # step 6
UNVERIFIED = "unverified"  # a verdict: neither an exact match nor judged


# ---- configuration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ResampleTier:
    max_turns: float  # inclusive upper bound on assistant turns; math.inf for the last tier
    copies: int


DEFAULT_RESAMPLE = (ResampleTier(50, 1), ResampleTier(100, 2), ResampleTier(math.inf, 5))


@dataclass(frozen=True)
class CleanConfig:
    allowed_tools: tuple[str, ...] = KNOWN_TOOLS
    require_correct: bool = True  # without a judge: drop answers that are not an exact match
    judge: ChatClientConfig | None = None  # None: no LLM judge, exact match only
    resample: tuple[ResampleTier, ...] = DEFAULT_RESAMPLE
    max_queries: int = SearchConfig.max_queries  # the search tool refuses more, so they cannot be learnt
    input_format: str = AUTO  # a format of learner/sft_formats.py, or auto: recognised per row

    def __post_init__(self) -> None:
        check_format_name(self.input_format)
        unknown = sorted(set(self.allowed_tools) - set(KNOWN_TOOLS))
        if unknown or not self.allowed_tools:
            raise ValueError(f"allowed tools must be among {', '.join(KNOWN_TOOLS)} (the tools the "
                             f"environment offers), got {', '.join(self.allowed_tools) or 'none'}")
        check_tiers(self.resample)


def check_tiers(tiers: Sequence[ResampleTier]) -> None:
    bounds = [tier.max_turns for tier in tiers]
    if not tiers or bounds != sorted(set(bounds)) or bounds[-1] != math.inf:
        raise ValueError("resample tiers need increasing turn bounds ending with inf, e.g. "
                         "50:1,100:2,inf:5")
    if any(tier.copies < 1 for tier in tiers):
        raise ValueError("every resample tier must write a row at least once (copies >= 1)")


def parse_resample(spec: str) -> tuple[ResampleTier, ...]:
    """``"50:1,100:2,inf:5"`` -> tiers: up to 50 turns once, 51-100 twice, more five times."""
    tiers = []
    for item in spec.split(","):
        bound, _, copies = item.strip().partition(":")
        try:
            tiers.append(ResampleTier(float(bound), int(copies)))
        except ValueError:
            raise ValueError(f"bad resample tier {item.strip()!r}: write MAX_TURNS:COPIES, e.g. "
                             "50:1,100:2,inf:5") from None
    check_tiers(tiers)
    return tuple(tiers)


def copies_for(turns: int, tiers: Sequence[ResampleTier]) -> int:
    return next(tier.copies for tier in tiers if turns <= tier.max_turns)


# ---- rows as they move through the steps ---------------------------------------------------------

@dataclass(frozen=True)
class RawRow:
    line: int
    fields: JsonObject  # the input object; ``messages`` (the row's chat) [{role: str, content: str}]
    input_format: str = CHAT.name  # the format the row was read in (its chat is in ``messages``)


@dataclass(frozen=True)
class Unreadable:
    line: int
    reason: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: JsonObject


@dataclass(frozen=True)
class TranscriptTurn:
    """One assistant message and the messages that answer it (normally its one tool response)."""

    text: str
    responses: tuple[str, ...] = ()
    calls: tuple[ToolCall, ...] = ()  # the <tool_call> blocks after the last </think> that parse
    broken_calls: int = 0  # <tool_call> blocks that do not parse (step 4 rejects the turn)


@dataclass(frozen=True)
class Transcript:
    """One input row as a chat transcript: not a rollout :class:`~turnstile.rollout.trajectory.Trajectory`
    (no token ids, no rewards) but text from another agent's run, cleaned into SFT rows here."""

    line: int
    question: str
    today: str | None  # the date the source's system prompt gave, kept for the new one
    turns: tuple[TranscriptTurn, ...]
    reference: tuple[str, ...]
    stray_messages: int = 0  # messages that belong to no turn (step 4 rejects the row)


@dataclass(frozen=True)
class Dropped:
    reason: str


@dataclass
class StepCount:
    name: str
    rows_in: int = 0
    rows_out: int = 0
    events: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)

    def record(self, result: object) -> None:
        self.rows_in += 1
        if isinstance(result, Dropped):
            self.dropped[result.reason] += 1
        else:
            self.rows_out += 1


@dataclass
class CleanReport:
    source: Path
    rows_read: int
    unreadable: list[str]  # "file:line: reason"
    steps: list[StepCount]
    written: int
    formats: Counter[str] = field(default_factory=Counter)  # readable rows per input format


class NoReadableRows(ValueError):
    """Not one line of the input is a row of a known format; nothing is written."""


# ---- reading ------------------------------------------------------------------------------------

def read_rows(path: Path, input_format: str = AUTO) -> Iterator[RawRow | Unreadable]:
    """Every non-blank line of ``path`` as a row with its chat in ``messages``; a line that is not a
    usable row of ``input_format`` (``auto``: of the format its fields mark) becomes :class:`Unreadable`."""
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            if raw.strip():
                yield _row(number, raw, input_format)


def _row(line: int, raw: bytes, input_format: str) -> RawRow | Unreadable:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        return Unreadable(line, f"not JSON ({error})")
    if not isinstance(value, dict):
        return Unreadable(line, "not a JSON object")
    fmt = row_format(value, input_format)
    if isinstance(fmt, str):
        return Unreadable(line, fmt)
    chat = fmt.chat(value)
    if isinstance(chat, str):
        return Unreadable(line, chat if input_format == AUTO else f"{chat} (read as {fmt.name})")
    return RawRow(line, {**value, "messages": [dict[str, JsonValue](message) for message in chat]}, fmt.name)


def reference_answers(value: JsonValue) -> tuple[str, ...]:
    """The gold alternatives of an ``answer`` field: a string, or lists of strings at any depth."""
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    if isinstance(value, list):
        return tuple(answer for item in value for answer in reference_answers(item))
    return ()


# ---- step 1: align the environment --------------------------------------------------------------

_DATE = re.compile(r"^\s*Current date:\s*(\S.*?)\s*$", re.MULTILINE)
_INLINE_QUESTION = re.compile(r"^User:[ \t]*", re.MULTILINE)
_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_SEARCH_HEADER = re.compile(r"^A (?:Google )?search for '(?P<query>.*)' found \d+ results?:$")
_NO_RESULTS = re.compile(r"^No results found for '(?P<query>.*)'")
_HIT = re.compile(r"^\d+\. \[(?P<title>.*)\]\((?P<url>\S*)\)$")


def align(raw: RawRow, events: Counter[str]) -> Transcript | Dropped:
    """Step 1: the question out of its prompt, tool calls in the §1 schema, search results in the
    search tool's format. The system prompt itself is rebuilt when the row is written (so the
    row's own tool schemas go); where they named the search parameter otherwise than the calls
    did, :func:`count_schema_mismatches` counts it."""
    messages = raw.fields["messages"]
    assert isinstance(messages, list)  # of {"role": str, "content": str}, checked by read_rows
    chat = [(str(m["role"]), str(m["content"])) for m in messages if isinstance(m, dict)]
    leading = 0
    while leading < len(chat) and chat[leading][0] == "system":
        leading += 1
    dates = [match.group(1) for _, text in chat[:leading] for match in _DATE.finditer(text)]
    rest = chat[leading:]
    question = question_of(rest[0][1]) if rest and rest[0][0] == "user" else None
    if question is None:
        return Dropped("no user question")
    turns: list[TranscriptTurn] = []
    raw_calls: list[ToolCall] = []  # the calls as the source wrote them, before normalise_call
    stray = 0
    for role, content in rest[1:]:
        if role == "assistant":
            turns.append(_aligned_turn(content, events, raw_calls))
        elif role in ("user", "tool", "function") and turns:
            # A tool-role message is a tool response in another chat format; a user message is
            # kept as written (step 4 rejects one that is not a <tool_response>).
            wrapped = role == "user" or content.lstrip().startswith(RESPONSE_OPEN)
            response = content if wrapped else render_tool_response(content)
            turns[-1] = dataclasses.replace(turns[-1], responses=(*turns[-1].responses, response))
        else:
            stray += 1
    turns = [_with_normalised_search(turn, events) for turn in turns]
    prompts = [text for _, text in chat[:leading]] + [rest[0][1]]
    count_schema_mismatches(declared_parameters(raw.fields, prompts), raw_calls, events)
    return Transcript(raw.line, question, dates[-1] if dates else None, tuple(turns),
                          reference_answers(raw.fields.get("answer")), stray)


def question_of(prompt: str) -> str | None:
    """The question in the first user message. A prompt that also lists tools (``<tools>``) holds
    the question after its last ``User:`` line outside the tool list, which never becomes part of
    it; without such a line, or with an unclosed tool list, the question cannot be told apart."""
    if "<tools>" not in prompt and "</tools>" not in prompt:
        return prompt.strip() or None
    outside = _TOOLS_BLOCK.sub("\n", prompt)
    if "<tools>" in outside or "</tools>" in outside:
        return None
    marks = list(_INLINE_QUESTION.finditer(outside))
    if not marks:
        return None
    return outside[marks[-1].end():].strip() or None


# ---- step 1: the row's own tool schemas against its calls ------------------------------------------

ToolParameters = dict[str, frozenset[str]]  # tool name -> the parameter names its schema declares


def declared_parameters(fields: JsonObject, prompts: Sequence[str]) -> list[ToolParameters]:
    """The parameters each of a row's tool schemas declares, one mapping per schema: the row's
    ``functions`` field, then every ``<tools>`` block in ``prompts``. A tool entry is a function
    object (``name`` or ``name_for_model``, ``parameters.properties``), bare or under OpenAI's
    ``{"type": "function", "function": ...}``; a block holds JSON values, one after another or
    separated by commas. What is not such an entry is skipped, and a schema with none is left out."""
    sources: list[list[JsonValue]] = []
    functions = fields.get("functions")
    if isinstance(functions, list):
        sources.append(functions)
    for prompt in prompts:
        sources.extend(_json_values(block.group(1)) for block in _TOOLS_BLOCK.finditer(prompt))
    return [names for names in map(_tool_parameters, sources) if names]


def _json_values(text: str) -> list[JsonValue]:
    """The JSON values in ``text`` up to the first that does not parse; lists flattened one level."""
    decoder = json.JSONDecoder()
    values: list[JsonValue] = []
    position = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return values
        values.extend(value if isinstance(value, list) else [value])


def _tool_parameters(entries: Sequence[JsonValue]) -> ToolParameters:
    declared: ToolParameters = {}
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("function"), dict):
            entry = entry["function"]
        if not isinstance(entry, dict):
            continue
        name = entry.get("name_for_model", entry.get("name"))
        parameters = entry.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(name, str) and name.strip() and isinstance(properties, dict):
            declared[name.strip()] = frozenset(properties)
    return declared


def count_schema_mismatches(schemas: Sequence[ToolParameters], calls: Sequence[ToolCall],
                            events: Counter[str]) -> None:
    """Count a row (and its calls) in :data:`SCHEMA_MISMATCHES` when one of its tool schemas
    declares a search parameter under one name and not the other while its calls (as written,
    before :func:`normalise_call`) use the other: the schema the source showed its model did not
    describe its own calls. Both names end up as the protocol's ``query``."""
    for (declared, used), (rows_event, calls_event) in SCHEMA_MISMATCHES.items():
        if not any(declared in names.get("search", ()) and used not in names.get("search", ())
                   for names in schemas):
            continue
        mismatched = sum(1 for call in calls if call.name == "search"
                         and used in call.arguments and declared not in call.arguments)
        if mismatched:
            events[rows_event] += 1
            events[calls_event] += mismatched


def schema_mismatch_lines(events: Counter[str]) -> list[str]:
    """One line per direction of :data:`SCHEMA_MISMATCHES` that step 1 met, for the report; a
    single line saying none when it met neither."""
    lines = []
    for (declared, used), (rows_event, calls_event) in SCHEMA_MISMATCHES.items():
        if events[rows_event]:
            lines.append(f"schema/call mismatches handled: {events[rows_event]} rows, "
                         f"{events[calls_event]} calls (schema says '{declared}', calls use "
                         f"'{used}'); schema replaced by the protocol's search schema")
    return lines or ["schema/call mismatches handled: 0 rows"]


def _aligned_turn(text: str, events: Counter[str], raw_calls: list[ToolCall]) -> TranscriptTurn:
    text = strip_stop(text)
    split = text.rfind(THINK_CLOSE) + len(THINK_CLOSE) if THINK_CLOSE in text else 0
    calls: list[ToolCall] = []
    broken = 0

    def canonical(match: re.Match[str]) -> str:
        nonlocal broken
        call = parse_call(match.group(1))
        if call is None:
            broken += 1
            return match.group(0)
        raw_calls.append(call)
        call = normalise_call(call, events)
        calls.append(call)
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"

    action = _CALL_BLOCK.sub(canonical, text[split:])
    return TranscriptTurn(text[:split] + action, (), tuple(calls), broken)


def parse_call(body: str) -> ToolCall | None:
    """A ``<tool_call>`` body read by the environment's parser (:func:`turnstile.envs.protocol.parse_call_body`),
    or None when the environment would refuse it."""
    call = parse_call_body(body, [])
    return None if call is None else ToolCall(*call)


def normalise_call(call: ToolCall, events: Counter[str]) -> ToolCall:
    """§1 search arguments: ``query`` (``queries`` renamed), always a list."""
    if call.name != "search":
        return call
    arguments = dict(call.arguments)
    if "queries" in arguments:
        queries = arguments.pop("queries")
        if "query" not in arguments:
            arguments["query"] = queries
            events[QUERIES_RENAMED] += 1
    if isinstance(arguments.get("query"), str):
        arguments["query"] = [arguments["query"]]
        events[QUERY_WRAPPED] += 1
    return ToolCall(call.name, arguments)


def _with_normalised_search(turn: TranscriptTurn, events: Counter[str]) -> TranscriptTurn:
    if not any(call.name == "search" for call in turn.calls):
        return turn
    responses = []
    for response in turn.responses:
        body = _response_body(response)
        normalised = normalise_search_results(body) if body is not None else None
        events[SEARCH_UNRECOGNISED if normalised is None else SEARCH_NORMALISED] += 1
        responses.append(response if normalised is None else render_tool_response(normalised))
    return dataclasses.replace(turn, responses=tuple(responses))


def _response_body(response: str) -> str | None:
    text = response.strip()
    if not (text.startswith(RESPONSE_OPEN) and text.endswith(RESPONSE_CLOSE)):
        return None
    return text[len(RESPONSE_OPEN):-len(RESPONSE_CLOSE)].strip()


def normalise_search_results(text: str) -> str | None:
    """Search results rewritten in the search tool's format (``format_results``, one section per
    query), or None when a section is not a result list this function knows. A hit's lines after
    its title line (a publication date, the snippet) become its snippet."""
    sections = []
    for section in text.split(QUERY_SEPARATOR):
        lines = section.strip().splitlines()
        header = _SEARCH_HEADER.match(lines[0]) if lines else None
        if header is None:
            empty = _NO_RESULTS.match(lines[0]) if lines else None
            if empty is None:
                return None
            sections.append(format_results(empty.group("query"), []))
            continue
        hits: list[SearchHit] = []
        for line in lines[1:]:
            hit = _HIT.match(line.strip())
            if hit is not None:
                hits.append(SearchHit(hit.group("title"), hit.group("url"), ""))
            elif hits and line.strip():
                last = hits[-1]
                snippet = f"{last.snippet}\n{line.strip()}" if last.snippet else line.strip()
                hits[-1] = SearchHit(last.title, last.url, snippet)
            elif line.strip() and line.strip() != "## Web Results":
                return None
        sections.append(format_results(header.group("query"), hits))
    return QUERY_SEPARATOR.join(sections)


# ---- steps 2 and 3: allowed tools, repeated calls -------------------------------------------------

def keep_allowed_tools(row: Transcript, allowed: Sequence[str], events: Counter[str]) -> Transcript:
    """Step 2: a turn calling a tool outside ``allowed`` goes, with its tool responses."""
    kept = [turn for turn in row.turns if all(call.name in allowed for call in turn.calls)]
    events[DISALLOWED_TURNS] += len(row.turns) - len(kept)
    return dataclasses.replace(row, turns=tuple(kept))


def call_signature(call: ToolCall) -> tuple[str, ...]:
    """What makes two calls the same: search, the set of queries; visit, the set of urls (the goal
    is ignored); any other tool, its arguments."""
    key = {"search": "query", "visit": "url"}.get(call.name)
    if key is None:
        return (call.name, json.dumps(call.arguments, sort_keys=True, ensure_ascii=False))
    value = call.arguments.get(key)
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return (call.name, *sorted({str(item).strip() for item in items}))


def remove_repeated_calls(row: Transcript, events: Counter[str]) -> Transcript:
    """Step 3: a turn whose every call was already made by a kept earlier turn goes, with its
    responses. Turns without a call (the answer) and turns with a broken call always stay."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for turn in row.turns:
        signatures = {call_signature(call) for call in turn.calls}
        if turn.calls and not turn.broken_calls and signatures <= seen:
            events[REPEATED_TURNS] += 1
            events[REPEATED_CALLS] += len(turn.calls)
            continue
        seen |= signatures
        kept.append(turn)
    return dataclasses.replace(row, turns=tuple(kept))


# ---- step 4: structure ----------------------------------------------------------------------------

def check_structure(row: Transcript, tools: dict[str, Tool]) -> Transcript | Dropped:
    """Step 4 (§1): think then exactly one well-formed tool call per turn, each answered by exactly
    one tool response, arguments the tool accepts, and a final well-formed answer turn."""
    if row.stray_messages:
        return Dropped("messages outside the turn structure")
    if not row.turns:
        return Dropped("no assistant turn")
    for turn in row.turns[:-1]:
        reason = _tool_turn_problem(turn, tools)
        if reason is not None:
            return Dropped(reason)
    last = row.turns[-1]
    parsed = parse_turn(last.text)
    if parsed.kind is not TurnKind.ANSWER:
        return Dropped("no final answer")
    if not parsed.format_ok or RESPONSE_OPEN in last.text:
        return Dropped("malformed answer turn")
    if last.responses:
        return Dropped("messages after the answer")
    return row


def _tool_turn_problem(turn: TranscriptTurn, tools: dict[str, Tool]) -> str | None:
    parsed = parse_turn(turn.text)
    if parsed.kind is TurnKind.ANSWER:
        return "answer before the last turn"
    if not parsed.format_ok or len(turn.calls) != 1 or RESPONSE_OPEN in turn.text:
        return "malformed tool-call turn"
    if len(turn.responses) != 1 or _response_body(turn.responses[0]) is None:
        return "tool call without exactly one tool response"
    call = turn.calls[0]
    try:
        tools[call.name].normalize(call.arguments)
    except ToolError:
        return f"{call.name} arguments the tool refuses"
    return None


# ---- step 5: the answer ---------------------------------------------------------------------------

def final_answer(row: Transcript) -> str:
    return parse_turn(row.turns[-1].text).answer or ""


async def answer_verdicts(rows: Sequence[Transcript], client: ChatClient | None) -> list[str]:
    """Per row: EXACT_MATCH (never judged), else the judge's verdict (JUDGE_ACCEPTED, JUDGE_REJECTED,
    JUDGE_UNREADABLE) when there is a judge and a reference, else UNVERIFIED."""

    async def verdict(row: Transcript) -> str:
        answer = final_answer(row)
        if answer_matches(answer, row.reference):
            return EXACT_MATCH
        if client is None or not row.reference:
            return UNVERIFIED
        reply = await client.complete(judge_messages(row.question, answer, row.reference))
        correct = parse_verdict(reply).correct
        if correct is None:
            return JUDGE_UNREADABLE
        return JUDGE_ACCEPTED if correct else JUDGE_REJECTED

    return list(await asyncio.gather(*(verdict(row) for row in rows)))


async def _judged(rows: Sequence[Transcript], config: CleanConfig) -> list[str]:
    client = ChatClient(config.judge) if config.judge is not None else None
    try:
        return await answer_verdicts(rows, client)
    finally:
        if client is not None:
            await client.aclose()


def keep_accepted(rows: Sequence[Transcript], verdicts: Sequence[str], require_correct: bool,
                  step: StepCount) -> list[Transcript]:
    """Step 5: exact matches and judge-accepted rows stay; unverified ones unless ``require_correct``."""
    kept = []
    for row, verdict in zip(rows, verdicts, strict=True):
        if verdict == UNVERIFIED and not require_correct:
            verdict = KEPT_UNVERIFIED
        elif verdict == UNVERIFIED:
            verdict = NOT_VERIFIED if row.reference else NO_REFERENCE
        if verdict in (EXACT_MATCH, JUDGE_ACCEPTED, KEPT_UNVERIFIED):
            step.record(row)
            step.events[verdict] += 1
            kept.append(row)
        else:
            step.record(Dropped(verdict))
    return kept


# ---- step 6 and output ----------------------------------------------------------------------------

def resample(rows: Iterable[JsonObject], tiers: Sequence[ResampleTier], step: StepCount
             ) -> Iterator[JsonObject]:
    """Step 6: each row ``copies_for(row["turns"])`` times, copies next to each other."""
    for row in rows:
        turns = row["turns"]
        copies = copies_for(turns if isinstance(turns, int) else 0, tiers)
        step.rows_in += 1
        step.rows_out += copies
        step.events[RESAMPLED_ROWS] += int(copies > 1)
        yield from [row] * copies


def tool_set(config: CleanConfig) -> dict[str, Tool]:
    """The environment's tools (built for their schemas and argument checks; never called)."""
    tools: dict[str, Tool] = {"search": SearchTool(_NoSearch(), max_queries=config.max_queries),
                              "visit": VisitTool()}
    return {name: tools[name] for name in KNOWN_TOOLS if name in config.allowed_tools}


class _NoSearch:
    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        raise RuntimeError("the search tool of turnstile data clean only describes itself")

    async def aclose(self) -> None:
        return None


def training_row(row: Transcript, tool_schemas: Sequence[JsonObject]) -> JsonObject:
    messages: list[JsonValue] = [
        {"role": "system", "content": system_prompt(tool_schemas, row.today)},
        {"role": "user", "content": row.question},
    ]
    for turn in row.turns:
        messages.append({"role": "assistant", "content": turn.text})
        messages.extend({"role": "user", "content": response} for response in turn.responses)
    return {"messages": messages, "answer": list(row.reference), "source_line": row.line,
            "turns": len(row.turns)}


# ---- the pipeline ---------------------------------------------------------------------------------

STEP_NAMES = ("align", "allowed tools", "repeated calls", "structure", "answer", "resample")
_SHOWN_EVENTS = {  # printed even when zero
    "align": (QUERIES_RENAMED, QUERY_WRAPPED, SEARCH_NORMALISED, SEARCH_UNRECOGNISED),
    "allowed tools": (DISALLOWED_TURNS,),
    "repeated calls": (REPEATED_TURNS, REPEATED_CALLS),
    "answer": (EXACT_MATCH, JUDGE_ACCEPTED, KEPT_UNVERIFIED),
    "resample": (RESAMPLED_ROWS,),
}


def clean_file(source: Path, target: Path, config: CleanConfig,
               progress: Callable[[str], None] | None = None) -> CleanReport:
    """Run the six steps over ``source`` and write the training rows to ``target`` atomically.
    Raises FileNotFoundError when ``source`` is missing; bad lines are reported, not raised."""
    if not source.is_file():
        raise FileNotFoundError(f"{source}: {'not a file' if source.exists() else 'no such file'}")
    steps = [StepCount(name, events=Counter(dict.fromkeys(_SHOWN_EVENTS.get(name, ()), 0)))
             for name in STEP_NAMES]
    align_step, tools_step, repeats_step, structure_step, answer_step, resample_step = steps
    tools = tool_set(config)
    unreadable: list[str] = []
    survivors: list[Transcript] = []
    formats: Counter[str] = Counter()
    rows_read = 0
    for item in read_rows(source, config.input_format):
        rows_read += 1
        if progress is not None and rows_read % PROGRESS_EVERY == 0:
            progress(f"{rows_read} rows read")
        if isinstance(item, Unreadable):
            unreadable.append(f"{source}:{item.line}: {item.reason}")
            continue
        formats[item.input_format] += 1
        result: Transcript | Dropped = align(item, align_step.events)
        align_step.record(result)
        if isinstance(result, Dropped):
            continue
        result = keep_allowed_tools(result, config.allowed_tools, tools_step.events)
        tools_step.record(result)
        result = remove_repeated_calls(result, repeats_step.events)
        repeats_step.record(result)
        result = check_structure(result, tools)
        structure_step.record(result)
        if not isinstance(result, Dropped):
            survivors.append(result)
    if not formats:
        raise no_readable_rows(source, rows_read, unreadable, config.input_format)
    if progress is not None and config.judge is not None:
        progress(f"judging the answers of {len(survivors)} rows")
    verdicts = asyncio.run(_judged(survivors, config))
    accepted = keep_accepted(survivors, verdicts, config.require_correct, answer_step)
    schemas = Toolbox(list(tools.values())).schemas()
    rows = (training_row(row, schemas) for row in accepted)
    write_records(target, resample(rows, config.resample, resample_step))
    return CleanReport(source, rows_read, unreadable, steps, resample_step.rows_out, formats)


def no_readable_rows(source: Path, rows_read: int, unreadable: Sequence[str],
                     input_format: str) -> NoReadableRows:
    """The error for an input in which no line is a row: what was found, and the formats known."""
    found = (f"no readable row among its {rows_read} lines (first: {unreadable[0]})" if unreadable
             else "no readable row: the file holds no rows")
    hint = "" if input_format == AUTO else f"; it was read as {input_format} (--format auto recognises rows)"
    return NoReadableRows(f"{source}: {found}; known formats: {known_formats()}{hint}")

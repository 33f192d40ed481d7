"""The agent protocol of docs/algorithms.md §1: how an assistant turn is written, parsed and checked.

It is the protocol of Tongyi DeepResearch / WebSailor / DR-Venus, so public trajectories and
checkpoints trained on it work unchanged. The environment speaks it (it parses every action), and the
rollout side uses the same module to build prompts and read back what the policy wrote.

Parsing never raises on model output: whatever the text, :func:`parse_turn` returns a
:class:`ParsedTurn` whose ``errors`` say what is wrong, in words the corrective observation shows the
model. Its cost is bounded, because it runs on a rollout worker's event loop beside every other
episode: a tool call longer than ``max_call_chars`` is refused before any JSON parser sees it, the
lenient json5 parser (about 5 µs a character, pure Python) only reads calls of up to
``JSON5_MAX_CHARS``, and arguments nested deeper than ``MAX_ARGUMENT_DEPTH`` or holding a lone UTF-16
surrogate (which no file, cache key or HTTP request can encode) make the turn malformed.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import json5

from turnstile.envs.tools.base import JsonObject

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
REPORT_OPEN, REPORT_CLOSE = "<report>", "</report>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# What a generation may end with: the stop string itself (vLLM can include it) and end-of-turn marks.
_TRAILING_STOPS = (RESPONSE_OPEN, "<|im_end|>", "<|endoftext|>")

MAX_CALL_CHARS = 16_384  # default size limit of one tool call body (EnvConfig.max_tool_call_chars)
JSON5_MAX_CHARS = 2_048  # longer calls must be strict JSON: json5 would hold the event loop ~10 ms+
MAX_ARGUMENT_DEPTH = 16  # nesting of objects/lists in a call's arguments
_SURROGATE = re.compile("[\ud800-\udfff]")

FINAL_ANSWER_INSTRUCTION = (
    "You have used all the tool calls and context available for this question. Do not call any more "
    "tools. Based on what you have found, give your final answer now: write your reasoning in "
    "<think></think>, then the answer in <answer></answer>."
)


class StopReason(enum.Enum):
    """Why an episode ended. The environment ends one with the first three (:class:`turnstile.envs.env.StepInfo`'s
    ``end``); the episode loop adds the others (engine, budget and wall-clock limits, failures)."""

    ANSWERED = "answered"  # a well-formed answer
    MALFORMED_ANSWER = "malformed_answer"  # an answer attempt that failed the format check
    NO_ANSWER = "no_answer"  # the forced-answer turn (max turns or budget) did not answer
    CONTEXT_OVERFLOW = "context_overflow"  # the context budget ran out and no answer followed
    MAX_TOKENS = "max_tokens"  # a turn hit max_new_tokens on the forced-answer turn
    ENGINE_ERROR = "engine_error"  # the policy engine failed; the episode is incomplete
    TIMEOUT = "timeout"  # the episode's wall-clock limit passed
    STALLED = "stalled"  # its calls brought nothing new for too long, a warning included (env.stall_turns)
    ERROR = "error"  # anything else failed (metadata["error"] says what); the episode is incomplete


class TurnKind(enum.Enum):
    TOOL_CALL = "tool_call"
    ANSWER = "answer"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class ParsedTurn:
    """What an assistant turn says, and whether it is well formed.

    ``kind`` is ANSWER for any turn that tries to answer (has an ``<answer>`` tag and no tool-call
    tag), even a malformed one: an answer attempt ends the episode and its format is folded into the
    outcome (docs/algorithms.md §3). A malformed turn that is not an answer attempt is MALFORMED.
    """

    kind: TurnKind
    format_ok: bool
    errors: tuple[str, ...] = ()
    think: str = ""
    report: str | None = None
    tool: str | None = None
    arguments: JsonObject = field(default_factory=dict)
    answer: str | None = None


def strip_stop(text: str) -> str:
    """Drop a trailing stop string or end-of-turn mark that generation may have kept."""
    stripped = text.rstrip()
    changed = True
    while changed:
        changed = False
        for stop in _TRAILING_STOPS:
            if stripped.endswith(stop):
                stripped = stripped[: -len(stop)].rstrip()
                changed = True
    return stripped


def without_surrogates(text: str) -> str:
    """``text`` with every lone UTF-16 surrogate replaced by U+FFFD, so it can be encoded as UTF-8
    (engines that do not decode through a tokenizer can hand back such strings)."""
    return _SURROGATE.sub("\ufffd", text)


def parse_turn(text: str, *, require_think: bool = True, expect_report: bool = False,
               max_call_chars: int = MAX_CALL_CHARS) -> ParsedTurn:
    """Parse and check one assistant turn (docs/algorithms.md §1).

    ``expect_report`` is the iter_research variant: a ``<report>`` block may stand between the think
    block and the action (it is required there). A tool call body longer than ``max_call_chars``
    makes the turn malformed without being parsed.
    """
    body = strip_stop(without_surrogates(text))
    errors: list[str] = []
    if not body.strip():
        return ParsedTurn(TurnKind.MALFORMED, False, ("the message is empty",))

    think, rest = _split_think(body, require_think, errors)
    report, rest = _split_report(rest, expect_report, errors)

    has_call = CALL_OPEN in rest or CALL_CLOSE in rest
    has_answer = ANSWER_OPEN in rest or ANSWER_CLOSE in rest
    if has_answer and not has_call:
        return _answer_turn(rest, think, report, errors)
    if has_call:
        return _tool_call_turn(rest, think, report, errors, also_answer=has_answer,
                               max_call_chars=max_call_chars)
    errors.append("no <tool_call> or <answer> after </think>")
    return ParsedTurn(TurnKind.MALFORMED, False, tuple(errors), think=think, report=report)


def _split_think(body: str, require_think: bool, errors: list[str]) -> tuple[str, str]:
    opens, closes = body.count(THINK_OPEN), body.count(THINK_CLOSE)
    if opens == 0 and closes == 0:
        if require_think:
            errors.append("the message must start with <think>...</think>")
        return "", body.strip()
    first = body.find(THINK_OPEN)
    if first == -1 or body[:first].strip():
        errors.append("nothing may come before the first <think>")
    if opens != closes or not _balanced(body, THINK_OPEN, THINK_CLOSE):
        errors.append("<think> and </think> tags are not balanced")
    last_close = body.rfind(THINK_CLOSE)
    if last_close == -1:
        return body[first + len(THINK_OPEN):].strip() if first != -1 else "", ""
    start = first + len(THINK_OPEN) if first != -1 else 0
    return body[start:last_close].strip(), body[last_close + len(THINK_CLOSE):].strip()


def _balanced(text: str, open_tag: str, close_tag: str) -> bool:
    depth = 0
    for match in re.finditer(re.escape(open_tag) + "|" + re.escape(close_tag), text):
        depth += 1 if match.group(0) == open_tag else -1
        if depth < 0:
            return False
    return depth == 0


def _split_report(rest: str, expect_report: bool, errors: list[str]) -> tuple[str | None, str]:
    if not expect_report:
        if REPORT_OPEN in rest or REPORT_CLOSE in rest:
            errors.append("<report> is not part of this protocol")
        return None, rest
    if not rest.startswith(REPORT_OPEN) or rest.count(REPORT_OPEN) != 1 or rest.count(REPORT_CLOSE) != 1:
        errors.append("write exactly one <report>...</report> right after </think>")
        return None, rest
    end = rest.find(REPORT_CLOSE)
    return rest[len(REPORT_OPEN):end].strip(), rest[end + len(REPORT_CLOSE):].strip()


def _answer_turn(rest: str, think: str, report: str | None, errors: list[str]) -> ParsedTurn:
    start, end = rest.find(ANSWER_OPEN), rest.find(ANSWER_CLOSE)
    if rest.count(ANSWER_OPEN) != 1 or rest.count(ANSWER_CLOSE) != 1 or end < start:
        errors.append("write exactly one <answer>...</answer>")
        return ParsedTurn(TurnKind.ANSWER, False, tuple(errors), think=think, report=report)
    answer = rest[start + len(ANSWER_OPEN):end].strip()
    if rest[:start].strip() or rest[end + len(ANSWER_CLOSE):].strip():
        errors.append("nothing may stand around <answer>...</answer>")
    if not answer:
        errors.append("the answer is empty")
    return ParsedTurn(TurnKind.ANSWER, not errors, tuple(errors), think=think, report=report,
                      answer=answer or None)


def _tool_call_turn(rest: str, think: str, report: str | None, errors: list[str],
                    also_answer: bool, max_call_chars: int) -> ParsedTurn:
    if also_answer:
        errors.append("a turn holds a tool call or an answer, not both")
    if rest.count(CALL_OPEN) != 1 or rest.count(CALL_CLOSE) != 1:
        errors.append("write exactly one <tool_call>...</tool_call>")
        return ParsedTurn(TurnKind.MALFORMED, False, tuple(errors), think=think, report=report)
    start, end = rest.find(CALL_OPEN), rest.find(CALL_CLOSE)
    if end < start:
        errors.append("</tool_call> comes before <tool_call>")
        return ParsedTurn(TurnKind.MALFORMED, False, tuple(errors), think=think, report=report)
    if rest[:start].strip() or rest[end + len(CALL_CLOSE):].strip():
        errors.append("nothing may stand around <tool_call>...</tool_call>")
    call = parse_call_body(rest[start + len(CALL_OPEN):end], errors, max_call_chars)
    if call is None or errors:
        return ParsedTurn(TurnKind.MALFORMED, False, tuple(errors), think=think, report=report)
    name, arguments = call
    return ParsedTurn(TurnKind.TOOL_CALL, True, (), think=think, report=report, tool=name,
                      arguments=arguments)


def parse_call_body(raw: str, errors: list[str],
                    max_call_chars: int = MAX_CALL_CHARS) -> tuple[str, JsonObject] | None:
    """A ``<tool_call>`` body as ``(name, arguments)``, or None with the reasons (worded for the
    model) appended to ``errors``: JSON (JSON5 tolerated up to ``JSON5_MAX_CHARS``), an object with a
    string ``name`` and an object ``arguments``, within the size, depth and text limits. Never raises.
    The one call parser: the environment's turns and ``turnstile data clean``'s rows."""
    text = raw.strip()
    if len(text) > max_call_chars:
        errors.append(f"the tool call is {len(text)} characters long; at most {max_call_chars} are read")
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        errors.append(f"the tool call is nested too deeply (at most {MAX_ARGUMENT_DEPTH} levels)")
        return None
    except ValueError:
        if len(text) > JSON5_MAX_CHARS:
            errors.append(f'the tool call is not valid JSON (a call over {JSON5_MAX_CHARS} characters '
                          f'must be strict JSON): write {{"name": ..., "arguments": {{...}}}}')
            return None
        try:
            value = json5.loads(text)
        except (ValueError, RecursionError, TypeError, OverflowError):
            errors.append('the tool call is not valid JSON: write {"name": ..., "arguments": {...}}')
            return None
    if not isinstance(value, dict):
        errors.append('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name.strip():
        errors.append('the tool call needs a string "name"')
        return None
    if not isinstance(arguments, dict):
        errors.append('the tool call needs an object "arguments"')
        return None
    problem = _argument_problem(value)
    if problem:
        errors.append(problem)
        return None
    return name.strip(), arguments


def _argument_problem(value: object) -> str | None:
    """Why a parsed call cannot be run as it is (too deep, unencodable text), walked without
    recursion so that no depth of nesting can raise."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return "the tool call holds a lone UTF-16 surrogate (an invalid \\ud800-\\udfff escape)"
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return "the tool call holds NaN or Infinity, which JSON does not allow"
        children = list(item.items()) if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth >= MAX_ARGUMENT_DEPTH:
            return f"the tool call is nested too deeply (at most {MAX_ARGUMENT_DEPTH} levels)"
        for child in children:
            if isinstance(child, tuple):  # a dict entry: its key is text too
                stack.append((child[0], depth))
                stack.append((child[1], depth + 1))
            else:
                stack.append((child, depth + 1))
    return None


# ---- rendering ---------------------------------------------------------------------------------

def render_tool_response(text: str) -> str:
    """The user message that carries a tool's result back to the model."""
    return f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}"


def render_correction(errors: Sequence[str], tool_names: Sequence[str]) -> str:
    """The corrective observation for a malformed turn: what was wrong and what to write instead."""
    problems = "; ".join(errors) if errors else "the message does not follow the format"
    tools = ", ".join(tool_names)
    return render_tool_response(
        f"Your last message could not be executed: {problems}. Write <think>your reasoning</think> "
        f"followed by exactly one <tool_call>\n{{\"name\": TOOL, \"arguments\": {{...}}}}\n</tool_call> "
        f"(tools: {tools}) or by <answer>your final answer</answer>."
    )


def render_stall_warning(turns: int) -> str:
    """The note added to a tool response after ``turns`` calls in a row brought nothing new."""
    return (f"\n[note] Your last {turns} tool calls brought nothing new (a call made before, or a result "
            f"already seen). Try another query or page, or answer. If the next {turns} calls bring "
            f"nothing new either, the episode ends without an answer.")


def render_tool_call(name: str, arguments: JsonObject, think: str, report: str | None = None) -> str:
    """An assistant turn calling a tool, exactly as the protocol wants it (used by scripted policies)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    middle = f"\n{REPORT_OPEN}\n{report}\n{REPORT_CLOSE}" if report is not None else ""
    return f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}{middle}\n{CALL_OPEN}\n{call}\n{CALL_CLOSE}"


def render_answer(answer: str, think: str, report: str | None = None) -> str:
    """An assistant turn giving the final answer."""
    middle = f"\n{REPORT_OPEN}\n{report}\n{REPORT_CLOSE}" if report is not None else ""
    return f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}{middle}\n{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


REPORT_INSTRUCTION = (
    "\n\nAfter </think>, write your research report in <report></report> before the tool call or "
    "the answer: everything you have established so far and what remains open. Each report replaces "
    "the previous one, and it is all you will see of your earlier work besides the last tool call "
    "and its result."
)


RESEARCH_ROLE = ("You are a deep research assistant. Answer the user's question by searching and reading "
                 "web pages: think step by step, call one tool per message, and keep going until you are sure.")


def system_prompt(tool_schemas: Sequence[JsonObject], today: str | None = None,
                  report: bool = False, role: str = RESEARCH_ROLE) -> str:
    """The system prompt: the ``role``, the tools as JSON schemas, and the turn format (with the
    ``<report>`` block of iter_research when ``report``)."""
    tools = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in tool_schemas)
    date = f"\n\nCurrent date: {today}" if today else ""
    return (
        f"{role}"
        "\n\n# Tools\n\nYou may call one of these functions per message:\n<tools>\n"
        f"{tools}\n</tools>\n\n"
        "Each message starts with your reasoning in <think></think>. Then call a tool with "
        "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call> "
        "or, when you know the answer, give it in <answer></answer>. Tool results come back inside "
        f"<tool_response></tool_response>.{REPORT_INSTRUCTION if report else ''}{date}"
    )

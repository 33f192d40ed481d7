"""Agent protocol (docs/algorithms.md §1): parsing, format check, rendering; never raises on model text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.envs.protocol import (
    TurnKind,
    parse_turn,
    render_answer,
    render_correction,
    render_tool_call,
    strip_stop,
    without_surrogates,
)


def test_rendered_tool_call_parses_back() -> None:
    turn = parse_turn(render_tool_call("search", {"query": ["a b", "c"]}, "let me look"))
    assert turn.kind is TurnKind.TOOL_CALL and turn.format_ok
    assert turn.tool == "search" and turn.arguments == {"query": ["a b", "c"]}
    assert turn.think == "let me look"


def test_rendered_answer_parses_back() -> None:
    turn = parse_turn(render_answer("Chief of Protocol", "found it"))
    assert turn.kind is TurnKind.ANSWER and turn.format_ok and turn.answer == "Chief of Protocol"


def test_json5_body_is_tolerated() -> None:
    text = "<think>x</think>\n<tool_call>\n{name: 'visit', arguments: {url: 'http://a.b/', goal: 'g',},}\n</tool_call>"
    turn = parse_turn(text)
    assert turn.format_ok and turn.tool == "visit" and turn.arguments["url"] == "http://a.b/"


def test_trailing_stop_string_is_dropped() -> None:
    text = render_tool_call("search", {"query": ["q"]}, "t") + "\n<tool_response>"
    assert parse_turn(text).format_ok
    assert strip_stop("abc<|im_end|>") == "abc"


@pytest.mark.parametrize(
    ("text", "kind", "needle"),
    [
        ("", TurnKind.MALFORMED, "empty"),
        ("   \n", TurnKind.MALFORMED, "empty"),
        ("hello <think>a</think><answer>x</answer>", TurnKind.ANSWER, "before the first <think>"),
        ("<think>a</think> text <answer>x</answer>", TurnKind.ANSWER, "around <answer>"),
        ("<think>a</think><answer> </answer>", TurnKind.ANSWER, "empty"),
        ("<think>a</think><answer>x</answer><answer>y</answer>", TurnKind.ANSWER, "exactly one <answer>"),
        ("<think>a</think><answer>x", TurnKind.ANSWER, "exactly one <answer>"),
        ("<think>a<think>b</think>", TurnKind.MALFORMED, "not balanced"),
        ("<think>a</think>", TurnKind.MALFORMED, "no <tool_call> or <answer>"),
        ("<answer>x</answer>", TurnKind.ANSWER, "start with <think>"),
        ("<think>a</think><tool_call>{\"name\": \"s\"}</tool_call>", TurnKind.MALFORMED, "object \"arguments\""),
        ("<think>a</think><tool_call>{\"arguments\": {}}</tool_call>", TurnKind.MALFORMED, "string \"name\""),
        ("<think>a</think><tool_call>[1, 2]</tool_call>", TurnKind.MALFORMED, "JSON object"),
        ("<think>a</think><tool_call>{oops</tool_call>", TurnKind.MALFORMED, "not valid JSON"),
        ("<think>a</think><tool_call>{\"name\":\"s\",\"arguments\":{}}</tool_call><tool_call>{}</tool_call>",
         TurnKind.MALFORMED, "exactly one <tool_call>"),
        ("<think>a</think>so <tool_call>{\"name\":\"s\",\"arguments\":{}}</tool_call>", TurnKind.MALFORMED,
         "around <tool_call>"),
        ("<think>a</think><tool_call>{\"name\":\"s\",\"arguments\":{}}</tool_call><answer>x</answer>",
         TurnKind.MALFORMED, "not both"),
        ("<think>a</think></tool_call>{\"name\":\"s\",\"arguments\":{}}<tool_call>", TurnKind.MALFORMED,
         "comes before"),
    ],
)
def test_malformed_turns_name_the_problem(text: str, kind: TurnKind, needle: str) -> None:
    turn = parse_turn(text)
    assert not turn.format_ok
    assert turn.kind is kind
    assert any(needle in error for error in turn.errors), turn.errors


def test_report_protocol() -> None:
    ok = parse_turn(render_tool_call("search", {"query": ["q"]}, "t", report="memory"), expect_report=True)
    assert ok.format_ok and ok.report == "memory"
    missing = parse_turn(render_tool_call("search", {"query": ["q"]}, "t"), expect_report=True)
    assert not missing.format_ok
    unexpected = parse_turn(render_answer("x", "t", report="m"))
    assert not unexpected.format_ok


def test_correction_lists_problems_and_tools() -> None:
    text = render_correction(["the message is empty"], ["search", "visit"])
    assert text.startswith("<tool_response>\n") and text.endswith("\n</tool_response>")
    assert "the message is empty" in text and "search, visit" in text


TAGS = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>",
                        "<report>", "</report>", "<tool_response>", "{", "}", '"name"', '"arguments"',
                        ":", ",", "\n", " ", "[", "]", "'", "\\", "search", "visit"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(TAGS, st.text(max_size=8)), max_size=30), st.booleans())
def test_parse_never_raises(parts: list[str], expect_report: bool) -> None:
    turn = parse_turn("".join(parts), expect_report=expect_report)
    assert turn.format_ok == (not turn.errors)
    if turn.format_ok:
        assert (turn.kind is TurnKind.TOOL_CALL) == (turn.tool is not None)


# ---- hostile output: bounded, never raising ------------------------------------------------------

def call_turn(body: str) -> str:
    return f"<think>t</think>\n<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize("body, error", [
    ('{"name": "search", "arguments": {"query": ' + "[" * 1000 + "]" * 1000 + "}}", "nested too deeply"),
    ("[" * 100_000, "at most"),
    ("[" * 2_000, "nested too deeply"),
    ("{" * 16_000, "not valid JSON"),
    ('{"name": "search", "arguments": {"query": "\\ud800"}}', "lone UTF-16 surrogate"),
    ('{"name": "search", "arguments": {"\\udfff": "q"}}', "lone UTF-16 surrogate"),
    ('{"name": "search", "arguments": {"query": NaN}}', "NaN or Infinity"),
    ('{"name": "search", "arguments": {"query": [[[[[[[[[[[[[[[[["q"]]]]]]]]]]]]]]]]]}}', "nested too deeply"),
])
def test_hostile_tool_calls_are_malformed_turns(body: str, error: str) -> None:
    turn = parse_turn(call_turn(body))
    assert turn.kind is TurnKind.MALFORMED and not turn.format_ok
    assert any(error in e for e in turn.errors), turn.errors


def test_size_limit_is_checked_before_any_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    import turnstile.envs.protocol as protocol

    def refuse(*_: object, **__: object) -> object:
        raise AssertionError("a parser ran on an oversized or long non-JSON call")

    lenient = "{'name': 'search', 'arguments': {'query': '" + "a" * 1_000_000 + "'}}"
    monkeypatch.setattr(protocol.json5, "loads", refuse)
    turn = parse_turn(call_turn(lenient))  # 1 MB that only json5 reads: 9-15 s of event loop before
    assert "at most 16384" in turn.errors[0]
    monkeypatch.setattr(protocol.json, "loads", refuse)
    assert "at most 100" in parse_turn(call_turn(lenient[:5000]), max_call_chars=100).errors[0]


def test_long_lenient_call_needs_strict_json(monkeypatch: pytest.MonkeyPatch) -> None:
    import turnstile.envs.protocol as protocol

    calls: list[int] = []
    real = protocol.json5.loads
    monkeypatch.setattr(protocol.json5, "loads", lambda text: calls.append(len(text)) or real(text))
    short = parse_turn(call_turn("{'name': 'search', 'arguments': {'query': 'q'}}"))
    assert short.kind is TurnKind.TOOL_CALL and short.arguments == {"query": "q"}
    long = parse_turn(call_turn("{'name': 'search', 'arguments': {'query': '" + "a" * 3000 + "'}}"))
    assert long.kind is TurnKind.MALFORMED and "strict JSON" in long.errors[0]
    assert len(calls) == 1  # json5 read the short call only
    strict = parse_turn(call_turn(json.dumps({"name": "search", "arguments": {"query": "a" * 3000}})))
    assert strict.kind is TurnKind.TOOL_CALL


def test_raw_surrogates_are_replaced_not_raised() -> None:
    turn = parse_turn("<think>a\ud800b</think>\n<answer>x\udc00</answer>")
    assert turn.format_ok and turn.think == "a\ufffdb" and turn.answer == "x\ufffd"
    turn.answer.encode("utf-8")  # encodable everywhere downstream
    assert without_surrogates("ok\ud83d\ude00") == "ok\ufffd\ufffd"  # a lone pair in str is two lone halves


HOSTILE = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=40),
    st.integers(1, 5000).map(lambda n: "[" * n),
    st.integers(1, 5000).map(lambda n: '{"a":' * n),
    st.integers(1, 3000).map(lambda n: "{'name': 'search', 'arguments': {'q': '" + "x" * n + "'}}"),
    st.sampled_from(['"\\ud800"', '"\\udfff\\ud800"', "\x00", '"\\u0000"', "NaN", "-Infinity", "1e999",
                     '{"name": "search", "arguments": {"query": "\\ud800"}}',
                     '{"name": "search", "arguments": {"query": "a\\u0000b"}}',
                     '{"name": "search", "arguments": {"query": 1e999}}']),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(HOSTILE, TAGS), min_size=1, max_size=6).map("".join))
def test_hostile_text_never_raises(body: str) -> None:
    for text in (body, call_turn(body)):
        turn = parse_turn(text)
        assert turn.format_ok == (not turn.errors)
        json.dumps(turn.arguments, ensure_ascii=False).encode("utf-8")  # what caches and files need
        for part in (turn.think, turn.answer or "", *turn.errors):
            part.encode("utf-8")

"""Agent protocol (ALGORITHMS.md §1): parsing, format check, rendering; never raises on model text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.protocol import (
    TurnKind,
    parse_turn,
    render_answer,
    render_correction,
    render_tool_call,
    strip_stop,
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

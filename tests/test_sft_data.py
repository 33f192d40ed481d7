"""``turnstile data clean`` (docs/algorithms.md §10): each step on hand-written rows, the DR-Venus
resampling figures, the judge over a local endpoint, and the command on the WebDancer sample."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.openai_server import Reply, chat_server
from turnstile.cluster.cli.commands import data as data_command
from turnstile.envs.answers import answer_matches
from turnstile.envs.chat_client import ChatClientConfig, ChatUnavailable
from turnstile.envs.protocol import (
    parse_turn,
    render_answer,
    render_tool_call,
    render_tool_response,
)
from turnstile.learner.sft_data import (
    DEFAULT_RESAMPLE,
    DISALLOWED_TURNS,
    EXACT_MATCH,
    JUDGE_ACCEPTED,
    JUDGE_REJECTED,
    JUDGE_UNREADABLE,
    KEPT_UNVERIFIED,
    NOT_VERIFIED,
    QUERIES_RENAMED,
    QUERY_WRAPPED,
    REPEATED_CALLS,
    REPEATED_TURNS,
    SCHEMA_MISMATCHES,
    SEARCH_NORMALISED,
    SEARCH_UNRECOGNISED,
    CleanConfig,
    Dropped,
    RawRow,
    StepCount,
    Transcript,
    align,
    check_structure,
    clean_file,
    copies_for,
    keep_allowed_tools,
    normalise_search_results,
    parse_resample,
    remove_repeated_calls,
    resample,
    schema_mismatch_lines,
    tool_set,
)

Message = dict[str, str]

# The shape of a WebDancer row: a system prompt with a date, and a first user message that carries
# the tool list and the instructions before the question.
SYSTEM = "You are a Web Information Seeking Master.\nCurrent date: 2025-07-18"
PROMPT = ('A conversation between User and Assistant.\n<tools>\n{"name": "search", "parameters": '
          '{"properties": {"queries": {"type": "array"}}}}\n</tools>\n\nExample response:\n'
          "<think> thinking process here </think>\n\nUser: ")


def google_results(query: str, hits: list[tuple[str, str, str]]) -> str:
    entries = [f"{rank}. [{title}]({url})\nDate published: May 1, 2024\n\n{snippet}"
               for rank, (title, url, snippet) in enumerate(hits, start=1)]
    return (f"A Google search for '{query}' found {len(hits)} results:\n\n## Web Results\n"
            + "\n\n".join(entries) + "\n")


def tool_turn(name: str, arguments: dict[str, object], response: str) -> list[Message]:
    return [{"role": "assistant", "content": render_tool_call(name, arguments, f"I call {name}.")},
            {"role": "user", "content": render_tool_response(response)}]


def search_turn(queries: list[str] | str, key: str = "query") -> list[Message]:
    listed = [queries] if isinstance(queries, str) else queries
    results = "\n=======\n".join(
        google_results(q, [(f"{q} page", f"https://example.org/{i}", f"About {q}.")])
        for i, q in enumerate(listed))
    return tool_turn("search", {key: queries}, results)


def visit_turn(urls: list[str], goal: str) -> list[Message]:
    return tool_turn("visit", {"url": urls, "goal": goal},
                     f"The useful information in {urls[0]} for user goal {goal} as follows: ...")


def answer_turn(answer: str) -> list[Message]:
    return [{"role": "assistant", "content": render_answer(answer, "I know it now.")}]


def raw_row(*turns: list[Message], answer: object = "Paris", line: int = 1,
            question: str = "What is the capital of France?", prompt: str = PROMPT,
            system: str = SYSTEM, functions: object = None) -> RawRow:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt + question}]
    for turn in turns:
        messages.extend(turn)
    fields: dict[str, object] = {"messages": messages, "answer": answer}
    if functions is not None:
        fields["functions"] = functions
    return RawRow(line, fields)  # type: ignore[arg-type]


def aligned(*turns: list[Message], answer: object = "Paris") -> Transcript:
    row = align(raw_row(*turns, answer=answer), Counter())
    assert isinstance(row, Transcript)
    return row


def assistant_calls(messages: list[Message]) -> list[dict]:
    calls = []
    for message in messages:
        if message["role"] == "assistant":
            calls += [json.loads(body) for body in
                      re.findall(r"<tool_call>(.*?)</tool_call>", message["content"], re.DOTALL)]
    return calls


# ---- step 1: align -------------------------------------------------------------------------------

def test_align_takes_the_question_and_date_out_of_the_source_prompts() -> None:
    row = aligned(search_turn(["paris"]), answer_turn("Paris"), answer=[["Paris", "Paris, France"]])
    assert row.question == "What is the capital of France?"
    assert row.today == "2025-07-18"
    assert row.reference == ("Paris", "Paris, France")  # nested answer lists flattened
    assert len(row.turns) == 2 and len(row.turns[0].responses) == 1


def test_align_renames_queries_and_wraps_a_bare_query() -> None:
    events: Counter[str] = Counter()
    row = align(raw_row(search_turn(["a", "b"], key="queries"), search_turn("c"),
                        search_turn(["d"]), answer_turn("Paris")), events)
    assert isinstance(row, Transcript)
    assert [call.arguments for turn in row.turns for call in turn.calls] == [
        {"query": ["a", "b"]}, {"query": ["c"]}, {"query": ["d"]}]
    assert events[QUERIES_RENAMED] == 1 and events[QUERY_WRAPPED] == 1
    # the assistant text itself now holds the §1 call
    assert '{"name": "search", "arguments": {"query": ["a", "b"]}}' in row.turns[0].text
    assert "queries" not in row.turns[0].text


# The two ways WebDancer rows declare their tools: a ``functions`` field and a <tools> block.
def webdancer_functions(search_parameter: str) -> list[dict[str, object]]:
    return [{"name_for_human": "search", "name_for_model": "search",
             "parameters": {"type": "object", "properties": {search_parameter: {"type": "array"}},
                            "required": ["query"]}},
            {"name_for_model": "visit",
             "parameters": {"properties": {"url": {"type": "array"}, "goal": {"type": "string"}}}}]


def tools_prompt(search_parameter: str) -> str:
    return PROMPT.replace('"queries"', json.dumps(search_parameter))


QUERIES_ROWS, QUERIES_CALLS = SCHEMA_MISMATCHES[("queries", "query")]
QUERY_ROWS, QUERY_CALLS = SCHEMA_MISMATCHES[("query", "queries")]
MISMATCH_EVENTS = (QUERIES_ROWS, QUERIES_CALLS, QUERY_ROWS, QUERY_CALLS)


def mismatch_counts(row: RawRow) -> tuple[int, ...]:
    events: Counter[str] = Counter()
    assert isinstance(align(row, events), Transcript)
    return tuple(events[event] for event in MISMATCH_EVENTS)


def test_a_schema_naming_queries_while_the_calls_use_query_is_counted() -> None:
    turns = (search_turn(["a"]), visit_turn(["https://a.org"], "g"), search_turn("b"),
             answer_turn("Paris"))
    # WebDancer's defect: "queries" in ``functions``, "query" in the prompt's list and the calls.
    row = raw_row(*turns, prompt=tools_prompt("query"), functions=webdancer_functions("queries"))
    assert mismatch_counts(row) == (1, 2, 0, 0)  # one row, its two search calls
    # The prompt's tool list alone is enough to count it, and so is one in the system prompt.
    assert mismatch_counts(raw_row(*turns, prompt=tools_prompt("queries"))) == (1, 2, 0, 0)
    listed = ('<tools>\n{"type": "function", "function": {"name": "search", "parameters": '
              '{"properties": {"queries": {}}}}}\n{"type": "function", "function": {"name": "visit"}}'
              '\n</tools>')
    assert mismatch_counts(raw_row(*turns, system=f"{SYSTEM}\n{listed}", prompt="",
                                   question="Q?")) == (1, 2, 0, 0)
    # The reverse: the schema says "query", a call writes "queries" (and is renamed).
    events: Counter[str] = Counter()
    reverse = raw_row(search_turn(["a"], key="queries"), search_turn(["b"]), answer_turn("Paris"),
                      prompt=tools_prompt("query"), functions=webdancer_functions("query"))
    assert isinstance(align(reverse, events), Transcript)
    assert tuple(events[event] for event in MISMATCH_EVENTS) == (0, 0, 1, 1)
    assert events[QUERIES_RENAMED] == 1


def test_a_schema_that_agrees_with_its_calls_is_not_counted() -> None:
    turns = (search_turn(["a"]), visit_turn(["https://a.org"], "g"), answer_turn("Paris"))
    agreeing = raw_row(*turns, prompt=tools_prompt("query"), functions=webdancer_functions("query"))
    assert mismatch_counts(agreeing) == (0, 0, 0, 0)
    # A schema that declares both names, none at all, or no search call: nothing to count.
    both = tools_prompt("query").replace('{"query": {"type": "array"}}',
                                         '{"query": {}, "queries": {}}')
    assert mismatch_counts(raw_row(*turns, prompt=both)) == (0, 0, 0, 0)
    assert mismatch_counts(raw_row(*turns, prompt="", question="Q?")) == (0, 0, 0, 0)
    assert mismatch_counts(raw_row(visit_turn(["https://a.org"], "g"), answer_turn("Paris"),
                                   functions=webdancer_functions("queries"))) == (0, 0, 0, 0)


def test_schema_mismatches_are_said_in_a_sentence() -> None:
    assert schema_mismatch_lines(Counter()) == ["schema/call mismatches handled: 0 rows"]
    events = Counter({QUERIES_ROWS: 3, QUERIES_CALLS: 7})
    assert schema_mismatch_lines(events) == [
        ("schema/call mismatches handled: 3 rows, 7 calls (schema says 'queries', calls use "
         "'query'); schema replaced by the protocol's search schema")]


def test_the_question_never_keeps_the_tool_list() -> None:
    tools = '<tools>\n{"name": "search", "parameters": {"properties": {"query": {}}}}\n</tools>'
    for prompt in (f"{tools}\nInstructions.\n\nUser: Who?",  # WebDancer: the list, then the question
                   f"User: Who?\n{tools}",  # the question before the list
                   "User: Who?\n<tools>\nUser: a line of the list\n</tools>\n"):  # User: in it
        row = align(raw_row(answer_turn("x"), prompt=prompt, question=""), Counter())
        assert isinstance(row, Transcript) and row.question == "Who?", prompt
    for prompt in ("User: Who?\n<tools>\n{", "</tools>\nUser: Who?"):  # half a list: unsure
        row = align(raw_row(answer_turn("x"), prompt=prompt, question=""), Counter())
        assert row == Dropped("no user question")


def test_align_rewrites_search_results_in_the_search_tool_format() -> None:
    events: Counter[str] = Counter()
    row = align(raw_row(search_turn(["eiffel tower", "louvre"]), answer_turn("Paris")), events)
    assert isinstance(row, Transcript)
    response = row.turns[0].responses[0]
    assert response.startswith("<tool_response>\nA search for 'eiffel tower' found 1 results:")
    assert "Google" not in response
    assert "1. [louvre page](https://example.org/1)\nDate published: May 1, 2024\nAbout louvre." in response
    assert response.count("\n=======\n") == 1
    assert events[SEARCH_NORMALISED] == 1 and events[SEARCH_UNRECOGNISED] == 0


def test_search_result_normalisation_is_idempotent_and_refuses_unknown_text() -> None:
    source = google_results("a (b)", [("T [x]", "https://w.org/A_(b)", "line one\nline two")])
    once = normalise_search_results(source)
    assert once is not None and "1. [T [x]](https://w.org/A_(b))\nDate published" in once
    assert normalise_search_results(once) == once
    assert normalise_search_results("Search engine quota exceeded.") is None


def test_align_drops_a_row_whose_question_cannot_be_found() -> None:
    row = raw_row(answer_turn("Paris"))
    messages = row.fields["messages"]
    assert isinstance(messages, list)
    messages[1] = {"role": "user", "content": "<tools>[]</tools> and no question marker"}
    assert align(row, Counter()) == Dropped("no user question")


def test_align_accepts_tool_role_responses() -> None:
    row = raw_row(answer_turn("Paris"))
    messages = row.fields["messages"]
    assert isinstance(messages, list)
    messages[2:2] = [{"role": "assistant", "content": render_tool_call("visit", {
        "url": "https://example.org", "goal": "g"}, "look")},
        {"role": "tool", "content": "page text"}]
    result = align(row, Counter())
    assert isinstance(result, Transcript)
    assert result.turns[0].responses == (render_tool_response("page text"),)


# ---- steps 2 and 3: allowed tools, repeated calls --------------------------------------------------

def test_a_turn_with_a_disallowed_tool_goes_with_its_response() -> None:
    row = aligned(search_turn(["x"]), tool_turn("python", {"code": "1+1"}, "2"), answer_turn("2"))
    events: Counter[str] = Counter()
    kept = keep_allowed_tools(row, ("search", "visit"), events)
    assert [call.name for turn in kept.turns for call in turn.calls] == ["search"]
    assert len(kept.turns) == 2 and "2" not in kept.turns[0].responses
    assert events[DISALLOWED_TURNS] == 1
    search_only = keep_allowed_tools(aligned(search_turn(["x"]), visit_turn(["https://a.org"], "g"),
                                             answer_turn("x")), ("search",), Counter())
    assert [call.name for turn in search_only.turns for call in turn.calls] == ["search"]


def test_repeated_calls_are_removed_with_their_responses() -> None:
    row = aligned(
        search_turn(["b", "a"]),
        visit_turn(["https://x.org"], "first goal"),
        search_turn(["a", "b", "a"]),  # the same set of queries: repeated
        visit_turn(["https://x.org"], "another goal"),  # the goal is ignored: repeated
        search_turn(["a", "c"]),  # a new set: kept
        visit_turn(["https://x.org", "https://y.org"], "both"),  # a new set of urls: kept
        answer_turn("Paris"),
    )
    events: Counter[str] = Counter()
    kept = remove_repeated_calls(row, events)
    assert [turn.calls[0].arguments for turn in kept.turns[:-1]] == [
        {"query": ["b", "a"]}, {"url": ["https://x.org"], "goal": "first goal"},
        {"query": ["a", "c"]}, {"url": ["https://x.org", "https://y.org"], "goal": "both"}]
    assert events[REPEATED_TURNS] == 2 and events[REPEATED_CALLS] == 2
    assert all(len(turn.responses) == 1 for turn in kept.turns[:-1])


def test_a_turn_goes_only_when_every_call_in_it_repeats() -> None:
    two_calls = "<think>both</think>\n" + "\n".join(
        f'<tool_call>\n{{"name": "search", "arguments": {{"query": ["{q}"]}}}}\n</tool_call>'
        for q in ("a", "b"))
    both = [{"role": "assistant", "content": two_calls},
            {"role": "user", "content": render_tool_response("results")}]
    row = aligned(search_turn(["a"]), both, both, search_turn(["b"]), answer_turn("x"))
    events: Counter[str] = Counter()
    kept = remove_repeated_calls(row, events)
    # the first two-call turn brings "b" and stays; the second repeats both; "b" alone repeats
    assert [len(turn.calls) for turn in kept.turns] == [1, 2, 0]
    assert events[REPEATED_TURNS] == 2 and events[REPEATED_CALLS] == 3


# ---- step 4: structure -----------------------------------------------------------------------------

NO_THINK = [{"role": "assistant",
             "content": '<tool_call>\n{"name": "search", "arguments": {"query": ["a"]}}\n</tool_call>'},
            {"role": "user", "content": render_tool_response("results")}]
EMPTY_ANSWER = [{"role": "assistant", "content": "<think>x</think>\n<answer></answer>"}]


@pytest.mark.parametrize(("turns", "reason"), [
    ([search_turn(["a"])], "no final answer"),
    ([NO_THINK, answer_turn("a")], "malformed tool-call turn"),
    ([search_turn(["a"])[:1], answer_turn("a")], "tool call without exactly one tool response"),
    ([answer_turn("a"), answer_turn("b")], "answer before the last turn"),
    ([search_turn([f"q{i}" for i in range(6)]), answer_turn("a")], "search arguments the tool refuses"),
    ([visit_turn(["ftp://x.org"], "g"), answer_turn("a")], "visit arguments the tool refuses"),
    ([EMPTY_ANSWER], "malformed answer turn"),
    ([], "no assistant turn"),
])
def test_structure_problems_drop_the_row_with_a_reason(turns: list[list[Message]], reason: str) -> None:
    assert check_structure(aligned(*turns), tool_set(CleanConfig())) == Dropped(reason)


def test_a_well_formed_row_passes_the_structure_check() -> None:
    row = aligned(search_turn(["a", "b"]), visit_turn(["https://a.org"], "g"), answer_turn("Paris"))
    assert check_structure(row, tool_set(CleanConfig())) is row


# ---- the whole file: unreadable rows, answers, output ------------------------------------------------

def write_rows(path: Path, rows: list[RawRow | str]) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row.fields) for row in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_bad_lines_are_reported_with_file_and_line(tmp_path: Path) -> None:
    good = raw_row(search_turn(["paris"]), answer_turn("Paris"))
    source = write_rows(tmp_path / "raw.jsonl", [good, '{"messages": [', '{"answer": "x"}', "", good])
    report = clean_file(source, tmp_path / "out.jsonl", CleanConfig())
    assert report.rows_read == 4  # the blank line is not a row
    assert [entry.split(": ")[0] for entry in report.unreadable] == [f"{source}:2", f"{source}:3"]
    assert "not JSON" in report.unreadable[0] and "no 'messages' field" in report.unreadable[1]
    assert report.steps[0].rows_in == 2 and report.written == 2
    assert [row["source_line"] for row in read_output(tmp_path / "out.jsonl")] == [1, 5]


def test_wrong_answers_are_kept_or_dropped_by_require_correct(tmp_path: Path) -> None:
    right = raw_row(search_turn(["paris"]), answer_turn("the  PARIS."), answer="Paris")
    wrong = raw_row(search_turn(["lyon"]), answer_turn("Lyon"), answer="Paris")
    source = write_rows(tmp_path / "raw.jsonl", [right, wrong])
    strict = clean_file(source, tmp_path / "strict.jsonl", CleanConfig())
    assert strict.steps[4].events[EXACT_MATCH] == 1 and strict.steps[4].dropped == {NOT_VERIFIED: 1}
    assert [row["source_line"] for row in read_output(tmp_path / "strict.jsonl")] == [1]
    lenient = clean_file(source, tmp_path / "lenient.jsonl", CleanConfig(require_correct=False))
    assert lenient.steps[4].events[KEPT_UNVERIFIED] == 1 and not lenient.steps[4].dropped
    assert lenient.written == 2


def test_the_judge_decides_what_exact_match_cannot(tmp_path: Path) -> None:
    def respond(messages: list[dict[str, str]]) -> Reply:
        prompt = messages[0]["content"]
        if "[response]: The city of Paris" in prompt:
            return Reply("extracted_final_answer: Paris\nreasoning: same city\ncorrect: yes")
        if "[response]: Lyon" in prompt:
            return Reply("extracted_final_answer: Lyon\nreasoning: another city\ncorrect: no")
        return Reply("I cannot tell.")

    rows = [raw_row(answer_turn("Paris")), raw_row(answer_turn("The city of Paris")),
            raw_row(answer_turn("Lyon")), raw_row(answer_turn("Somewhere"))]
    source = write_rows(tmp_path / "raw.jsonl", rows)
    with chat_server(respond) as server:
        judge = ChatClientConfig(base_url=server.base_url, model="judge", api_key_env="")
        report = clean_file(source, tmp_path / "out.jsonl", CleanConfig(judge=judge))
    assert server.log.count == 3  # the exact match never reaches the judge
    answer = report.steps[4]
    assert (answer.events[EXACT_MATCH], answer.events[JUDGE_ACCEPTED]) == (1, 1)
    assert answer.dropped == {JUDGE_REJECTED: 1, JUDGE_UNREADABLE: 1}
    assert report.written == 2


def test_a_failing_judge_leaves_the_old_output_untouched(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "raw.jsonl", [raw_row(answer_turn("Lyon"))])
    target = tmp_path / "out.jsonl"
    target.write_text("previous\n")
    judge = ChatClientConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="judge",
                             api_key_env="", max_attempts=1, timeout_s=5)
    with pytest.raises(ChatUnavailable):
        clean_file(source, target, CleanConfig(judge=judge))
    assert target.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "raw.jsonl"]


def test_training_rows_speak_the_project_protocol(tmp_path: Path) -> None:
    row = raw_row(search_turn(["paris"], key="queries"), visit_turn(["https://a.org"], "g"),
                  answer_turn("Paris"))
    clean_file(write_rows(tmp_path / "raw.jsonl", [row]), tmp_path / "out.jsonl", CleanConfig())
    (written,) = read_output(tmp_path / "out.jsonl")
    assert set(written) == {"messages", "answer", "source_line", "turns"}
    roles = [message["role"] for message in written["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    system = written["messages"][0]["content"]
    assert system.startswith("You are a deep research assistant.") and "2025-07-18" in system
    assert '"query"' in system and '"queries"' not in system
    assert written["messages"][1]["content"] == "What is the capital of France?"
    turns = [parse_turn(m["content"]) for m in written["messages"] if m["role"] == "assistant"]
    assert all(turn.format_ok for turn in turns) and turns[0].arguments == {"query": ["paris"]}
    assert written["answer"] == ["Paris"] and written["turns"] == 3


# ---- step 6: resampling ------------------------------------------------------------------------------

def test_resample_tiers_are_inclusive_upper_bounds() -> None:
    tiers = parse_resample("50:1,100:2,inf:5")
    assert tiers == DEFAULT_RESAMPLE
    assert [copies_for(t, tiers) for t in (1, 50, 51, 100, 101, 10_000)] == [1, 1, 2, 2, 5, 5]
    for bad in ("50:1,100:2", "100:2,50:1,inf:5", "50:0,inf:1", "fifty:1,inf:2"):
        with pytest.raises(ValueError):
            parse_resample(bad)


def test_resampling_reproduces_the_dr_venus_figures() -> None:
    rows_before, rows_after = 9_365, 18_745
    # n1 + n2 + n3 = 9,365 and n1 + 2 n2 + 5 n3 = 18,745, so n2 + 4 n3 = 9,380; the published share
    # of >100-turn rows (13.29 %) leaves a single n3.
    candidates = [n for n in range(rows_before + 1) if round(100 * n / rows_before, 2) == 13.29]
    assert len(candidates) == 1
    long_rows = candidates[0]
    middle_rows = rows_after - rows_before - 4 * long_rows
    short_rows = rows_before - middle_rows - long_rows
    assert min(short_rows, middle_rows) > 0
    # TranscriptTurn counts spread over each tier, its boundaries included.
    turns = ([1 + i % 50 for i in range(short_rows)] + [51 + i % 50 for i in range(middle_rows)]
             + [101 + i % 200 for i in range(long_rows)])
    step = StepCount("resample")
    out = list(resample(({"turns": t} for t in turns), parse_resample("50:1,100:2,inf:5"), step))
    assert step.rows_in == rows_before and len(out) == step.rows_out == rows_after
    long_after = sum(1 for row in out if row["turns"] > 100)
    assert round(100 * long_rows / rows_before, 2) == 13.29
    assert round(100 * long_after / len(out), 2) == 33.21


# ---- the command -----------------------------------------------------------------------------------

def run_command(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="turnstile data")
    data_command.add_arguments(parser)
    return data_command.run(parser.parse_args(list(argv)))


def test_the_command_is_registered() -> None:
    from turnstile.cluster.cli import COMMANDS

    assert "data" in COMMANDS and data_command.NAME == "data"


def test_missing_input_and_bad_options_are_clear(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.jsonl"
    assert run_command("clean", "--in", str(missing), "--out", str(tmp_path / "o.jsonl")) == 1
    assert f"{missing}: no such file" in capsys.readouterr().out
    source = write_rows(tmp_path / "raw.jsonl", [raw_row(answer_turn("Paris"))])
    assert run_command("clean", "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                       "--resample", "50:1") == 2
    assert "inf" in capsys.readouterr().out
    assert run_command("clean", "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                       "--tools", "search,python") == 2
    assert "python" in capsys.readouterr().out
    assert run_command("clean", "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                       "--judge-url", "http://127.0.0.1:1/v1") == 2
    assert "--judge-model" in capsys.readouterr().out


def printed_steps(text: str) -> list[dict[str, int]]:
    """The printed report as one dict per step: rows in/out, then every counted line."""
    steps: list[dict[str, int]] = []
    for line in text.splitlines():
        header = re.match(r"step \d \S.*: (\d+) rows in, (\d+) rows out$", line)
        counted = re.match(r"  (\S.*): (\d+)$", line)
        if header:
            steps.append({"in": int(header.group(1)), "out": int(header.group(2))})
        elif counted and steps:
            steps[-1][counted.group(1)] = int(counted.group(2))
    return steps


def search_parameters(tools: list[dict]) -> set[str]:
    """The parameter names the search entry of a WebDancer tool list declares."""
    entries = [t for t in tools if t.get("name_for_model", t.get("name")) == "search"]
    return {name for t in entries for name in t["parameters"]["properties"]}


def webdancer_facts(path: Path) -> dict[str, int]:
    """What the WebDancer file holds, counted here independently of the pipeline."""
    facts: Counter[str] = Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        facts["rows"] += 1
        # The search parameter's names in the row's schemas: ``functions`` and the prompt's list,
        # which holds comma-separated objects.
        declared = [search_parameters(row.get("functions", []))]
        for block in re.findall(r"<tools>(.*?)</tools>", row["messages"][1]["content"], re.DOTALL):
            declared.append(search_parameters(json.loads(f"[{block}]")))
        says_queries = any("queries" in names for names in declared)
        calls_query = sum(1 for call in assistant_calls(row["messages"])
                          if call["name"] == "search" and "query" in call["arguments"])
        facts["schema 'queries', calls 'query' rows"] += says_queries and calls_query > 0
        facts["schema 'queries', calls 'query' calls"] += calls_query if says_queries else 0
        made: set[tuple[str, ...]] = set()
        for call in assistant_calls(row["messages"]):
            facts[call["name"]] += 1
            arguments = call["arguments"]
            facts["queries key"] += "queries" in arguments
            if call["name"] == "search":
                queries = arguments.get("query", arguments.get("queries"))
                signature = ("search", *sorted(set([queries] if isinstance(queries, str) else queries)))
            else:
                urls = arguments["url"]
                signature = ("visit", *sorted(set([urls] if isinstance(urls, str) else urls)))
            facts["repeated"] += signature in made
            made.add(signature)
        final = row["messages"][-1]["content"]
        answer = final.split("<answer>")[-1].split("</answer>")[0]
        gold = [a for alternatives in row["answer"] for a in alternatives]
        facts["exact"] += answer_matches(answer, gold)
    return dict(facts)


def test_clean_on_the_webdancer_sample(shared_data: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    source = shared_data / "trajectories" / "webdancer_traj200.jsonl"
    facts = webdancer_facts(source)
    assert facts["rows"] == 200 and (facts["search"], facts["visit"]) == (204, 18)  # data README
    out = tmp_path / "sft.jsonl"

    assert run_command("clean", "--in", str(source), "--out", str(out), "--no-require-correct") == 0
    printed = capsys.readouterr().out
    steps = printed_steps(printed)
    assert len(steps) == 6 and steps[0]["in"] == 200
    assert "read: 200 rows, 0 unreadable" in printed
    for before, after in itertools.pairwise(steps):
        assert before["out"] == after["in"]
    for step in steps[:5]:
        dropped = sum(v for k, v in step.items() if k.startswith("dropped"))
        assert step["in"] - step["out"] == dropped
    align_step, tools_step, repeats_step, structure_step, answer_step, resample_step = steps
    # The sample's defect: its function schema names the search parameter "queries" while every
    # call writes "query" (data README). Step 1 counts it and says so; no call is renamed. It
    # repeats no call either, so the renamed and repeated counts are 0 here; the unit tests above
    # cover rows where they are not.
    rows_counted = facts["schema 'queries', calls 'query' rows"]
    calls_counted = facts["schema 'queries', calls 'query' calls"]
    assert rows_counted == facts["rows"] and calls_counted == facts["search"]  # all of the sample
    assert (f"  schema/call mismatches handled: {rows_counted} rows, {calls_counted} calls (schema "
            "says 'queries', calls use 'query'); schema replaced by the protocol's search schema\n"
            ) in printed
    assert "calls use 'queries'" not in printed  # no row the other way round
    assert align_step[QUERIES_RENAMED] == facts.get("queries key", 0)
    assert align_step[SEARCH_NORMALISED] == facts["search"]  # one response per search call
    assert tools_step[DISALLOWED_TURNS] == 0
    assert repeats_step[REPEATED_CALLS] == facts.get("repeated", 0)
    assert structure_step["out"] == 200  # every sample row follows §1
    assert answer_step[EXACT_MATCH] == facts.get("exact", 0)
    assert answer_step[KEPT_UNVERIFIED] == 200 - facts.get("exact", 0)

    rows = read_output(out)
    assert f"written: {len(rows)} rows to {out}" in printed
    distinct = {row["source_line"]: row["turns"] for row in rows}
    assert resample_step["in"] == len(distinct) == answer_step["out"]
    assert resample_step["out"] == len(rows) == sum(
        copies_for(turns, DEFAULT_RESAMPLE) for turns in distinct.values())
    rows = [row for row in rows if distinct.pop(row["source_line"], None) is not None]  # one copy each
    calls = [call for row in rows for call in assistant_calls(row["messages"])]
    assert len(calls) == facts["search"] + facts["visit"] - repeats_step[REPEATED_CALLS]
    assert all(isinstance(c["arguments"]["query"], list) for c in calls if c["name"] == "search")
    prompts = {re.sub(r"Current date: .*", "", row["messages"][0]["content"]) for row in rows}
    assert len(prompts) == 1  # one system prompt template
    responses = [m["content"] for row in rows for m in row["messages"][2:] if m["role"] == "user"]
    assert sum(r.startswith("<tool_response>\nA search for '") for r in responses) == facts["search"]
    questions = [row["messages"][1]["content"] for row in rows]
    assert not any(mark in q for q in questions for mark in ("<tools>", "</tools>", '"parameters"'))

    # The default requires a verified answer: without a judge only exact matches stay.
    assert run_command("clean", "--in", str(source), "--out", str(out)) == 0
    printed = capsys.readouterr().out
    strict = printed_steps(printed)
    assert strict[4]["out"] == facts.get("exact", 0)
    assert strict[4].get(f"dropped ({NOT_VERIFIED})", 0) == 200 - facts.get("exact", 0)
    assert len(read_output(out)) == strict[5]["out"]
    if strict[4]["out"] < 200:
        assert "--no-require-correct" in printed  # the note says how to keep them

"""``turnstile data clean`` input formats: R1-Searcher rollouts beside chat rows, format detection,
and a file with no readable row (an error naming the formats, nothing written)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from turnstile.cluster.cli.commands import data as data_command
from turnstile.envs.protocol import parse_turn, render_answer
from turnstile.learner.sft_data import CleanConfig, NoReadableRows, clean_file
from turnstile.learner.sft_formats import FORMATS, r1_searcher_messages, search_results

R1_ROLLOUTS = Path(__file__).parent / "fixtures" / "r1_searcher_rollouts.jsonl"
Q, Q_END = "<|begin_of_query|>", "<|end_of_query|>"
DOCS, DOCS_END = "<|begin_of_documents|>", "<|end_of_documents|>"


def run_command(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="turnstile data")
    data_command.add_arguments(parser)
    return data_command.run(parser.parse_args(list(argv)))


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---- R1-Searcher rows as chats -------------------------------------------------------------------

def test_queries_become_search_calls_documents_results_and_the_answer_the_last_turn() -> None:
    generated = (f"I need the founder.\n\n{Q} Quiet Engine\tfounder{Q_END}\n\n{DOCS}\n"
                 f"(1)Title: Quiet Engine Text:  Quiet Engine was founded by Tomas Venn.\n{DOCS_END}\n\n"
                 "So it is Tomas Venn.</think>\n\n <answer> Tomas Venn </answer>")
    chat = r1_searcher_messages({"question": " Who founded Quiet Engine? ", "answer": "Tomas Venn",
                                 "gen_text_store": generated})
    assert isinstance(chat, list)
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert chat[0]["content"] == "Who founded Quiet Engine?"
    call = parse_turn(chat[1]["content"])
    assert call.format_ok and call.think == "I need the founder."
    assert (call.tool, call.arguments) == ("search", {"query": ["Quiet Engine founder"]})  # tab: a space
    assert chat[2]["content"] == (
        "<tool_response>\nA search for 'Quiet Engine founder' found 1 results:\n\n## Web Results\n"
        "1. [Quiet Engine](https://en.wikipedia.org/wiki/Quiet_Engine)\n"
        "Quiet Engine was founded by Tomas Venn.\n</tool_response>")
    assert chat[3]["content"] == render_answer("Tomas Venn", "So it is Tomas Venn.")


@pytest.mark.parametrize(("documents", "expected"), [
    # the HotpotQA abstracts, one CSV-quoted with its quotes doubled
    ('(1)"Title: Harbour Lights Text:  An album called ""Lights""."',
     ("Harbour Lights", 'An album called "Lights".')),
    # the KILT Wikipedia: the title, three spaces, a 100-word chunk
    ("(1)Leeds   Leeds is a city on the River Aire.", ("Leeds", "Leeds is a city on the River Aire.")),
])
def test_both_passage_shapes_of_the_retriever_become_hits(documents: str, expected: tuple[str, str]) -> None:
    title, text = expected
    results = search_results("q", f"\n{documents}\n")
    url = "https://en.wikipedia.org/wiki/" + title.replace(" ", "_")
    assert results == f"A search for 'q' found 1 results:\n\n## Web Results\n1. [{title}]({url})\n{text}"


def test_no_documents_and_unknown_documents() -> None:
    assert search_results("q", "\nNone") == "No results found for 'q'. Try a shorter or more general query."
    summary = "Tomas Venn founded Quiet Engine, according to the pages read."
    assert search_results("q", f"\n{summary}\n") == summary  # kept; step 1 counts it as unknown


def test_unfinished_rollouts_keep_their_turns_for_step_4_to_drop() -> None:
    searched = f"{Q} a{Q_END}\n\n{DOCS}\nNone{DOCS_END}"
    no_answer = r1_searcher_messages({"question": "q?", "gen_text_store": searched})
    assert isinstance(no_answer, list)
    assert [m["role"] for m in no_answer] == ["user", "assistant", "user", "assistant"]
    assert not parse_turn(no_answer[-1]["content"]).format_ok
    cut_in_query = r1_searcher_messages({"question": "q?", "gen_text_store": f"Look up {Q} a b"})
    assert isinstance(cut_in_query, list) and [m["role"] for m in cut_in_query] == ["user", "assistant"]
    assert r1_searcher_messages({"question": "q?", "pred_ans": "I don't know."}) == [
        {"role": "user", "content": "q?"}]
    assert r1_searcher_messages({"question": "", "gen_text_store": "x"}) == (
        "field 'question' must be a non-empty string")


# ---- the command on R1-Searcher rows -----------------------------------------------------------------

def test_clean_r1_searcher_rollouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sft.jsonl"
    assert run_command("clean", "--in", str(R1_ROLLOUTS), "--out", str(out), "--no-require-correct") == 0
    printed = capsys.readouterr().out
    assert "read: 4 rows, 0 unreadable" in printed and "format: r1_searcher (4 rows)" in printed
    assert "search responses normalised: 4" in printed  # every documents block is a result list
    assert "dropped (no assistant turn): 1" in printed  # shot_down: no gen_text_store
    assert "dropped (no final answer): 1" in printed  # many_retrieve: stopped after a search
    rows = read_output(out)
    assert [row["source_line"] for row in rows] == [1, 2]
    first = rows[0]
    assert set(first) == {"messages", "answer", "source_line", "turns"}  # as for chat rows
    assert first["messages"][0]["content"].startswith("You are a deep research assistant.")
    assert first["answer"] == ["Aire"] and first["turns"] == 3
    turns = [parse_turn(m["content"]) for m in first["messages"] if m["role"] == "assistant"]
    assert all(turn.format_ok for turn in turns)
    assert [turn.arguments for turn in turns[:2]] == [{"query": ["Harbour Lights composer"]},
                                                      {"query": ["Leeds river"]}]
    assert turns[2].answer == "Aire"
    responses = [m["content"] for m in first["messages"][2:] if m["role"] == "user"]
    assert len(responses) == 2 and '2. [Tomas Venn](https://en.wikipedia.org/wiki/Tomas_Venn)\n' \
        'Tomas Venn (born 1951 in Leeds) wrote "Harbour Lights".' in responses[0]

    # Without --no-require-correct the wrong answer (pred_ans is not trusted either) goes.
    assert run_command("clean", "--in", str(R1_ROLLOUTS), "--out", str(out)) == 0
    assert [row["source_line"] for row in read_output(out)] == [1]


def test_formats_are_recognised_per_row_or_forced(tmp_path: Path) -> None:
    chat_row = {"messages": [{"role": "user", "content": "Who?"},
                             {"role": "assistant", "content": render_answer("Ada", "known")}],
                "answer": "Ada"}
    source = tmp_path / "mixed.jsonl"
    source.write_text(json.dumps(chat_row) + "\n" + R1_ROLLOUTS.read_text(encoding="utf-8"),
                      encoding="utf-8")
    report = clean_file(source, tmp_path / "out.jsonl", CleanConfig(require_correct=False))
    assert report.formats == {"chat": 1, "r1_searcher": 4} and report.written == 3
    forced = clean_file(source, tmp_path / "out.jsonl", CleanConfig(input_format="r1_searcher"))
    assert forced.formats == {"r1_searcher": 4}
    assert forced.unreadable == [
        f"{source}:1: field 'question' must be a non-empty string (read as r1_searcher)"]
    with pytest.raises(ValueError, match="unknown input format 'webdancer'; use auto or one of: chat"):
        CleanConfig(input_format="webdancer")


# ---- a file with no readable row -------------------------------------------------------------------

@pytest.mark.parametrize("lines", [['{"prompt": "q", "completion": "a"}', "[1, 2]", "not json"], []])
def test_a_file_without_a_readable_row_is_an_error_naming_the_formats(
        lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, out = tmp_path / "raw.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert run_command("clean", "--in", str(source), "--out", str(out)) == 1
    printed = capsys.readouterr().out
    assert printed.startswith(f"turnstile data clean: {source}: ")
    assert ("no readable row among its 3 lines (first: " if lines else "the file holds no rows") in printed
    assert all(fmt.describe() in printed for fmt in FORMATS.values())
    assert "chat ({messages, answer}" in printed
    assert "r1_searcher ({question, answer, gen_text_store}" in printed
    assert not out.exists()


def test_a_forced_format_that_fits_no_row_says_so(tmp_path: Path) -> None:
    with pytest.raises(NoReadableRows, match=r"read as chat \(--format auto recognises rows\)"):
        clean_file(R1_ROLLOUTS, tmp_path / "out.jsonl", CleanConfig(input_format="chat"))
    assert not (tmp_path / "out.jsonl").exists()

"""``turnstile view``: the page it writes, opened in real Chromium (headless, through Playwright), and
the command's answers to bad input."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from turnstile.cluster.cli import main
from turnstile.envs.protocol import StopReason
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, save_trajectories

CHROMIUM = "/usr/bin/chromium"
HOSTILE_RESPONSE = "<think>x</think><script>window.pwned = 1; alert(1)</script>"
HOSTILE_OBSERVATION = "</script><img src=x onerror=\"window.pwned = 2; alert(2)\"><!--<script>"
LONG_RESPONSE = "<think>\nFirst I search the founder.\n" + "The ledger says many things. " * 20 + "\n</think>"


def turn(index: int, advantage: float | None, tool: str | None = "search", *, answer: str | None = None,
         response: str = "", observation: str = "", version: int = 3) -> Turn:
    """A turn: a tool call, or an answer when ``answer`` is given."""
    action = "answer" if answer is not None else "tool_call"
    return Turn(index=index, response_ids=[5, 6], response_logprobs=[-0.5, -0.25], weights_version=version,
                context_len=10 + index, finish_reason="stop", response_text=response or f"<think>turn {index}</think>",
                action=action, tool=tool if action == "tool_call" else None,
                arguments={"query": f"query {index}"} if action == "tool_call" else None, format_ok=True,
                answer=answer, observation_text=observation or f"results of turn {index}", ig_value=-2.0 + index,
                ig=0.25 if tool == "visit" else None, step_score=1.0, advantage=advantage)


def trajectory(uid: str, sample: int, question: str, gold: str, turns: list[Turn],
               stop: StopReason = StopReason.ANSWERED) -> Trajectory:
    answer = turns[-1].answer
    return Trajectory(uid=uid, sample=sample, task_id=uid, question=question, answers=[gold],
                      segments=[Segment(prompt_ids=[1, 2, 3], turns=turns)], stop_reason=stop, answer=answer,
                      outcome=1.0 if answer == gold else 0.0)


def sample_file() -> list[Trajectory]:
    """Two groups, five trajectories: 3 correct, 2 wrong; one stopped without an answer; |A| ≤ 2."""
    alpha, beta = "Who founded Harbour Lights?", "Which river flows through Leeds?"
    return [
        trajectory("alpha", 0, alpha, "Tomas Venn", [turn(0, 0.125), turn(1, 1.75, "visit", version=2),
                                                     turn(2, 0.5, answer="Tomas Venn", response=LONG_RESPONSE)]),
        trajectory("alpha", 1, alpha, "Tomas Venn", [turn(0, -0.5), turn(1, -2.0, answer="Ilse Marlow")]),
        trajectory("alpha", 2, alpha, "Tomas Venn",
                   [turn(0, -0.25, observation="A zebra crossing on the harbour road."), turn(1, 0.0, "visit")],
                   stop=StopReason.NO_ANSWER),
        trajectory("beta", 0, beta, "Aire", [turn(0, 0.75, "visit"), turn(1, 0.75, answer="Aire")]),
        trajectory("beta", 1, beta, "Aire", [turn(0, 2.0), turn(1, -0.125, answer="Aire")]),
    ]


# ---- the page in Chromium ------------------------------------------------------------------------

@dataclass
class OpenedPage:
    """A page with what it did: console errors, uncaught errors, requests and dialogs."""

    page: object
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def expand(self, uid: str) -> None:
        self.page.click(f'.group[data-uid="{uid}"] .group-head')
        self.page.wait_for_selector(f'.turn[data-uid="{uid}"]')

    def shown(self) -> int:
        return int(self.page.get_attribute("#count", "data-trajectories"))

    def search(self, query: str) -> int:
        self.page.fill("#search", query)
        self.page.wait_for_selector(f'#count[data-query="{query.lower()}"]')
        return self.shown()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


def build(tmp_path: Path, trajectories: list[Trajectory], *more: Path) -> Path:
    data = tmp_path / "scored.jsonl"
    save_trajectories(trajectories, data)
    page = tmp_path / "page.html"
    with pytest.raises(SystemExit) as done:
        main(["view", *(str(p) for p in more or [data]), "--out", str(page)])
    assert done.value.code == 0
    return page


def open_page(browser: object, path: Path) -> Iterator[OpenedPage]:
    context = browser.new_context()
    page = context.new_page()
    opened = OpenedPage(page)
    page.on("console", lambda message: opened.errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: opened.errors.append(str(error)))
    page.on("request", lambda request: opened.requests.append(request.url))
    page.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
    page.set_default_timeout(15_000)
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready=true]")
    yield opened
    context.close()


@pytest.fixture
def opened(browser: object, tmp_path: Path) -> Iterator[OpenedPage]:
    yield from open_page(browser, build(tmp_path, sample_file()))


@pytest.mark.integration
def test_page_loads_without_errors_and_fetches_nothing(opened: OpenedPage, tmp_path: Path) -> None:
    opened.expand("alpha")
    opened.page.click('.turn[data-uid="alpha"][data-sample="0"][data-turn="1"]')
    assert opened.page.is_visible("#detail")
    assert opened.errors == []
    assert opened.requests == [(tmp_path / "page.html").resolve().as_uri()]
    assert opened.page.text_content("#count") == "5 of 5 trajectories, in 2 of 2 groups"


CHOSEN = [("alpha", 0, 1, 1.75), ("alpha", 1, 1, -2.0), ("alpha", 2, 1, 0.0), ("beta", 1, 0, 2.0),
          ("beta", 1, 1, -0.125)]


@pytest.mark.integration
def test_rendered_advantages_equal_the_file(opened: OpenedPage) -> None:
    opened.expand("alpha")
    opened.expand("beta")
    for uid, sample, index, advantage in CHOSEN:
        row = f'.turn[data-uid="{uid}"][data-sample="{sample}"][data-turn="{index}"]'
        assert float(opened.page.get_attribute(row, "data-advantage")) == advantage
    assert opened.page.locator(".turn").count() == 11  # every turn of both groups, one element each
    colour = {a: opened.page.eval_on_selector(f'.turn[data-advantage="{a}"]', "e => e.style.backgroundColor")
              for a in ("2", "-2", "0")}  # the scale runs to the file's max |A| = 2, white at 0
    assert colour == {"2": "rgb(214, 96, 77)", "-2": "rgb(67, 147, 195)", "0": "rgb(255, 255, 255)"}


@pytest.mark.integration
def test_filters_change_what_is_shown(opened: OpenedPage) -> None:
    page = opened.page
    page.select_option("#outcome", "correct")
    assert opened.shown() == 3
    page.select_option("#outcome", "wrong")
    assert opened.shown() == 2 and page.locator(".group").count() == 1  # both wrong ones are in alpha
    page.select_option("#outcome", "all")
    page.select_option("#stop", "no_answer")
    assert opened.shown() == 1
    page.select_option("#stop", "")
    page.select_option("#tool", "visit")
    assert opened.shown() == 3
    opened.expand("alpha")
    assert page.locator('.trajectory[data-uid="alpha"]').count() == 2  # sample 1 never visited
    page.select_option("#tool", "")
    assert opened.search("zebra crossing") == 1  # an observation
    assert opened.search("LEEDS") == 2  # the question of both beta samples
    assert opened.search("the ledger says") == 1  # a response
    assert opened.search("nowhere to be found") == 0 and page.locator(".group").count() == 0


@pytest.mark.integration
def test_clicking_a_turn_shows_its_full_texts(opened: OpenedPage) -> None:
    opened.expand("alpha")
    assert opened.page.is_hidden("#detail")
    opened.page.click('.turn[data-uid="alpha"][data-sample="0"][data-turn="2"]')
    assert opened.page.text_content("#detail-response") == LONG_RESPONSE
    assert opened.page.text_content("#detail-observation") == "results of turn 2"
    assert opened.page.text_content("#detail-title") == "alpha · sample 0 · turn 2"
    opened.page.click('.turn[data-uid="alpha"][data-sample="2"][data-turn="0"]')
    assert opened.page.text_content("#detail-observation") == "A zebra crossing on the harbour road."


@pytest.mark.integration
def test_hostile_texts_are_shown_as_text_and_never_run(browser: object, tmp_path: Path) -> None:
    hostile = turn(0, 1.0, response=HOSTILE_RESPONSE, observation=HOSTILE_OBSERVATION)
    hostile.arguments = {"query": "<img src=x onerror=alert(3)>"}
    page_path = build(tmp_path, [trajectory("<b>bold</b>", 0, "</script><script>alert(4)</script>", "x",
                                            [hostile, turn(1, -1.0, answer="<i>y</i>")])])
    assert "</script><img" not in page_path.read_text(encoding="utf-8")
    for opened in open_page(browser, page_path):
        page = opened.page
        assert page.text_content(".group-head .question") == "</script><script>alert(4)</script>"
        opened.expand("<b>bold</b>")
        page.click('.turn[data-turn="0"]')
        assert page.text_content("#detail-response") == HOSTILE_RESPONSE
        assert page.text_content("#detail-observation") == HOSTILE_OBSERVATION
        assert opened.search("<img src=x") == 1  # the search reads the escaped JSON right
        assert page.evaluate("window.pwned") is None
        # no element made from the texts; the one script without a type is the page's own
        assert page.evaluate("document.querySelectorAll('img, b, i, script:not([type])').length") == 1
        assert opened.dialogs == [] and opened.errors == []


@pytest.mark.integration
def test_a_training_run_shows_each_step(browser: object, tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (0, 1):
        steps = [trajectory(f"s{step}-task", sample, f"Question of step {step}?", "a",
                            [turn(0, 0.5 - sample), turn(1, 0.5 - sample, answer="a" if sample else "b")])
                 for sample in range(2)]
        save_trajectories(steps, run / "scored" / f"step{step}.jsonl")
        save_trajectories(steps, run / "rollouts" / f"step{step}.jsonl")  # scored: shown from there only
    (run / "fleet.jsonl").write_text('{"not": "a trajectory"}\n')
    for opened in open_page(browser, build(tmp_path, [], run)):
        page = opened.page
        labels = page.eval_on_selector_all("#source option", "options => options.map(o => o.textContent)")
        assert labels == ["step 0 (scored) · 2 trajectories", "step 1 (scored) · 2 trajectories"]
        assert page.get_attribute(".group", "data-uid") == "s1-task"  # opens on the latest step
        page.select_option("#source", "0")
        assert page.get_attribute(".group", "data-uid") == "s0-task"
        assert opened.errors == []


# ---- the command ---------------------------------------------------------------------------------

def run_view(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(["view", *args])
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    return int(done.value.code), printed.out


def test_the_command_says_where_the_page_is_and_how_to_open_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    save_trajectories(sample_file(), tmp_path / "scored.jsonl")
    out = tmp_path / "pages" / "view.html"
    code, printed = run_view(capsys, str(tmp_path / "scored.jsonl"), "--out", str(out))
    assert code == 0 and out.is_file()
    assert "1 file(s), 2 groups, 5 trajectories, 11 turns" in printed
    assert f"open it in a browser: {out.resolve().as_uri()}" in printed


def test_an_eval_directory_shows_its_trajectories_not_its_results(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``turnstile eval`` writes results.jsonl and fleet.jsonl beside trajectories.jsonl: a directory
    shows the JSONL files that hold trajectories and passes over the others."""
    save_trajectories(sample_file(), tmp_path / "trajectories.jsonl")
    (tmp_path / "results.jsonl").write_text('{"benchmark": "b", "task_id": "t", "sample": 0, "correct": true}\n')
    (tmp_path / "fleet.jsonl").write_text('{"at_s": 0.1, "action": "up", "member": "worker-0"}\n')
    code, printed = run_view(capsys, str(tmp_path), "--out", str(tmp_path / "view.html"))
    assert code == 0, printed
    assert "1 file(s), 2 groups, 5 trajectories, 11 turns" in printed


@pytest.mark.parametrize("case", ["missing file", "corrupt line", "empty directory", "no trajectories", "turn records"])
def test_bad_input_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    data = tmp_path / "scored.jsonl"
    save_trajectories(sample_file(), data)
    lines = data.read_text().splitlines()
    inputs = {
        "missing file": (tmp_path / "nope.jsonl", "nope.jsonl: no such file or directory"),
        "corrupt line": (data, "scored.jsonl:2: not valid JSON"),
        "empty directory": (tmp_path / "empty", "no trajectory files in this directory"),
        "no trajectories": (tmp_path / "blank.jsonl", "blank.jsonl: no trajectories in this file"),
        "turn records": (tmp_path / "records.jsonl", "records.jsonl:1: a turn-record line"),
    }
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.jsonl").write_text("\n")
    (tmp_path / "records.jsonl").write_text('{"uid": "e1", "outcome": 1.0, "turns": [{"tool": null}]}\n')
    data.write_text("\n".join([lines[0], lines[1][:40], *lines[2:]]) + "\n")  # line 2 cut short
    path, message = inputs[case]
    out = tmp_path / "page.html"
    code, printed = run_view(capsys, str(path), "--out", str(out))
    assert code == 2
    assert len(printed.strip().splitlines()) == 1 and message in printed, printed
    assert not out.exists() and not list(tmp_path.glob("page.html*"))  # nothing half-written


def test_estimator_fields_of_a_credited_file_reach_the_page(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """abc_grpo writes ``sft_weight``, which the trajectory schema does not know: the page keeps it."""
    save_trajectories(sample_file(), tmp_path / "scored.jsonl")
    credited, page = tmp_path / "credited.jsonl", tmp_path / "page.html"
    with pytest.raises(SystemExit):
        main(["credit", "--estimator", "abc_grpo", "--in", str(tmp_path / "scored.jsonl"), "--out", str(credited)])
    # The command's last line says how to look at what it wrote.
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"turnstile view {credited})")
    code, _ = run_view(capsys, str(credited), "--out", str(page))
    assert code == 0
    tag = re.search(r'<script type="application/json" id="turns-0">(.*?)</script>', page.read_text())
    fields = json.loads(re.search(r'"turn_fields":(\[.*?\])', page.read_text()).group(1))
    first_turn = dict(zip(fields, json.loads(tag.group(1))[0], strict=True))
    written = json.loads(credited.read_text().splitlines()[0])["segments"][0]["turns"][0]
    assert first_turn["extras"] == {"sft_weight": written["sft_weight"]}
    assert first_turn["advantage"] == written["advantage"]

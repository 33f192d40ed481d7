"""How ``turnstile view`` copes with a large file: a synthetic scored file of 1,000 trajectories × 200
turns (125 groups of 8) is built into a page, opened in real Chromium (headless, through Playwright),
and the page is used as a person would: expand a group, open a turn, scroll the whole group list,
search. Prints the figures docs/benchmarks/viewer.md reports.

The trajectories look like a search agent's: ``<think>`` reasoning and a tool call per turn,
search results or page text as observations, an answer at the end, IG values, clue events and step
scores, and advantages from the real ``igpo`` estimator. Token id lists are kept short (the page
drops them anyway); ``--response-chars`` and ``--observation-chars`` set the mean text lengths.

Run: .venv/bin/python benchmarks/viewer.py [--trajectories 1000] [--turns 200] [--group-size 8]
     [--response-chars 400] [--observation-chars 1200] [--work /tmp/turnstile-viewer-bench]
     .venv/bin/python benchmarks/viewer.py --screenshots docs   (the README's two pictures)
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from playwright.sync_api import CDPSession, Page, sync_playwright

from turnstile.cluster.cli.commands.credit import configured_estimator
from turnstile.cluster.tools.view import find_sources, write_page
from turnstile.envs.protocol import StopReason
from turnstile.learner.credit.assign import assign_credit
from turnstile.rewards.clues import step_score
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, write_trajectory

CHROMIUM = "/usr/bin/chromium"
WORDS = ("harbour ledger founder archive survey river charter engine studio quarry mill guild "
         "signal beacon northern county registry company railway museum festival orchard").split()
SYLLABLES = ("vu wie bro ste ase sa ke prund har dir de dal fla dry nford ko ren ta mo li").split()


@dataclass(frozen=True)
class Shape:
    """What to generate: sizes and mean text lengths."""

    trajectories: int
    turns: int  # per trajectory: exactly this many, or up to it with ``vary_turns``
    group_size: int
    response_chars: int
    observation_chars: int
    vary_turns: bool = False


# ---- synthetic trajectories ----------------------------------------------------------------------

def name(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).title() for _ in range(2))


def sentence(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS) if rng.random() < 0.8 else name(rng))
    return " ".join(words).capitalize() + "."


def tool_turn(rng: random.Random, shape: Shape, turn: int,
              subject: str) -> tuple[str, str, dict[str, str], str]:
    """A search or visit call: its tool, response text, arguments and observation."""
    think = sentence(rng, max(20, rng.randint(shape.response_chars // 2, shape.response_chars * 3 // 2) - 80))
    if turn % 3 == 2:
        arguments = {"url": f"http://127.0.0.1:20011/wiki/{subject.replace(' ', '_')}",
                     "goal": f"who founded {subject}"}
        observation = sentence(rng, rng.randint(shape.observation_chars // 2, shape.observation_chars * 3 // 2))
        tool = "visit"
    else:
        query = f"{subject} {rng.choice(WORDS)}"
        arguments = {"query": query}
        per_hit = max(60, shape.observation_chars // 5)
        hits = [f"{rank}. [{name(rng)}](http://127.0.0.1:20011/wiki/p{rng.randint(1, 9999)})\n{sentence(rng, per_hit)}"
                for rank in range(1, 6)]
        observation = f"A search for '{query}' found 5 results:\n\n## Web Results\n" + "\n\n".join(hits)
        tool = "search"
    call = json.dumps({"name": tool, "arguments": arguments})
    return tool, f"<think>\n{think}\n</think>\n<tool_call>\n{call}\n</tool_call>", arguments, observation


CLUE_EVENTS = ("clue_found:c1", "clue_found:c2", "clue_verified:c1", "candidate_excluded:Ko Ren", "clue_discarded:c2")
MALFORMED = ["<think> and </think> tags are not balanced", "no <tool_call> or <answer> after </think>"]


def trajectory(rng: random.Random, shape: Shape, uid: str, sample: int, question: str, gold: str,
               subject: str) -> Trajectory:
    """One episode: tool calls, sometimes a malformed turn, then an answer (right or wrong)."""
    count = rng.randint(3, shape.turns) if shape.vary_turns else shape.turns
    right = rng.random() < 0.45
    value = -3.0 + rng.random()  # the IG value v climbs faster in a trajectory that ends right
    turns = []
    for index in range(count):
        value += rng.gauss(0.25 if right else 0.02, 0.15)
        turn = Turn(index=index, response_ids=[1, 2, 3], response_logprobs=[-0.1, -0.2, -0.3],
                    weights_version=7 if index > count // 3 else 6, context_len=400 + 900 * index,
                    finish_reason="stop", ig_value=round(value, 4))
        if index == count - 1:
            answer_turn(rng, shape, turn, gold if right else name(rng), right)
        elif rng.random() < 0.05:
            turn.response_text = f"<think>\n{sentence(rng, shape.response_chars)}\n"
            turn.format_errors = list(MALFORMED)
            turn.observation_text = f"Your last message could not be executed: {MALFORMED[0]}."
        else:
            turn.tool, turn.response_text, turn.arguments, turn.observation_text = tool_turn(rng, shape, index, subject)
            turn.action, turn.format_ok, turn.tool_ok = "tool_call", True, True
            turn.events = [rng.choice(CLUE_EVENTS)] if rng.random() < 0.2 else []
        turn.step_score = step_score(turn.events)
        turns.append(turn)
    stop = StopReason.ANSWERED if rng.random() < 0.9 else StopReason.NO_ANSWER
    return Trajectory(uid=uid, sample=sample, task_id=uid.split("-", 1)[1], question=question, answers=[gold],
                      segments=[Segment(prompt_ids=[1, 2], turns=turns)], stop_reason=stop,
                      answer=turns[-1].answer, policy="synthetic",
                      outcome=1.0 if right and stop is StopReason.ANSWERED else 0.0)


def answer_turn(rng: random.Random, shape: Shape, turn: Turn, answer: str, right: bool) -> None:
    turn.response_text = f"<think>\n{sentence(rng, shape.response_chars // 2)}\n</think>\n<answer>{answer}</answer>"
    turn.action, turn.answer, turn.format_ok = "answer", answer, True
    turn.events = ["answer_correct" if right else "answer_wrong"]


def synthetic_groups(shape: Shape, seed: int = 0) -> Iterator[list[Trajectory]]:
    """Groups of ``shape.group_size`` samples, with advantages from the igpo estimator."""
    rng = random.Random(seed)
    estimator = configured_estimator("igpo", [])
    for number in range(shape.trajectories // shape.group_size):
        subject, gold = f"{name(rng)} Works", name(rng)
        uid = f"s7-synthetic-q{number:04d}"
        group = [trajectory(rng, shape, uid, sample, f"What is the name of the founder of {subject}?", gold, subject)
                 for sample in range(shape.group_size)]
        assign_credit(group, estimator)
        yield group


def write_synthetic(path: Path, shape: Shape, seed: int = 0) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for group in synthetic_groups(shape, seed):
            for member in group:
                write_trajectory(member, out)
                count += 1
    return count


# ---- measuring in Chromium -----------------------------------------------------------------------

def chromium_pss_mb() -> float:
    """Proportional set size of every Chromium process this program started (browser, renderer, GPU)."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if "chrom" in child.name():
                total += child.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 1e6


def measure(page_path: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(600_000)
        page.goto("about:blank")
        figures["chromium_pss_blank_page_mb"] = chromium_pss_mb()  # what Chromium itself takes
        started = time.perf_counter()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]")
        figures["load_s"] = time.perf_counter() - started
        figures["dom_content_loaded_s"] = page.evaluate(
            "performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd") / 1000
        page.evaluate("""window.longest = 0; new PerformanceObserver((list) => { for (const e of list.getEntries())
            window.longest = Math.max(window.longest, e.duration); }).observe({type: 'longtask'});""")
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        figures.update(heap(cdp, "after_load"))
        figures["chromium_pss_after_load_mb"] = chromium_pss_mb()
        actions = {
            "expand_group": lambda: (page.click(".group-head"), page.wait_for_selector(".turn")),
            "open_turn": lambda: (page.click(".turn >> nth=150"), page.wait_for_selector("#detail:not([hidden])")),
            "scroll_all_groups": lambda: (page.click("#detail-close"), scroll_to_end(page)),
            "search_rare": lambda: search(page, "no such phrase"),
            "search_common": lambda: search(page, "quarry beacon"),
        }
        for name, action in actions.items():
            page.evaluate("window.longest = 0")
            figures[f"{name}_s"] = timed(action)
            page.wait_for_timeout(100)  # the long-task entry of the action's last task arrives
            figures[f"{name}_longest_task_ms"] = page.evaluate("window.longest")
            if name == "expand_group":
                figures["rows_rendered"] = page.locator(".turn").count()
        figures["search_common_hits"] = float(page.get_attribute("#count", "data-trajectories") or 0)
        figures.update(heap(cdp, "after_use"))
        figures["chromium_pss_after_use_mb"] = chromium_pss_mb()
        browser.close()
    return figures


def heap(cdp: CDPSession, when: str) -> dict[str, float]:
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {f"js_heap_used_{when}_mb": metrics["JSHeapUsedSize"] / 1e6,
            f"js_heap_total_{when}_mb": metrics["JSHeapTotalSize"] / 1e6}


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def scroll_to_end(page: Page) -> None:
    """Scroll down until every group header is in the list (it grows as its end comes into view)."""
    total = int(page.get_attribute("#count", "data-groups"))
    while page.locator(".group").count() < total:
        page.mouse.wheel(0, 4000)
        page.wait_for_timeout(50)


def search(page: Page, query: str) -> None:
    page.fill("#search", query)
    page.wait_for_selector(f'#count[data-query="{query}"]')


# ---- screenshots ---------------------------------------------------------------------------------

def screenshots(folder: Path, work: Path) -> None:
    """docs/viewer-groups.png (a group open, turns coloured by advantage) and docs/viewer-turn.png
    (a turn open), from a small realistic file."""
    data = work / "screens" / "scored" / "step7.jsonl"
    write_synthetic(data, Shape(trajectories=48, turns=14, group_size=4, response_chars=300,
                                observation_chars=700, vary_turns=True), seed=3)
    page_path = work / "screens.html"
    write_page(find_sources([work / "screens"]), page_path)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]")
        page.click(".group-head >> nth=1")
        page.wait_for_selector(".turn")
        page.screenshot(path=str(folder / "viewer-groups.png"))
        page.click(".group .turn >> nth=5")
        page.wait_for_selector("#detail:not([hidden])")
        page.mouse.move(0, 0)  # no hover outline where the narrowed list moved under the pointer
        page.screenshot(path=str(folder / "viewer-turn.png"))
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-chars", type=int, default=400)
    parser.add_argument("--observation-chars", type=int, default=1200)
    parser.add_argument("--work", type=Path, default=Path("/tmp/turnstile-viewer-bench"))
    parser.add_argument("--screenshots", type=Path, metavar="DIR",
                        help="write the two README pictures into DIR and stop")
    args = parser.parse_args()
    if args.screenshots:
        screenshots(args.screenshots, args.work)
        print(f"written: {args.screenshots / 'viewer-groups.png'}, {args.screenshots / 'viewer-turn.png'}")
        return
    shape = Shape(args.trajectories, args.turns, args.group_size, args.response_chars, args.observation_chars)
    data, page_path = args.work / "scored.jsonl", args.work / "view.html"
    started = time.perf_counter()
    write_synthetic(data, shape)
    generated = time.perf_counter() - started
    started = time.perf_counter()
    page = write_page(find_sources([data]), page_path)
    built = time.perf_counter() - started
    print(f"{page.trajectories} trajectories × {args.turns} turns ({page.turns} turns, {page.groups} groups), "
          f"mean texts {args.response_chars} + {args.observation_chars} chars a turn")
    print(f"input file      {data.stat().st_size / 1e6:8.1f} MB  (generated in {generated:.1f} s)")
    print(f"page            {page.bytes / 1e6:8.1f} MB  (built in {built:.1f} s by turnstile view's write_page; "
          f"this process peaked at {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB)")
    figures = measure(page_path)
    print(f"chromium {CHROMIUM}, headless, viewport 1600 × 1000")
    for key, value in figures.items():
        print(f"{key:34s} {value:10.2f}")


if __name__ == "__main__":
    main()

"""The scripted expert: its turns follow the protocol, it solves questions through the env and tools.

Unit tests run it against the real search tool and an in-memory visit tool (same page text as the
real one, no network). Integration tests use the real path: corpus server, visit tool over HTTP with
Chromium for JavaScript-only pages. The slow test is the 200-question acceptance run.
"""

from __future__ import annotations

import pytest

from tests.tools_for_tests import memory_toolbox
from turnstile.envs.answers import answer_matches
from turnstile.envs.env import EnvConfig
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, TurnKind, parse_turn
from turnstile.envs.synthetic.evaluate import evaluate_expert, run_expert_episode
from turnstile.envs.synthetic.expert import ExpertConfig, ScriptedExpert
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import World, WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rollout.engines.config import ScriptedEngineConfig

BASE = "http://corpus.test"


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(WorldConfig(seed=3))


@pytest.fixture(scope="module")
def tasks(world: World) -> list[Task]:
    return generate_tasks(world, QuestionConfig(count=60), BASE)


def _memory_toolbox(world: World) -> Toolbox:
    docs = world_documents(world, BASE)
    return memory_toolbox(docs, extract=True)


async def test_solves_chain_and_aggregation_questions_in_memory(world: World, tasks: list[Task]) -> None:
    toolbox = _memory_toolbox(world)
    chains = [t for t in tasks if t.metadata["kind"] == "chain"][:25]
    aggregate = next(t for t in tasks if t.metadata["kind"] == "aggregate")
    results = [await run_expert_episode(task, toolbox, EnvConfig()) for task in [*chains, aggregate]]
    wrong = [(r.question, r.answer, r.gold) for r in results if not r.correct]
    assert not wrong, wrong
    assert results[-1].tool_calls >= 2 * int(aggregate.metadata["members"])  # type: ignore[arg-type]


def test_every_turn_is_well_formed(world: World, tasks: list[Task]) -> None:
    expert = ScriptedExpert(tasks[0])
    first = parse_turn(expert.next_turn(None))
    assert first.kind is TurnKind.TOOL_CALL and first.format_ok and first.tool == "search"
    if tasks[0].metadata["kind"] == "chain":
        assert first.arguments == {"query": [tasks[0].metadata["start"]]}


def test_a_hasty_expert_answers_from_the_listing_without_opening_a_page(world: World, tasks: list[Task]) -> None:
    """``hasty_fraction``: that share of chain questions (a function of the task id) is answered
    with the first search result that is not the question's entity, unread; the rest as before."""
    chains = [t for t in tasks if t.metadata["kind"] == "chain"]
    half = ExpertConfig(hasty_fraction=0.5)
    picked = [half.hasty(t.id) for t in chains]
    assert 0 < sum(picked) < len(chains) and picked == [half.hasty(t.id) for t in chains]
    assert not any(ExpertConfig().hasty(t.id) for t in chains)
    assert all(ExpertConfig(hasty_fraction=1.0).hasty(t.id) for t in chains)
    with pytest.raises(ValueError, match="hasty_fraction"):
        ExpertConfig(hasty_fraction=1.5)

    task = chains[0]
    expert = ScriptedExpert(task, ExpertConfig(hasty_fraction=1.0))
    search = parse_turn(expert.next_turn(None))
    assert search.tool == "search" and search.arguments == {"query": [task.metadata["start"]]}
    listing = ("<tool_response>\nA search found 2 results:\n\n## Web Results\n"
               f"1. [{task.metadata['start']}](http://corpus.test/wiki/A)\n2. [Nearby Name](http://corpus.test/wiki/B)\n"
               "</tool_response>")
    answer = parse_turn(expert.next_turn(listing))
    assert answer.kind is TurnKind.ANSWER and answer.answer == "Nearby Name" and expert.tool_calls == 1
    assert "without opening a page" in answer.think
    alone = ScriptedExpert(task, ExpertConfig(hasty_fraction=1.0))
    alone.next_turn(None)
    listed_alone = f"<tool_response>\n1. [{task.metadata['start']}](http://corpus.test/wiki/A)\n</tool_response>"
    assert parse_turn(alone.next_turn(listed_alone)).answer == "unknown"  # nothing else listed: no guess


async def test_an_early_expert_answers_with_a_bridge_entity(world: World) -> None:
    """``early_fraction``: that share of chains of two or more hops (a function of the task id) is
    answered after k < n hops with the entity reached there, through the real tools; one-hop chains
    and hasty questions never stop early; the rest are solved as before."""
    chains = [t for t in generate_tasks(world, QuestionConfig(count=60, min_hops=2, max_hops=3,
                                                              entity_answer_fraction=1.0,
                                                              aggregation_fraction=0.0), BASE)]
    half = ExpertConfig(early_fraction=0.5)
    stops = {t.id: half.stops_after(t.id, len(t.metadata["path"])) for t in chains}  # type: ignore[arg-type]
    early = [t for t in chains if stops[t.id] is not None]
    assert 0 < len(early) < len(chains)
    assert all(1 <= stops[t.id] < len(t.metadata["path"]) for t in early)  # type: ignore[arg-type, operator]
    assert {stops[t.id] for t in early if len(t.metadata["path"]) == 3} == {1, 2}  # type: ignore[arg-type]
    assert ExpertConfig(early_fraction=1.0).stops_after("q", 1) is None  # one hop: nothing to stop
    assert ExpertConfig(early_fraction=1.0, hasty_fraction=1.0).stops_after("q", 3) is None
    with pytest.raises(ValueError, match="early_fraction"):
        ExpertConfig(early_fraction=-0.1)
    with pytest.raises(ValueError, match=r"engine\.scripted\.early_fraction=1\.5 must be in \[0, 1\]"):
        ScriptedEngineConfig(early_fraction=1.5)  # refused when the config loads, not in the actor

    toolbox = _memory_toolbox(world)
    for task in early[:4] + [t for t in chains if stops[t.id] is None][:2]:
        result = await run_expert_episode(task, toolbox, EnvConfig(max_turns=8), half)
        if stops[task.id] is None:
            assert result.correct, (task.question, result.answer)
            continue
        assert not result.correct and result.tool_calls == 2 * stops[task.id]  # type: ignore[operator]


def test_a_missed_search_is_retried_with_another_query(tasks: list[Task]) -> None:
    task = next(t for t in tasks if t.metadata["kind"] == "chain")
    expert = ScriptedExpert(task)
    expert.next_turn(None)
    retry = parse_turn(expert.next_turn("<tool_response>\nNo results found for 'x'.\n</tool_response>"))
    assert retry.tool == "search" and retry.arguments["query"] != [task.metadata["start"]]


def test_forced_final_instruction_gets_an_answer(tasks: list[Task]) -> None:
    expert = ScriptedExpert(tasks[0])
    expert.next_turn(None)
    final = parse_turn(expert.next_turn(FINAL_ANSWER_INSTRUCTION))
    assert final.kind is TurnKind.ANSWER and final.format_ok
    with pytest.raises(RuntimeError, match="already answered"):
        expert.next_turn("more")


def test_refuses_tasks_without_a_plan() -> None:
    with pytest.raises(ValueError, match="no synthetic plan"):
        ScriptedExpert(Task("t", "Who?", ("x",)))


def test_answer_matching_normalises() -> None:
    assert answer_matches("12400", ("12,400",))
    assert answer_matches("the  Teal", ("Teal",))
    assert not answer_matches(None, ("x",)) and not answer_matches("13", ("12",))


# ---- the real path -----------------------------------------------------------------------------

@pytest.mark.integration
async def test_expert_through_server_env_and_real_tools() -> None:
    """A handful of questions end to end, with one 50+ call aggregation and a JavaScript-only page."""
    from urllib.parse import urlsplit

    from turnstile.envs.corpus_server import CorpusServer
    from turnstile.envs.toolset import ToolsConfig, build_toolbox

    world = generate_world(WorldConfig(seed=0))
    with CorpusServer(world_documents(world)) as server:
        tasks = generate_tasks(world, QuestionConfig(count=60), server.base_url)
        chains = [t for t in tasks if t.metadata["kind"] == "chain"]
        js_chain = next(t for t in chains if int(t.metadata["js_pages"]) > 0)  # type: ignore[arg-type]
        long_chain = next(t for t in chains if t.metadata["hops"] == 8)
        aggregate = min((t for t in tasks if t.metadata["kind"] == "aggregate"),
                        key=lambda t: int(t.metadata["members"]))  # type: ignore[arg-type]
        chosen = [js_chain, long_chain, chains[0], aggregate]
        toolbox = build_toolbox(ToolsConfig(), server.documents(),
                                allow_hosts=[urlsplit(server.base_url).netloc])
        try:
            results = [await run_expert_episode(task, toolbox, EnvConfig()) for task in chosen]
        finally:
            await toolbox.aclose()
    assert all(r.correct for r in results), [(r.question, r.answer, r.gold) for r in results]
    assert results[-1].tool_calls >= 50
    assert toolbox.metrics.failures == {} or sum(toolbox.metrics.failures.values()) == 0


@pytest.mark.integration
async def test_js_only_page_needs_the_browser() -> None:
    """Static extraction of a JavaScript-only page is empty; the visit tool (Chromium) reads it all."""
    from urllib.parse import urlsplit

    from turnstile.envs.corpus_server import CorpusServer
    from turnstile.envs.synthetic.render import article, line_text
    from turnstile.envs.visit.guard import GuardConfig
    from turnstile.envs.visit.tool import VisitConfig, VisitTool

    world = generate_world(WorldConfig(seed=0))
    entity = next(e for e in world.hubs() if e.js_only) if any(h.js_only for h in world.hubs()) \
        else next(e for e in world.entities if e.js_only)
    with CorpusServer(world_documents(world)) as server:
        url = server.url_for(entity.slug)
        tool = VisitTool(VisitConfig(guard=GuardConfig(allow_hosts=[urlsplit(url).netloc])))
        try:
            static = VisitTool(VisitConfig(render="never",
                                           guard=GuardConfig(allow_hosts=[urlsplit(url).netloc])))
            assert "no readable text" in await static.call({"url": [url], "goal": "facts"})
            await static.aclose()
            text = await tool.call({"url": [url], "goal": "facts"})
        finally:
            await tool.aclose()
    for section in article(world, entity).sections:
        for item in section.items:
            assert line_text(item) in text


@pytest.mark.integration
@pytest.mark.slow
async def test_acceptance_200_questions() -> None:
    """>= 95% of 200 questions right through the real HTTP path, >= 20 of them with 100+ tool calls."""
    report = await evaluate_expert(200, seed=0, concurrency=8)
    print(report.summary())
    assert report.accuracy >= 0.95, report.summary()
    assert report.long_runs >= 20, report.summary()


@pytest.mark.integration
def test_expert_command_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from turnstile.cluster.cli.commands import expert as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--questions", "3", "--seed", "2", "--concurrency", "3",
                              "--min-accuracy", "0.6"])
    assert command.NAME == "expert"
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "questions: 3" in out and "accuracy:" in out and ">= 100 tool calls" in out


async def test_follows_the_clue_chains_of_hotpotqa_through_the_tools(shared_data) -> None:  # noqa: ANN001
    """On a data set with evidence (HotpotQA), the expert is an oracle: it searches each clue's page by
    its title, opens the listed result at the clue's address (many hold parentheses) and answers."""
    from turnstile.envs.datasets.hotpotqa import read_hotpotqa

    loaded = read_hotpotqa(shared_data / "multihop/hotpotqa_dev500.jsonl", f"{BASE}/wiki/")
    toolbox = memory_toolbox(loaded.corpus)
    tasks = loaded.tasks[:30]
    assert sum("(" in url for task in tasks for clue in task.clues or () for url in clue.evidence_urls) >= 3
    results = [await run_expert_episode(task, toolbox, EnvConfig()) for task in tasks]
    wrong = [(r.question, r.answer, r.gold) for r in results if not r.correct]
    assert not wrong, wrong
    assert all(r.tool_calls >= 2 * len(task.clues or ()) for r, task in zip(results, tasks, strict=True))
    with pytest.raises(ValueError, match="no clue chain with evidence pages"):
        ScriptedExpert(Task(id="x", question="Who?", answers=("a",)))

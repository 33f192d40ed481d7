"""Clue step scores (docs/algorithms.md §6): the score rule, the heuristic judge on the synthetic world's
scripted-expert trajectories, the LLM judge and clue recovery against a local OpenAI-compatible server.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.openai_server import Reply, chat_server, replies_in_order
from tests.test_episode import BASE, chain, episode, smallest_aggregate
from tests.test_rewards_format import TASK, make_trajectory, make_turn
from tests.tools_for_tests import memory_toolbox
from turnstile.envs.chat_client import ChatClient, ChatClientConfig
from turnstile.envs.corpus_server import CorpusServer
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.protocol import render_answer, render_tool_call
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import World, WorldConfig, generate_world
from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.toolset import ToolsConfig, build_toolbox
from turnstile.rewards.base import build_reward
from turnstile.rewards.clue_recovery import ClueRecoverer, ClueRecoveryConfig, ClueRecoveryError, parse_clues
from turnstile.rewards.clues import ClueMatcher, ClueSteps, ClueStepsConfig, heuristic_events, step_score
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.trajectory import StopReason, Trajectory

# ---- the score rule (worked example E3) ----------------------------------------------------------


@pytest.mark.parametrize(("events", "score"), [
    (["clue_found:a"], 1.8),
    (["clue_found:a", "clue_found:b"], 2.0),
    (["candidate_excluded:x", "clue_discarded:a"], 0.6),
    ([], 1.0),
    (["clue_discarded:a", "clue_discarded:b"], 0.0),
    (["answer_wrong"], 0.0),
    (["clue_verified:a", "answer_correct"], 2.0),
    (["judge_unparseable"], 1.0),
])
def test_step_score(events: list[str], score: float) -> None:
    assert step_score(events) == pytest.approx(score)


def test_unknown_events_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown step event 'clue_lost:a'"):
        step_score(["clue_lost:a"])


# ---- the heuristic judge on hand-written turns -------------------------------------------------

def test_a_clue_needs_its_value_not_just_its_subject() -> None:
    member = ClueMatcher.of(Clue("m1", "Born of Ada Varn: 1931", "constraint", (), ("Ada Varn",)))
    assert not member.matches(" member ada varn joined in 1950 ")
    assert member.matches(" ada varn born 1931 ")
    hop = ClueMatcher.of(Clue("h1", "Founder of Osk Guild: Ada Varn", "bridge", (), ("Ada Varn",)))
    assert hop.matches(" osk guild founder ada varn ") and not hop.matches(" ada varn ")


CLUES = (
    Clue("hop1", "Founder of Osk Guild: Ada Varn", "bridge", ("http://x/wiki/osk-guild",), ("Ada Varn",)),
    Clue("answer", "Born of Ada Varn: 1931", "answer", ("http://x/wiki/ada-varn",), ()),
)
BORN = Task("t2", "When was the founder of Osk Guild born?", ("1931",), CLUES)


def test_found_verified_excluded_discarded_and_answered() -> None:
    turns = [
        make_turn(0, "tool_call", observation="Osk Guild. Founder: Ada Varn. Founded 1880."),
        make_turn(1, "tool_call", tool="visit", url="http://x/wiki/osk-guild",
                  observation="Content of http://x/wiki/osk-guild:\nOsk Guild\nFounder: Ada Varn"),
        make_turn(2, "tool_call", text="<think>Bo Lund is not the answer; I rule out Bo Lund.</think>",
                  observation="Bo Lund, born 1950."),
        make_turn(3, "tool_call", text="<think>I discard Ada Varn, she seems wrong.</think>"),
        make_turn(4, "tool_call", tool="visit", url="http://x/wiki/ada-varn",
                  observation="Ada Varn\nBorn: 1931"),
        make_turn(5, "answer", text="<think>Born: 1931.</think><answer>1931</answer>", answer="1931"),
    ]
    events = heuristic_events(make_trajectory(turns, StopReason.ANSWERED, "1931", BORN), BORN, CLUES)
    assert events == [
        ["clue_found:hop1"],
        ["clue_verified:hop1"],  # read again on its evidence page
        ["candidate_excluded:bo lund"],  # named twice, credited once
        ["clue_discarded:hop1"],
        ["clue_verified:answer"],  # first seen on its evidence page: one event
        ["answer_correct"],  # the model repeating a known clue earns nothing more
    ]
    assert [step_score(e) for e in events] == pytest.approx([1.8, 1.8, 1.4, 0.2, 1.8, 2.0])


def test_an_unanswered_last_turn_counts_as_a_wrong_answer() -> None:
    turns = [make_turn(0, "tool_call"), make_turn(1, "malformed", format_ok=False)]
    events = heuristic_events(make_trajectory(turns, StopReason.NO_ANSWER, task=BORN), BORN, CLUES)
    assert events == [[], ["answer_wrong"]]
    wrong = [make_turn(0, "answer", text="<answer>1950</answer>", answer="1950")]
    events = heuristic_events(make_trajectory(wrong, StopReason.ANSWERED, "1950", BORN), BORN, CLUES)
    assert events == [["answer_wrong"]]


# ---- the heuristic judge on the synthetic world's expert ----------------------------------------

@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(WorldConfig(seed=0))


@pytest.fixture(scope="module")
def tasks(world: World) -> list[Task]:
    return generate_tasks(world, QuestionConfig(), BASE)


@pytest.fixture(scope="module")
def toolbox(world: World) -> Toolbox:
    documents = world_documents(world, BASE)
    return memory_toolbox(documents)


def assert_chain_events(trajectory: Trajectory, task: Task, events_T: list[list[str]]) -> None:
    """What a solved clue chain implies: each clue verified on the first visit of its evidence
    page, found at most once before that, in chain order; the right answer last; nothing else."""
    assert task.clues is not None
    turns = trajectory.turns
    verified_at = []
    for clue in task.clues:
        visit = next(t.index for t in turns if t.tool == "visit"
                     and t.arguments is not None and t.arguments["url"] in clue.evidence_urls)
        assert f"clue_verified:{clue.id}" in events_T[visit], (clue, visit, events_T)
        found = [i for i, events in enumerate(events_T) if f"clue_found:{clue.id}" in events]
        assert len(found) <= 1 and all(i < visit for i in found)
        verified_at.append(visit)
    assert verified_at == sorted(verified_at)
    assert events_T[-1][-1] == "answer_correct"
    all_events = [event for events in events_T for event in events]
    assert all(e.split(":")[0] in ("clue_found", "clue_verified", "answer_correct") for e in all_events)
    assert sum(e.startswith("clue_verified") for e in all_events) == len(task.clues)


@pytest.mark.parametrize("hops", [2, 3, 5])
async def test_expert_chains_get_the_events_of_their_clue_chain(chat: ChatFormat, tasks: list[Task],
                                                               toolbox: Toolbox, hops: int) -> None:
    task = chain(tasks, hops)
    trajectory = await episode(task, ScriptedEngine(chat, tasks=tasks), toolbox, chat)
    assert trajectory.stop_reason is StopReason.ANSWERED
    plugin = build_reward(PluginSpec("turnstile.rewards.clues:ClueSteps"))
    await plugin.score(trajectory, task)
    events_T = [turn.events for turn in trajectory.turns]
    assert_chain_events(trajectory, task, events_T)
    # The expert searches a page (the snippet shows the fact) and then reads it: found, verified.
    assert task.clues is not None
    expected = [[f"clue_{kind}:{clue.id}"] for clue in task.clues for kind in ("found", "verified")]
    assert events_T == [*expected, ["answer_correct"]]
    assert [t.step_score for t in trajectory.turns] == pytest.approx([1.8] * len(expected) + [2.0])


async def test_expert_aggregation_verifies_every_member(chat: ChatFormat, tasks: list[Task],
                                                        toolbox: Toolbox) -> None:
    task = smallest_aggregate(tasks)
    trajectory = await episode(task, ScriptedEngine(chat, tasks=tasks), toolbox, chat)
    assert task.clues is not None
    events_T = heuristic_events(trajectory, task, task.clues)
    readable = task.clues[:-1]  # the last clue ("Answer: N") is computed, never read on a page
    assert_chain_events(trajectory, task.__class__(task.id, task.question, task.answers,
                                                  tuple(readable)), events_T)


async def test_an_expert_cut_short_answers_wrong(chat: ChatFormat, tasks: list[Task],
                                                 toolbox: Toolbox) -> None:
    task = chain(tasks, 5)
    trajectory = await episode(task, ScriptedEngine(chat, tasks=tasks), toolbox, chat, max_turns=4)
    assert task.clues is not None
    events_T = heuristic_events(trajectory, task, task.clues)
    first = task.clues[0].id
    assert events_T == [[f"clue_found:{first}"], [f"clue_verified:{first}"], [], ["answer_wrong"]]


@pytest.mark.integration
async def test_expert_events_through_the_real_tools(chat: ChatFormat) -> None:
    """Corpus server on loopback, real search and HTTP visit (a chain without JavaScript pages)."""
    world = generate_world(WorldConfig(seed=0))
    with CorpusServer(world_documents(world)) as server:
        tasks = generate_tasks(world, QuestionConfig(), server.base_url)
        task = next(t for t in tasks if t.metadata["kind"] == "chain" and t.metadata["js_pages"] == 0
                    and int(t.metadata["hops"]) >= 3)  # type: ignore[arg-type]
        real = build_toolbox(ToolsConfig(), server.documents(),
                             allow_hosts=[urlsplit(server.base_url).netloc])
        try:
            trajectory = await episode(task, ScriptedEngine(chat, tasks=tasks), real, chat)
        finally:
            await real.aclose()
    assert trajectory.stop_reason is StopReason.ANSWERED
    plugin = ClueSteps(ClueStepsConfig())
    await plugin.score(trajectory, task)
    assert_chain_events(trajectory, task, [turn.events for turn in trajectory.turns])
    assert all(turn.step_score is not None and 0 <= turn.step_score <= 2 for turn in trajectory.turns)


# ---- the LLM judge -----------------------------------------------------------------------------

def llm_plugin(base_url: str, turns_per_call: int = 20) -> ClueSteps:
    options = {"judge": "llm", "llm": {"turns_per_call": turns_per_call},
               "client": {"base_url": base_url, "model": "step-judge", "api_key_env": "",
                          "backoff_s": 0.01}}
    plugin = build_reward(PluginSpec("turnstile.rewards.clues:ClueSteps", options))  # type: ignore[arg-type]
    assert isinstance(plugin, ClueSteps)
    return plugin


def three_turns() -> Trajectory:
    turns = [make_turn(0, "tool_call", observation="Founder: Ada Varn"),
             make_turn(1, "tool_call", observation="Born: 1931"),
             make_turn(2, "answer", text="<answer>1931</answer>", answer="1931")]
    return make_trajectory(turns, StopReason.ANSWERED, "1931", BORN)


async def test_llm_judge_labels_turns() -> None:
    labels = {"turns": [
        {"turn": 0, "events": [{"type": "clue_found", "clue": "hop1"},
                               {"type": "candidate_excluded", "candidate": "Bo Lund"}]},
        {"turn": 1, "events": [{"type": "clue_found", "clue": "hop1"},  # again: no credit
                               {"type": "clue_verified", "clue": "answer"},
                               {"type": "clue_found", "clue": "made-up"},  # not a clue: dropped
                               {"type": "celebrated"}]},
    ]}
    with chat_server(replies_in_order(["Here you go:\n```json\n" + json.dumps(labels) + "\n```"])) as srv:
        plugin = llm_plugin(srv.base_url)
        trajectory = three_turns()
        await plugin.score(trajectory, BORN)
        await plugin.aclose()
    assert [t.events for t in trajectory.turns] == [
        ["clue_found:hop1", "candidate_excluded:bo lund"], ["clue_verified:answer"], ["answer_correct"]]
    assert [t.step_score for t in trajectory.turns] == pytest.approx([2.0, 1.8, 2.0])
    prompt = srv.log.requests[0]["messages"][0]["content"]
    assert "hop1 (bridge): Founder of Osk Guild: Ada Varn" in prompt and "Step 1:" in prompt


async def test_llm_judge_garbage_scores_one_per_window() -> None:
    good = json.dumps({"turns": [{"turn": 0, "events": [{"type": "clue_found", "clue": "hop1"}]}]})
    def by_window(messages: list[dict[str, str]]) -> Reply:
        # Windows are judged concurrently: answer by which window asks, not by arrival order.
        return Reply(good if "Step 0:" in messages[-1]["content"] else "no idea, sorry")

    with chat_server(by_window) as srv:
        plugin = llm_plugin(srv.base_url, turns_per_call=2)
        trajectory = three_turns()
        await plugin.score(trajectory, BORN)
        await plugin.aclose()
    assert srv.log.count == 2
    assert [t.events for t in trajectory.turns] == [["clue_found:hop1"], [], ["judge_unparseable"]]
    assert [t.step_score for t in trajectory.turns] == pytest.approx([1.8, 1.0, 1.0])


# ---- clue recovery -----------------------------------------------------------------------------

def recovery_script(task: Task, search_first: str) -> list[str]:
    """What a recovery model writes: a search, a visit, a bad list, then a good list."""
    assert task.clues is not None
    clues = [{"id": c.id, "text": c.text, "role": c.role, "evidence_urls": list(c.evidence_urls),
              "aliases": list(c.aliases)} for c in task.clues]
    return [
        render_tool_call("search", {"query": [search_first]}, "Find the start page."),
        render_tool_call("visit", {"url": task.clues[0].evidence_urls[0], "goal": "the first fact"},
                         "Read it."),
        render_answer('[{"id": "c1", "text": "x", "role": "hint"}]', "Done?"),
        render_answer(json.dumps(clues), "Every fact is on a page I read."),
    ]


async def test_recovery_uses_the_tools_and_is_cached(world: World, tmp_path: Path) -> None:
    with CorpusServer(world_documents(world)) as corpus:
        tasks = generate_tasks(world, QuestionConfig(count=20), corpus.base_url)
        task = next(t for t in tasks if t.metadata["kind"] == "chain" and t.metadata["js_pages"] == 0)
        bare = Task(task.id, task.question, task.answers)  # ships no clues
        tools = build_toolbox(ToolsConfig(), corpus.documents(),
                              allow_hosts=[urlsplit(corpus.base_url).netloc])
        script = recovery_script(task, str(task.metadata["start"]))
        with chat_server(replies_in_order(script)) as srv:
            client = ChatClient(ChatClientConfig(base_url=srv.base_url, model="m", api_key_env=""))
            cache = tmp_path / "clues.jsonl"
            recoverer = ClueRecoverer(ClueRecoveryConfig(cache_path=str(cache)), client, tools)
            first = await recoverer.clues(bare)
            again = await recoverer.clues(bare)
            own = await recoverer.clues(task)  # a task with clues never asks
            reread = await ClueRecoverer(ClueRecoveryConfig(cache_path=str(cache)), client,
                                         tools).clues(bare)
            await client.aclose()
        await tools.aclose()
    assert first == again == own == reread == task.clues
    assert srv.log.count == 4 and recoverer.recovered == 1
    conversation = srv.log.requests[-1]["messages"]
    observations = [m["content"] for m in conversation if m["role"] == "user"][1:]
    assert str(task.metadata["start"]) in observations[0]  # the search ran
    assert "Content of " in observations[1]  # the visit fetched the page over HTTP
    assert "role must be one of" in observations[2]  # the bad list was explained


async def test_recovery_gives_up_after_max_turns() -> None:
    nonsense = "I am not sure what to do."
    with chat_server(replies_in_order([], then=Reply(nonsense))) as srv:
        client = ChatClient(ChatClientConfig(base_url=srv.base_url, model="m", api_key_env=""))
        recoverer = ClueRecoverer(ClueRecoveryConfig(max_turns=3), client, Toolbox([]))
        with pytest.raises(ClueRecoveryError, match="no valid clue list after 3 turns"):
            await recoverer.recover(TASK)
        await client.aclose()
    assert srv.log.count == 3  # one request per turn, then it stops


def test_parse_clues_checks_every_field() -> None:
    clues = parse_clues('[{"text": "Founder of X: Y", "role": "bridge", "aliases": ["Y"]}, '
                        '{"id": "c1", "text": "Born of Y: 1900", "role": "answer"}]')
    assert [c.id for c in clues] == ["c1", "c1-2"] and clues[0].aliases == ("Y",)
    for bad, message in [("nothing", "JSON list"), ("[]", "empty"), ('[{"role": "bridge"}]', "text"),
                         ('[{"text": "a", "role": "bridge", "aliases": [1]}]', "lists of strings")]:
        with pytest.raises(ValueError, match=message):
            parse_clues(bad)

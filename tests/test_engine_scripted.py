"""The scripted engine: an expert that reads its token context, and a replay of recorded turns."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from turnstile.envs.protocol import TurnKind, parse_turn, render_answer, render_tool_call
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import FINISH_LENGTH, FINISH_STOP, PolicyEngine, SamplingParams
from turnstile.rollout.engines.config import EngineConfig, ScriptedEngineConfig
from turnstile.rollout.engines.registry import build_engine
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, save_trajectories

SYSTEM = {"role": "system", "content": "You are a deep research assistant."}


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return generate_tasks(generate_world(WorldConfig(seed=0)), QuestionConfig())


@pytest.fixture
def sampling(chat: ChatFormat) -> SamplingParams:
    return SamplingParams(max_new_tokens=512, stop_token_ids=chat.stop_token_ids)


def first_prompt(chat: ChatFormat, question: str) -> list[int]:
    return chat.prompt_ids([SYSTEM, {"role": "user", "content": question}])


def chain(tasks: list[Task]) -> Task:
    return next(t for t in tasks if t.metadata["kind"] == "chain")


async def test_builds_from_config_through_the_registry(chat: ChatFormat, tasks: list[Task],
                                                       sampling: SamplingParams) -> None:
    engine = build_engine(EngineConfig(kind="scripted", model=str(ensure_default_model())))
    assert isinstance(engine, ScriptedEngine) and isinstance(engine, PolicyEngine)
    task = chain(tasks)
    generation = await engine.generate(first_prompt(chat, task.question), sampling, affinity="e1")
    assert generation.finish_reason == FINISH_STOP
    assert generation.token_ids[-1] == chat.turn_end_id
    assert generation.logprobs == (0.0,) * len(generation.token_ids)
    turn = parse_turn(chat.response_text(generation.token_ids))
    assert turn.kind is TurnKind.TOOL_CALL and turn.arguments == {"query": [task.metadata["start"]]}


async def test_reads_the_last_observation_from_the_context(chat: ChatFormat, tasks: list[Task],
                                                          sampling: SamplingParams) -> None:
    engine = ScriptedEngine(chat, tasks=tasks)
    task = chain(tasks)
    prompt = first_prompt(chat, task.question)
    first = await engine.generate(prompt, sampling)  # no affinity: keyed by the question
    missed = "<tool_response>\nNo results found for 'x'.\n</tool_response>"
    prompt += [*first.token_ids, *chat.delta_ids(missed, first.token_ids)]
    retry = parse_turn(chat.response_text((await engine.generate(prompt, sampling)).token_ids))
    assert retry.tool == "search" and retry.arguments["query"] != [task.metadata["start"]]


async def test_report_mode_writes_a_report(chat: ChatFormat, tasks: list[Task],
                                           sampling: SamplingParams) -> None:
    engine = ScriptedEngine(chat, tasks=tasks, report=True)
    generation = await engine.generate(first_prompt(chat, chain(tasks).question), sampling, "e")
    turn = parse_turn(chat.response_text(generation.token_ids), expect_report=True)
    assert turn.format_ok and turn.report and turn.report.startswith("1 tool calls so far.")


async def test_cuts_at_max_new_tokens(chat: ChatFormat, tasks: list[Task]) -> None:
    engine = ScriptedEngine(chat, tasks=tasks)
    generation = await engine.generate(first_prompt(chat, chain(tasks).question),
                                       SamplingParams(max_new_tokens=5), "e")
    assert len(generation.token_ids) == 5 and generation.finish_reason == FINISH_LENGTH


async def test_unknown_questions_are_errors_and_moved_episodes_continue(chat: ChatFormat, tasks: list[Task],
                                                                      sampling: SamplingParams) -> None:
    engine = ScriptedEngine(chat, tasks=tasks)
    with pytest.raises(ValueError, match="world_seed"):
        await engine.generate(first_prompt(chat, "What is not asked?"), sampling, "e")
    prompt = first_prompt(chat, chain(tasks).question)
    first = await engine.generate(prompt, sampling, "e1")
    prompt += [*first.token_ids, *chat.delta_ids("<tool_response>\nx\n</tool_response>", first.token_ids)]
    # The episode moves (its replica drained or died): another replica rebuilds it from the context
    # and writes the turn the first one writes.
    moved = await ScriptedEngine(chat, tasks=tasks).generate(prompt, sampling, "e1")
    stayed = await engine.generate(prompt, sampling, "e1")
    assert moved.token_ids == stayed.token_ids and len(moved.token_ids) > 1
    with pytest.raises(ValueError, match="tasks"):
        ScriptedEngine(chat)


async def test_replays_recorded_turns_in_order(chat: ChatFormat, tmp_path: Path,
                                               sampling: SamplingParams) -> None:
    question = "Which city is the capital of Krandara?"
    texts = [render_tool_call("search", {"query": ["a"]}, "first"), render_answer("Fegrel", "second")]
    turns = [Turn(index=i, response_ids=[*chat.encode(t), chat.turn_end_id],
                  response_logprobs=[-0.5] * (len(chat.encode(t)) + 1), weights_version=3,
                  context_len=0, finish_reason=FINISH_STOP) for i, t in enumerate(texts)]
    recorded = Trajectory(uid="u", sample=0, task_id="t", question=question, answers=["Fegrel"],
                          segments=[Segment(prompt_ids=[1], turns=turns)])
    path = tmp_path / "recorded.jsonl"
    save_trajectories([recorded], path)
    config = EngineConfig(kind="scripted", model=str(ensure_default_model()),
                          scripted=ScriptedEngineConfig(mode="replay", replay_path=str(path)))
    engine = ScriptedEngine.from_config(config)
    prompt = first_prompt(chat, question)
    first = await engine.generate(prompt, sampling, "r")
    assert list(first.token_ids) == turns[0].response_ids and first.logprobs[0] == -0.5
    prompt += [*first.token_ids, *chat.delta_ids("<tool_response>\nx\n</tool_response>", first.token_ids)]
    second = await engine.generate(prompt, sampling, "r")
    assert list(second.token_ids) == turns[1].response_ids
    with pytest.raises(ValueError, match="replay_path"):
        ScriptedEngine.from_config(dataclasses.replace(config, scripted=ScriptedEngineConfig(mode="replay")))
    with pytest.raises(ValueError, match="'expert' or 'replay'"):
        ScriptedEngine.from_config(dataclasses.replace(config, scripted=ScriptedEngineConfig(mode="x")))


async def test_score_and_weights(chat: ChatFormat, tasks: list[Task], sampling: SamplingParams) -> None:
    engine = ScriptedEngine(chat, tasks=tasks)
    assert await engine.score([[1, 2, 3], [4, 5]], [(1, 3), (0, 0)]) == [[0.0, 0.0], []]
    with pytest.raises(ValueError, match="outside"):
        await engine.score([[1]], [(0, 2)])
    assert await engine.weights_version() == 0
    await engine.update_weights(4, {})
    assert await engine.weights_version() == 4
    generation = await engine.generate(first_prompt(chat, chain(tasks).question), sampling, "w")
    assert generation.weights_version == 4
    await engine.aclose()
    await engine.aclose()


def test_check_tasks_refuses_questions_outside_the_world(tasks: list[Task]) -> None:
    from turnstile.rollout.engines.registry import check_engine_tasks

    config = EngineConfig(kind="scripted")
    check_engine_tasks(config, [t.question for t in tasks[:5]])  # its own world: served
    with pytest.raises(ValueError, match=r"cannot answer 1 of 2 tasks .*'Which band released Abbey Road\?'"
                                         r".*use rollout data.kind=synthetic"):
        check_engine_tasks(config, [tasks[0].question, "Which band released Abbey Road?"])
    check_engine_tasks(EngineConfig(kind="hf"), ["Which band released Abbey Road?"])  # a model: anything


def test_check_servable_refuses_clues_the_corpus_does_not_serve(shared_data: Path) -> None:
    from turnstile.cluster.jobs.session import check_servable
    from turnstile.envs.corpus import CorpusConfig
    from turnstile.envs.corpus_server import PAGE_PREFIX
    from turnstile.envs.datasets.registry import DatasetConfig, load_tasks

    corpus = CorpusConfig(kind="synthetic", base_url="http://127.0.0.1:9")
    prefix = corpus.base_url + PAGE_PREFIX
    synthetic = load_tasks(DatasetConfig(kind="synthetic", path="", limit=3, url_prefix=prefix))
    check_servable(synthetic, corpus, EngineConfig(kind="hf"))
    hotpot = load_tasks(DatasetConfig(kind="hotpotqa", path=str(shared_data / "multihop/hotpotqa_dev500.jsonl"),
                                      limit=3, url_prefix=prefix))
    with pytest.raises(ValueError, match=r"3 of 3 tasks have clue pages the corpus \(corpus.kind=synthetic\) "
                                         r"does not serve"):
        check_servable(hotpot, corpus, EngineConfig(kind="hf"))
    with pytest.raises(ValueError, match=r"engine.kind=scripted"):
        check_servable(hotpot, CorpusConfig(kind="none"), EngineConfig(kind="scripted"))
    # A rollout of HotpotQA tells the expert its data: it follows those questions' clue chains.
    from turnstile.cluster.jobs.session import expert_engine

    data = DatasetConfig(kind="hotpotqa", path=str(shared_data / "multihop/hotpotqa_dev500.jsonl"), limit=3)
    oracle = expert_engine(EngineConfig(kind="scripted"), data)
    assert oracle.scripted.data["kind"] == "hotpotqa"
    check_servable(hotpot, CorpusConfig(kind="none"), oracle)
    assert expert_engine(EngineConfig(kind="hf"), data) == EngineConfig(kind="hf")  # a model needs no plan


async def test_the_sim_engine_takes_a_model_servers_time(chat: ChatFormat, tasks: list[Task],
                                                         sampling: SamplingParams) -> None:
    """``engine.kind=sim``: the expert's turns, each holding one of ``concurrency`` slots for
    prefill of the uncached prompt plus decode of the turn; a replica that did not serve the
    episode's last turn prefills the whole context."""
    import asyncio
    import time

    from turnstile.rollout.engines.sim import SimEngine

    config = EngineConfig(kind="sim", model=str(ensure_default_model()),
                          options={"decode_s_per_token": 0.002, "prefill_s_per_token": 0.001, "concurrency": 1})
    engine = build_engine(config)
    assert isinstance(engine, SimEngine)
    prompts = [first_prompt(chat, task.question) for task in [chain(tasks), tasks[1]]]
    started = time.monotonic()
    first = await engine.generate(prompts[0], sampling, "a")
    one = time.monotonic() - started
    expected = 0.001 * len(prompts[0]) + 0.002 * len(first.token_ids)
    assert one >= expected and engine.busy_s == pytest.approx(expected)
    # One slot: two requests at once take the two requests' time, one after the other.
    started = time.monotonic()
    both = await asyncio.gather(*(engine.generate(p, sampling, f"b{i}") for i, p in enumerate(prompts)))
    assert time.monotonic() - started >= sum(0.001 * len(p) + 0.002 * len(g.token_ids)
                                             for p, g in zip(prompts, both, strict=True))
    # The episode's next turn on this replica prefills only what its cache lacks; moved, all of it.
    prompt = [*prompts[0], *first.token_ids, *chat.delta_ids("<tool_response>\nx\n</tool_response>", first.token_ids)]
    before = engine.busy_s
    following = await engine.generate(prompt, sampling, "a")
    cached = len(prompts[0]) + len(first.token_ids)
    assert engine.busy_s - before == pytest.approx(0.001 * (len(prompt) - cached) + 0.002 * len(following.token_ids))
    moved = build_engine(config)
    again = await moved.generate(prompt, sampling, "a")
    assert again.token_ids == following.token_ids
    assert moved.busy_s == pytest.approx(0.001 * len(prompt) + 0.002 * len(again.token_ids))
    with pytest.raises(ValueError, match="concurrency=0 must be >= 1"):
        build_engine(dataclasses.replace(config, options={"concurrency": 0}))

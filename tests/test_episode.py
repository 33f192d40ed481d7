"""The episode loop: the scripted policy solves synthetic questions, every way an episode can end,
and the token-in/token-out invariant on every segment.

Unit tests use the real search tool over the world's pages and an in-memory visit tool (the page
text the real tool extracts); the integration test runs the real path (corpus server, HTTP visit,
Chromium for JavaScript-only pages).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import WORLD_BASE
from tests.tools_for_tests import SlowTool
from turnstile.envs.env import EnvConfig
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, render_tool_call
from turnstile.envs.synthetic.evaluate import answer_matches
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.cache import CacheConfig
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.trajectory import StopReason, Trajectory, load_trajectories, save_trajectories

BASE = WORLD_BASE


class Policy:
    """Base of the test policies: the PolicyEngine methods other than generate."""

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return [[0.0] * (end - start) for start, end in spans]

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        pass

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        pass


class FailsOnTurn(Policy):
    def __init__(self, inner: ScriptedEngine, turn: int, abort: bool = False) -> None:
        self.inner, self.turn, self.abort, self.calls = inner, turn, abort, 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        self.calls += 1
        if self.calls == self.turn:
            if self.abort:
                return Generation((), (), FINISH_ABORT, 0)
            raise ConnectionError("replica lost")
        return await self.inner.generate(prompt_ids, sampling, affinity)


class Stubborn(Policy):
    """Always calls search, even when told to answer; ``ramble`` makes every turn run out of tokens."""

    def __init__(self, chat: ChatFormat, ramble: bool = False) -> None:
        self.chat, self.ramble = chat, ramble

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        if self.ramble:
            ids = self.chat.encode("<think> and so on" * sampling.max_new_tokens)[: sampling.max_new_tokens]
            return Generation(tuple(ids), (0.0,) * len(ids), FINISH_LENGTH, 0)
        ids = [*self.chat.encode(render_tool_call("search", {"query": ["Krandara"]}, "More.")),
               self.chat.turn_end_id]
        return Generation(tuple(ids), (-1.0,) * len(ids), FINISH_STOP, 0)


class Garbage(Policy):
    """Random token ids of random length, sometimes ending on a stop token."""

    def __init__(self, chat: ChatFormat, seed: int) -> None:
        self.chat, self.rng = chat, random.Random(seed)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        ids = [self.rng.randrange(len(self.chat.tokenizer))
               for _ in range(self.rng.randint(0, min(40, sampling.max_new_tokens)))]
        if self.rng.random() < 0.5 and len(ids) < sampling.max_new_tokens:
            ids.append(self.rng.choice(sampling.stop_token_ids))
        finish = FINISH_STOP if ids and ids[-1] in sampling.stop_token_ids else FINISH_LENGTH
        return Generation(tuple(ids), (0.0,) * len(ids), finish, 0)


class Slow(Policy):
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        await asyncio.sleep(30)
        raise AssertionError("the episode timeout should have fired")


def chain(tasks: list[Task], hops: int = 3) -> Task:
    return next(t for t in tasks if t.metadata["kind"] == "chain" and t.metadata["hops"] == hops)


def smallest_aggregate(tasks: list[Task]) -> Task:
    return min((t for t in tasks if t.metadata["kind"] == "aggregate"),
               key=lambda t: int(t.metadata["members"]))  # type: ignore[arg-type]


async def episode(task: Task, engine: object, toolbox: Toolbox, chat: ChatFormat, *,
                  kind: str = "mono", sample: int = 0, **limits: object) -> Trajectory:
    env = EnvConfig(max_turns=int(limits.pop("max_turns", 200)),  # type: ignore[call-overload]
                    stall_turns=int(limits.pop("stall_turns", 4)))  # type: ignore[call-overload]
    settings = {"context_budget": 262144, "max_new_tokens": 1024, **limits}
    config = EpisodeConfig(env=env, **settings)  # type: ignore[arg-type]
    return await run_episode(task, task.id, sample, engine, toolbox, chat,  # type: ignore[arg-type]
                             build_context_manager(ContextConfig(kind=kind)), config)


def assert_token_invariant(trajectory: Trajectory, chat: ChatFormat) -> None:
    """Each turn was generated from exactly the segment's ids before it; for one-segment episodes
    whose turns all ended normally, the ids are what the chat template gives for the conversation."""
    for segment in trajectory.segments:
        length = len(segment.prompt_ids)
        for turn in segment.turns:
            assert turn.context_len == length
            assert len(turn.response_logprobs) == len(turn.response_ids)
            length += len(turn.response_ids) + len(turn.observation_ids)
        assert length == len(segment.flat_ids())
    if trajectory.context_manager != "mono" or not all(chat.ends_turn(t.response_ids)
                                                       for t in trajectory.turns):
        return
    (segment,) = trajectory.segments
    messages = [{"role": "system", "content": chat.decode(segment.prompt_ids).split("<|im_end|>")[0]
                 .removeprefix("<|im_start|>system\n")},
                {"role": "user", "content": trajectory.question}]
    for turn in segment.turns:
        messages.append({"role": "assistant", "content": turn.response_text})
        if turn.observation_ids:
            messages.append({"role": "user", "content": turn.observation_text})
    open_turn = messages[-1]["role"] == "user"  # the episode stopped before the next turn
    full = chat.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=open_turn)
    flat = segment.flat_ids()
    assert list(full if open_turn else full[: len(flat)]) == flat


# ---- the scripted policy solves questions --------------------------------------------------------

async def test_mono_episode_answers_a_chain_question(chat: ChatFormat, tasks: list[Task],
                                                     toolbox: Toolbox, expert: ScriptedEngine) -> None:
    task = chain(tasks)
    trajectory = await episode(task, expert, toolbox, chat)
    assert trajectory.stop_reason is StopReason.ANSWERED, trajectory.metadata
    assert answer_matches(trajectory.answer, task.answers)
    assert len(trajectory.segments) == 1 and len(trajectory.turns) >= 2 * 3 + 1
    first = trajectory.turns[0]
    assert first.action == "tool_call" and first.tool == "search" and first.format_ok
    assert first.observation_text.startswith("<tool_response>") and first.tool_ok
    assert first.weights_version == 0 and first.finish_reason == FINISH_STOP
    assert trajectory.turns[-1].action == "answer" and trajectory.turns[-1].observation_ids == []
    assert_token_invariant(trajectory, chat)


async def test_aggregation_question_runs_past_100_tool_calls(chat: ChatFormat, tasks: list[Task],
                                                             toolbox: Toolbox,
                                                             expert: ScriptedEngine) -> None:
    task = smallest_aggregate(tasks)
    trajectory = await episode(task, expert, toolbox, chat, max_turns=200)
    tool_calls = sum(turn.tool is not None for turn in trajectory.turns)
    assert trajectory.stop_reason is StopReason.ANSWERED and answer_matches(trajectory.answer, task.answers)
    assert 100 <= tool_calls < 200
    assert_token_invariant(trajectory, chat)


async def test_iter_research_answers_with_one_segment_per_turn(chat: ChatFormat, tasks: list[Task],
                                                               toolbox: Toolbox) -> None:
    task = chain(tasks, hops=5)
    trajectory = await episode(task, ScriptedEngine(chat, tasks=tasks, report=True), toolbox, chat,
                               kind="iter_research")
    assert trajectory.stop_reason is StopReason.ANSWERED and answer_matches(trajectory.answer, task.answers)
    assert len(trajectory.segments) == len(trajectory.turns)
    assert all(turn.format_ok for turn in trajectory.turns)
    assert_token_invariant(trajectory, chat)


async def test_recorded_episodes_replay_and_round_trip(chat: ChatFormat, tasks: list[Task],
                                                       toolbox: Toolbox, expert: ScriptedEngine,
                                                       tmp_path: Path) -> None:
    recorded = [await episode(task, expert, toolbox, chat) for task in (chain(tasks), chain(tasks, 4))]
    path = tmp_path / "episodes.jsonl"
    assert save_trajectories(recorded, path) == 2
    loaded = load_trajectories(path)
    assert [t.to_json() for t in loaded] == [t.to_json() for t in recorded]
    replay = ScriptedEngine(chat, recordings=loaded)
    again = await episode(tasks[tasks.index(chain(tasks))], replay, toolbox, chat)
    assert [t.response_ids for t in again.turns] == [t.response_ids for t in recorded[0].turns]
    assert again.answer == recorded[0].answer


# ---- every way an episode ends -------------------------------------------------------------------

async def test_last_allowed_turn_gets_the_forced_answer(chat: ChatFormat, tasks: list[Task],
                                                        toolbox: Toolbox, expert: ScriptedEngine) -> None:
    trajectory = await episode(smallest_aggregate(tasks), expert, toolbox, chat, max_turns=6)
    assert len(trajectory.turns) == 6 and trajectory.turns[-2].forced_final
    assert trajectory.turns[-2].observation_text == FINAL_ANSWER_INSTRUCTION
    assert trajectory.stop_reason is StopReason.ANSWERED  # the expert answers what it has


async def test_context_overflow_forces_the_answer(chat: ChatFormat, tasks: list[Task],
                                                  toolbox: Toolbox, expert: ScriptedEngine) -> None:
    trajectory = await episode(smallest_aggregate(tasks), expert, toolbox, chat,
                               context_budget=12000, max_new_tokens=512)
    assert trajectory.stop_reason is StopReason.ANSWERED
    assert len(trajectory.segments[0]) <= 12000
    forced = trajectory.turns[-2]
    assert forced.forced_final and forced.observation_text == FINAL_ANSWER_INSTRUCTION
    assert FINAL_ANSWER_INSTRUCTION in chat.decode(forced.observation_ids)
    assert_token_invariant(trajectory, chat)
    stubborn = await episode(chain(tasks), Stubborn(chat), toolbox, chat, context_budget=6000,
                             max_new_tokens=512, stall_turns=0)  # its repeats would end it first
    assert stubborn.stop_reason is StopReason.CONTEXT_OVERFLOW and stubborn.answer is None


async def test_no_answer_and_max_tokens(chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    stubborn = await episode(chain(tasks), Stubborn(chat), toolbox, chat, max_turns=4)
    assert stubborn.stop_reason is StopReason.NO_ANSWER and len(stubborn.turns) == 4
    rambling = await episode(chain(tasks), Stubborn(chat, ramble=True), toolbox, chat, max_turns=3,
                             max_new_tokens=64)
    assert rambling.stop_reason is StopReason.MAX_TOKENS
    assert all(t.finish_reason == FINISH_LENGTH and not t.format_ok for t in rambling.turns)
    assert all(t.observation_ids[0] == chat.turn_end_id for t in rambling.turns[:-1])
    assert_token_invariant(rambling, chat)


@pytest.mark.parametrize("abort", [False, True])
async def test_engine_failure_keeps_the_partial_trajectory(chat: ChatFormat, tasks: list[Task],
                                                           toolbox: Toolbox, expert: ScriptedEngine,
                                                           abort: bool) -> None:
    trajectory = await episode(chain(tasks), FailsOnTurn(expert, 4, abort), toolbox, chat,
                               sample=1 + abort)
    assert trajectory.stop_reason is StopReason.ENGINE_ERROR
    assert len(trajectory.turns) == 3
    assert ("aborted" if abort else "ConnectionError: replica lost") in str(trajectory.metadata["error"])
    assert_token_invariant(trajectory, chat)


async def test_a_looping_policy_is_warned_then_ends_stalled(chat: ChatFormat, tasks: list[Task],
                                                            toolbox: Toolbox) -> None:
    """The same search every turn: the first is new, the third repeat in a row gets the warning in
    its response, the sixth ends the episode (stall_turns=3), long before max_turns."""
    trajectory = await episode(chain(tasks), Stubborn(chat), toolbox, chat, max_turns=50, stall_turns=3)
    assert trajectory.stop_reason is StopReason.STALLED and len(trajectory.turns) == 7
    warned = [turn.index for turn in trajectory.turns if "brought nothing new" in turn.observation_text]
    assert warned == [3]
    assert "brought nothing new" in chat.decode(trajectory.turns[3].observation_ids)  # the policy reads it
    assert trajectory.answer is None and "environment_fault" not in trajectory.metadata  # its own doing
    assert_token_invariant(trajectory, chat)


async def test_a_tool_that_never_returns_ends_the_episode_at_its_deadline(
        chat: ChatFormat, tasks: list[Task], expert: ScriptedEngine) -> None:
    hanging = Toolbox([SlowTool("search", seconds=3600), SlowTool("visit", seconds=3600)],
                      ToolboxConfig(timeout_s=3600, max_attempts=1))
    trajectory = await episode(chain(tasks), expert, hanging, chat, sample=7, timeout_s=0.5)
    assert trajectory.stop_reason is StopReason.TIMEOUT and trajectory.wall_s < 5
    assert "timeout" in str(trajectory.metadata["environment_fault"])  # never trained as a wrong answer


async def test_an_outage_on_the_last_call_makes_the_result_the_environments(
        chat: ChatFormat, tasks: list[Task], toolbox: Toolbox, expert: ScriptedEngine) -> None:
    """Every call of a service that is down fails as the environment's; the expert gives up and
    answers, and the episode says the environment decided it. The same episode with the service up
    says nothing."""
    down = Toolbox(list(toolbox.tools.values()), ToolboxConfig(max_attempts=1, inject_failure_rate=1.0,
                                                               cache=CacheConfig(backend="none")))
    trajectory = await episode(chain(tasks), expert, down, chat, sample=5)
    calls = [turn for turn in trajectory.turns if turn.tool_ok is not None]
    assert calls and all(turn.tool_fault == "environment" and turn.tool_error == "injected" for turn in calls)
    assert trajectory.stop_reason is StopReason.ANSWERED
    assert "the environment failed the last tool call" in str(trajectory.metadata["environment_fault"])
    healthy = await episode(chain(tasks), expert, toolbox, chat, sample=6)
    assert healthy.stop_reason is StopReason.ANSWERED and "environment_fault" not in healthy.metadata
    assert all(turn.tool_fault is None for turn in healthy.turns)


async def test_timeout_ends_the_episode(chat: ChatFormat, tasks: list[Task], toolbox: Toolbox) -> None:
    trajectory = await episode(chain(tasks), Slow(), toolbox, chat, timeout_s=0.2)
    assert trajectory.stop_reason is StopReason.TIMEOUT and trajectory.wall_s < 5


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_garbage_output_never_raises(chat: ChatFormat, tasks: list[Task], toolbox: Toolbox,
                                     seed: int) -> None:
    trajectory = asyncio.run(episode(chain(tasks), Garbage(chat, seed), toolbox, chat, max_turns=12,
                                     max_new_tokens=48, context_budget=4000))
    assert trajectory.stop_reason in set(StopReason) - {StopReason.ENGINE_ERROR, StopReason.TIMEOUT}
    assert 1 <= len(trajectory.turns) <= 12
    assert_token_invariant(trajectory, chat)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="context_budget"):
        EpisodeConfig(max_new_tokens=4096, context_budget=4096)
    with pytest.raises(ValueError, match="timeout_s"):
        EpisodeConfig(timeout_s=0)
    assert EpisodeConfig().max_turns == 200


# ---- the real path -------------------------------------------------------------------------------

@pytest.mark.integration
async def test_real_tools_mono_and_iter_research(chat: ChatFormat, tmp_path: Path) -> None:
    """Corpus server, real search + visit (Chromium for JavaScript pages), 100+ tool calls."""
    from urllib.parse import urlsplit

    from turnstile.envs.corpus_server import CorpusServer
    from turnstile.envs.toolset import ToolsConfig, build_toolbox

    world = generate_world(WorldConfig(seed=0))
    with CorpusServer(world_documents(world)) as server:
        tasks = generate_tasks(world, QuestionConfig(), server.base_url)
        js_chain = next(t for t in tasks if t.metadata["kind"] == "chain"
                        and int(t.metadata["js_pages"]) > 0)  # type: ignore[arg-type]
        aggregate = smallest_aggregate(tasks)
        real = build_toolbox(ToolsConfig(), server.documents(),
                             allow_hosts=[urlsplit(server.base_url).netloc])
        try:
            mono = [await episode(task, ScriptedEngine(chat, tasks=tasks), real, chat)
                    for task in (js_chain, aggregate)]
            iterative = await episode(aggregate, ScriptedEngine(chat, tasks=tasks, report=True), real,
                                      chat, kind="iter_research", context_budget=16384)
        finally:
            await real.aclose()
    for trajectory, task in zip([*mono, iterative], [js_chain, aggregate, aggregate], strict=True):
        assert trajectory.stop_reason is StopReason.ANSWERED, trajectory.metadata
        assert answer_matches(trajectory.answer, task.answers)
        assert_token_invariant(trajectory, chat)
    assert sum(t.tool is not None for t in mono[1].turns) >= 100
    assert all(t.tool_ok for t in mono[1].turns if t.tool is not None)
    contexts = [t.context_len for t in iterative.turns]
    assert max(contexts) < 4000 < len(mono[1].segments[0])  # flat vs growing
    save_trajectories([*mono, iterative], tmp_path / "real.jsonl")
    loaded = load_trajectories(tmp_path / "real.jsonl")
    assert [t.to_json() for t in loaded] == [t.to_json() for t in [*mono, iterative]]


async def test_any_failure_ends_the_episode_as_error_not_a_raise(chat: ChatFormat, tasks: list[Task],
                                                                 toolbox: Toolbox, expert: ScriptedEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from turnstile.rollout.context import Mono

    calls = {"n": 0}
    real = Mono.next_context

    def flaky(self, exchange):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("a bug three turns in")
        return real(self, exchange)

    monkeypatch.setattr(Mono, "next_context", flaky)
    trajectory = await episode(chain(tasks), expert, toolbox, chat, sample=7)
    assert trajectory.stop_reason is StopReason.ERROR
    assert trajectory.metadata["error"] == "KeyError: 'a bug three turns in'"
    assert len(trajectory.turns) == 3 and trajectory.wall_s > 0
    with_error = Trajectory.from_json(trajectory.to_json())  # it is written like any other
    assert with_error.stop_reason is StopReason.ERROR

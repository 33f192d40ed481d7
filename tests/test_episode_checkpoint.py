"""Episode checkpoints: an episode resumed from a saved state continues exactly where it stopped.

The test policy is a pure function of its context (like a model sampling greedily, and unlike the
scripted expert, which keeps per-episode state in its engine), so a resumed episode must reproduce
the uninterrupted one turn for turn, while asking the engine only for the turns after the checkpoint.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Sequence

import pytest

from tests.test_episode import Policy, assert_token_invariant, chain
from turnstile.envs.env import EnvConfig, SearchBrowseEnv
from turnstile.envs.protocol import render_tool_call
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.episode import Checkpointing, EpisodeConfig, EpisodeState, run_episode
from turnstile.rollout.trajectory import StopReason, Trajectory


class ContextPolicy(Policy):
    """Searches for two words of the question chosen by a hash of the whole context; answers when
    told to. Counts its calls."""

    def __init__(self, chat_format: ChatFormat, question: str, report: bool = False) -> None:
        self.chat, self.words, self.report, self.calls = chat_format, question.split(), report, 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        self.calls += 1
        digest = zlib.crc32(bytes(str(list(prompt_ids)), "ascii"))
        report = f"Notes on context {digest:x}." if self.report else None
        if "give your final answer now" in self.chat.decode(list(prompt_ids[-80:])):
            middle = f"<report>\n{report}\n</report>\n" if report else ""
            text = f"<think>\nTime to answer.\n</think>\n{middle}<answer>{digest % 1000}</answer>"
        else:
            start = digest % max(len(self.words) - 1, 1)
            text = render_tool_call("search", {"query": [" ".join(self.words[start:start + 2])]},
                                    f"Looking up part {start}.", report)
        ids = [*self.chat.encode(text), self.chat.turn_end_id]
        return Generation(tuple(ids), (-0.5,) * len(ids), FINISH_STOP, 0)


async def _run(task: Task, engine: object, box: Toolbox, chat_format: ChatFormat, kind: str,
               checkpointing: Checkpointing | None, **limits: int) -> Trajectory:
    config = EpisodeConfig(env=EnvConfig(max_turns=limits.pop("max_turns", 60)),
                           context_budget=limits.pop("context_budget", 262144), max_new_tokens=1024)
    return await run_episode(task, task.id, 0, engine, box, chat_format,  # type: ignore[arg-type]
                             build_context_manager(ContextConfig(kind=kind, **limits)), config,
                             checkpointing=checkpointing)


async def _saved_states(task: Task, engine: ContextPolicy, box: Toolbox, chat_format: ChatFormat,
                        kind: str, every: int, **limits: int) -> tuple[Trajectory, list[dict]]:
    states: list[dict] = []

    async def save(state: EpisodeState) -> None:
        states.append(copy.deepcopy(state.to_json()))  # what a store would keep: JSON, not objects

    whole = await _run(task, engine, box, chat_format, kind, Checkpointing(save=save, every=every), **limits)
    return whole, states


@pytest.mark.parametrize(("kind", "report", "limits"), [
    ("mono", False, {"max_turns": 9}),
    ("iter_research", True, {"max_turns": 9}),
    ("discard_all", False, {"max_turns": 14, "context_budget": 2600, "max_resets": 3}),
])
async def test_resumed_episode_continues_turn_for_turn(chat: ChatFormat, tasks: list[Task],
                                                       toolbox: Toolbox, kind: str, report: bool,
                                                       limits: dict[str, int]) -> None:
    task = chain(tasks, hops=4)
    whole, states = await _saved_states(task, ContextPolicy(chat, task.question, report), toolbox,
                                        chat, kind, every=2, **dict(limits))
    assert whole.stop_reason is StopReason.ANSWERED, whole.metadata
    total = len(whole.turns)
    assert [len(Trajectory.from_json(s["trajectory"]).turns) for s in states] == list(range(2, total, 2))
    if kind == "discard_all":  # the resumed state must lie after a reset for this case to mean anything
        assert len(whole.segments) > 1
        states = [s for s in states if len(s["trajectory"]["segments"]) > 1]
    state = EpisodeState.from_json(states[len(states) // 2])
    done = len(state.trajectory.turns)
    engine = ContextPolicy(chat, task.question, report)
    resumed = await _run(task, engine, toolbox, chat, kind, Checkpointing(resume=state), **dict(limits))
    assert engine.calls == total - done  # only the turns after the checkpoint were generated
    assert resumed.metadata["resumed_at_turn"] == done
    assert resumed.stop_reason is whole.stop_reason and resumed.answer == whole.answer
    assert [t.response_ids for t in resumed.turns] == [t.response_ids for t in whole.turns]
    assert [t.observation_ids for t in resumed.turns] == [t.observation_ids for t in whole.turns]
    assert [s.prompt_ids for s in resumed.segments] == [s.prompt_ids for s in whole.segments]
    assert_token_invariant(resumed, chat)


async def test_a_failing_save_is_counted_and_the_episode_goes_on(chat: ChatFormat, tasks: list[Task],
                                                                  toolbox: Toolbox) -> None:
    async def save(state: EpisodeState) -> None:
        raise ConnectionError("store down")

    task = chain(tasks)
    trajectory = await _run(task, ContextPolicy(chat, task.question), toolbox, chat, "mono",
                            Checkpointing(save=save, every=1), max_turns=5)
    assert trajectory.stop_reason is StopReason.ANSWERED
    assert trajectory.metadata["checkpoint_failures"] == len(trajectory.turns) - 1


async def test_a_store_that_lost_the_run_stops_the_episode(chat: ChatFormat, tasks: list[Task],
                                                          toolbox: Toolbox) -> None:
    from turnstile.rollout.store import StoreDataLostError

    async def save(state: EpisodeState) -> None:
        raise StoreDataLostError("the run's marker is gone: Redis restarted without its data")

    task = chain(tasks)  # not recorded as one failed episode: the driver must stop the whole run
    with pytest.raises(StoreDataLostError, match="marker is gone"):
        await _run(task, ContextPolicy(chat, task.question), toolbox, chat, "mono",
                   Checkpointing(save=save, every=1), max_turns=5)


async def test_bad_checkpoints_are_refused_by_name(chat: ChatFormat, tasks: list[Task],
                                                   toolbox: Toolbox) -> None:
    for garbage, why in [([], "trajectory, env and context"),
                         ({"trajectory": {"uid": 1}, "env": {}, "context": {}}, "malformed"),
                         ({"trajectory": Trajectory("u", 0, "t", "q", []).to_json(), "env": {},
                           "context": {}}, "no segment")]:
        with pytest.raises(ValueError, match=why):
            EpisodeState.from_json(garbage)
    task, other = chain(tasks), chain(tasks, hops=4)
    _, states = await _saved_states(other, ContextPolicy(chat, other.question), toolbox, chat, "mono",
                                    every=2, max_turns=5)
    with pytest.raises(ValueError, match=r"not .*task"):
        await _run(task, ContextPolicy(chat, task.question), toolbox, chat, "mono",
                   Checkpointing(resume=EpisodeState.from_json(states[0])))
    env = SearchBrowseEnv(task, toolbox)
    await env.reset()
    with pytest.raises(ValueError, match="not an environment snapshot"):
        env.restore({"turn": -1, "tool_calls": {}})
    env.restore({"turn": 3, "tool_calls": {"search": 2}, "final_next": True})
    assert env.turn == 3 and env.tool_calls["search"] == 2
    with pytest.raises(RuntimeError, match="right after reset"):
        env.restore({"turn": 1, "tool_calls": {}})

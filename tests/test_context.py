"""Context managers: what each turn's context holds, and how segments start, over long episodes.

The long-episode checks run the real episode loop with a policy that keeps calling a tool (and
writes a report) and tools that return pages of a fixed size, so the context grows as fast as it
would in a real search episode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from turnstile.envs.env import EnvConfig
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, TurnKind, parse_turn, render_tool_call
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import (
    CONTEXT_MANAGERS,
    Append,
    ContextConfig,
    Exchange,
    NewSegment,
    action_text,
    build_context_manager,
)
from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.episode import EpisodeConfig, run_episode
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.trajectory import StopReason, Trajectory

SYSTEM = {"role": "system", "content": "You are a deep research assistant."}
QUESTION = "Which city is the capital of Krandara?"
PAGE_WORDS = 300
RESULT = "<tool_response>\nr\n</tool_response>"


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_pretrained(ensure_default_model())


class PageTool:
    """Returns a page of PAGE_WORDS words for any arguments."""

    description = "returns a page"
    parameters: ClassVar[JsonObject] = {"type": "object"}

    def __init__(self, name: str) -> None:
        self.name = name

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        return json.loads(json.dumps(dict(arguments)))

    async def call(self, arguments: JsonObject) -> str:
        return " ".join(f"word{i % 50}" for i in range(PAGE_WORDS))

    async def aclose(self) -> None:
        pass


class SearchingPolicy:
    """Calls ``search`` every turn (with a report when asked), answers after the final instruction."""

    def __init__(self, chat: ChatFormat, report: bool) -> None:
        self.chat = chat
        self.report = report
        self.turn = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        self.turn += 1
        report = f"Searched {self.turn} times; nothing yet." if self.report else None
        if FINAL_ANSWER_INSTRUCTION in self.chat.decode(prompt_ids[-200:]):
            middle = f"<report>\n{report}\n</report>\n" if report else ""
            text = f"<think>\nTime to answer.\n</think>\n{middle}<answer>Fegrel</answer>"
        else:
            text = render_tool_call("search", {"query": [f"query {self.turn}"]},
                                    f"Step {self.turn}: I keep looking.", report)
        ids = [*self.chat.encode(text), self.chat.turn_end_id]
        return Generation(tuple(ids), (0.0,) * len(ids), FINISH_STOP, 0)

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        return [[0.0] * (end - start) for start, end in spans]

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        pass

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        pass


async def run(chat: ChatFormat, context: ContextConfig, budget: int, max_turns: int = 200) -> Trajectory:
    toolbox = Toolbox([PageTool("search"), PageTool("visit")])
    manager = build_context_manager(context)
    config = EpisodeConfig(max_new_tokens=256, context_budget=budget,
                           env=EnvConfig(max_turns=max_turns, stall_turns=0))  # it repeats on purpose
    return await run_episode(Task("t1", QUESTION, ("Fegrel",)), "g", 0,
                             SearchingPolicy(chat, manager.expect_report), toolbox, chat, manager,
                             config)


def assert_token_invariant(trajectory: Trajectory) -> None:
    for segment in trajectory.segments:
        length = len(segment.prompt_ids)
        for turn in segment.turns:
            assert turn.context_len == length
            length += len(turn.response_ids) + len(turn.observation_ids)
        assert length == len(segment.flat_ids())


def exchange(chat: ChatFormat, text: str, observation: str, report: bool = False) -> Exchange:
    ids = [*chat.encode(text), chat.turn_end_id]
    return Exchange(ids, text, parse_turn(text, expect_report=report), observation)


# ---- the managers on their own -------------------------------------------------------------------

def test_registry_names_the_three_managers_and_refuses_others() -> None:
    assert {"mono", "iter_research", "discard_all"} <= set(CONTEXT_MANAGERS.names())
    with pytest.raises(ValueError, match="mono"):
        build_context_manager(ContextConfig(kind="nope"))
    with pytest.raises(ValueError, match="max_resets"):
        ContextConfig(max_resets=-1)


def test_mono_appends_the_observation_delta(chat: ChatFormat) -> None:
    manager = build_context_manager(ContextConfig(kind="mono"))
    prompt = manager.start(chat, [SYSTEM, {"role": "user", "content": QUESTION}])
    assert prompt == chat.prompt_ids([SYSTEM, {"role": "user", "content": QUESTION}])
    step = exchange(chat, render_tool_call("search", {"query": ["x"]}, "go"), RESULT)
    plan = manager.next_context(step)
    assert plan == Append(chat.delta_ids(step.observation, step.response_ids))
    assert manager.on_overflow(step) is None
    with pytest.raises(RuntimeError, match="single use"):
        manager.start(chat, [SYSTEM, {"role": "user", "content": QUESTION}])


def test_iter_research_rebuilds_a_workspace_without_think(chat: ChatFormat) -> None:
    manager = build_context_manager(ContextConfig(kind="iter_research"))
    assert manager.expect_report
    manager.start(chat, [SYSTEM, {"role": "user", "content": QUESTION}])
    text = render_tool_call("visit", {"url": "http://h/a", "goal": "capital"}, "SECRET THINKING",
                            "Krandara's page is at http://h/a.")
    plan = manager.next_context(exchange(chat, text, "<tool_response>\npage\n</tool_response>", True))
    assert isinstance(plan, NewSegment)
    workspace = chat.decode(plan.prompt_ids)
    assert QUESTION in workspace and "Krandara's page is at http://h/a." in workspace
    assert '"name": "visit"' in workspace and "<tool_response>\npage\n</tool_response>" in workspace
    assert "SECRET THINKING" not in workspace
    # A turn without a report keeps the previous one.
    malformed = exchange(chat, "no tags at all", "<tool_response>\nfix it\n</tool_response>", True)
    again = chat.decode(manager.next_context(malformed).prompt_ids)  # type: ignore[union-attr]
    assert "Krandara's page is at http://h/a." in again and "fix it" in again


def test_discard_all_resets_at_most_k_times_with_a_capped_summary(chat: ChatFormat) -> None:
    manager = build_context_manager(ContextConfig(kind="discard_all", max_resets=2,
                                                  summary_max_chars=20))
    manager.start(chat, [SYSTEM, {"role": "user", "content": QUESTION}])
    step = exchange(chat, render_tool_call("search", {"query": ["x"]}, "A" * 100), RESULT)
    assert isinstance(manager.next_context(step), Append)
    resets = [manager.on_overflow(step) for _ in range(3)]
    assert resets[2] is None and all(isinstance(plan, NewSegment) for plan in resets[:2])
    text = chat.decode(resets[0].prompt_ids)  # type: ignore[union-attr]
    assert QUESTION in text and "A" * 20 + " …" in text and "A" * 21 not in text


def test_action_text_drops_think_and_report() -> None:
    text = render_tool_call("search", {"query": ["q"]}, "thinking", "report")
    assert action_text(text).startswith("<tool_call>") and "thinking" not in action_text(text)
    assert action_text("plain") == "plain"


# ---- over long episodes --------------------------------------------------------------------------

async def test_mono_overflow_forces_the_answer_within_budget(chat: ChatFormat) -> None:
    trajectory = await run(chat, ContextConfig(kind="mono"), budget=8000)
    assert len(trajectory.segments) == 1
    assert len(trajectory.segments[0]) <= 8000
    forced = trajectory.turns[-2]
    assert forced.forced_final and forced.observation_text == FINAL_ANSWER_INSTRUCTION
    assert chat.decode(forced.observation_ids).count(FINAL_ANSWER_INSTRUCTION) == 1
    assert trajectory.stop_reason is StopReason.ANSWERED and trajectory.answer == "Fegrel"
    assert_token_invariant(trajectory)


async def test_iter_research_context_stays_flat_over_200_turns(chat: ChatFormat) -> None:
    trajectory = await run(chat, ContextConfig(kind="iter_research"), budget=8000, max_turns=200)
    turns = trajectory.turns
    assert len(turns) == 200 and len(trajectory.segments) == 200
    assert trajectory.stop_reason is StopReason.ANSWERED
    lengths = [turn.context_len for turn in turns[1:-1]]  # the last one sees the instruction
    assert max(lengths) - min(lengths) <= 16  # only the counters in the report grow
    assert all(turn.observation_ids == [] for turn in turns)
    assert all(parse_turn(t.response_text, expect_report=True).kind is TurnKind.TOOL_CALL
               for t in turns[:-1])
    assert_token_invariant(trajectory)


@pytest.mark.parametrize("k", [0, 2])
async def test_discard_all_keeps_at_most_k_plus_one_segments(chat: ChatFormat, k: int) -> None:
    trajectory = await run(chat, ContextConfig(kind="discard_all", max_resets=k), budget=6000)
    assert len(trajectory.segments) == k + 1
    assert all(len(segment) <= 6000 for segment in trajectory.segments)
    assert trajectory.turns[-2].forced_final and trajectory.stop_reason is StopReason.ANSWERED
    assert trajectory.context_manager == "discard_all"
    for segment in trajectory.segments[1:]:
        prompt = chat.decode(segment.prompt_ids)
        assert QUESTION in prompt and "Notes carried over" in prompt
    assert_token_invariant(trajectory)


async def test_segments_round_trip_through_jsonl(chat: ChatFormat, tmp_path: Path) -> None:
    from turnstile.rollout.trajectory import load_trajectories, save_trajectories

    trajectory = await run(chat, ContextConfig(kind="discard_all", max_resets=1), budget=6000)
    save_trajectories([trajectory], tmp_path / "t.jsonl")
    (loaded,) = load_trajectories(tmp_path / "t.jsonl")
    assert [s.flat_ids() for s in loaded.segments] == [s.flat_ids() for s in trajectory.segments]
    assert loaded.stop_reason is trajectory.stop_reason


@pytest.mark.parametrize("kind", CONTEXT_MANAGERS.names())
async def test_every_registered_manager_keeps_the_contract(chat: ChatFormat, kind: str) -> None:
    """Any registered manager: a long episode within budget, the invariant on every segment."""
    trajectory = await run(chat, ContextConfig(kind=kind), budget=6000, max_turns=40)
    assert trajectory.context_manager == kind
    assert trajectory.stop_reason is StopReason.ANSWERED
    assert all(len(segment) <= 6000 for segment in trajectory.segments)
    assert_token_invariant(trajectory)

"""The format penalty: malformed non-final turns get −λ_fmt; the answer turn's format goes to the
outcome (docs/algorithms.md §3, §5)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardError, build_reward
from turnstile.rewards.format import (
    FormatConfig,
    FormatPenalty,
    final_turn_penalty,
)
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn

TASK = Task("t1", "Who founded Varnholt?", ("Ada Varn", "A. Varn"))


def make_turn(index: int, action: str, format_ok: bool = True, answer: str | None = None,
              text: str = "", observation: str = "", tool: str | None = None,
              url: str | None = None) -> Turn:
    if tool is None and action == "tool_call":
        tool = "search"
    arguments = {"url": url, "goal": "read"} if tool == "visit" else {"query": ["q"]} if tool else None
    return Turn(index=index, response_ids=[1, 2], response_logprobs=[0.0, 0.0], weights_version=0,
                context_len=10, finish_reason="stop", response_text=text, action=action, tool=tool,
                arguments=arguments, format_ok=format_ok, answer=answer,
                observation_text=observation)


def make_trajectory(turns: Sequence[Turn], stop: StopReason, answer: str | None = None,
                    task: Task = TASK) -> Trajectory:
    return Trajectory(uid=task.id, sample=0, task_id=task.id, question=task.question,
                      answers=list(task.answers), segments=[Segment([0], list(turns))],
                      stop_reason=stop, answer=answer)


def answered(answer: str, *malformed_at: int, turns: int = 4) -> Trajectory:
    body = [make_turn(i, "malformed" if i in malformed_at else "tool_call", i not in malformed_at)
            for i in range(turns - 1)]
    return make_trajectory([*body, make_turn(turns - 1, "answer", True, answer)], StopReason.ANSWERED,
                           answer)


async def test_malformed_non_final_turns_get_the_penalty() -> None:
    trajectory = answered("Ada Varn", 1, 2)
    await FormatPenalty(FormatConfig()).score(trajectory, TASK)
    assert [t.reward for t in trajectory.turns] == [None, -1.0, -1.0, None]


async def test_the_last_turn_is_never_penalised_at_turn_level() -> None:
    malformed_answer = make_trajectory(
        [make_turn(0, "tool_call"), make_turn(1, "answer", format_ok=False)], StopReason.MALFORMED_ANSWER)
    cut = make_trajectory([make_turn(0, "tool_call"), make_turn(1, "malformed", format_ok=False)],
                          StopReason.MAX_TOKENS)
    for trajectory in (malformed_answer, cut):
        await FormatPenalty(FormatConfig()).score(trajectory, TASK)
        assert [t.reward for t in trajectory.turns] == [None, None]
        assert final_turn_penalty(trajectory) == -1.0  # folded into the outcome instead


async def test_lambda_is_configurable_and_checked() -> None:
    plugin = build_reward(PluginSpec("turnstile.rewards.format:FormatPenalty", {"lambda_fmt": 0.5}))
    trajectory = answered("Ada Varn", 0)
    await plugin.score(trajectory, TASK)
    assert trajectory.turns[0].reward == -0.5
    with pytest.raises(RewardError, match="lambda_fmt must be >= 0"):
        build_reward(PluginSpec("turnstile.rewards.format:FormatPenalty", {"lambda_fmt": -1}))
    with pytest.raises(RewardError, match="unknown option 'lamda_fmt'"):
        build_reward(PluginSpec("turnstile.rewards.format:FormatPenalty", {"lamda_fmt": 1}))


@pytest.mark.parametrize("stop", [StopReason.NO_ANSWER, StopReason.CONTEXT_OVERFLOW,
                                  StopReason.MAX_TOKENS, StopReason.MALFORMED_ANSWER,
                                  StopReason.ENGINE_ERROR, StopReason.TIMEOUT])
def test_every_way_of_not_answering_is_penalised_in_the_outcome(stop: StopReason) -> None:
    trajectory = make_trajectory([make_turn(0, "tool_call"), make_turn(1, "malformed", False)], stop)
    assert final_turn_penalty(trajectory, 2.0) == -2.0


def test_a_well_formed_answer_has_no_final_penalty() -> None:
    assert final_turn_penalty(answered("anything")) is None
    assert final_turn_penalty(make_trajectory([], StopReason.ENGINE_ERROR)) == -1.0

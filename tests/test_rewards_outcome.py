"""Outcome rewards: exact match, token F1, the LLM judge (against a local OpenAI-compatible server)
and the format rule folded into the outcome."""

from __future__ import annotations

import pytest

from tests.openai_server import Reply, chat_server, replies_in_order
from tests.test_rewards_format import TASK, answered, make_trajectory, make_turn
from turnstile.envs.chat_client import ChatClientConfig
from turnstile.envs.plugins import PluginSpec
from turnstile.rewards.base import RewardError, build_reward
from turnstile.rewards.outcome import (
    ExactMatch,
    LlmJudge,
    LlmJudgeConfig,
    OutcomeConfig,
    TokenF1,
    best_f1,
    parse_verdict,
    token_f1,
)
from turnstile.rollout.trajectory import StopReason


@pytest.mark.parametrize(("answer", "expected"), [
    ("Ada Varn", 1.0), ("ada varn.", 1.0), ("The Ada Varn", 1.0), ("A. Varn", 1.0),
    ("Ada Varnholt", 0.0), ("Ada", 0.0),
    ("Varn", 1.0),  # "A. Varn" loses its article "a" when normalised
])
async def test_exact_match_is_normalised(answer: str, expected: float) -> None:
    trajectory = answered(answer)
    await ExactMatch(OutcomeConfig()).score(trajectory, TASK)
    assert trajectory.outcome == expected


def test_token_f1_counts_repeated_tokens() -> None:
    assert token_f1("the cat sat", "cat sat") == 1.0  # articles go before counting
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("cat dog", "cat cat dog") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))
    assert token_f1("bird", "cat") == 0.0 and token_f1("", "") == 1.0 and token_f1("a", "cat") == 0.0
    assert best_f1("Varn", ["Ada Varn", "Varn"]) == 1.0 and best_f1(None, ["x"]) == 0.0


async def test_f1_takes_the_best_gold_alternative() -> None:
    trajectory = answered("Varn the elder")
    await TokenF1(OutcomeConfig()).score(trajectory, TASK)
    assert trajectory.outcome == pytest.approx(max(token_f1("Varn the elder", g) for g in TASK.answers))


async def test_unanswered_and_malformed_answers_get_minus_lambda() -> None:
    unanswered = make_trajectory([make_turn(0, "tool_call"), make_turn(1, "tool_call")],
                                 StopReason.NO_ANSWER)
    malformed = make_trajectory([make_turn(0, "answer", False, "Ada Varn")],
                                StopReason.MALFORMED_ANSWER, answer="Ada Varn")
    for plugin in (ExactMatch(OutcomeConfig()), TokenF1(OutcomeConfig(lambda_fmt=0.5))):
        for trajectory in (unanswered, malformed):
            await plugin.score(trajectory, TASK)
            assert trajectory.outcome == -plugin.config.lambda_fmt
    off = ExactMatch(OutcomeConfig(format_penalty=False))
    await off.score(unanswered, TASK)
    await off.score(malformed, TASK)
    assert unanswered.outcome == 0.0 and malformed.outcome == 1.0  # the answer text is still scored


# ---- the LLM judge -----------------------------------------------------------------------------

def judge(base_url: str, **client: float | str) -> LlmJudge:
    options = {"client": {"base_url": base_url, "model": "grader", "api_key_env": "",
                          "backoff_s": 0.01, **client}}
    plugin = build_reward(PluginSpec("turnstile.rewards.outcome:LlmJudge", options))  # type: ignore[arg-type]
    assert isinstance(plugin, LlmJudge)
    return plugin


GOOD_YES = ("extracted_final_answer: Ada Varn of Osk\nreasoning: same person, with her town added.\n"
            "correct: yes")


@pytest.mark.parametrize(("reply", "outcome"), [
    (GOOD_YES, 1.0),
    ("extracted_final_answer: Bo Lund\nreasoning: a different person.\ncorrect: no", 0.0),
    ("**correct:** Yes", 1.0),
    ("I think it is probably right.", 0.0),  # no verdict: unparseable scores 0
    ("correct: yes\ncorrect: no", 0.0),  # two verdicts: unparseable
    ("", 0.0),
])
async def test_judge_verdicts(reply: str, outcome: float) -> None:
    with chat_server(replies_in_order([reply])) as server:
        plugin = judge(server.base_url)
        trajectory = answered("Ada Varn of Osk")
        await plugin.score(trajectory, TASK)
        await plugin.aclose()
    assert trajectory.outcome == outcome
    (request,) = server.log.requests
    assert request["temperature"] <= 0.1
    prompt = request["messages"][0]["content"]
    assert "Ada Varn of Osk" in prompt and "[reference answer]: Ada Varn" in prompt
    assert "[also accepted]: A. Varn" in prompt


async def test_exact_match_short_circuits_the_judge() -> None:
    with chat_server(replies_in_order([])) as server:
        plugin = judge(server.base_url)
        trajectory = answered("the ada varn")
        await plugin.score(trajectory, TASK)
        await plugin.aclose()
    assert trajectory.outcome == 1.0 and server.log.count == 0
    assert trajectory.metadata["llm_judge"] == {"correct": True, "by": "exact_match"}


async def test_judge_retries_then_grades_and_caches() -> None:
    with chat_server(replies_in_order([Reply("oops", status=502), GOOD_YES])) as server:
        plugin = judge(server.base_url)
        group = [answered("Ada Varn of Osk") for _ in range(3)]
        await plugin.score_group(group, TASK)
        await plugin.aclose()
    assert [t.outcome for t in group] == [1.0, 1.0, 1.0]
    assert server.log.count == 2  # one failure, one reply shared by the group
    assert group[0].metadata["llm_judge"]["extracted"] == "Ada Varn of Osk"  # type: ignore[index]


async def test_format_rule_comes_before_the_judge() -> None:
    with chat_server(replies_in_order([])) as server:
        plugin = judge(server.base_url)
        trajectory = make_trajectory([make_turn(0, "tool_call")], StopReason.NO_ANSWER)
        await plugin.score(trajectory, TASK)
    assert trajectory.outcome == -1.0 and server.log.count == 0


def test_judge_temperature_is_capped() -> None:
    with pytest.raises(RewardError, match=r"temperature=0.5 is above 0.1"):
        build_reward(PluginSpec("turnstile.rewards.outcome:LlmJudge", {"client": {"model": "m",
                                                                         "temperature": 0.5}}))
    with pytest.raises(ValueError, match=r"above 0.1"):
        LlmJudgeConfig(client=ChatClientConfig(model="m", temperature=0.2))


def test_parse_verdict_fields() -> None:
    verdict = parse_verdict(GOOD_YES)
    assert verdict.correct is True and verdict.extracted == "Ada Varn of Osk"
    assert verdict.reasoning == "same person, with her town added."
    assert parse_verdict("correct: maybe").correct is None

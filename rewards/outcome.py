"""Outcome rewards (docs/algorithms.md §3): how right the final answer is, written to
``trajectory.outcome``.

- ``exact_match``: 1 when the normalised answer equals a normalised gold alternative, else 0.
- ``f1``: token multiset F1 between the normalised answer and each gold alternative; the best one.
- ``llm_judge``: a BrowseComp-style grader over an OpenAI-compatible endpoint. The judge is asked for
  the extracted final answer, its reasoning and ``correct: yes|no``; an exact match never reaches the
  judge (it scores 1), a reply without a readable verdict scores 0.

With ``format_penalty`` on (the default), an episode that did not end in a well-formed answer gets
``−λ_fmt`` whatever the answer says (:func:`turnstile.rewards.format.final_turn_penalty`).
"""

from __future__ import annotations

import abc
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from turnstile.envs.answers import answer_matches, normalize_answer
from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage
from turnstile.envs.tasks import Task
from turnstile.rewards.base import RewardPlugin
from turnstile.rewards.format import DEFAULT_LAMBDA_FMT, final_turn_penalty
from turnstile.rollout.trajectory import Trajectory

MAX_JUDGE_TEMPERATURE = 0.1


def token_f1(answer: str, gold: str) -> float:
    """F1 of the normalised tokens of ``answer`` against ``gold``, counting repeated tokens."""
    predicted, expected = normalize_answer(answer).split(), normalize_answer(gold).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def best_f1(answer: str | None, gold: Sequence[str]) -> float:
    """The best :func:`token_f1` over the gold alternatives (0 for no answer)."""
    if answer is None:
        return 0.0
    return max((token_f1(answer, alternative) for alternative in gold), default=0.0)


@dataclass
class OutcomeConfig:
    format_penalty: bool = True  # malformed or missing final answer -> -lambda_fmt
    lambda_fmt: float = DEFAULT_LAMBDA_FMT


class _Outcome(RewardPlugin):
    """The shared part: the format rule, then the answer's score."""

    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome"})

    def __init__(self, config: OutcomeConfig) -> None:
        self.config = config

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        penalty = final_turn_penalty(trajectory, self.config.lambda_fmt)
        if penalty is not None and self.config.format_penalty:
            trajectory.outcome = penalty
        elif trajectory.answer is None:
            trajectory.outcome = 0.0
        else:
            trajectory.outcome = await self.answer_score(trajectory, task)

    @abc.abstractmethod
    async def answer_score(self, trajectory: Trajectory, task: Task) -> float:
        """The score of ``trajectory.answer`` (not None here) against the task's gold answers."""


class ExactMatch(_Outcome):
    Options = OutcomeConfig

    async def answer_score(self, trajectory: Trajectory, task: Task) -> float:
        return float(answer_matches(trajectory.answer, task.answers))


class TokenF1(_Outcome):
    Options = OutcomeConfig

    async def answer_score(self, trajectory: Trajectory, task: Task) -> float:
        return best_f1(trajectory.answer, task.answers)


# ---- LLM judge ---------------------------------------------------------------------------------

JUDGE_PROMPT = """You grade answers to research questions. Decide whether the response below gives \
the same final answer as the reference answer.

[question]: {question}

[response]: {response}

[reference answer]: {reference}{alternatives}

Reply in exactly this format:

extracted_final_answer: the final answer the response gives, copied exactly; write None if it gives none
reasoning: compare the extracted answer with the reference answer only. Say whether they name the \
same thing, allowing small differences of spelling, formatting or, for numbers, rounding. Do not \
solve the question again and do not argue about whether the reference is right.
correct: yes if the extracted answer matches the reference answer, otherwise no"""

_VERDICT = re.compile(r"^\W*correct\W*:\W*(yes|no)\b", re.IGNORECASE | re.MULTILINE)
_EXTRACTED = re.compile(r"^\W*extracted_final_answer\W*:[ \t]*(.*)$", re.IGNORECASE | re.MULTILINE)
_REASONING = re.compile(r"^\W*reasoning\W*:[ \t]*(.*)$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class JudgeVerdict:
    correct: bool | None  # None: the reply had no readable verdict
    extracted: str | None = None
    reasoning: str | None = None


def judge_messages(question: str, response: str, gold: Sequence[str]) -> list[ChatMessage]:
    others = list(gold[1:])
    alternatives = f"\n\n[also accepted]: {'; '.join(others)}" if others else ""
    prompt = JUDGE_PROMPT.format(question=question, response=response, reference=gold[0],
                                 alternatives=alternatives)
    return [ChatMessage("user", prompt)]


def parse_verdict(reply: str) -> JudgeVerdict:
    """Read the judge's reply; ``correct`` is None unless exactly one yes/no verdict is given."""
    verdicts = {match.group(1).lower() for match in _VERDICT.finditer(reply)}
    extracted = _EXTRACTED.search(reply)
    reasoning = _REASONING.search(reply)
    return JudgeVerdict(
        correct=(verdicts == {"yes"}) if len(verdicts) == 1 else None,
        extracted=extracted.group(1).strip() if extracted else None,
        reasoning=reasoning.group(1).strip() if reasoning else None,
    )


@dataclass
class LlmJudgeConfig(OutcomeConfig):
    client: ChatClientConfig = field(default_factory=ChatClientConfig)

    def __post_init__(self) -> None:
        if self.client.temperature > MAX_JUDGE_TEMPERATURE:
            raise ValueError(f"llm_judge: client.temperature={self.client.temperature} is above "
                             f"{MAX_JUDGE_TEMPERATURE}; a grader must be (nearly) deterministic")


class LlmJudge(_Outcome):
    """See the module docstring. Writes the verdict to ``trajectory.metadata["llm_judge"]``."""

    Options = LlmJudgeConfig
    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome", "trajectory.metadata"})

    def __init__(self, config: LlmJudgeConfig, client: ChatClient | None = None) -> None:
        super().__init__(config)
        self._client_config = config.client
        self._client = client
        self._owns_client = client is None  # a client passed in is closed by whoever made it

    @property
    def client(self) -> ChatClient:
        if self._client is None:
            self._client = ChatClient(self._client_config)
        return self._client

    async def answer_score(self, trajectory: Trajectory, task: Task) -> float:
        answer = trajectory.answer or ""
        if answer_matches(answer, task.answers):
            trajectory.metadata["llm_judge"] = {"correct": True, "by": "exact_match"}
            return 1.0
        if not task.answers:
            raise ValueError(f"task {task.id!r} has no gold answer to judge against")
        reply = await self.client.complete(judge_messages(task.question, answer, task.answers))
        verdict = parse_verdict(reply)
        trajectory.metadata["llm_judge"] = {
            "correct": verdict.correct, "by": "judge", "extracted": verdict.extracted,
            "reasoning": verdict.reasoning,
        }
        return 1.0 if verdict.correct else 0.0

    async def aclose(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()

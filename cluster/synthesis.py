"""Research-synthesis at test time (WebResearcher): ``n`` agents research a question in parallel,
each ends with a final report; a synthesis model reads the ``n`` reports (not the trajectories) and
answers. ``turnstile eval`` scores synth@n for every ``n`` in ``synthesis.ns`` up to ``k`` from the
same samples: the first ``n`` samples' reports.

A sample's **final report** is its last ``<report>`` (the iter_research protocol), else its last
turn's text; its final answer follows it. The synthesis model is any OpenAI-compatible endpoint
(:class:`envs.chat_client.ChatClient`: bounded, retried, cached); it answers inside
``<answer>…</answer>``, and its answer is judged by the benchmark's own judge. A reply without an
answer is wrong; an endpoint that stays down leaves the question's synth@n out of the summary and
says so (nothing is made up).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

from envs.chat_client import ChatClient, ChatClientConfig, ChatMessage, ChatUnavailable
from envs.protocol import ANSWER_CLOSE, ANSWER_OPEN, REPORT_CLOSE, REPORT_OPEN
from rollout.trajectory import Trajectory

log = logging.getLogger(__name__)
REPORT_CHARS = 4000  # of each report, its end kept (where the conclusions are)
_REPORT = re.compile(re.escape(REPORT_OPEN) + r"(.*?)" + re.escape(REPORT_CLOSE), re.S)
_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)

PROMPT = """Several research agents worked on the same question independently. Each wrote a final \
report and an answer. Read the reports, weigh the evidence they give, and answer the question.

Question: {question}

{reports}

Think about which answer the evidence supports best, then give the answer alone inside \
<answer></answer>."""


@dataclass
class SynthesisConfig:
    enabled: bool = False
    ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # those above k are skipped
    client: ChatClientConfig = field(default_factory=ChatClientConfig)  # the synthesis model

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.ns):
            raise ValueError(f"synthesis.ns={self.ns}: every n must be >= 1")
        if self.enabled and not self.client.model:
            raise ValueError("synthesis.client.model is empty: name the model the synthesis endpoint serves")


def final_report(trajectory: Trajectory) -> str:
    """The sample's last report (else its last turn's text) and its answer, at most REPORT_CHARS."""
    texts = [turn.response_text for turn in trajectory.turns]
    reports = [match.group(1).strip() for text in texts for match in _REPORT.finditer(text)]
    body = reports[-1] if reports else (texts[-1].strip() if texts else "")
    answer = trajectory.answer if trajectory.answered else "(no answer)"
    return f"{body[-REPORT_CHARS:]}\nFinal answer: {answer}"


def synthesis_messages(question: str, reports: list[str]) -> list[ChatMessage]:
    joined = "\n\n".join(f"Report {i}:\n{report}" for i, report in enumerate(reports, start=1))
    return [ChatMessage("user", PROMPT.format(question=question, reports=joined))]


def parse_answer(reply: str) -> str | None:
    """The last ``<answer>`` of the reply, stripped; None without one."""
    found = _ANSWER.findall(reply)
    if not found:
        return None
    return found[-1].strip() or None


async def synthesize(config: SynthesisConfig, jobs: list[tuple[str, list[str]]]) -> list[str | None | Exception]:
    """For each (question, reports): the synthesis model's answer (None: the reply had none), or
    the :class:`ChatUnavailable` the endpoint ended with."""
    client = ChatClient(config.client)
    try:
        async def one(question: str, reports: list[str]) -> str | None | Exception:
            try:
                return parse_answer(await client.complete(synthesis_messages(question, reports)))
            except ChatUnavailable as error:
                return error

        return list(await asyncio.gather(*(one(q, r) for q, r in jobs)))
    finally:
        await client.aclose()

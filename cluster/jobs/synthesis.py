"""Research-synthesis at test time (WebResearcher): ``n`` agents research a question in parallel,
each ends with a final report; a synthesis model reads the ``n`` reports (not the trajectories) and
answers. ``turnstile eval`` scores synth@n for every ``n`` in ``synthesis.ns`` up to ``k`` from the
same samples: the first ``n`` samples' reports.

A sample's **final report** is its last ``<report>`` (the iter_research protocol), else its last
turn's text; its final answer follows it. The synthesis model (``synthesis.synthesizer``) is any
OpenAI-compatible endpoint (``endpoint``: :class:`turnstile.envs.chat_client.ChatClient`, bounded, retried,
cached) or the evaluated policy itself (``policy``: one replica of ``rollout.engine`` on the same
model, the reports cut to fit the episode's context budget, sampled as its turns are). It answers
inside ``<answer>…</answer>``, and its answer is judged by the benchmark's own judge. A reply
without an answer is wrong; a synthesis model that stays down or fails a request leaves the
question's synth@n out of the summary and says so (nothing is made up).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage, ChatUnavailable
from turnstile.envs.protocol import ANSWER_CLOSE, ANSWER_OPEN, REPORT_CLOSE, REPORT_OPEN
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.shape import follow_model
from turnstile.rollout.episode import EpisodeConfig
from turnstile.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from turnstile.rollout.chat import ChatFormat

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


SYNTHESIZERS = ("endpoint", "policy")


@dataclass
class SynthesisConfig:
    enabled: bool = False
    ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # those above k are skipped
    synthesizer: str = "endpoint"  # endpoint: the model behind `client`; policy: the evaluated policy
    client: ChatClientConfig = field(default_factory=ChatClientConfig)  # the endpoint's model

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.ns):
            raise ValueError(f"synthesis.ns={self.ns}: every n must be >= 1")
        if self.synthesizer not in SYNTHESIZERS:
            raise ValueError(f"synthesis.synthesizer={self.synthesizer!r} is not one of {', '.join(SYNTHESIZERS)}")
        if self.enabled and self.synthesizer == "endpoint" and not self.client.model:
            raise ValueError("synthesis.client.model is empty: name the model the synthesis endpoint serves "
                             "(or synthesis.synthesizer=policy)")


def final_report(trajectory: Trajectory) -> str:
    """The sample's last report (else its last turn's text) and its answer, at most REPORT_CHARS."""
    texts = [turn.response_text for turn in trajectory.turns]
    reports = [match.group(1).strip() for text in texts for match in _REPORT.finditer(text)]
    body = reports[-1] if reports else (texts[-1].strip() if texts else "")
    answer = trajectory.answer if trajectory.answered else "(no answer)"
    return f"{body[-REPORT_CHARS:]}\nFinal answer: {answer}"


def synthesis_messages(question: str, reports: list[str], report_chars: int = REPORT_CHARS) -> list[ChatMessage]:
    """The synthesis prompt: the question and each report's last ``report_chars`` characters."""
    joined = "\n\n".join(f"Report {i}:\n{report[-report_chars:]}" for i, report in enumerate(reports, start=1))
    return [ChatMessage("user", PROMPT.format(question=question, reports=joined))]


def parse_answer(reply: str) -> str | None:
    """The last ``<answer>`` of the reply, stripped; None without one."""
    found = _ANSWER.findall(reply)
    if not found:
        return None
    return found[-1].strip() or None


async def synthesize(config: SynthesisConfig, jobs: list[tuple[str, list[str]]]) -> list[str | Exception | None]:
    """For each (question, reports): the synthesis model's answer (None: the reply had none), or
    the :class:`ChatUnavailable` the endpoint ended with."""
    client = ChatClient(config.client)
    try:
        async def one(question: str, reports: list[str]) -> str | Exception | None:
            try:
                return parse_answer(await client.complete(synthesis_messages(question, reports)))
            except ChatUnavailable as error:
                return error

        return list(await asyncio.gather(*(one(q, r) for q, r in jobs)))
    finally:
        await client.aclose()


async def synthesize_with_policy(engine: EngineConfig, model: str, episode: EpisodeConfig,
                                 jobs: list[tuple[str, list[str]]]) -> list[str | Exception | None]:
    """As :func:`synthesize`, the synthesis model being the evaluated policy: one replica of
    ``engine`` on ``model`` (a Ray actor, started here and killed after), each prompt within
    ``episode.context_budget`` (the reports' beginnings cut evenly until it fits: a report's
    conclusions are at its end), sampled as the episode samples its turns. A request the engine
    fails is that question's exception, not the run's."""
    import ray

    from turnstile.rollout.chat import ChatFormat
    from turnstile.rollout.engines.base import SamplingParams
    from turnstile.rollout.fleet import engine_actor

    chat = ChatFormat.from_pretrained(model)
    room = episode.context_budget - episode.max_new_tokens
    sampling = SamplingParams(max_new_tokens=episode.max_new_tokens, temperature=episode.sampling.temperature,
                              top_p=episode.sampling.top_p, top_k=episode.sampling.top_k,
                              stop_token_ids=chat.stop_token_ids)
    actor = engine_actor(follow_model(engine, model, episode.context_budget + episode.max_new_tokens))
    try:
        await actor.ready.remote()

        async def one(question: str, reports: list[str]) -> str | Exception | None:
            try:
                ids = fitted_prompt(chat, question, reports, room)
                generation = await actor.generate.remote(ids, sampling)
            except Exception as error:  # noqa: BLE001 - one question's failure, reported by the caller
                return error
            return parse_answer(chat.response_text(generation.token_ids))

        return list(await asyncio.gather(*(one(q, r) for q, r in jobs)))
    finally:
        ray.kill(actor)


def fitted_prompt(chat: ChatFormat, question: str, reports: list[str], room: int) -> list[int]:
    """The synthesis prompt's ids within ``room`` tokens: each report cut to its last characters,
    fewer each try, until it fits; ValueError if even the question alone does not."""
    chars = REPORT_CHARS
    while True:
        ids = chat.prompt_ids([asdict(m) for m in synthesis_messages(question, reports, chars)])
        if len(ids) <= room:
            return ids
        if chars == 0:
            raise ValueError(f"the synthesis prompt takes {len(ids)} tokens without any report: more than the "
                             f"{room} the context budget leaves (raise rollout.episode.context_budget)")
        chars = chars * 2 // 3 if chars > 30 else 0

"""Optional LLM extractor: turn a long page into the evidence and summary that serve the agent's goal.

Deep-research agents (WebSailor, Tongyi DeepResearch) do not read raw pages: a separate model reads
the page with the agent's stated goal and returns the relevant evidence and a short summary. This
module calls any OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint for that and asks for
a JSON object ``{"rational", "evidence", "summary"}`` (field names as in those agents' prompts).

The request goes through the shared :class:`~turnstile.envs.chat_client.ChatClient` (its config is the
extractor's, plus ``enabled``), which is the only retry layer. Failure policy, chosen so that the
observation stays useful and failures stay visible:
- a reply that cannot be parsed (no JSON object, even tolerating code fences and JSON5, or no
  evidence/summary) → :meth:`LlmExtractor.extract` returns None and the tool shows the truncated raw
  page text instead;
- the endpoint failing (connect errors, timeouts, 429, 5xx) is retried by the client, ``max_attempts``
  times with capped exponential backoff, then raises ``ToolError("extractor_unavailable")``; a 4xx
  (bad model name, bad key) raises ``ToolError("extractor")`` at once. Neither is retryable: the
  toolbox does not retry the visit on top of the client's retries (``build_toolbox`` also refuses an
  extractor whose retries cannot finish within the toolbox's timeout for one call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import json5

from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage, ChatUnavailable
from turnstile.envs.retry import longest_backoff_s
from turnstile.envs.tools.base import ToolError

PROMPT = """You read a web page for a research agent. Find what in the page serves the agent's goal.

## Page ({url})
{page}

## Goal
{goal}

Reply with one JSON object and nothing else:
{{"rational": "which parts of the page relate to the goal and why",
  "evidence": "the relevant passages, quoted or closely paraphrased, with numbers and names kept",
  "summary": "a short answer to the goal from this page; say so if the page does not help"}}"""

_FENCE = re.compile(r"```(?:json5?|JSON)?\s*(.*?)```", re.DOTALL)


@dataclass
class ExtractorConfig(ChatClientConfig):
    """Where the extractor model is served and how hard to try (the chat client's settings)."""

    enabled: bool = False
    timeout_s: float = 20.0  # one attempt; every attempt must fit in toolbox.timeout_s
    max_attempts: int = 2
    backoff_s: float = 1.0
    proxy_from_env: bool = False  # the extractor is a service of the cluster, not of the web

    def __post_init__(self) -> None:
        if self.enabled:
            super().__post_init__()

    def worst_case_s(self) -> float:
        """The longest a call can take: every attempt timing out, with the longest backoffs."""
        waits = sum(longest_backoff_s(attempt, self.backoff_s, self.backoff_max_s)
                    for attempt in range(1, self.max_attempts))
        return self.max_attempts * self.timeout_s + waits


@dataclass(frozen=True)
class Extraction:
    """What the extractor model found in one page."""

    rational: str
    evidence: str
    summary: str


def _as_text(value: object) -> str:
    if isinstance(value, list):
        return "\n".join(_as_text(item) for item in value)
    return value.strip() if isinstance(value, str) else ("" if value is None else str(value))


def parse_reply(reply: str) -> Extraction | None:
    """The extraction in a model reply, tolerating code fences, prose around it and JSON5; or None."""
    fenced = _FENCE.search(reply)
    text = fenced.group(1) if fenced else reply
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    body = text[start:end + 1]
    parsed: object = None
    for loads in (json.loads, json5.loads):
        try:
            parsed = loads(body)
            break
        except ValueError:
            continue
    if not isinstance(parsed, dict):
        return None
    evidence, summary = _as_text(parsed.get("evidence")), _as_text(parsed.get("summary"))
    if not evidence and not summary:
        return None
    return Extraction(rational=_as_text(parsed.get("rational")), evidence=evidence, summary=summary)


class LlmExtractor:
    """Asks the extractor model for the goal-relevant evidence of a page's text."""

    def __init__(self, config: ExtractorConfig) -> None:
        if not config.model:
            raise ValueError("visit.extractor.enabled is true but visit.extractor.model is empty; set "
                             "it to the model name the endpoint serves")
        self.config = config
        self.client = ChatClient(config)

    async def extract(self, url: str, goal: str, page_text: str) -> Extraction | None:
        """Evidence and summary of ``page_text`` for ``goal``; None when the reply is unparseable."""
        prompt = PROMPT.format(url=url, page=page_text, goal=goal)
        try:
            reply = await self.client.complete([ChatMessage("user", prompt)])
        except ChatUnavailable as error:
            kind = "extractor" if error.kind == "refused" else "extractor_unavailable"
            raise ToolError(kind, f"the page extractor: {error}") from None
        return parse_reply(reply)

    async def aclose(self) -> None:
        await self.client.aclose()

"""Optional LLM extractor: turn a long page into the evidence and summary that serve the agent's goal.

Deep-research agents (WebSailor, Tongyi DeepResearch) do not read raw pages: a separate model reads
the page with the agent's stated goal and returns the relevant evidence and a short summary. This
module calls any OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint for that and asks for
a JSON object ``{"rational", "evidence", "summary"}`` (field names as in those agents' prompts).

Failure policy, chosen so that the observation stays useful and failures stay visible:
- a reply that cannot be parsed (no JSON object, even tolerating code fences and JSON5, or no
  evidence/summary) → :meth:`LlmExtractor.extract` returns None and the tool shows the truncated raw
  page text instead;
- the endpoint failing (connect errors, timeouts, 429, 5xx) is retried ``max_attempts`` times with
  capped exponential backoff, then raises ``ToolError("extractor_unavailable", retryable=True)``;
  other 4xx replies (bad model name, bad key) raise at once, since retrying cannot help.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass

import httpx
import json5

from envs.tools.base import ToolError

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
class ExtractorConfig:
    """Where the extractor model is served and how hard to try."""

    enabled: bool = False
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # name of the environment variable; unset → no auth header
    temperature: float = 0.0
    max_output_tokens: int = 1024
    timeout_s: float = 60.0
    max_attempts: int = 3
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 8.0


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
    """Calls a chat-completions endpoint to extract goal-relevant evidence from page text."""

    def __init__(self, config: ExtractorConfig) -> None:
        if not config.model:
            raise ValueError("visit.extractor.enabled is true but visit.extractor.model is empty; set "
                             "it to the model name the endpoint serves")
        self.config = config
        self._client: httpx.AsyncClient | None = None

    def _client_now(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Content-Type": "application/json"}
            key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
            if key:
                headers["Authorization"] = f"Bearer {key}"
            self._client = httpx.AsyncClient(base_url=self.config.base_url.rstrip("/"),
                                             headers=headers, timeout=self.config.timeout_s,
                                             trust_env=False)
        return self._client

    async def extract(self, url: str, goal: str, page_text: str) -> Extraction | None:
        """Evidence and summary of ``page_text`` for ``goal``; None when the reply is unparseable."""
        payload = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": PROMPT.format(url=url, page=page_text, goal=goal)}],
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_output_tokens,
        }
        reply = await self._complete(payload)
        return parse_reply(reply)

    async def _complete(self, payload: dict[str, object]) -> str:
        cfg = self.config
        problem = ""
        for attempt in range(cfg.max_attempts):
            if attempt:
                await asyncio.sleep(min(cfg.backoff_initial_s * 2 ** (attempt - 1), cfg.backoff_max_s))
            try:
                response = await self._client_now().post("/chat/completions", json=payload)
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                problem = f"HTTP {response.status_code}"
                continue
            if response.status_code >= 400:
                raise ToolError("extractor", f"the extractor endpoint {cfg.base_url} answered HTTP "
                                             f"{response.status_code}: {response.text[:200]}; check "
                                             f"visit.extractor.model and the API key in "
                                             f"${cfg.api_key_env}")
            try:
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                return ""  # not a chat-completions reply: treated as unparseable
            return content if isinstance(content, str) else ""
        raise ToolError("extractor_unavailable", f"the extractor endpoint {cfg.base_url} failed "
                                                 f"{cfg.max_attempts} times (last: {problem}); check "
                                                 f"that it is running", retryable=True)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

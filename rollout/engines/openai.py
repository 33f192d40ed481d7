"""A policy behind an OpenAI-compatible ``/v1/chat/completions`` endpoint (an API model, or a
server this project does not run), so it can be evaluated through the same environment, tools,
context managers and judges as the policies we train.

The rollout owns tokenisation (:mod:`turnstile.rollout.engines.base`), so this engine turns the prompt ids
back into chat messages with the tokenizer of ``engine.model`` (its chat template's frames: the
text the template writes around each role's message), sends them, and tokenises the reply with
the same tokenizer, the template's end-of-turn token appended. What it cannot give:

- **log-probs**: an endpoint's are of its own tokenizer, not ours; the engine reports 0.0 for every
  token. Such trajectories can be evaluated, not trained on;
- **scoring** and **new weights**: refused with a message (``score``, ``update_weights``).

Every sample is its own request: the client's reply cache is off, or k samples of a question
would be one sample k times. Options (``engine.options``): the endpoint (``base_url``, ``model``,
``api_key_env``: the variable holding the key) and the client's limits; the sampling settings
(temperature, top_p, max tokens) are the episode's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from turnstile.envs.chat_client import ChatClient, ChatClientConfig, ChatMessage
from turnstile.envs.plugins import typed_options
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Probe,
    ProbeUnsupported,
    SamplingParams,
)
from turnstile.rollout.engines.config import EngineConfig

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class OpenAIOptions:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # "" = send no key
    timeout_s: float = 300.0  # one attempt (a long answer takes a while)
    max_attempts: int = 4
    max_concurrency: int = 16

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("engine 'openai': options.model is empty: name the model the endpoint serves")


class OpenAIEngine:
    """See the module docstring."""

    Options = OpenAIOptions

    def __init__(self, chat: ChatFormat, client: ChatClient) -> None:
        self.chat, self.client = chat, client
        self._headers = self._role_headers()

    @classmethod
    def from_config(cls, config: EngineConfig) -> OpenAIEngine:
        from turnstile.rollout.model_store import resolve_model

        options = typed_options(OpenAIOptions, config.options, "engine 'openai'", error=ValueError)
        client = ChatClientConfig(base_url=options.base_url, model=options.model, api_key_env=options.api_key_env,
                                  timeout_s=options.timeout_s, max_attempts=options.max_attempts,
                                  max_concurrency=options.max_concurrency, cache_entries=0)
        return cls(ChatFormat.from_pretrained(resolve_model(config.model)), ChatClient(client))

    @classmethod
    def check_tasks(cls, config: EngineConfig, questions: Sequence[str]) -> None:
        typed_options(OpenAIOptions, config.options, "engine 'openai'", error=ValueError)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        messages = prompt_messages(self.chat, self._headers, prompt_ids)
        reply = await self.client.complete(messages, temperature=sampling.temperature,
                                           max_tokens=sampling.max_new_tokens)
        ids = self.chat.encode(reply)[:sampling.max_new_tokens]
        finish = FINISH_LENGTH if len(ids) >= sampling.max_new_tokens else FINISH_STOP
        if finish == FINISH_STOP:
            ids.append(self.chat.turn_end_id)  # the turn ended: as a local engine's stop token would say
        return Generation(tuple(ids), (0.0,) * len(ids), finish, 0)

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        raise ValueError("engine 'openai' cannot score tokens (an endpoint's log-probs are of its own "
                         "tokenizer); use it to evaluate, and a local engine for rewards that score")

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        raise ProbeUnsupported("engine 'openai' cannot score tokens (an endpoint's log-probs are of its "
                               "own tokenizer): measure information gain with a local engine (vllm, hf)")

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        raise ValueError("engine 'openai' serves a model it does not hold: it cannot take new weights")

    async def weights_version(self) -> int:
        return 0

    async def aclose(self) -> None:
        await self.client.aclose()

    def _role_headers(self) -> dict[str, str]:
        """The text that opens each role's message after an end of turn (the template's frames)."""
        headers = {}
        for role in ROLES:
            try:
                headers[role] = self.chat.frame(role).prefix
            except ValueError:
                continue  # a template without that role
        return headers


def prompt_messages(chat: ChatFormat, headers: Mapping[str, str], prompt_ids: Sequence[int]) -> list[ChatMessage]:
    """The chat messages ``prompt_ids`` spell, without the trailing generation prompt.

    The text is cut at every end-of-turn token; each piece opens with a role's header (the first
    one without the whitespace that would follow an earlier turn's end)."""
    pieces = chat.decode(list(prompt_ids)).split(chat.turn_end_text)
    messages = []
    for index, piece in enumerate(pieces[:-1]):  # the last piece is the generation prompt
        for role, header in sorted(headers.items(), key=lambda item: -len(item[1])):
            opening = header if index else header.lstrip()
            if piece.startswith(opening):
                messages.append(ChatMessage(role, piece[len(opening):]))
                break
        else:
            raise ValueError(f"engine 'openai': a message of the prompt opens with {piece[:40]!r}, which is "
                             f"no role's header in the chat template of {chat.name!r}")
    return messages

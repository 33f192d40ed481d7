"""Token ids of a conversation, built once and extended turn by turn, never re-tokenised.

The policy's context is token ids: the prompt of the first messages, then for each turn the ids the
engine generated and the ids of the observation that answers them. Re-tokenising the decoded text
would not give back the generated ids (BPE merges across what were turn boundaries), and training on
ids the policy never produced biases the gradient. So :class:`ChatFormat` knows, from the tokenizer's
own chat template, what text separates a generated assistant turn from the next message and how the
next generation prompt reads, and it tokenises only that new text.

How the delta is found: for each message role, the template renders a placeholder conversation
(user, assistant, then a message of that role, plus the generation prompt); the text between the
assistant's end-of-turn token and the new placeholder is the message's prefix, the text after it its
suffix. The delta of an observation is ``prefix + content + suffix``, tokenised behind the
end-of-turn token (then dropped) so it splits exactly as it does inside the whole conversation. When a
generation did not end with the end-of-turn token (it stopped on ``<tool_response>`` or ran out of
tokens), the delta starts with that token.

Invariant (tested): prompt ids + Σ(response ids + delta ids) equals ``apply_chat_template`` of the
whole conversation whenever every response ended with the end-of-turn token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from turnstile.envs.protocol import RESPONSE_OPEN

Message = Mapping[str, str]

_ASSISTANT = "TURNSTILEPLACEHOLDERASSISTANT"
_CONTENT = "TURNSTILEPLACEHOLDERCONTENT"
_QUESTION = "TURNSTILEPLACEHOLDERQUESTION"


@dataclass(frozen=True)
class MessageFrame:
    """The text a chat template puts around a message that follows an assistant turn.

    ``prefix`` runs from just after the assistant's end-of-turn token to the message content;
    ``suffix`` from the content to the end of the next generation prompt.
    """

    prefix: str
    suffix: str


class ChatFormat:
    """A tokenizer's chat template, seen as token ids to append turn by turn (see module doc)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: use a chat "
                             "(instruct) model or set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self._frames: dict[str, MessageFrame] = {}
        self.turn_end_id, self.turn_end_text = self._find_turn_end()
        self.stop_token_ids = self._stop_token_ids()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatFormat:
        """The chat format of the tokenizer saved at ``path`` (a model directory or hub name)."""
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def name(self) -> str:
        return str(self.tokenizer.name_or_path)

    # ---- ids ---------------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` followed by the generation prompt of an assistant turn."""
        ids = self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        return [int(i) for i in ids]  # type: ignore[arg-type]  # one conversation: a list of ids

    def delta_ids(self, content: str, response_ids: Sequence[int], role: str = "user") -> list[int]:
        """The ids that append a ``role`` message with ``content`` after the assistant turn
        ``response_ids``, up to and including the next generation prompt.

        Only the new text is tokenised, so the cost is that of the message, not of the context.
        """
        frame = self.frame(role)
        anchored = self.encode(self.turn_end_text + frame.prefix + content + frame.suffix)
        if not anchored or anchored[0] != self.turn_end_id:
            raise RuntimeError(f"tokenizer {self.name!r} does not keep {self.turn_end_text!r} as one "
                               "token in front of a message; its chat template cannot be extended")
        delta = anchored[1:]
        return delta if self.ends_turn(response_ids) else [self.turn_end_id, *delta]

    def ends_turn(self, response_ids: Sequence[int]) -> bool:
        """Whether a generation ended with the template's end-of-turn token."""
        return bool(response_ids) and response_ids[-1] == self.turn_end_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text exactly as the ids spell it, special tokens included."""
        # transformers types decode() as str | list[str]: one id list gives one str.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,  # type: ignore[return-value]
                                     clean_up_tokenization_spaces=False)

    def response_text(self, response_ids: Sequence[int]) -> str:
        """What the policy wrote in a turn: its ids decoded, without the stop token it ended on."""
        ids = list(response_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return self.decode(ids)

    # ---- the template ------------------------------------------------------------------------

    def frame(self, role: str) -> MessageFrame:
        """The text around a ``role`` message that follows an assistant turn (computed once)."""
        frame = self._frames.get(role)
        if frame is None:
            frame = self._frames[role] = self._render_frame(role)
        return frame

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as error:  # templates raise whatever Jinja raises
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template of {self.name!r} cannot render roles {roles}: "
                             f"{error}") from error
        return str(text)

    def _render_frame(self, role: str) -> MessageFrame:
        text = self._render([{"role": "user", "content": _QUESTION},
                             {"role": "assistant", "content": _ASSISTANT},
                             {"role": role, "content": _CONTENT}])
        after = text.split(_ASSISTANT, 1)[1]
        if not after.startswith(self.turn_end_text) or _CONTENT not in after:
            raise ValueError(f"the chat template of {self.name!r} does not close an assistant turn "
                             f"with {self.turn_end_text!r} right after its content, or drops a "
                             f"{role!r} message; turns cannot be appended as token ids")
        prefix, suffix = after[len(self.turn_end_text):].split(_CONTENT, 1)
        return MessageFrame(prefix, suffix)

    def _find_turn_end(self) -> tuple[int, str]:
        """The special token the template writes right after an assistant message's content."""
        text = self._render([{"role": "user", "content": _QUESTION},
                             {"role": "assistant", "content": _ASSISTANT},
                             {"role": "user", "content": _CONTENT}])
        if _ASSISTANT not in text:
            raise ValueError(f"the chat template of {self.name!r} drops assistant messages")
        special = set(self.tokenizer.all_special_ids) | {
            token_id for token_id, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        for token_id in self.encode(text.split(_ASSISTANT, 1)[1]):
            if token_id in special:
                return token_id, self.decode([token_id])
        raise ValueError(f"the chat template of {self.name!r} writes no special end-of-turn token "
                         "after an assistant message; generation could not stop at the turn's end")

    def _stop_token_ids(self) -> tuple[int, ...]:
        stops = [self.turn_end_id]
        response_open = self.encode(RESPONSE_OPEN)
        if len(response_open) == 1:  # the policy must not write the tool's response itself
            stops.append(response_open[0])
        eos = self.tokenizer.eos_token_id
        for token_id in eos if isinstance(eos, list) else [eos]:
            if token_id is not None:
                stops.append(int(token_id))
        return tuple(dict.fromkeys(stops))

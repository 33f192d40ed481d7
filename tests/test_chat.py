"""ChatFormat: turns appended as token ids give what the chat template gives for the whole conversation.

The default tiny model's tokenizer (ChatML) is the main subject; a Llama-3-style template built on
the same vocabulary checks that nothing depends on ChatML.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from turnstile.envs.protocol import render_tool_call
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.model_store import ensure_default_model

LLAMA_STYLE = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)
SYSTEM = {"role": "system", "content": "You are a deep research assistant."}
CALL = render_tool_call("search", {"query": ["x"]}, "I search.")
RESULT = "<tool_response>\n1. [Krandara](http://h/wiki/krandara)\n  A country.\n</tool_response>"
ANSWER = "<think>\nDone.\n</think>\n<answer>Fegrel</answer>"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatFormat:
    return ChatFormat.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def llama_chat(model_dir: Path) -> ChatFormat:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in
                          ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")],
                         special_tokens=True)
    tokenizer.chat_template = LLAMA_STYLE
    return ChatFormat(tokenizer)


def template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                 generation_prompt: bool = True) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=generation_prompt))


def appended_ids(chat: ChatFormat, question: str, turns: list[tuple[str, str]],
                 stop_on_turn_end: bool = True) -> list[int]:
    """Prompt, then each (assistant, observation) pair as response ids + delta ids."""
    ids = chat.prompt_ids([SYSTEM, {"role": "user", "content": question}])
    for response, observation in turns:
        response_ids = chat.encode(response) + ([chat.turn_end_id] if stop_on_turn_end else [])
        ids += response_ids + chat.delta_ids(observation, response_ids)
    return ids


def conversation(question: str, turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    messages = [SYSTEM, {"role": "user", "content": question}]
    for response, observation in turns:
        messages += [{"role": "assistant", "content": response}, {"role": "user", "content": observation}]
    return messages


def test_finds_turn_end_and_stop_tokens(chat: ChatFormat) -> None:
    tokenizer = chat.tokenizer
    assert chat.turn_end_text == "<|im_end|>"
    assert chat.turn_end_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.stop_token_ids[0] == chat.turn_end_id
    assert tokenizer.convert_tokens_to_ids("<tool_response>") in chat.stop_token_ids
    assert tokenizer.eos_token_id in chat.stop_token_ids
    assert chat.frame("user").prefix == "\n<|im_start|>user\n"
    assert chat.frame("user").suffix == "<|im_end|>\n<|im_start|>assistant\n"


def test_appended_ids_equal_the_template_of_the_whole_conversation(chat: ChatFormat) -> None:
    turns = [(CALL, RESULT), (CALL, "<tool_response>\n  spaced   text\n\n</tool_response>")]
    ids = appended_ids(chat, "Where?", turns)
    assert ids == template_ids(chat.tokenizer, conversation("Where?", turns))
    # The answer turn closes the episode: the segment is a prefix of the finished conversation.
    answer_ids = [*chat.encode(ANSWER), chat.turn_end_id]
    finished = [*conversation("Where?", turns), {"role": "assistant", "content": ANSWER}]
    full = template_ids(chat.tokenizer, finished, generation_prompt=False)
    assert full[: len(ids) + len(answer_ids)] == ids + answer_ids


def test_a_turn_cut_before_its_end_gets_the_end_token_first(chat: ChatFormat) -> None:
    stopped = chat.encode(CALL) + chat.encode("<tool_response>")  # stopped on <tool_response>
    delta = chat.delta_ids(RESULT, stopped)
    assert delta[0] == chat.turn_end_id
    prompt = chat.prompt_ids([SYSTEM, {"role": "user", "content": "Where?"}])
    messages = [SYSTEM, {"role": "user", "content": "Where?"},
                {"role": "assistant", "content": CALL + "<tool_response>"},
                {"role": "user", "content": RESULT}]
    assert prompt + stopped + delta == template_ids(chat.tokenizer, messages)
    assert chat.response_text(stopped) == CALL
    cut = chat.encode(CALL)[:7]  # ran out of tokens: no stop token at all
    assert chat.delta_ids(RESULT, cut)[0] == chat.turn_end_id
    assert chat.delta_ids(RESULT, cut)[1:] == chat.delta_ids(RESULT, [*cut, chat.turn_end_id])


def test_response_text_drops_only_the_stop_token(chat: ChatFormat) -> None:
    ids = chat.encode(CALL)
    assert chat.response_text([*ids, chat.turn_end_id]) == CALL
    assert chat.response_text(ids) == CALL
    assert chat.decode([*ids, chat.turn_end_id]).endswith("<|im_end|>")


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
_tagged = st.builds(lambda a, b: f"<think>{a}</think>{b}", _text, _text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(question=_text, turns=st.lists(st.tuples(_tagged, _text), min_size=1, max_size=4))
def test_invariant_holds_for_generated_conversations(chat: ChatFormat, question: str,
                                                     turns: list[tuple[str, str]]) -> None:
    # Assistant turns start with <think> as the protocol says, so their first id does not depend
    # on the text before them; observations and the question are arbitrary text.
    assert appended_ids(chat, question, turns) == template_ids(chat.tokenizer,
                                                               conversation(question, turns))


def test_works_with_another_template(llama_chat: ChatFormat) -> None:
    assert llama_chat.turn_end_text == "<|eot_id|>"
    assert llama_chat.frame("user").prefix == "<|start_header_id|>user<|end_header_id|>\n\n"
    turns = [(CALL, RESULT), (CALL, "<tool_response>\nnothing\n</tool_response>")]
    ids = appended_ids(llama_chat, "Where?", turns)
    assert ids == template_ids(llama_chat.tokenizer, conversation("Where?", turns))
    assert llama_chat.turn_end_id in llama_chat.stop_token_ids


def test_a_tokenizer_without_template_is_refused(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatFormat(tokenizer)


def test_a_template_without_end_of_turn_token_is_refused(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor -%}"
    with pytest.raises(ValueError, match="end-of-turn"):
        ChatFormat(tokenizer)

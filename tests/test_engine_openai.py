"""The ``openai`` policy engine against a local server speaking the chat-completions protocol: the
prompt's messages reach it as the episode built them, every sample is its own request, its reply
comes back as our tokens; and ``turnstile eval`` runs an API model through the same environment,
tools and judge."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.openai_server import Reply, chat_server
from turnstile.envs.chat_client import ChatClient, ChatClientConfig
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.openai import OpenAIEngine, prompt_messages
from turnstile.rollout.model_store import resolve_model

REPO = Path(__file__).resolve().parent.parent
HELDOUT = {"min_hops": 1, "max_hops": 1, "entity_answer_fraction": 1.0, "aggregation_fraction": 0.0, "count": 1200}


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_pretrained(resolve_model("tiny-qwen3"))


async def test_the_endpoint_gets_the_episodes_messages_and_each_sample_is_its_own_request(chat: ChatFormat) -> None:
    system, question = "You search and read.", "Who founded Acme?"
    ids = chat.prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": question}])
    ids += [*chat.encode("<think>search</think>\n<tool_call>{}</tool_call>"), chat.turn_end_id]
    ids += chat.delta_ids("<tool_response>Acme was founded by Ada.</tool_response>", ids)
    replies = iter(["<think>read</think>\n<answer>Ada</answer>", "<think>again</think>\n<answer>Ada</answer>",
                    "a very long reply " * 40])
    with chat_server(lambda _messages: Reply(next(replies))) as server:
        client = ChatClient(ChatClientConfig(base_url=server.base_url, model="api-model", api_key_env="",
                                             cache_entries=0))
        engine = OpenAIEngine(chat, client)
        sampling = SamplingParams(max_new_tokens=64, temperature=0.7)
        # The same prompt twice at once (two samples of one question): two requests, not one shared.
        first, second = await asyncio.gather(engine.generate(ids, sampling), engine.generate(ids, sampling))
        cut = await engine.generate(ids, SamplingParams(max_new_tokens=8))
        await engine.aclose()
    sent = server.log.requests[0]
    assert server.log.count == 3 and sent["model"] == "api-model" and sent["temperature"] == 0.7
    assert sent["max_tokens"] == 64
    assert sent["messages"] == [
        {"role": "system", "content": system}, {"role": "user", "content": question},
        {"role": "assistant", "content": "<think>search</think>\n<tool_call>{}</tool_call>"},
        {"role": "user", "content": "<tool_response>Acme was founded by Ada.</tool_response>"}]
    assert first.finish_reason == FINISH_STOP and first.token_ids[-1] == chat.turn_end_id
    assert {chat.response_text(first.token_ids), chat.response_text(second.token_ids)} == {
        "<think>read</think>\n<answer>Ada</answer>", "<think>again</think>\n<answer>Ada</answer>"}
    assert set(first.logprobs) == {0.0}
    assert cut.finish_reason == FINISH_LENGTH and len(cut.token_ids) == 8
    with pytest.raises(ValueError, match="cannot score"):
        await engine.score([ids], [(0, 1)])
    with pytest.raises(ValueError, match="cannot take new weights"):
        await engine.update_weights(1, {})


def test_a_prompt_the_template_did_not_write_is_refused(chat: ChatFormat) -> None:
    with pytest.raises(ValueError, match="no role's header"):
        prompt_messages(chat, {"user": chat.frame("user").prefix}, chat.encode("plain text<|im_end|>more"))
    with pytest.raises(ValueError, match=r"options.model is empty"):
        OpenAIEngine.check_tasks(EngineConfig(kind="openai", options={"base_url": "http://127.0.0.1:9/v1"}), [])


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_turnstile_eval_runs_an_api_model_through_the_environment(tmp_path: Path) -> None:
    data = DatasetConfig(kind="synthetic", path="", split="eval", limit=4, options=HELDOUT)
    gold = {task.question: task.answers[0] for task in load_tasks(data)}

    def respond(messages: list[dict[str, str]]) -> Reply:  # answers right, at once, from the question
        question = next(q for q in gold if any(q in m["content"] for m in messages))
        return Reply(f"<think>I know this one.</think>\n<answer>{gold[question]}</answer>")

    with chat_server(respond) as server:
        options = f"{{base_url: '{server.base_url}', model: api-model, api_key_env: ''}}"
        bench = f"benchmarks=[{{name: api, data: {json.dumps({**data.__dict__, 'options': HELDOUT})}}}]"
        result = subprocess.run(
            [str(Path(sys.executable).parent / "turnstile"), "eval", "--config", str(REPO / "examples" / "eval.yaml"),
             "--no-progress", bench, "k=2", f"out={tmp_path}", "rollout.engine.kind=openai",
             "rollout.engine.model=tiny-qwen3", f"rollout.engine.options={options}", "rollout.corpus.port=0",
             "rollout.ray.num_cpus=2"], cwd=REPO, capture_output=True, text=True, timeout=500, check=False)
        asked = server.log.count
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(row["correct"] and row["turns"] == 1 for row in rows), rows
    assert asked == 8  # one request per sample: k samples are k requests
    summary = json.loads((tmp_path / "summary.json").read_text())["benchmarks"]["api"]
    assert summary["pass@1"][0] == 1.0 and summary["maj@2"][0] == 1.0

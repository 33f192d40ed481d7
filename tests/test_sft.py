"""SFT: samples from chat rows and trajectories, the turnstile sft job end to end (veRL on CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from turnstile.cluster.cli import main
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.learner.batch import Sample, abc_sft_turn_weight
from turnstile.learner.credit.estimators import abc_sft_weight
from turnstile.learner.sft import (
    SftDataError,
    chat_trajectories,
    detect_format,
    load_sft_samples,
)
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.model_store import resolve_model
from turnstile.rollout.summary import well_formed_share
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, save_trajectories

ROW = {"messages": [
    {"role": "system", "content": "You research."},
    {"role": "user", "content": "Who founded Arlen Mills?"},
    {"role": "assistant", "content": '<think>search</think>\n<tool_call>\n{"name": "search", "arguments": '
                                     '{"query": ["Arlen Mills founder"]}}\n</tool_call>'},
    {"role": "user", "content": "<tool_response>\n1. Arlen Mills — founded by Oda Venn\n</tool_response>"},
    {"role": "assistant", "content": "<think>found it</think>\n<answer>Oda Venn</answer>"},
], "answer": "Oda Venn", "source_line": 7, "turns": 2}


@pytest.fixture(scope="module", params=["tiny-qwen3", "smollm2-135m-instruct"])
def chat(request: pytest.FixtureRequest) -> ChatFormat:
    """The tiny model's minimal template, and a real model's own (SmolLM2's ChatML, which adds a
    default system prompt when a conversation has none)."""
    return ChatFormat.from_pretrained(resolve_model(request.param))


def test_chat_row_tokenises_like_the_template_and_masks_tool_responses(chat: ChatFormat) -> None:
    (trajectory,) = chat_trajectories([(1, ROW)], chat)
    segment = trajectory.segments[0]
    whole = chat.tokenizer.apply_chat_template(ROW["messages"], tokenize=True, return_dict=False)
    assert segment.flat_ids() == [int(i) for i in whole][:len(segment.flat_ids())]
    # The policy's tokens are exactly the two assistant messages (each with its end-of-turn token).
    first, last = segment.turns
    assert chat.response_text(first.response_ids) == ROW["messages"][2]["content"]
    assert chat.response_text(last.response_ids) == ROW["messages"][4]["content"]
    assert "Oda Venn" in chat.decode(first.observation_ids) and last.observation_ids == []


def test_samples_from_chat_rows_and_errors(tmp_path: Path, chat: ChatFormat) -> None:
    rows = tmp_path / "clean.jsonl"
    rows.write_text(json.dumps(ROW) + "\n\n" + json.dumps(ROW) + "\n")
    samples = load_sft_samples(rows, chat)
    assert len(samples) == 2
    sample = samples[0]
    assert sum(sample.response_mask) == sum(len(t.response_ids) for t in
                                            next(iter(chat_trajectories([(1, ROW)], chat))).turns)
    assert all(w == m for w, m in zip(sample.loss_weights, sample.response_mask, strict=True))
    with pytest.raises(SftDataError, match="no such file"):
        load_sft_samples(tmp_path / "missing.jsonl", chat)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n{oops\n")
    with pytest.raises(SftDataError, match=r"bad.jsonl:2: not JSON"):
        load_sft_samples(bad, chat, fmt="chat")
    other = tmp_path / "other.jsonl"
    other.write_text('{"question": "?"}\n')
    with pytest.raises(SftDataError, match="neither a trajectory"):
        detect_format(other)
    twice = dict(ROW, messages=[*ROW["messages"][:3], ROW["messages"][4]])
    with pytest.raises(SftDataError, match="two assistant messages in a row"):
        list(chat_trajectories([(4, twice)], chat, source="x.jsonl"))
    with pytest.raises(SftDataError, match="weighting='abcd'"):
        load_sft_samples(rows, chat, weighting="abcd")


def _trajectory(scores: list[float | None], formats: list[bool]) -> Trajectory:
    turns = [Turn(index=i, response_ids=[5 + i, 6], response_logprobs=[0.0, 0.0], weights_version=0,
                  context_len=3, finish_reason="stop", format_ok=ok, step_score=score,
                  observation_ids=[9])
             for i, (score, ok) in enumerate(zip(scores, formats, strict=True))]
    return Trajectory(uid="u", sample=0, task_id="t", question="q", answers=["a"],
                      segments=[Segment(prompt_ids=[1, 2, 3], turns=turns)])


def test_abc_weighting_and_trajectory_input(tmp_path: Path, chat: ChatFormat) -> None:
    path = tmp_path / "expert.jsonl"
    save_trajectories([_trajectory([1.8, None], [True, False])], path)
    (unit,) = load_sft_samples(path, chat)
    (abc,) = load_sft_samples(path, chat, weighting="abc")
    assert unit.loss_weights == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert abc.loss_weights == pytest.approx([abc_sft_weight(1.8)] * 2 + [0.0] + [1.0, 1.0, 0.0])
    assert abc_sft_turn_weight(_trajectory([0.0], [True]).turns[0]) == pytest.approx(0.238406, abs=1e-6)
    # Turn-aware resampling: the 2-turn trajectory falls in the second tier.
    assert len(load_sft_samples(path, chat, resample="1:1,inf:3")) == 3
    assert len(load_sft_samples(path, chat, resample="2:1,inf:3")) == 1
    with pytest.raises(ValueError, match="bad resample tier"):
        load_sft_samples(path, chat, resample="lots")


def test_a_resumed_sft_takes_the_batches_the_run_would_have_taken_next() -> None:
    from turnstile.cluster.jobs.sft import sample_batches

    samples = [Sample(uid=str(i), trajectory=(str(i), 0), segment=0, prompt_ids=[1], response_ids=[2],
                      response_mask=[1], advantages=[0.0], old_log_probs=[0.0], loss_weights=[1.0],
                      weights_version=0) for i in range(10)]
    whole = sample_batches(samples, 4, seed=3)
    straight = [[s.uid for s in next(whole)] for _ in range(7)]  # past two passes over the samples
    resumed = sample_batches(samples, 4, seed=3)
    for _ in range(4):  # the steps a checkpoint holds
        next(resumed)
    assert [[s.uid for s in next(resumed)] for _ in range(3)] == straight[4:]
    assert len({uid for batch in straight[:2] for uid in batch}) == 8  # a pass draws each sample once


def test_well_formed_share() -> None:
    assert well_formed_share([_trajectory([None] * 4, [True, False, True, True])]) == (0.75, 4)
    assert well_formed_share([]) == (0.0, 0)


def test_synthetic_eval_split_is_held_out_and_filled() -> None:
    held_out = load_tasks(DatasetConfig(kind="synthetic", path="", split="eval", limit=6))
    train = load_tasks(DatasetConfig(kind="synthetic", path="", split="train", limit=40))
    assert len(held_out) == 6 and len(train) == 40
    assert not {t.id for t in held_out} & {t.id for t in train}


@pytest.mark.integration
def test_sft_command_trains_on_cleaned_rows(shared_data: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """data clean → sft: the loss falls on a repeated batch; a loadable model and the evals come out."""
    clean = tmp_path / "clean.jsonl"
    with pytest.raises(SystemExit) as done:
        main(["data", "clean", "--in", str(shared_data / "trajectories" / "webdancer_traj200.jsonl"),
              "--out", str(clean), "--no-require-correct"])
    assert done.value.code == 0
    out = tmp_path / "sft"
    with pytest.raises(SystemExit) as done:
        main(["sft", "--config", str(Path(__file__).resolve().parent.parent / "examples" / "sft.yaml"),
              "--no-progress", f"data.path={clean},{clean}", "steps=6", "log_every=3", f"out={out}",
              "checkpoint_every=3",
              "learner.mini_batch=4", "learner.micro_batch=2", "learner.max_length=1536",
              "eval.rollout.data.limit=1", "eval.rollout.group_size=1",
              "eval.rollout.episode.env.max_turns=2", "eval.rollout.episode.max_new_tokens=16"])
    printed = capsys.readouterr().out
    assert done.value.code == 0, printed
    losses = [float(found.group(1)) for found in re.finditer(r"^step \d+: loss ([0-9.]+),", printed, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], printed
    evaluations = json.loads((out / "evaluations.json").read_text())
    assert [e["step"] for e in evaluations] == [0, 6] and all(e["turns"] > 0 for e in evaluations)
    assert "eval @ step 0: well-formed turns" in printed
    assert f"step 3: checkpoint and {out / 'model'} written" in printed
    assert re.search(r"sft: (\d+) samples from .*clean.jsonl,.*clean.jsonl", printed)  # both files read
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model")  # loadable
    with pytest.raises(SystemExit) as done:
        main(["sft", f"data.path={clean}", "learner.mini_batch=3", "learner.dp=2"])
    assert done.value.code == 2 and "must be a multiple of learner.dp=2" in capsys.readouterr().out

"""SFT data: training samples from our trajectories or from ``turnstile data clean``'s chat rows.

Two inputs, one sample form (:class:`turnstile.learner.batch.Sample`, loss on the policy's own tokens only):

- **trajectories** (``turnstile rollout`` JSONL, e.g. the scripted expert's): the token ids are
  already the policy's; every segment is a sample, its turns' response tokens are trained on and the
  observations are masked.
- **chat rows** (``turnstile data clean`` output: ``messages`` with system, user, then alternating
  assistant turns and tool responses): tokenised with the policy's chat template the way the episode
  loop builds a context (:class:`turnstile.rollout.chat.ChatFormat`): the prompt of the first messages, then
  per assistant turn its text plus the end-of-turn token, then the delta of the tool response.

Weights per turn: ``unit`` (plain SFT) or ``abc`` (ABC-SFT, w(step score) of docs/algorithms.md §6 for
turns that carry a step score, 1 otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from turnstile.learner.batch import (
    Sample,
    abc_sft_turn_weight,
    samples_from_trajectories,
    unit_weight,
)
from turnstile.learner.sft_data import copies_for, parse_resample
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, load_trajectories

FORMATS = ("auto", "trajectories", "chat")
WEIGHTINGS = {"unit": unit_weight, "abc": abc_sft_turn_weight}


class SftDataError(ValueError):
    """An SFT input that cannot be trained on; the message names the file, line and fix."""


def detect_format(path: Path) -> str:
    """``trajectories`` when the first record is one of ours (it has ``segments``), ``chat`` when it
    has ``messages``."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SftDataError(f"{path}:{number}: not JSON ({error.msg})") from None
            if isinstance(record, dict) and "segments" in record:
                return "trajectories"
            if isinstance(record, dict) and "messages" in record:
                return "chat"
            raise SftDataError(f"{path}:{number}: neither a trajectory (no 'segments') nor a chat row "
                               "(no 'messages'); pass `turnstile rollout` or `turnstile data clean` output")
    raise SftDataError(f"{path} holds no records")


def load_sft_samples(path: str | Path, chat: ChatFormat, *, fmt: str = "auto",
                     weighting: str = "unit", resample: str = "") -> list[Sample]:
    """Every training sample of ``path``.

    ``resample`` (e.g. ``50:1,100:2,inf:5``) repeats each trajectory's samples by its number of turns,
    docs/algorithms.md §10's turn-aware resampling; ``turnstile data clean`` already applies it to chat
    rows, so it is meant for trajectory input. Empty: every sample once.
    """
    path = Path(path)
    if not path.is_file():
        raise SftDataError(f"{path}: no such file (the SFT data: `turnstile rollout --out` or "
                           "`turnstile data clean --out`)")
    if fmt not in FORMATS:
        raise SftDataError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if weighting not in WEIGHTINGS:
        raise SftDataError(f"data.weighting={weighting!r} is not one of {', '.join(WEIGHTINGS)}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "trajectories":
        trajectories = load_trajectories(path)
    else:
        trajectories = list(chat_trajectories(_read_rows(path), chat, source=str(path)))
    samples: list[Sample] = []
    tiers = parse_resample(resample) if resample else None
    for trajectory in trajectories:
        own = samples_from_trajectories([trajectory], require_advantage=False,
                                        turn_weight=WEIGHTINGS[weighting])
        samples.extend(own * (copies_for(len(trajectory.turns), tiers) if tiers else 1))
    if not samples:
        raise SftDataError(f"{path}: no sample with at least one assistant turn")
    return samples


def _read_rows(path: Path) -> Iterable[tuple[int, dict[str, object]]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SftDataError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise SftDataError(f"{path}:{number}: a row must be a JSON object")
            yield number, row


def chat_trajectories(rows: Iterable[tuple[int, dict[str, object]]], chat: ChatFormat, *,
                      source: str = "<rows>") -> Iterable[Trajectory]:
    """Chat rows as single-segment trajectories of the policy's token ids (see the module doc)."""
    for number, row in rows:
        messages = row.get("messages")
        where = f"{source}:{number}"
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise SftDataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        roles = [m.get("role") for m in messages]
        first_assistant = roles.index("assistant") if "assistant" in roles else -1
        if first_assistant < 1:
            raise SftDataError(f"{where}: no assistant message after the prompt")
        prompt = chat.prompt_ids(messages[:first_assistant])
        turns: list[Turn] = []
        context = len(prompt)
        rest = messages[first_assistant:]
        for i, message in enumerate(rest):
            if message.get("role") != "assistant":
                continue
            response = [*chat.encode(str(message.get("content", ""))), chat.turn_end_id]
            following = rest[i + 1] if i + 1 < len(rest) else None
            observation: list[int] = []
            text = ""
            if following is not None:
                if following.get("role") == "assistant":
                    raise SftDataError(f"{where}: two assistant messages in a row; each tool call needs "
                                       "its tool response between them")
                text = str(following.get("content", ""))
                observation = chat.delta_ids(text, response, role=str(following.get("role")))
            turns.append(Turn(index=len(turns), response_ids=response, response_logprobs=[0.0] * len(response),
                              weights_version=0, context_len=context, finish_reason="stop",
                              response_text=str(message.get("content", "")), format_ok=True,
                              observation_text=text, observation_ids=observation))
            context += len(response) + len(observation)
        answers = row.get("answer")
        yield Trajectory(uid=f"row{number}", sample=0, task_id=str(row.get("source_line", number)),
                         question=str(messages[first_assistant - 1].get("content", ""))[:200],
                         answers=[str(answers)] if answers else [],
                         segments=[Segment(prompt_ids=prompt, turns=turns)])

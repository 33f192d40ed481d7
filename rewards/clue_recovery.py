"""Clue recovery (docs/algorithms.md §6, ABSeeker): the clues a solution must establish, for tasks that
ship none.

An LLM works backwards from the question and its verified answer with the project's own search and
visit tools (a ReAct loop in the agent protocol of §1) and returns the clues as JSON. Once per
question: recovered sets are cached in memory and, when ``cache_path`` is set, in a JSONL file that
later runs reuse. Tasks that carry clues (the synthetic world's chains, HotpotQA's supporting facts)
skip it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from turnstile.envs.chat_client import ChatClient, ChatMessage, clip_text
from turnstile.envs.protocol import (
    FINAL_ANSWER_INSTRUCTION,
    TurnKind,
    parse_turn,
    render_correction,
    render_tool_response,
)
from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.base import JsonValue
from turnstile.envs.tools.toolbox import Toolbox

log = logging.getLogger(__name__)

ROLES = ("bridge", "constraint", "answer")


RECOVERY_PROMPT = """You reconstruct the evidence behind a research question whose answer is known. \
Work backwards from the answer to the question's starting points with the tools, and find the pages \
that establish every fact a correct solution needs.

# Tools

Call one function per message:
<tools>
{tools}
</tools>

Each message starts with your reasoning in <think></think>, then either a call
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
or, when you have the evidence, the clues as a JSON list inside <answer></answer>:
[{{"id": "c1", "text": "<subject and relation>: <value>", "role": "bridge", \
"evidence_urls": ["<url of a page stating it>"], "aliases": ["<other spellings of the value>"]}}]
role is "bridge" (a fact linking the question to the next entity), "constraint" (a condition the \
answer must meet) or "answer" (the fact that gives the answer). List the clues in solving order, \
with the answer clue last."""


class ClueRecoveryError(RuntimeError):
    """No usable clue list came back within the turn limit."""


@dataclass
class ClueRecoveryConfig:
    max_turns: int = 30  # assistant turns, the final clue list included
    max_observation_chars: int = 8000
    cache_path: str = ""  # JSONL of recovered clue sets, reused across runs; "" = memory only

    def __post_init__(self) -> None:
        if self.max_turns < 2:
            raise ValueError("recovery.max_turns must be >= 2 (one tool call and the clue list)")


def clue_key(task: Task) -> str:
    """Cache key of a question: its text and gold answers."""
    material = json.dumps([task.question.strip(), list(task.answers)], ensure_ascii=False)
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


def parse_clues(text: str) -> tuple[Clue, ...]:
    """Clues from the recovery model's JSON list; raises ValueError saying what to fix."""
    start, end = text.find("["), text.rfind("]")
    if start == -1 or end <= start:
        raise ValueError("the answer must be a JSON list of clue objects")
    try:
        items = json.loads(text[start:end + 1])
    except ValueError as error:
        raise ValueError(f"the clue list is not valid JSON ({error})") from None
    if not isinstance(items, list) or not items:
        raise ValueError("the clue list is empty")
    clues: list[Clue] = []
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise ValueError(f"clue {number} is not an object")  # bad model output, not a bug
        statement = item.get("text")
        role = item.get("role")
        if not isinstance(statement, str) or not statement.strip():
            raise ValueError(f"clue {number} needs a non-empty \"text\"")
        if role not in ROLES:
            raise ValueError(f"clue {number}: role must be one of {', '.join(ROLES)}")
        urls = item.get("evidence_urls") or []
        aliases = item.get("aliases") or []
        if not all(isinstance(x, str) for x in [*urls, *aliases]):
            raise ValueError(f"clue {number}: evidence_urls and aliases are lists of strings")
        clue_id = str(item.get("id") or f"c{number}")
        if any(clue.id == clue_id for clue in clues):
            clue_id = f"{clue_id}-{number}"
        clues.append(Clue(clue_id, statement.strip(), role, tuple(urls), tuple(aliases)))
    return tuple(clues)


def _clue_record(clue: Clue) -> dict[str, JsonValue]:
    return {"id": clue.id, "text": clue.text, "role": clue.role,
            "evidence_urls": list(clue.evidence_urls), "aliases": list(clue.aliases)}


class ClueRecoverer:
    """Recovers (and caches) the clues of tasks that ship none; see the module docstring."""

    def __init__(self, config: ClueRecoveryConfig, client: ChatClient, toolbox: Toolbox) -> None:
        self.config = config
        self.client = client
        self.toolbox = toolbox
        self.recovered = 0  # LLM recoveries run by this object (cache misses)
        self._cache: dict[str, tuple[Clue, ...]] | None = None
        self._locks: dict[str, asyncio.Lock] = {}

    async def clues(self, task: Task) -> tuple[Clue, ...]:
        """The task's own clues, else the cached recovery, else a new recovery (once per question,
        however many trajectories ask at the same time)."""
        if task.clues is not None:
            return task.clues
        key = clue_key(task)
        cache = self._load_cache()
        if key in cache:
            return cache[key]
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in cache:
                clues = await self.recover(task)
                cache[key] = clues
                self._append(key, task, clues)
        return cache[key]

    async def recover(self, task: Task) -> tuple[Clue, ...]:
        """Run the ReAct loop; raises :class:`ClueRecoveryError` when no valid list comes back."""
        if not task.answers:
            raise ClueRecoveryError(f"task {task.id!r} has no verified answer to work back from")
        self.recovered += 1
        tools = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in self.toolbox.schemas())
        messages = [ChatMessage("system", RECOVERY_PROMPT.format(tools=tools)),
                    ChatMessage("user", f"Question: {task.question}\nVerified answer: "
                                        f"{' / '.join(task.answers)}")]
        for turn in range(self.config.max_turns):
            reply = await self.client.complete(messages)
            messages.append(ChatMessage("assistant", reply))
            parsed = parse_turn(reply, require_think=False)
            if parsed.kind is TurnKind.ANSWER and parsed.answer is not None:
                try:
                    return parse_clues(parsed.answer)
                except ValueError as problem:
                    observation = render_tool_response(f"The clue list could not be used: {problem}.")
            elif parsed.kind is TurnKind.TOOL_CALL and parsed.tool is not None:
                outcome = await self.toolbox.run(parsed.tool, parsed.arguments)
                observation = render_tool_response(clip_text(outcome.text,
                                                          self.config.max_observation_chars))
            else:
                observation = render_correction(parsed.errors, self.toolbox.names)
            if turn == self.config.max_turns - 2:
                observation = f"{observation}\n\n{FINAL_ANSWER_INSTRUCTION} Give the clue list."
            messages.append(ChatMessage("user", observation))
        raise ClueRecoveryError(f"task {task.id!r}: no valid clue list after "
                                f"{self.config.max_turns} turns")

    def _load_cache(self) -> dict[str, tuple[Clue, ...]]:
        if self._cache is None:
            self._cache = {}
            path = Path(self.config.cache_path) if self.config.cache_path else None
            if path is not None and path.is_file():
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        self._cache[record["key"]] = parse_clues(json.dumps(record["clues"]))
                    except (ValueError, KeyError, TypeError) as error:
                        log.warning("%s:%d: skipping a clue cache entry (%s)", path, number, error)
        return self._cache

    def _append(self, key: str, task: Task, clues: tuple[Clue, ...]) -> None:
        if not self.config.cache_path:
            return
        path = Path(self.config.cache_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"key": key, "task_id": task.id, "question": task.question,
                  "clues": [_clue_record(clue) for clue in clues]}
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")



"""A deterministic policy engine for tests and load tests: the synthetic world's expert, or a replay.

It speaks token ids like any engine, so everything around it (episode loop, context managers,
workers, router, store) runs exactly as with a model.

- ``mode="expert"`` (the synthetic world's questions, or with ``scripted.data`` another data set's
  tasks, whose clue chains the expert follows: an oracle for HotpotQA) reads its context like a real
  policy: it decodes the prompt ids of the last
  user message and of the first (the question: its first paragraph) and asks the episode's
  :class:`~turnstile.envs.synthetic.expert.ScriptedExpert` for its next turn, given the last message as the
  observation. Only those two messages are decoded, so a turn costs the same late in a long episode.
  When the last user message is itself a known question (its first paragraph), a new episode starts.
  One expert per episode, keyed by ``affinity`` (or by the question when there is none). The tasks
  of the synthetic world of ``scripted.world_seed`` are built once, to map questions to their plans.
  With ``report=True`` every turn carries a ``<report>`` (the iter_research protocol).
- ``mode="replay"`` replays, per episode, the response ids of a recorded trajectory of the same
  question (JSONL of :mod:`turnstile.rollout.trajectory`), turn after turn; several recordings of one question
  are used in turn.

Log-probs are 0.0 in expert mode (the recorded ones in replay), ``score`` returns zeros, and
``update_weights`` only changes the reported version. Per-episode state lives in this engine (the
router's affinity keeps an episode on one replica); an episode that moves to another replica (its
replica drained or died) has its state rebuilt there from the observations its context holds, as a
model would read them.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence

import torch

from turnstile.envs.protocol import REPORT_CLOSE, REPORT_OPEN, THINK_CLOSE, parse_turn
from turnstile.envs.synthetic.dataset import question_config
from turnstile.envs.synthetic.expert import ExpertConfig, ScriptedExpert
from turnstile.envs.synthetic.questions import generate_tasks
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Probe,
    ProbeUnsupported,
    SamplingParams,
)
from turnstile.rollout.engines.config import EngineConfig, ScriptedEngineConfig
from turnstile.rollout.trajectory import Trajectory, Turn, load_trajectories

MAX_OPEN_EPISODES = 10_000  # episodes abandoned mid-way (timeouts) are forgotten beyond this


def last_user_message(chat: ChatFormat, prompt_ids: Sequence[int]) -> str:
    """The content of the last user message that follows another message in the context.

    Only the tail is decoded (a window doubled until it holds the message's start), so reading a
    turn costs the size of its last observation, not of the whole context.
    """
    marker = chat.turn_end_text + chat.frame("user").prefix
    window = 256
    while True:
        text = chat.decode(prompt_ids[-window:])
        start = text.rfind(marker)
        if start != -1:
            return text[start + len(marker):].split(chat.turn_end_text, 1)[0]
        if window >= len(prompt_ids):
            raise ValueError("the prompt holds no user message after a system message; the scripted "
                             "engine reads contexts built by the episode loop")
        window *= 2


def first_user_message(chat: ChatFormat, prompt_ids: Sequence[int]) -> str:
    """The content of the first user message that follows another message (the question)."""
    marker = chat.turn_end_text + chat.frame("user").prefix
    window = 1024
    while True:
        text = chat.decode(prompt_ids[:window])
        start = text.find(marker)
        if start != -1:
            content = text[start + len(marker):]
            if chat.turn_end_text in content:
                return content.split(chat.turn_end_text, 1)[0]
        if window >= len(prompt_ids):
            raise ValueError("the prompt holds no complete user message after a system message")
        window *= 2


def user_messages(chat: ChatFormat, prompt_ids: Sequence[int]) -> list[str]:
    """Every user message that follows another message, in order (the question, then the
    observations); decodes the whole context, so it is for the rare rebuild, not every turn."""
    marker = chat.turn_end_text + chat.frame("user").prefix
    parts = chat.decode(list(prompt_ids)).split(marker)[1:]
    return [part.split(chat.turn_end_text, 1)[0] for part in parts]


def first_paragraph(text: str) -> str:
    return text.split("\n\n", 1)[0].strip()


class ScriptedEngine:
    """See the module docstring. Build with :meth:`from_config` (or directly, in tests)."""

    def __init__(self, chat: ChatFormat, *, tasks: Sequence[Task] = (),
                 recordings: Sequence[Trajectory] = (), report: bool = False,
                 expert: ExpertConfig | None = None, weights_version: int = 0) -> None:
        if not tasks and not recordings:
            raise ValueError("a scripted engine needs tasks (mode=expert) or recorded trajectories "
                             "(mode=replay)")
        self.chat = chat
        self.report = report
        self.expert_config = expert or ExpertConfig()
        self._tasks = {task.question.strip(): task for task in tasks}
        self._recordings: dict[str, list[list[Turn]]] = defaultdict(list)
        for trajectory in recordings:
            self._recordings[trajectory.question.strip()].append(trajectory.turns)
        self._questions = set(self._tasks) | set(self._recordings)
        self._replays_started: dict[str, int] = defaultdict(int)
        self._episodes: OrderedDict[str, ScriptedExpert | _Replay] = OrderedDict()
        self._version = weights_version

    @classmethod
    def from_config(cls, config: EngineConfig) -> ScriptedEngine:
        from turnstile.rollout.model_store import resolve_model

        chat = ChatFormat.from_pretrained(resolve_model(config.model))
        scripted = config.scripted
        if scripted.mode == "expert":
            return cls(chat, tasks=_expert_tasks(scripted), report=scripted.report,
                       expert=ExpertConfig(hasty_fraction=scripted.hasty_fraction,
                                           early_fraction=scripted.early_fraction))
        if scripted.mode == "replay":
            if not scripted.replay_path:
                raise ValueError("engine.scripted.mode=replay needs engine.scripted.replay_path (a "
                                 "trajectories JSONL file)")
            return cls(chat, recordings=load_trajectories(scripted.replay_path))
        raise ValueError(f"engine.scripted.mode={scripted.mode!r}: use 'expert' or 'replay'")

    @classmethod
    def check_tasks(cls, config: EngineConfig, questions: Sequence[str]) -> None:
        """Refuse, before any actor starts, questions this engine has no script for: the expert
        knows only the synthetic world of ``scripted.world_seed``, a replay only its recordings."""
        scripted = config.scripted
        if scripted.mode == "expert" and scripted.data:
            known = {task.question.strip() for task in _expert_tasks(scripted)}
            what = f"the tasks of engine.scripted.data={dict(scripted.data)}"
        elif scripted.mode == "expert":
            known = {task.question.strip() for task in _expert_tasks(scripted)}
            what = (f"the synthetic world's questions (engine.scripted.world_seed={scripted.world_seed}, "
                    f"engine.scripted.questions={dict(scripted.questions)}: the same as data.options); "
                    f"use rollout data.kind=synthetic, or a model engine (vllm, hf)")
        elif scripted.mode == "replay" and scripted.replay_path:
            known = {t.question.strip() for t in load_trajectories(scripted.replay_path)}
            what = f"the questions recorded in {scripted.replay_path}"
        else:
            return  # from_config says what is wrong with the mode
        unknown = [q for q in questions if first_paragraph(q) not in known and q.strip() not in known]
        if unknown:
            raise ValueError(f"engine.kind=scripted (mode={scripted.mode}) cannot answer {len(unknown)} of "
                             f"{len(questions)} tasks (first: {unknown[0][:80]!r}): it answers only {what}")

    # ---- PolicyEngine ------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        key, episode, observation = self._episode(prompt_ids, affinity)
        if isinstance(episode, _Replay):
            ids, logprobs, finish = episode.next_turn()
        else:
            ids = self._expert_turn(episode, observation)
            logprobs, finish = [0.0] * len(ids), FINISH_STOP
        if episode.finished:
            del self._episodes[key]
        return self._limit(ids, logprobs, finish, sampling)

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        if len(sequences) != len(spans):
            raise ValueError(f"score got {len(sequences)} sequences but {len(spans)} spans")
        for sequence, (start, end) in zip(sequences, spans, strict=True):
            if not 0 <= start <= end <= len(sequence):
                raise ValueError(f"span ({start}, {end}) is outside a sequence of {len(sequence)} ids")
        return [[0.0] * (end - start) for start, end in spans]

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        raise ProbeUnsupported(
            "the scripted engine follows a script and has no model whose belief in the gold answer "
            "could be measured: score information gain after the fact (information_gain options "
            "scorer=kv_cache with the model that should score it), or roll out on engine.kind=vllm or hf")

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self._version = version

    async def weights_version(self) -> int:
        return self._version

    async def aclose(self) -> None:
        self._episodes.clear()

    # ---- turns -------------------------------------------------------------------------------

    def _episode(self, prompt_ids: Sequence[int],
                 affinity: str | None) -> tuple[str, ScriptedExpert | _Replay, str | None]:
        """The episode a context belongs to (its key, its state) and its last observation (None
        on a first turn, which starts the episode)."""
        last = last_user_message(self.chat, prompt_ids)
        if first_paragraph(last) in self._questions:  # the context ends with the question
            question = first_paragraph(last)
            key = affinity if affinity is not None else question
            self._episodes.pop(key, None)
            episode = self._episodes[key] = self._start(question)
            while len(self._episodes) > MAX_OPEN_EPISODES:
                self._episodes.popitem(last=False)
            return key, episode, None
        question = first_paragraph(first_user_message(self.chat, prompt_ids))
        key = affinity if affinity is not None else question
        known = self._episodes.get(key)
        if known is None:  # its earlier turns ran on another replica: rebuild it from the context
            known = self._episodes[key] = self._rebuilt(question, prompt_ids)
        return key, known, last

    def _rebuilt(self, question: str, prompt_ids: Sequence[int]) -> ScriptedExpert | _Replay:
        """The episode's state after the turns its context holds, as a model would read them: its
        observations replayed in order (exact for the mono context, which keeps them all)."""
        episode = self._start(question)  # raises for an unknown question
        observations = user_messages(self.chat, prompt_ids)[1:-1]
        if isinstance(episode, _Replay):
            episode.cursor = min(len(observations) + 1, len(episode.turns))
            return episode
        for observation in [None, *observations]:
            if episode.finished:
                break
            episode.next_turn(observation)
        return episode

    def _start(self, question: str) -> ScriptedExpert | _Replay:
        if self._tasks:
            task = self._tasks.get(question)
            if task is None:
                raise ValueError(f"question {question[:80]!r} is not one of the synthetic world's "
                                 f"{len(self._tasks)} tasks; check engine.scripted.world_seed")
            return ScriptedExpert(task, self.expert_config)
        recorded = self._recordings.get(question)
        if not recorded:
            raise ValueError(f"no recorded trajectory has the question {question[:80]!r}")
        started = self._replays_started[question]
        self._replays_started[question] += 1
        return _Replay(recorded[started % len(recorded)])

    def _expert_turn(self, expert: ScriptedExpert, observation: str | None) -> list[int]:
        text = expert.next_turn(observation)
        if self.report:
            think = parse_turn(text).think
            report = f"{expert.tool_calls} tool calls so far. {think}"
            text = text.replace(THINK_CLOSE, f"{THINK_CLOSE}\n{REPORT_OPEN}\n{report}\n{REPORT_CLOSE}", 1)
        return [*self.chat.encode(text), self.chat.turn_end_id]

    def _limit(self, ids: list[int], logprobs: list[float], finish: str,
               sampling: SamplingParams) -> Generation:
        """Cut a scripted turn as sampling would: at the first stop token, or at max_new_tokens."""
        stops = set(sampling.stop_token_ids)
        for position, token_id in enumerate(ids[: sampling.max_new_tokens]):
            if token_id in stops:
                end = position + 1
                return Generation(tuple(ids[:end]), tuple(logprobs[:end]), FINISH_STOP, self._version)
        if len(ids) > sampling.max_new_tokens:
            end = sampling.max_new_tokens
            return Generation(tuple(ids[:end]), tuple(logprobs[:end]), FINISH_LENGTH, self._version)
        return Generation(tuple(ids), tuple(logprobs), finish, self._version)


class _Replay:
    """One episode replaying a recorded trajectory's turns in order."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = turns
        self.cursor = 0

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.turns)

    def next_turn(self) -> tuple[list[int], list[float], str]:
        if self.finished:
            raise RuntimeError(f"the recorded trajectory has only {len(self.turns)} turns; the "
                               "replayed episode asked for more")
        turn = self.turns[self.cursor]
        self.cursor += 1
        return list(turn.response_ids), list(turn.response_logprobs), turn.finish_reason


def _expert_tasks(scripted: ScriptedEngineConfig) -> list[Task]:
    """The tasks the expert knows: ``scripted.data``'s (every split: the rollout picks), else the
    synthetic world's questions with the synthetic data set's options."""
    if scripted.data:
        from turnstile.envs.datasets.registry import DatasetConfig, load_tasks

        # Every split (the rollout picks its tasks); the expert finds a clue's page by the last part of
        # its address, so the corpus server's address is not needed here.
        data = DatasetConfig(**{**scripted.data, "split": "all", "shards": 1, "shard": 0, "limit": None,
                                "url_prefix": scripted.data.get("url_prefix") or "http://corpus/wiki/"})
        return load_tasks(data)
    world = generate_world(WorldConfig(seed=scripted.world_seed, entities=scripted.world_entities))
    return generate_tasks(world, question_config(dict(scripted.questions)))

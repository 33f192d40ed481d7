"""A user's own plugins, in a module of their own: each is named in config by import path
(``tests.user_plugins:Name``), registered nowhere (``tests/test_plugins.py``,
``tests/test_env_conformance.py``)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from turnstile.cluster.fleet.autoscale import FleetView, Want
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.env import Env, EnvConfig, Message, StepInfo, StepResult
from turnstile.envs.plugins import typed_options
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, StopReason, TurnKind, parse_turn
from turnstile.envs.search.base import SearchHit
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.learner.credit.records import Group, TurnCredit
from turnstile.learner.credit.registry import CreditResult, Estimator
from turnstile.rewards.base import RewardPlugin
from turnstile.rollout.engines.base import FINISH_STOP, Generation, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.scripted import ScriptedEngine, last_user_message
from turnstile.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    import torch


@dataclass
class ConstantOptions:
    value: float = 1.0


class Constant(Estimator):
    """Every turn gets the same advantage."""

    name = "constant"
    Options = ConstantOptions

    def __init__(self, options: ConstantOptions) -> None:
        self.options = options

    def assign(self, batch: Sequence[Group]) -> CreditResult:
        return CreditResult(groups=[[[TurnCredit(advantage=self.options.value, reward=None) for _ in t.turns]
                                     for t in group.trajectories] for group in batch])


@dataclass
class LengthOptions:
    per_char: float = 0.01


class AnswerLength(RewardPlugin):
    """The outcome is the answer's length times ``per_char``."""

    Options: ClassVar[type] = LengthOptions
    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome"})

    def __init__(self, options: LengthOptions) -> None:
        self.options = options

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        trajectory.outcome = len(trajectory.answer or "") * self.options.per_char


class OldStyle(AnswerLength):
    """A plugin written before issue 38, its options class under the old name."""

    config_type: ClassVar[type] = LengthOptions


def three_questions(cfg: DatasetConfig) -> list[Task]:
    return [Task(id=f"{cfg.path}{i}", question=f"question {i}?", answers=(str(i),)) for i in range(3)]


@dataclass
class NullEngineOptions:
    version: int = 0


class NullEngine:
    """Builds from a config and remembers which; its own options come from ``engine.options``.
    Published weights reach it through a checkpoint directory (``weight_sync``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.options = typed_options(NullEngineOptions, config.options, "engine 'NullEngine'")

    @classmethod
    def weight_sync(cls, config: EngineConfig) -> tuple[str, str]:
        return "checkpoint", f"/shared/{config.model}"

    @classmethod
    def from_config(cls, config: EngineConfig) -> NullEngine:
        return cls(config)


class GuessEnv(Env):
    """Guess the task's number: a tool call ``{"name": "guess", "arguments": {"n": 7}}`` is answered
    higher, lower or right; the episode ends with ``<answer>``. Written on the bare :class:`Env`
    contract (not on ``ProtocolEnv``), to show the contract is all the episode loop needs."""

    def __init__(self, task: Task, toolbox: Toolbox, config: EnvConfig) -> None:
        self.task, self.config = task, config
        self.turn, self.final_next, self.started, self.done = 0, False, False, False

    async def reset(self) -> list[Message]:
        if self.started:
            raise RuntimeError("reset() twice")
        self.started = True
        return [{"role": "system", "content": "Guess the number with the guess tool, then answer."},
                {"role": "user", "content": self.task.question}]

    async def step(self, action: str) -> StepResult:
        if not self.started or self.done:
            raise RuntimeError("step() before reset() or after the end")
        turn, parsed = self.turn, parse_turn(action)
        self.turn += 1
        if parsed.kind is TurnKind.ANSWER or self.final_next or self.turn >= self.config.max_turns:
            self.done = True
            end = StopReason.ANSWERED if parsed.kind is TurnKind.ANSWER and parsed.format_ok else StopReason.NO_ANSWER
            return StepResult("", True, StepInfo(turn, parsed, end=end))
        guess = parsed.arguments.get("n") if parsed.kind is TurnKind.TOOL_CALL else None
        if not isinstance(guess, int):
            return StepResult("Call guess with an integer n, or answer.", False, StepInfo(turn, parsed))
        target = int(self.task.answers[0])
        text = "right" if guess == target else ("higher" if guess < target else "lower")
        if self.turn == self.config.max_turns - 1:
            self.final_next = True
            return StepResult(FINAL_ANSWER_INSTRUCTION, False, StepInfo(turn, parsed, tool="guess", tool_ok=True,
                                                                        forced_final=True))
        return StepResult(text, False, StepInfo(turn, parsed, tool="guess", tool_ok=True))

    def force_final_answer(self) -> str:
        self.final_next = True
        return FINAL_ANSWER_INSTRUCTION

    def snapshot(self) -> dict[str, object]:
        return {"turn": self.turn, "final_next": self.final_next}

    def restore(self, state: dict[str, object]) -> None:
        if self.turn:
            raise RuntimeError("restore() goes right after reset()")
        if not isinstance(state.get("turn"), int):
            raise ValueError(f"not a guess snapshot: {state!r}")
        self.turn, self.final_next = int(state["turn"]), bool(state.get("final_next"))  # type: ignore[arg-type]

    async def close(self) -> None:
        self.done = True


class CalculatorExpert(ScriptedEngine):
    """A scripted policy for the calculator environment: the first turn calls ``calculate`` on the
    question's expression, the second answers with the result, off by one in sample 1 of every group
    (so that a group has a right and a wrong answer to learn from)."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> CalculatorExpert:
        engine = super().from_config(config)
        engine.__class__ = cls
        return engine  # type: ignore[return-value]

    @classmethod
    def check_tasks(cls, config: EngineConfig, questions: Sequence[str]) -> None:
        return None  # any arithmetic question

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        last = last_user_message(self.chat, prompt_ids)
        asked = re.match(r"What is (.+)\?", last)
        result = re.search(r"= (-?[0-9.]+)", last)
        if asked:
            call = json.dumps({"name": "calculate", "arguments": {"expression": asked.group(1)}})
            text = f"<think>\nlet me compute it\n</think>\n<tool_call>\n{call}\n</tool_call>"
        else:
            value = int(float(result.group(1))) if result else 0
            value += 1 if affinity is not None and affinity.endswith("/1") else 0
            text = f"<think>\nthe calculator says so\n</think>\n<answer>{value}</answer>"
        ids = [*self.chat.encode(text), self.chat.turn_end_id]
        return self._limit(ids, [0.0] * len(ids), FINISH_STOP, sampling)


@dataclass
class PolicyScoreOptions:
    model: str = ""
    versions_dir: str = ""


class PolicyScore(RewardPlugin):
    """A reward that scores with the policy's own weights (as information gain does): the driver
    hands it the run's weights archive."""

    Options: ClassVar[type] = PolicyScoreOptions
    writes: ClassVar[frozenset[str]] = frozenset({"trajectory.outcome"})
    scores_with_policy: ClassVar[bool] = True

    def __init__(self, options: PolicyScoreOptions) -> None:
        self.options = options

    async def score(self, trajectory: Trajectory, task: Task) -> None:
        trajectory.outcome = 0.0


class OnePageSearch:
    """A search backend that always finds the same page."""

    async def search(self, query: str, top_k: int) -> list[SearchHit]:
        return [SearchHit(title="The page", url="http://127.0.0.1:9/page", snippet=f"about {query}")][:top_k]

    async def aclose(self) -> None:
        return None


def one_page_search(config: object) -> OnePageSearch:  # a search backend factory
    return OnePageSearch()


@dataclass
class GrowThenShrinkOptions:
    more_episodes: int = 6  # finished at the larger size before it shrinks


class GrowThenShrink:
    """A user's scale policy: two replicas and two workers from the start; once both serve, one
    each again after ``more_episodes`` more episodes. Unlike a plan keyed to episodes alone, it
    cannot shrink before the larger fleet is up, however slowly actors start."""

    Options = GrowThenShrinkOptions

    def __init__(self, options: GrowThenShrinkOptions) -> None:
        self.options = options
        self.grown_at: int | None = None

    def decide(self, view: FleetView) -> Want:
        if self.grown_at is None and view.engines == 2 and view.workers == 2:
            self.grown_at = view.finished
        if self.grown_at is not None and view.finished >= self.grown_at + self.options.more_episodes:
            return Want(1, 1, f"{self.options.more_episodes} episodes done at the larger size")
        return Want(2, 2, "grow first")


@dataclass
class StuckUpdateOptions:
    hang: list[int] = field(default_factory=list)  # the replicas (engine-<id>) whose update never returns
    fail: list[int] = field(default_factory=list)  # the replicas whose update raises


class StuckUpdateExpert(ScriptedEngine):
    """The scripted expert, except that the weight update of the replicas ``engine.options`` names
    never returns (``hang``) or raises (``fail``): the weight-sync watchdog's drill."""

    stuck: StuckUpdateOptions

    @classmethod
    def from_config(cls, config: EngineConfig) -> StuckUpdateExpert:
        engine = super().from_config(replace(config, options={}))
        engine.__class__ = cls
        engine.stuck = typed_options(StuckUpdateOptions, config.options, "engine 'StuckUpdateExpert'")  # type: ignore[attr-defined]
        return engine  # type: ignore[return-value]

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        import ray

        name = ray.get_runtime_context().get_actor_name() or ""
        if any(name.endswith(f"-engine-{replica}") for replica in self.stuck.hang):
            await asyncio.sleep(3600)
        if any(name.endswith(f"-engine-{replica}") for replica in self.stuck.fail):
            raise RuntimeError("the new weights could not be loaded (the test engine's drill)")
        await super().update_weights(version, weights)

"""The episode loop: one task, one policy, up to ``max_turns`` turns, token ids in and out.

Each turn the loop sends the current context ids to the policy engine, decodes the generated ids only
to let the environment parse and run the action, and records the ids exactly as generated. What
follows the turn is decided by the context manager (append the observation's delta ids, or start a
new segment), within the context budget: when the next context would leave no room for a full turn
(plus the forced-answer instruction), the manager may offer a reset (``discard_all``); otherwise the
environment is told to make the next turn the last and the observation becomes the instruction to
answer now (docs/algorithms.md §1).

Per-turn cost does not grow with the episode: the context is one list extended in place, its length
is a running count, and only new text (observation, one response) is ever tokenised or decoded.

``run_episode`` never raises once the episode runs (only a ``resume`` state of another episode is
refused up front): not on what the policy writes, an engine failure, or a bug anywhere below it.
Every way an episode ends is a :class:`~turnstile.rollout.trajectory.StopReason` (``error`` with
``metadata["error"]`` for the unexpected), and the trajectory keeps the turns done so far.

Checkpoints (:class:`Checkpointing`): every ``every`` turns the loop hands an :class:`EpisodeState`
(the trajectory so far, the environment's and the context manager's state) to ``save``; an episode
given such a state as ``resume`` continues after its last turn instead of starting again, on
whichever worker and engine replica it lands (the context ids are rebuilt from the recorded ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import cast

from turnstile.envs.env import Env, EnvConfig, StepResult, build_env
from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, TurnKind, without_surrogates
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import (
    Append,
    ContextManager,
    ContextPlan,
    Exchange,
    planned_length,
)
from turnstile.rollout.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    Generation,
    PolicyEngine,
    SamplingParams,
)
from turnstile.rollout.errors import describe_error
from turnstile.rollout.faults import VERDICT_KEY, FaultConfig, environment_verdict
from turnstile.rollout.probes import IgProbeConfig, IgProbes
from turnstile.rollout.store.base import StoreDataLostError
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, TrajectoryError, Turn

log = logging.getLogger(__name__)


@dataclass
class SamplingConfig:
    """How each turn is sampled (stop tokens come from the chat template)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None  # when set, each turn gets a seed derived from it, the episode and turn


@dataclass
class EpisodeConfig:
    """Limits of one episode. ``env.max_turns`` (default 200) counts assistant turns, the answer
    included; ``env.expect_report`` is set from the context manager."""

    max_new_tokens: int = 2048  # per turn
    context_budget: int = 32768  # tokens of one segment's context: prompt + responses + observations
    timeout_s: float = 3600.0  # wall clock of the whole episode, tool calls included
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)  # when the environment decided the result
    ig_probe: IgProbeConfig = field(default_factory=IgProbeConfig)  # information gain measured on the engine

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.context_budget <= self.max_new_tokens:
            raise ValueError(f"context_budget={self.context_budget} must exceed max_new_tokens="
                             f"{self.max_new_tokens}: raise the budget")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")

    @property
    def max_turns(self) -> int:
        return self.env.max_turns


@dataclass
class EpisodeState:
    """A running episode, as a checkpoint: the trajectory so far (ending after a whole turn and its
    observation), the environment's and the context manager's ``snapshot()``, and whether the
    context budget already forced the final answer."""

    trajectory: Trajectory
    env: dict[str, object]
    context: dict[str, object]
    overflowed: bool = False

    def to_json(self) -> JsonObject:
        # Both snapshots are JSON by the Env and ContextManager contracts, typed as plain dicts.
        return {"trajectory": self.trajectory.to_json(), "env": cast("JsonObject", self.env),
                "context": cast("JsonObject", self.context), "overflowed": self.overflowed}

    @classmethod
    def from_json(cls, record: object) -> EpisodeState:
        """Parse a saved state; raises ValueError naming what is wrong (a corrupt checkpoint)."""
        if not isinstance(record, dict) or not {"trajectory", "env", "context"} <= set(record):
            raise ValueError("an episode checkpoint is an object with trajectory, env and context")
        try:
            trajectory = Trajectory.from_json(record["trajectory"])
        except TrajectoryError as error:
            raise ValueError(f"the checkpoint's trajectory is malformed: {error}") from None
        if not trajectory.segments or not isinstance(record["env"], dict) \
                or not isinstance(record["context"], dict):
            raise ValueError("the checkpoint has no segment, or its env/context state is not an object")
        return cls(trajectory, dict(record["env"]), dict(record["context"]),
                   bool(record.get("overflowed", False)))

    def check_for(self, task: Task, uid: str, sample: int) -> None:
        """Raise ValueError unless this state is of episode ``uid``/``sample`` of ``task``."""
        saved = self.trajectory
        if (saved.uid, saved.sample, saved.task_id) != (uid, sample, task.id):
            raise ValueError(f"the checkpoint is of episode {saved.uid}/{saved.sample} (task "
                             f"{saved.task_id}), not {uid}/{sample} (task {task.id})")


@dataclass
class Checkpointing:
    """Episode checkpoints. ``save`` is awaited with the state every ``every`` turns (a failing
    save is logged and counted in the trajectory's ``metadata["checkpoint_failures"]``; it never
    ends the episode). ``resume``: a state saved earlier for this episode, to continue from."""

    save: Callable[[EpisodeState], Awaitable[None]] | None = None
    every: int = 0
    resume: EpisodeState | None = None


async def run_episode(task: Task, uid: str, sample: int, engine: PolicyEngine, toolbox: Toolbox,
                      chat: ChatFormat, context_manager: ContextManager, config: EpisodeConfig,
                      affinity: str | None = None, checkpointing: Checkpointing | None = None) -> Trajectory:
    """Run one episode of ``task`` and return its trajectory (see the module docstring).

    ``context_manager`` is a fresh instance for this episode (``build_context_manager``).
    ``affinity`` (default ``"{uid}/{sample}"``) goes with every engine request so that a router
    keeps the episode on one replica, whose prefix cache holds its context. ``checkpointing``
    saves the episode every few turns and/or resumes it from a saved state.
    """
    trajectory = Trajectory(uid=uid, sample=sample, task_id=task.id, question=task.question,
                            answers=list(task.answers), context_manager=context_manager.name,
                            policy=chat.name)
    if checkpointing is not None and checkpointing.resume is not None:
        checkpointing.resume.check_for(task, uid, sample)  # the caller's mistake: raises ValueError
    started = time.monotonic()
    env: Env | None = None
    episode: _Episode | None = None
    deadline = asyncio.timeout(config.timeout_s)
    affinity = affinity if affinity is not None else f"{uid}/{sample}"
    probes = IgProbes(engine, chat, trajectory.answers[0] if trajectory.answers else "", affinity,
                      config.ig_probe) if config.ig_probe.enabled else None
    try:
        try:
            env = build_env(task, toolbox, replace(config.env, expect_report=context_manager.expect_report))
            episode = _Episode(trajectory, engine, chat, context_manager, config, affinity, checkpointing, probes)
            async with deadline:
                await episode.run(env)
        except TimeoutError as error:
            if deadline.expired():
                trajectory.stop_reason = StopReason.TIMEOUT
            else:
                _record_error(trajectory, error)
        except StoreDataLostError:
            raise  # the store lost the run's data: the driver stops the run
        except Exception as error:  # noqa: BLE001 - whatever else went wrong, it ends this episode only
            _record_error(trajectory, error)
        finally:
            if env is not None:
                await env.close()
            trajectory.wall_s = episode.wall_s() if episode is not None else time.monotonic() - started
        if probes is not None:
            await probes.finish(trajectory)
    finally:
        if probes is not None:
            probes.cancel()  # what is still running if the episode never reached finish()
    verdict = environment_verdict(trajectory, config.faults)
    if verdict is not None:
        trajectory.metadata[VERDICT_KEY] = verdict
    return trajectory


def _record_error(trajectory: Trajectory, error: Exception) -> None:
    """End the episode as ``error``, keeping its turns and saying what failed."""
    log.error("episode %s/%d failed after %d turns: %s", trajectory.uid, trajectory.sample,
              len(trajectory.turns), describe_error(error), exc_info=error)
    trajectory.stop_reason = StopReason.ERROR
    trajectory.metadata["error"] = describe_error(error)


class _Episode:
    """The state of one running episode: the trajectory so far and the current context ids."""

    def __init__(self, trajectory: Trajectory, engine: PolicyEngine, chat: ChatFormat,
                 context: ContextManager, config: EpisodeConfig, affinity: str,
                 checkpointing: Checkpointing | None = None, probes: IgProbes | None = None) -> None:
        self.trajectory = trajectory
        self.engine = engine
        self.chat = chat
        self.context = context
        self.config = config
        self.affinity = affinity
        self.ids: list[int] = []  # the current segment's context, extended in place
        self.turns = 0
        self.overflowed = False  # the final answer was forced by the context budget
        self._generate_s = 0.0
        self.checkpointing = checkpointing or Checkpointing()
        self.probes = probes  # information gain measured on the engine, a probe per boundary
        self.wall_before = 0.0  # wall time spent before the checkpoint this episode resumed from
        self._started = time.monotonic()
        # Room kept free in every context for the forced-answer instruction.
        self.reserve = len(chat.delta_ids(FINAL_ANSWER_INSTRUCTION, ()))

    def wall_s(self) -> float:
        """Wall time of the episode so far, including what it ran before a resume."""
        return self.wall_before + time.monotonic() - self._started

    async def run(self, env: Env) -> None:
        prompt_ids = self.context.start(self.chat, await env.reset())
        if self.checkpointing.resume is not None:
            self._restore(env, self.checkpointing.resume)
            if self.probes is not None:
                await self.probes.issue_missing(self.trajectory)
        else:
            self._open_segment(prompt_ids)
        for _ in range(self.config.max_turns - self.turns):
            room = self.config.context_budget - len(self.ids)
            if room <= 0:
                self.trajectory.stop_reason = StopReason.CONTEXT_OVERFLOW
                return
            generation = await self._generate(min(self.config.max_new_tokens, room))
            if generation is None:
                return
            if self.probes is not None:  # the context was just prefilled: the probe finds it cached
                await self.probes.issue(self.turns, self.ids)
            text = without_surrogates(self.chat.response_text(generation.token_ids))
            step = await env.step(text)
            turn = self._record(generation, text, step)
            if step.done:
                self._finish(step, generation)
                return
            self._continue(env, turn, Exchange(generation.token_ids, text, step.info.parsed,
                                               step.observation))
            await self._checkpoint(env)
        raise RuntimeError(f"the environment did not end the episode within {self.config.max_turns} "
                           "turns; it must force the final answer on its last turn")

    def _restore(self, env: Env, state: EpisodeState) -> None:
        saved = state.trajectory
        env.restore(state.env)
        self.context.restore(state.context)
        self.trajectory.segments = saved.segments
        self.trajectory.metadata.update(saved.metadata)
        self.trajectory.metadata["resumed_at_turn"] = len(saved.turns)
        self.turns = len(saved.turns)
        self.overflowed = state.overflowed
        self.wall_before = saved.wall_s
        last = saved.segments[-1]
        self.ids = list(last.prompt_ids)
        for turn in last.turns:
            self.ids.extend(turn.response_ids)
            self.ids.extend(turn.observation_ids)

    async def _checkpoint(self, env: Env) -> None:
        save, every = self.checkpointing.save, self.checkpointing.every
        if save is None or every < 1 or self.turns % every:
            return
        self.trajectory.wall_s = self.wall_s()
        if self.probes is not None:
            self.probes.record(self.trajectory)  # the values measured so far travel with the checkpoint
        state = EpisodeState(self.trajectory, env.snapshot(), self.context.snapshot(), self.overflowed)
        try:
            await save(state)
        except StoreDataLostError:
            raise  # not this episode's problem: the whole run stops
        except Exception as error:  # noqa: BLE001 - a lost checkpoint costs a restart, not the episode
            failures = self.trajectory.metadata.get("checkpoint_failures", 0)
            self.trajectory.metadata["checkpoint_failures"] = int(failures) + 1  # type: ignore[arg-type]
            log.warning("episode %s: checkpoint after turn %d failed: %s: %s", self.affinity,
                        self.turns, type(error).__name__, error)

    async def _generate(self, max_new_tokens: int) -> Generation | None:
        """One turn from the engine; None (and the episode stopped) when the engine failed."""
        sampling = self.config.sampling
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k,
                                stop_token_ids=self.chat.stop_token_ids, seed=self._seed())
        started = time.monotonic()
        try:
            generation = await self.engine.generate(self.ids, params, affinity=self.affinity)
        except Exception as error:  # noqa: BLE001 - any engine failure ends this episode only
            self._fail(f"the engine failed on turn {self.turns}: {describe_error(error)}")
            return None
        if generation.finish_reason == FINISH_ABORT:
            self._fail(f"the engine aborted turn {self.turns}")
            return None
        self._generate_s = time.monotonic() - started
        return generation

    def _seed(self) -> int | None:
        seed = self.config.sampling.seed
        if seed is None:
            return None
        return zlib.crc32(f"{seed}/{self.affinity}/{self.turns}".encode())

    def _record(self, generation: Generation, text: str, step: StepResult) -> Turn:
        info, parsed = step.info, step.info.parsed
        turn = Turn(
            index=self.turns, response_ids=list(generation.token_ids),
            response_logprobs=list(generation.logprobs), weights_version=generation.weights_version,
            context_len=len(self.ids), finish_reason=generation.finish_reason, response_text=text,
            action=parsed.kind.value, tool=info.tool or parsed.tool,
            arguments=dict(parsed.arguments) if parsed.kind is TurnKind.TOOL_CALL else None,
            format_ok=parsed.format_ok, format_errors=list(parsed.errors), answer=parsed.answer,
            observation_text=step.observation, forced_final=info.forced_final, tool_ok=info.tool_ok,
            tool_error=info.tool_error, tool_fault=None if info.fault is None else info.fault.value,
            tool_cached=info.tool_cached,
            generate_s=self._generate_s, tool_s=info.tool_seconds,
        )
        self.trajectory.segments[-1].turns.append(turn)
        self.ids.extend(generation.token_ids)
        self.turns += 1
        return turn

    def _continue(self, env: Env, turn: Turn, exchange: Exchange) -> None:
        """Put the observation into the context (or a new one), forcing the answer on overflow."""
        plan = self.context.next_context(exchange)
        if not self._fits(plan):
            reset = self.context.on_overflow(exchange)
            if reset is not None and self._fits(reset):
                plan = reset
            else:
                instruction = env.force_final_answer()
                self.overflowed = True
                turn.observation_text, turn.forced_final = instruction, True
                plan = self.context.next_context(replace(exchange, observation=instruction))
        if isinstance(plan, Append):
            turn.observation_ids = plan.ids
            self.ids.extend(plan.ids)
        else:
            self._open_segment(plan.prompt_ids)

    def _fits(self, plan: ContextPlan) -> bool:
        needed = planned_length(plan, len(self.ids)) + self.config.max_new_tokens + self.reserve
        return needed <= self.config.context_budget

    def _open_segment(self, prompt_ids: list[int]) -> None:
        self.trajectory.segments.append(Segment(prompt_ids=prompt_ids))
        self.ids = list(prompt_ids)

    def _finish(self, step: StepResult, generation: Generation) -> None:
        end = step.info.end
        self.trajectory.answer = step.info.answer
        reason: StopReason
        if end is StopReason.ANSWERED or end is StopReason.STALLED:
            reason = end
        elif generation.finish_reason == FINISH_LENGTH:
            reason = StopReason.MAX_TOKENS  # the last turn was cut before it could answer
        elif end is StopReason.MALFORMED_ANSWER:
            reason = StopReason.MALFORMED_ANSWER
        elif self.overflowed:
            reason = StopReason.CONTEXT_OVERFLOW
        else:
            reason = StopReason.NO_ANSWER
        self.trajectory.stop_reason = reason

    def _fail(self, message: str) -> None:
        self.trajectory.stop_reason = StopReason.ENGINE_ERROR
        self.trajectory.metadata["error"] = message

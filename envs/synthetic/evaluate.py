"""The end-to-end check of the synthetic world: the scripted expert through the real HTTP path.

For each question an episode runs exactly as a policy's would: :class:`~turnstile.envs.env.SearchBrowseEnv`
parses the expert's turns, the toolbox runs ``search`` over a BM25 index of the world and ``visit``
fetches pages from the loopback :class:`~turnstile.envs.corpus_server.CorpusServer` (Chromium for the
JavaScript-only pages), and the expert reads the observations. The report says how many answers are
right and how many tool calls each question took; the acceptance target is at least 95% correct over
200 questions with at least 20 questions of 100+ tool calls.

Run it with ``turnstile expert --questions 200 --seed 0 --concurrency 8``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from turnstile.envs.answers import answer_matches
from turnstile.envs.corpus_server import CorpusServer, CorpusServerConfig
from turnstile.envs.env import EnvConfig, SearchBrowseEnv
from turnstile.envs.synthetic.expert import ExpertConfig, ScriptedExpert
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.toolbox import Toolbox
from turnstile.envs.toolset import ToolsConfig, build_toolbox

LONG_RUN_CALLS = 100


@dataclass
class EvaluationConfig:
    """What the expert is evaluated on, and with which tools and episode limits."""

    world: WorldConfig = field(default_factory=WorldConfig)
    questions: QuestionConfig = field(default_factory=QuestionConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    concurrency: int = 8


@dataclass(frozen=True)
class QuestionResult:
    task_id: str
    kind: str  # "chain" | "aggregate"
    question: str
    answer: str | None
    gold: tuple[str, ...]
    correct: bool
    tool_calls: int
    seconds: float


@dataclass
class ExpertReport:
    results: list[QuestionResult]
    wall_seconds: float

    @property
    def accuracy(self) -> float:
        return sum(r.correct for r in self.results) / len(self.results) if self.results else 0.0

    @property
    def long_runs(self) -> int:
        """Questions that took at least 100 tool calls."""
        return sum(r.tool_calls >= LONG_RUN_CALLS for r in self.results)

    @property
    def tool_calls(self) -> list[int]:
        return [r.tool_calls for r in self.results]

    def summary(self) -> str:
        calls = sorted(self.tool_calls) or [0]
        lines = [
            f"questions: {len(self.results)}  correct: {sum(r.correct for r in self.results)}  "
            f"accuracy: {self.accuracy:.1%}",
            f"tool calls per question: min {calls[0]}  median {calls[len(calls) // 2]}  "
            f"mean {sum(calls) / len(calls):.1f}  max {calls[-1]}  total {sum(calls)}",
            f"questions with >= {LONG_RUN_CALLS} tool calls: {self.long_runs}",
        ]
        for kind in sorted({r.kind for r in self.results}):
            group = [r for r in self.results if r.kind == kind]
            lines.append(f"  {kind}: {len(group)} questions, "
                         f"{sum(r.correct for r in group) / len(group):.1%} correct, "
                         f"mean {sum(r.tool_calls for r in group) / len(group):.1f} tool calls")
        lines.append(f"wall time: {self.wall_seconds:.1f} s")
        wrong = [r for r in self.results if not r.correct][:10]
        lines += [f"  wrong: {r.task_id}: {r.answer!r} (gold {r.gold[0]!r}) — {r.question}"
                  for r in wrong]
        return "\n".join(lines)


async def run_expert_episode(task: Task, toolbox: Toolbox, env_config: EnvConfig,
                             expert_config: ExpertConfig | None = None) -> QuestionResult:
    """One episode of the scripted expert (with ``expert_config``) on ``task`` through ``SearchBrowseEnv``."""
    started = time.monotonic()
    env = SearchBrowseEnv(task, toolbox, env_config)
    expert = ScriptedExpert(task, expert_config)
    tool_calls, answer = 0, None
    try:
        await env.reset()
        observation: str | None = None
        while True:
            step = await env.step(expert.next_turn(observation))
            tool_calls += step.info.tool is not None
            if step.done:
                answer = step.info.answer
                break
            observation = step.observation
    finally:
        await env.close()
    kind = str(task.metadata.get("kind", ""))
    return QuestionResult(task.id, kind, task.question, answer, task.answers,
                          answer_matches(answer, task.answers), tool_calls,
                          time.monotonic() - started)


async def evaluate_expert(n_questions: int = 200, seed: int = 0, concurrency: int = 8, *,
                          config: EvaluationConfig | None = None,
                          on_result: Callable[[QuestionResult], None] | None = None) -> ExpertReport:
    """Serve the world of ``seed``, run the expert on ``n_questions`` of its questions concurrently.

    ``config`` overrides the world, question mix, tools and episode limits (its ``world.seed``,
    ``questions.count`` and ``concurrency`` are replaced by the arguments). ``on_result`` is called
    as each question finishes (a progress bar).
    """
    cfg = config or EvaluationConfig()
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    world = generate_world(replace(cfg.world, seed=seed))
    started = time.monotonic()
    with CorpusServer(world_documents(world), CorpusServerConfig(port=0)) as server:
        tasks = generate_tasks(world, replace(cfg.questions, count=n_questions), server.base_url)
        toolbox = build_toolbox(cfg.tools, server.documents(),
                                allow_hosts=[urlsplit(server.base_url).netloc])
        limit = asyncio.Semaphore(concurrency)

        async def one(task: Task) -> QuestionResult:
            async with limit:
                result = await run_expert_episode(task, toolbox, cfg.env)
            if on_result is not None:
                on_result(result)
            return result

        try:
            results = await asyncio.gather(*(one(task) for task in tasks))
        finally:
            await toolbox.aclose()
    return ExpertReport(list(results), time.monotonic() - started)

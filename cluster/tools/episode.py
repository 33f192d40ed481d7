"""One episode of the scripted expert on the embedded default, every turn printed (``turnstile
episode``, see :mod:`turnstile.cluster.cli.commands.episode`): the synthetic world served over loopback HTTP (in
process, or a running ``turnstile serve-corpus``), the real tools, :class:`~turnstile.envs.env.SearchBrowseEnv`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import httpx

from turnstile.envs.answers import answer_matches
from turnstile.envs.corpus_server import CorpusServer, page_path
from turnstile.envs.env import EnvConfig, SearchBrowseEnv
from turnstile.envs.search.base import Document
from turnstile.envs.synthetic.expert import ScriptedExpert
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.toolset import ToolsConfig, build_toolbox


@dataclass
class EpisodeJob:
    world: WorldConfig = field(default_factory=WorldConfig)
    questions: QuestionConfig = field(default_factory=QuestionConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    question: int = 0  # index into the world's questions
    corpus_url: str = ""  # a running `turnstile serve-corpus` of the same world; "" = serve in process


class EpisodeSetupError(RuntimeError):
    """The episode could not start (bad question index, unreachable corpus server, ...)."""


@contextlib.contextmanager
def corpus(job: EpisodeJob, documents: list[Document]) -> Iterator[str]:
    """The base URL of the pages: a running server if configured, else one started here."""
    if not job.corpus_url:
        with CorpusServer(documents) as server:
            yield server.base_url
        return
    base = job.corpus_url.rstrip("/")
    probe = documents[0]
    try:
        page = httpx.get(base + page_path(probe.doc_id), timeout=5)
    except httpx.HTTPError as error:
        raise EpisodeSetupError(f"cannot reach the corpus server at {base} ({error}); start it with "
                                f"`turnstile serve-corpus --seed {job.world.seed}`") from None
    if page.status_code != 200 or probe.title not in page.text:
        raise EpisodeSetupError(
            f"{base} does not serve the world of seed {job.world.seed} with {job.world.entities} "
            f"entities; start it with `turnstile serve-corpus --seed {job.world.seed} --entities "
            f"{job.world.entities}` or set world.seed/world.entities to match it")
    yield base


async def show_episode(job: EpisodeJob) -> int:
    world = generate_world(job.world)
    documents = world_documents(world)
    with corpus(job, documents) as base_url:
        tasks = generate_tasks(world, job.questions, base_url)
        if not 0 <= job.question < len(tasks):
            raise EpisodeSetupError(f"question={job.question} is out of range: the world has "
                                    f"{len(tasks)} questions (0..{len(tasks) - 1})")
        task = tasks[job.question]
        served = [replace(doc, url=base_url + page_path(doc.doc_id)) for doc in documents]
        toolbox = build_toolbox(job.tools, served, allow_hosts=[urlsplit(base_url).netloc])
        env = SearchBrowseEnv(task, toolbox, job.env)
        expert = ScriptedExpert(task)
        print(f"pages: {base_url}/  ({len(documents)} pages)")
        print(f"question {job.question} [{task.metadata.get('kind')}]: {task.question}")
        started = time.monotonic()
        try:
            await env.reset()
            observation: str | None = None
            while True:
                step = await env.step(expert.next_turn(observation))
                info = step.info
                if step.done:
                    break
                head = step.observation.replace("\n", " ")[:150]
                action = f"{info.tool}({_short(info.parsed.arguments)})" if info.tool else "malformed"
                print(f"  turn {info.turn:3d}  {action:60.60s}  {info.tool_seconds * 1000:6.0f} ms"
                      f"{'  (cached)' if info.tool_cached else ''}\n             -> {head}")
                observation = step.observation
        finally:
            await env.close()
            await toolbox.aclose()
    correct = answer_matches(info.answer, task.answers)
    print(f"answer: {info.answer!r}  gold: {task.answers[0]!r}  correct: {correct}")
    print(f"turns: {info.turn + 1}  tool calls: {sum(env.tool_calls.values())}  "
          f"end: {info.end.value if info.end else '?'}  wall: {time.monotonic() - started:.1f} s")
    return 0


def _short(arguments: Mapping[str, object]) -> str:
    text = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return text if len(text) <= 56 else text[:53] + "..."

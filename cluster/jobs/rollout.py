"""The rollout job: tasks × G samples through a fleet of engine and worker actors, to a JSONL file.

Reads like the first half of the loop in docs/design.md §1: serve the corpus, load tasks, start engine replicas
and rollout workers, hand out episodes as workers free up, write each trajectory as it arrives.

A worker that dies mid-run loses the episodes it was running; they are **rerun** on another worker
(Ray restarts the dead one, up to ``worker_restarts`` times), at most ``max_episode_attempts`` times
each, after which an episode is reported failed in the summary. The run never waits on a dead actor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import ray
from tqdm import tqdm

from cluster.fleet.dispatch import Dispatcher, Episode, WorkerPool
from cluster.fleet.elastic import ElasticFleet, FleetConfig, elastic_fleet
from cluster.fleet.logs import worker_runtime_env
from cluster.jobs.console import Tally
from envs.corpus import CorpusConfig, corpus_documents
from envs.corpus_server import PAGE_PREFIX, CorpusServer, CorpusServerConfig
from envs.datasets.registry import DatasetConfig, load_tasks
from envs.env import env_class
from envs.tasks import Task
from envs.toolset import ToolsConfig
from rollout.context import ContextConfig
from rollout.engines.config import EngineConfig
from rollout.engines.registry import check_engine_tasks
from rollout.engines.shape import follow_model
from rollout.episode import EpisodeConfig
from rollout.model_store import resolve_model
from rollout.summary import RolloutSummary, summarize
from rollout.trajectory import Trajectory, write_trajectory
from rollout.workers import WorkerSpec

log = logging.getLogger(__name__)


TASK_EVENTS_VARIABLE = "RAY_task_events_max_num_task_in_gcs"


@dataclass
class RayConfig:
    address: str = ""  # "" = start a local Ray (or join the one RAY_ADDRESS / `ray job submit` names)
    num_cpus: int | None = None  # logical CPUs of a local Ray; None = Ray's default
    # Actor calls whose records a local Ray's GCS keeps (for its task listing). Every call leaves
    # ~3.3 KB there until this many are kept: Ray's default of 100,000 is ~330 MB that a long run
    # reaches and holds (benchmarks/soak.py). Ignored when joining a cluster: it has its own.
    task_events: int = 10_000

    def __post_init__(self) -> None:
        if self.task_events < 1:
            raise ValueError(f"ray.task_events must be >= 1, got {self.task_events}")


@dataclass
class RolloutJob:
    """One rollout experiment (``turnstile rollout``, ``examples/rollout*.yaml``); also the ``rollout:``
    section of the train, eval and sft jobs, which run it."""

    data: DatasetConfig = field(default_factory=lambda: DatasetConfig(kind="synthetic", path="", limit=8))
    group_size: int = 4  # G samples per task
    engine: EngineConfig = field(default_factory=EngineConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1 (samples per task)")


def run_rollout(cfg: RolloutJob, out: Path, progress: bool = True) -> RolloutSummary:
    """Run every task's G samples and write the trajectories to ``out`` (JSONL, as they arrive)."""
    started = time.monotonic()
    init_ray(cfg.ray)
    model = resolve_model(cfg.engine.model)  # build the default model once, before the actors
    cfg = replace(cfg, engine=expert_engine(cfg.engine, cfg.data))
    with serve_corpus(cfg.corpus) as corpus:
        (tasks,) = servable_tasks([cfg.data], corpus, cfg.engine)
        with fleet(cfg.engine, cfg.fleet, WorkerSpec(tools=cfg.tools, episode=cfg.episode, context=cfg.context,
                                                     corpus=corpus, model=model),
                   name=f"turnstile-{uuid.uuid4().hex[:8]}", events=fleet_events(out)) as rollout_fleet:
            episodes = [(task, f"{task.id}", sample) for task in tasks for sample in range(cfg.group_size)]
            with tqdm(total=len(episodes), desc="episodes", unit="ep", disable=not progress) as bar:
                trajectories, failed, rerun = collect(rollout_fleet.pool, episodes, cfg.fleet, out, bar)
    return summarize(trajectories, time.monotonic() - started, failed, rerun)


def servable_tasks(datasets: list[DatasetConfig], corpus: CorpusConfig, engine: EngineConfig) -> list[list[Task]]:
    """The tasks of each dataset (pages on the served corpus), checked together before any actor
    starts (:func:`check_servable`); the first dataset must give some."""
    prefix = corpus.base_url + PAGE_PREFIX
    loaded = [load_tasks(replace(data, url_prefix=data.url_prefix or prefix)) for data in datasets]
    if not loaded[0]:
        raise ValueError(f"the dataset {datasets[0].kind!r} gave no tasks: check its kind, path and limit")
    check_servable([task for tasks in loaded for task in tasks], corpus, engine)
    return loaded


@contextlib.contextmanager
def fleet(engine: EngineConfig, config: FleetConfig, spec: WorkerSpec, name: str,
          events: Path | None = None) -> Iterator[ElasticFleet]:
    """The rollout fleet of rollout and training alike (:class:`~cluster.fleet.elastic.ElasticFleet`):
    engine replicas behind a router and rollout workers in a dispatch pool, named
    ``<name>-engine-<i>`` and ``<name>-worker-<i>``, healed, and grown or shrunk when
    ``config.autoscale`` says so; every actor is killed on exit. ``spec.model`` is the resolved
    model directory. The environment ``spec`` names and the scale policy are loaded here first, so a
    wrong ``episode.env.kind`` or ``autoscale.kind`` fails before any actor starts. Scale events
    go to the JSONL file ``events``, when given."""
    env_class(spec.episode.env.kind)
    spec = replace(spec, policy_name=spec.policy_name or f"{engine.kind}:{Path(spec.model).name}")
    if not engine.max_model_len:
        # The model's length, or what an episode needs: its context budget and one more turn (the
        # information-gain scorer appends a gold answer to a context that may be full).
        with contextlib.suppress(OSError, ValueError):  # an engine without a local model decides itself
            engine = follow_model(engine, spec.model, spec.episode.context_budget + spec.episode.max_new_tokens)
    with elastic_fleet(engine, config, spec, name, events) as running:
        yield running


def fleet_events(out: Path) -> Path:
    """Where a rollout to ``out`` writes its fleet's scale events: beside it, ``<stem>.fleet.jsonl``."""
    return out.with_name(f"{out.stem}.fleet.jsonl")


def rollout_logs(out: Path) -> Path:
    """Where a rollout to ``out`` sends its workers' output (:mod:`cluster.fleet.logs`): ``<stem>.logs/`` beside it."""
    return out.with_name(f"{out.stem}.logs")


def init_ray(cfg: RayConfig, logs: Path | None = None) -> None:
    """Join the cluster ``cfg.address`` (or ``RAY_ADDRESS``, which ``ray job submit`` sets) or start
    a local Ray with ``cfg.num_cpus`` logical CPUs (ignored when joining: the cluster has its own).
    A local Ray started with ``logs`` sends its workers' output there (:mod:`cluster.fleet.logs`)."""
    if ray.is_initialized():
        return
    joining = bool(cfg.address or os.environ.get("RAY_ADDRESS"))
    runtime_env = worker_runtime_env(logs) if logs is not None and not joining else None
    if not joining:  # read by the GCS this start launches (an environment variable, not _system_config,
        # which Ray refuses if it finds a `ray start` cluster to connect to instead)
        os.environ[TASK_EVENTS_VARIABLE] = str(cfg.task_events)
    ray.init(address=cfg.address or None, num_cpus=None if joining else cfg.num_cpus,
             include_dashboard=False if not joining else None, log_to_driver=True, configure_logging=False,
             runtime_env=runtime_env)


def expert_engine(engine: EngineConfig, data: DatasetConfig) -> EngineConfig:
    """The engine config with the scripted expert told which questions it answers: the synthetic
    data's own options, unless ``engine.scripted.questions`` says otherwise; another data set's
    tasks (their clue chains), unless ``engine.scripted.data`` names one."""
    if data.kind != "synthetic":
        if engine.kind != "scripted" or engine.scripted.data:
            return engine
        return replace(engine, scripted=replace(engine.scripted, data=asdict(data)))
    if engine.scripted.questions or not data.options:
        return engine
    return replace(engine, scripted=replace(engine.scripted, questions=dict(data.options)))


def check_servable(tasks: list[Task], corpus: CorpusConfig, engine: EngineConfig) -> None:
    """Refuse tasks the run cannot serve, before any actor starts: clues on pages the local corpus
    does not hold (HotpotQA tasks beside the default synthetic world), or questions the engine has
    no answer for (the scripted expert outside its world)."""
    if corpus.kind != "none":
        served = {document.url for document in corpus_documents(corpus, corpus.base_url)}
        local = corpus.base_url + PAGE_PREFIX
        missing = [(task.id, url) for task in tasks for clue in task.clues or ()
                   for url in clue.evidence_urls if url.startswith(local) and url not in served]
        if missing:
            tasks_missing = len({task_id for task_id, _ in missing})
            raise ValueError(f"{tasks_missing} of {len(tasks)} tasks have clue pages the corpus "
                             f"(corpus.kind={corpus.kind}) does not serve, e.g. {missing[0][1]} of "
                             f"task {missing[0][0]}: serve the tasks' own corpus (corpus.kind=jsonl, "
                             f"corpus.path=...) or use tasks of this corpus")
    check_engine_tasks(engine, [task.question for task in tasks])


@contextlib.contextmanager
def serve_corpus(corpus: CorpusConfig) -> Iterator[CorpusConfig]:
    """Serve the corpus from this process; yields the config with ``base_url`` set."""
    if corpus.kind == "none":
        yield corpus
        return
    documents = corpus_documents(corpus, "")
    with CorpusServer(documents, CorpusServerConfig(host=corpus.host, port=corpus.port)) as server:
        base = server.base_url
        if corpus.host in ("0.0.0.0", "::"):
            base = f"http://{ray.util.get_node_ip_address()}:{server.base_url.rsplit(':', 1)[1]}"
        yield replace(corpus, base_url=base)


def collect(pool: WorkerPool, episodes: list[Episode], fleet: FleetConfig, out: Path,
            tally: Tally) -> tuple[list[Trajectory], int, int]:
    """Run ``episodes`` on the pool (:class:`~cluster.fleet.dispatch.Dispatcher`: least loaded worker,
    a dead worker's episodes rerun elsewhere), writing each trajectory to ``out`` as it finishes and
    counting it on ``tally`` (a progress bar, or the console's stage). Returns the trajectories
    (failed ones as their records), how many failed and how many were rerun."""
    dispatcher = Dispatcher(pool, fleet.max_episode_attempts)
    dispatcher.submit(episodes)
    done: list[Trajectory] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as sink:
        while dispatcher.busy:
            # At least once a second, so workers that join the fleet meanwhile get waiting episodes.
            for trajectory in dispatcher.wait(timeout=1.0):
                write_trajectory(trajectory, sink)
                done.append(trajectory)
                tally.update(1)
            sink.flush()
    return done, dispatcher.failed, dispatcher.rerun

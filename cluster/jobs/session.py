"""One fleet session: what every job sets up before its first episode and tears down after its
last, and what it does with the fleet between.

:func:`fleet_session` joins or starts Ray, resolves the model, tells the scripted expert its
questions, serves the corpus, loads and checks every dataset's tasks (all before any actor starts),
checks that the cluster has room for the fleet and for what runs beside it, and starts the elastic
fleet of engine replicas and rollout workers. The :class:`FleetSession` it yields has the verbs the
jobs use: :meth:`~FleetSession.generate` (episodes to a trajectory file), :meth:`~FleetSession.stream`
(the same, batch by batch, for a caller that handles each trajectory itself), :meth:`~FleetSession.evaluate`
(held-out tasks, scored) and :meth:`~FleetSession.publish` (new weights to every replica).
``turnstile rollout``, ``train``, ``eval`` and ``sft`` all run through it (docs/design.md §1). Train's
and sft's evaluations are one call of :meth:`~FleetSession.evaluate`; ``turnstile eval`` streams its
benchmarks' samples through the same dispatcher, to judge and write each one as it finishes.

:class:`RolloutJob` is what a session runs from: the ``rollout:`` section of every job, and the
whole of ``turnstile rollout``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from turnstile.cluster.fleet.dispatch import Dispatcher, Episode
from turnstile.cluster.fleet.elastic import ElasticFleet, FleetConfig, elastic_fleet, fleet_demands
from turnstile.cluster.fleet.logs import worker_runtime_env
from turnstile.cluster.fleet.room import Demand, check_room
from turnstile.cluster.jobs.console import UNCOUNTED, Tally
from turnstile.cluster.jobs.metrics import evaluation_metrics
from turnstile.envs.corpus import CorpusConfig, corpus_documents
from turnstile.envs.corpus_server import PAGE_PREFIX, CorpusServer, CorpusServerConfig
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.env import env_class
from turnstile.envs.tasks import Task
from turnstile.envs.toolset import ToolsConfig
from turnstile.rollout.context import ContextConfig
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.registry import check_engine_tasks, weight_sync
from turnstile.rollout.engines.shape import follow_model
from turnstile.rollout.episode import EpisodeConfig
from turnstile.rollout.model_store import resolve_model
from turnstile.rollout.trajectory import Trajectory, write_trajectory
from turnstile.rollout.workers import WorkerSpec

if TYPE_CHECKING:
    import torch

    from turnstile.learner.trainer import Learner
    from turnstile.rollout.store.base import TrajectoryStore

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


@dataclass
class FleetSession:
    """A running fleet with its corpus served and its tasks checked (:func:`fleet_session`)."""

    rollout: RolloutJob  # as served: the expert told its questions, ``corpus.base_url`` set
    model: str  # the resolved model directory the engines started from
    tasks: list[list[Task]]  # each dataset's tasks, in the order given
    fleet: ElasticFleet
    beside: Future[object] | None = None  # what started beside the fleet (``alongside``), to wait on

    def dispatcher(self, episodes: Sequence[Episode] = ()) -> Dispatcher:
        """A dispatcher over the fleet's workers (least loaded worker first, a dead worker's
        episodes rerun elsewhere, up to ``fleet.max_episode_attempts`` times), given ``episodes``."""
        dispatcher = Dispatcher(self.fleet.pool, self.rollout.fleet.max_episode_attempts)
        dispatcher.submit(episodes)
        return dispatcher

    def stream(self, dispatcher: Dispatcher) -> Iterator[list[Trajectory]]:
        """The trajectories ``dispatcher`` finishes, batch by batch, until it has none left (failed
        episodes as their records). At least once a second, so that workers that join the fleet
        meanwhile get waiting episodes."""
        while dispatcher.busy:
            yield dispatcher.wait(timeout=1.0)

    def generate(self, episodes: Sequence[Episode], out: Path, tally: Tally = UNCOUNTED,
                 ) -> tuple[list[Trajectory], int, int]:
        """Run ``episodes``, writing each trajectory to ``out`` (JSONL) as it finishes and counting
        it on ``tally`` (a progress bar, or the console's stage). Returns the trajectories, how many
        episodes failed and how many were rerun."""
        dispatcher = self.dispatcher(episodes)
        done: list[Trajectory] = []
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as sink:
            for batch in self.stream(dispatcher):
                for trajectory in batch:
                    write_trajectory(trajectory, sink)
                    done.append(trajectory)
                    tally.update(1)
                sink.flush()
        return done, dispatcher.failed, dispatcher.rerun

    def evaluate(self, tasks: Sequence[Task], samples: int, out: Path, tally: Tally = UNCOUNTED,
                 label: str = "eval") -> dict[str, float]:
        """``samples`` samples of each of ``tasks`` on the weights the fleet serves now (the
        rollout's sampling settings), written to ``out``; their scores
        (:func:`~turnstile.cluster.jobs.metrics.evaluation_metrics`: accuracy with its 95% interval, answered,
        format rate, turns, browse ratio, accuracy by hop count)."""
        # an evaluation measures no information gain, even in a run whose episodes do
        episodes: list[Episode] = [(task, f"{label}-{task.id}", sample, None, False)
                                   for task in tasks for sample in range(samples)]
        trajectories, _, _ = self.generate(episodes, out, tally)
        return evaluation_metrics(trajectories, tasks)

    async def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """``weights`` to every engine replica as ``version``, the way the engine asks
        (``rollout.engines.registry.weight_sync``): through Ray's object store, or a shared
        checkpoint directory the replicas load (learner and engines on different nodes)."""
        mode, directory = weight_sync(self.rollout.engine)
        await self.fleet.publish(weights, version, mode=mode, checkpoint_dir=directory)


def learner_demand(learner: Learner) -> Demand:
    """What a learner asks Ray for beside the fleet: its ranks (twice with a KL reference), on GPUs a
    GPU and a CPU each, else ``num_cpus_per_worker`` CPUs each."""
    config = learner.config
    ranks = config.processes * (2 if config.kl_coef > 0 else 1)
    each = (1.0, 1.0) if learner.uses_gpu() else (float(config.num_cpus_per_worker), 0.0)
    return Demand("learner.dp" if config.sequence_parallel == 1 else "learner.dp x sequence_parallel", ranks, *each)


@contextlib.contextmanager
def fleet_session(rollout: RolloutJob, datasets: Sequence[DatasetConfig], *, name: str = "",
                  events: Path | None = None, model: str = "", store: TrajectoryStore | None = None,
                  beside: Sequence[Demand] = (), alongside: Callable[[], object] | None = None,
                  ) -> Iterator[FleetSession]:
    """Set up the fleet ``rollout`` describes, yield the session, tear it all down on exit.

    ``datasets`` are loaded against the served corpus and checked together before any actor starts
    (the first must give tasks). ``model`` overrides ``rollout.engine.model`` (train: the learner's).
    ``store`` is where the workers checkpoint long episodes (every ``fleet.checkpoint_every``
    turns). The cluster must have room for the fleet and for ``beside`` (the learner's ranks, say);
    ``alongside`` (the learner's start) runs in a thread while the actors start, since both mostly
    wait on new processes importing torch, vLLM or veRL: side by side they take the longer of the
    two, not the sum; :attr:`FleetSession.beside` is its future, and a failed start raises there.
    Scale events go to the JSONL file ``events``, when given. Actors are named ``<name>-engine-<i>``
    and ``<name>-worker-<i>``."""
    init_ray(rollout.ray)
    resolved = resolve_model(model or rollout.engine.model)  # built once, before the actors
    engine = rollout.engine
    for data in datasets:
        engine = expert_engine(engine, data)
    rollout = replace(rollout, engine=engine)
    with serve_corpus(rollout.corpus) as corpus:
        rollout = replace(rollout, corpus=corpus)
        tasks = servable_tasks(list(datasets), corpus, engine)
        check_room([*fleet_demands(rollout.fleet), *beside])
        spec = WorkerSpec(tools=rollout.tools, episode=rollout.episode, context=rollout.context, corpus=corpus,
                          model=resolved, store=store, checkpoint_every=rollout.fleet.checkpoint_every)
        with ThreadPoolExecutor(1, thread_name_prefix="beside-the-fleet") as pool:
            started = pool.submit(alongside) if alongside is not None else None
            try:
                with _fleet(engine, rollout.fleet, spec, name or f"turnstile-{uuid.uuid4().hex[:8]}",
                            events) as running:
                    yield FleetSession(rollout, resolved, tasks, running, started)
            finally:
                if started is not None:
                    with contextlib.suppress(Exception):  # a failed start was raised to the caller already
                        started.result()


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
def _fleet(engine: EngineConfig, config: FleetConfig, spec: WorkerSpec, name: str,
          events: Path | None = None) -> Iterator[ElasticFleet]:
    """The rollout fleet of rollout and training alike (:class:`~turnstile.cluster.fleet.elastic.ElasticFleet`):
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


def init_ray(cfg: RayConfig, logs: Path | None = None) -> None:
    """Join the cluster ``cfg.address`` (or ``RAY_ADDRESS``, which ``ray job submit`` sets) or start
    a local Ray with ``cfg.num_cpus`` logical CPUs (ignored when joining: the cluster has its own).
    A local Ray started with ``logs`` sends its workers' output there (:mod:`turnstile.cluster.fleet.logs`)."""
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



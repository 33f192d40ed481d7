"""Rollout workers: Ray actors that each run many episodes concurrently with asyncio.

A worker is built from a small picklable :class:`WorkerSpec` and builds its heavy parts inside the
actor: the search index over the corpus, the HTTP pools and the browser (one toolbox shared by its
episodes), and the tokenizer's chat format. Each ``run`` call is one episode; the actor's
``max_concurrency`` is how many run at once, and Ray queues the rest.

With a trajectory store in its spec, a worker checkpoints each episode every ``checkpoint_every``
turns under ``episode:<uid>:<sample>`` and drops the checkpoint when the episode ends. An episode
handed to a worker (after the one running it died) that finds a checkpoint resumes after its last
saved turn instead of starting again; an unreadable checkpoint is dropped and the episode starts
over (noted in ``metadata["checkpoint_error"]``), and a store that does not answer costs only the
checkpoint, never the episode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import ray

from turnstile.envs.corpus import CorpusConfig, corpus_documents
from turnstile.envs.tasks import Task
from turnstile.envs.toolset import ToolsConfig, build_toolbox
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.context import ContextConfig, build_context_manager
from turnstile.rollout.episode import Checkpointing, EpisodeConfig, EpisodeState, run_episode
from turnstile.rollout.fleet import EngineRouter
from turnstile.rollout.store import StoreDataLostError, StoreError, TrajectoryStore
from turnstile.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a worker needs, small and picklable."""

    tools: ToolsConfig
    episode: EpisodeConfig
    context: ContextConfig
    corpus: CorpusConfig
    model: str  # the policy's model directory (its tokenizer and chat template)
    policy_name: str = ""
    store: TrajectoryStore | None = None  # where episode checkpoints go (None = no checkpoints)
    checkpoint_every: int = 4  # turns between checkpoints of a running episode (0 = none)


class RolloutWorker:
    """Runs episodes; wrapped with ``ray.remote`` by :func:`worker_actor`."""

    def __init__(self, spec: WorkerSpec, router: EngineRouter) -> None:
        self.spec = spec
        self.router = router
        documents = corpus_documents(spec.corpus, spec.corpus.base_url)
        allow = [urlsplit(spec.corpus.base_url).netloc] if spec.corpus.base_url else []
        self.toolbox = build_toolbox(spec.tools, documents or None, allow_hosts=allow)
        self.chat = ChatFormat.from_pretrained(spec.model)
        self.episodes_done = 0
        self.resumed = 0  # episodes continued from a checkpoint
        self._running: dict[str, int] = {}  # episode -> checkpoints saved so far

    async def run(self, task: Task, uid: str, sample: int, context: ContextConfig | None = None,
                  probe: bool = True) -> Trajectory:
        """One episode of ``task`` (sample ``sample`` of group ``uid``), with the worker's context
        manager unless ``context`` names another (an evaluation's benchmark with its own).
        ``probe=False``: no information-gain probes, even where the fleet's episodes take them (a
        held-out evaluation)."""
        episode = self.spec.episode
        if episode.ig_probe.enabled and not probe:
            episode = replace(episode, ig_probe=replace(episode.ig_probe, enabled=False))
        affinity = f"{uid}/{sample}"
        key = f"episode:{uid}:{sample}"
        checkpointing, note = await self._checkpointing(key, task, uid, sample)
        self._running[affinity] = 0
        self.resumed += checkpointing is not None and checkpointing.resume is not None
        try:
            trajectory = await run_episode(
                task, uid, sample, engine=self.router, toolbox=self.toolbox, chat=self.chat,
                context_manager=build_context_manager(context or self.spec.context), config=episode,
                affinity=affinity, checkpointing=checkpointing,
            )
        finally:
            self.router.release(affinity)
            self._running.pop(affinity, None)
        if checkpointing is not None:
            await self._drop(key)
        if note:
            trajectory.metadata["checkpoint_error"] = note
        trajectory.policy = self.spec.policy_name
        if self.spec.corpus.base_url:  # where the pages were served: scoring finds clue urls by it
            trajectory.metadata["corpus_url"] = self.spec.corpus.base_url
        self.episodes_done += 1
        return trajectory

    async def _checkpointing(self, key: str, task: Task, uid: str,
                             sample: int) -> tuple[Checkpointing | None, str]:
        """The episode's checkpointing, resuming from a saved state if there is a usable one."""
        store, every = self.spec.store, self.spec.checkpoint_every
        if store is None or every < 1:
            return None, ""
        note, resume = "", None
        try:
            record = await store.load_checkpoint(key)
        except StoreDataLostError:
            raise  # the run must stop, not go on over an empty store
        except StoreError as error:
            log.warning("episode %s/%d: cannot read its checkpoint (%s); starting it afresh", uid, sample, error)
            record = None
        if record is not None:
            try:
                resume = EpisodeState.from_json(record)
                resume.check_for(task, uid, sample)
            except ValueError as error:
                note = f"checkpoint {key} was unusable and dropped: {error}"
                log.warning("episode %s/%d: %s; starting it afresh", uid, sample, note)
                resume = None
                await self._drop(key)

        affinity = f"{uid}/{sample}"

        async def save(state: EpisodeState) -> None:
            await store.checkpoint(key, state.to_json())
            if affinity in self._running:
                self._running[affinity] += 1

        return Checkpointing(save=save, every=every, resume=resume), note

    async def _drop(self, key: str) -> None:
        try:
            await self.spec.store.drop_checkpoint(key)  # type: ignore[union-attr]
        except StoreDataLostError:
            raise  # the run must stop, not go on over an empty store
        except StoreError as error:
            log.warning("cannot drop checkpoint %s (%s); it is overwritten if the episode runs again",
                        key, error)

    async def tool_metrics(self) -> dict[str, int]:
        metrics = self.toolbox.metrics
        return {"calls": sum(metrics.calls.values()), "failures": sum(metrics.failures.values()),
                "retries": metrics.retries, "cache_hits": self.toolbox.cache.stats.hits}

    async def set_replicas(self, replicas: dict[int, ray.actor.ActorHandle]) -> None:
        """The engine replicas to use from now on (the fleet grew, shrank or replaced one)."""
        self.router.set_replicas(replicas)

    async def ping(self) -> int:
        return self.episodes_done

    async def status(self) -> dict[str, int]:
        """What the worker is doing: episodes done, running, running with a checkpoint saved, and
        resumed from one."""
        return {"done": self.episodes_done, "running": len(self._running),
                "checkpointed": sum(saved > 0 for saved in self._running.values()),
                "resumed": self.resumed}

    async def aclose(self) -> None:
        await self.toolbox.aclose()


def worker_actor(spec: WorkerSpec, router: EngineRouter, concurrency: int, num_cpus: float = 0.5,
                 max_restarts: int = 2, name: str | None = None) -> ray.actor.ActorHandle:
    """Start one worker running up to ``concurrency`` episodes at once (not waited for: its
    ``ping()`` answers once it is built); Ray restarts it up to ``max_restarts`` times."""
    if concurrency < 1:
        raise ValueError("fleet.episodes_per_worker must be >= 1")
    # Ray types .remote() as ActorHandle | type[RolloutWorker]; it is the handle.
    return ray.remote(RolloutWorker).options(  # type: ignore[return-value]
        num_cpus=num_cpus, max_concurrency=concurrency, max_restarts=max_restarts, name=name).remote(spec, router)

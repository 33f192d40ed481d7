"""Policy engines as Ray actors, and the router rollout workers call them through.

An :class:`EngineActor` holds one engine replica (vLLM on a GPU, or on a CPU here) built inside the
actor from a small picklable :class:`~turnstile.rollout.engines.config.EngineConfig`. An
:class:`EngineRouter` is a :class:`~turnstile.rollout.engines.base.PolicyEngine` over the replicas: each
episode sticks to one replica (its ``affinity``), so the replica's prefix cache holds the episode's
growing context; a new episode goes to the replica with the fewest requests in flight. When a
replica dies, its episodes move to another replica and the request is retried there once; weight
updates and version queries skip it from then on. Ray does not restart a replica (it would come back
serving the base weights, not the published version): the fleet (:mod:`turnstile.cluster.fleet.elastic`) starts a
new one, brings it to the published version, and only then adds it to the routers' membership.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict, TypeVar

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from turnstile.rollout.engines.base import Generation, Probe, SamplingParams
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.registry import build_engine
from turnstile.rollout.errors import describe_error

log = logging.getLogger(__name__)
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)
T = TypeVar("T")


class EngineStartError(RuntimeError):
    """An engine replica of the initial fleet could not start: the run stops, saying why."""


class EngineActor:
    """One engine replica. Wrapped with ``ray.remote`` by :func:`start_engines`; async methods let
    many requests run concurrently inside the replica (vLLM batches them)."""

    def __init__(self, config: EngineConfig) -> None:
        self._engine = build_engine(config)
        self._in_flight = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        self._in_flight += 1
        try:
            return await self._engine.generate(prompt_ids, sampling, affinity)
        finally:
            self._in_flight -= 1

    async def score(self, sequences: list[list[int]], spans: list[tuple[int, int]]) -> list[list[float]]:
        return await self._engine.score(sequences, spans)

    async def probe(self, context: list[int], continuation: list[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        return await self._engine.probe(context, continuation, span, affinity)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        await self._engine.update_weights(version, weights)

    async def weights_version(self) -> int:
        return await self._engine.weights_version()

    async def in_flight(self) -> int:
        return self._in_flight

    async def ready(self) -> int:
        """Start the engine where it has a start (vLLM: here, not on the first request, so that a
        replica that cannot serve fails here, once); returns its weights version."""
        start = getattr(self._engine, "start", None)
        if start is not None:
            await start()
        return await self._engine.weights_version()

    async def aclose(self) -> None:
        await self._engine.aclose()


def engine_actor(config: EngineConfig, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 name: str | None = None) -> ray.actor.ActorHandle:
    """Start one engine replica (not waited for: its ``ready()`` says when it serves)."""
    # vLLM logs every start-up step at INFO; a rollout's console should show progress, not that.
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    # Ray types .remote() as ActorHandle | type[EngineActor]; it is the handle.
    return ray.remote(EngineActor).options(  # type: ignore[return-value]
        num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000, runtime_env={"env_vars": env},
        name=name).remote(config)


class _RouterState(TypedDict):
    """What a pickled :class:`EngineRouter` carries."""

    replicas: dict[int, ray.actor.ActorHandle]
    wait: float


class EngineRouter:
    """A PolicyEngine over engine replicas: least-loaded placement, per-episode affinity.

    The replicas are a membership keyed by replica id, which whoever runs the fleet replaces with
    :meth:`set_replicas` as replicas join and leave (:class:`turnstile.cluster.fleet.elastic.ElasticFleet`); a
    replica that left gets no new request, and an episode that was on it moves to another. Load is
    what this router has in flight on each replica; with several rollout workers each balances its
    own share, which evens out the total. With no live replica a request waits up to
    ``wait_for_replica_s`` for one to join (a replacement on its way) before it fails. Picklable (it
    holds actor handles only).
    """

    # An episode leaves its replica (and prefills its context again elsewhere) when that replica has
    # this many more requests in flight than the least loaded: without it, episodes that began on a
    # crowded fleet stay queued there while replicas that joined later idle (the fleet simulator
    # measured it: 8 replicas, one at 16 busy slots and 488 queued requests, seven idle).
    MOVE_AFTER = 4

    def __init__(self, replicas: Mapping[int, ray.actor.ActorHandle], wait_for_replica_s: float = 120.0) -> None:
        self._replicas = dict(replicas)
        self.wait_for_replica_s = wait_for_replica_s
        self._dead: set[int] = set()
        self._in_flight: dict[int, int] = {}
        self._affinity: dict[str, int] = {}
        self.published: tuple[int, object] | None = None  # the last update: (version, its weights' object)

    def __getstate__(self) -> _RouterState:
        return {"replicas": self._replicas, "wait": self.wait_for_replica_s}

    def __setstate__(self, state: _RouterState) -> None:
        type(self).__init__(self, state["replicas"], state["wait"])

    def set_replicas(self, replicas: Mapping[int, ray.actor.ActorHandle]) -> None:
        """The replicas to use from now on (requests already sent finish where they are)."""
        self._replicas = dict(replicas)
        self._dead &= set(self._replicas)
        self._affinity = {key: index for key, index in self._affinity.items() if index in self._replicas}

    def replica_ids(self) -> list[int]:
        return sorted(self._replicas)

    def choose(self, affinity: str | None, stay: bool = False) -> int | None:
        """The replica for a request: the episode's own while it serves and is not more than
        ``MOVE_AFTER`` requests busier than the least loaded (``stay``: however busy), else the least
        loaded (which becomes the episode's); None while no replica is live."""
        alive = [i for i in self._replicas if i not in self._dead]
        if not alive:
            return None
        least = min(alive, key=lambda i: self._in_flight.get(i, 0))
        own = self._affinity.get(affinity) if affinity is not None else None
        if own in alive and (stay or self._in_flight.get(own, 0) - self._in_flight.get(least, 0) <= self.MOVE_AFTER):
            return own
        if affinity is not None:
            self._affinity[affinity] = least
        return least

    def sent(self, index: int, change: int = 1) -> None:
        """Count a request sent to replica ``index`` (``change=-1``: its answer came back)."""
        self._in_flight[index] = self._in_flight.get(index, 0) + change

    async def _pick(self, affinity: str | None, stay: bool = False) -> int:
        waited = 0.0
        while (index := self.choose(affinity, stay)) is None:
            if waited >= self.wait_for_replica_s:
                raise RuntimeError(f"no engine replica has served for {self.wait_for_replica_s:.0f} s; "
                                   "the rollout cannot continue")
            await asyncio.sleep(0.25)
            waited += 0.25
        return index

    def release(self, affinity: str) -> None:
        """Forget an episode's replica (call when the episode ends)."""
        self._affinity.pop(affinity, None)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        return await self._on_episode_replica(
            affinity, lambda replica: replica.generate.remote(list(prompt_ids), sampling, affinity))

    async def probe(self, context: Sequence[int], continuation: Sequence[int], span: tuple[int, int],
                    affinity: str | None = None) -> Probe:
        """On the episode's replica, however busy: its prefix cache holds the context (a probe
        never moves an episode, but counts as load for the others' placement)."""
        return await self._on_episode_replica(
            affinity, lambda replica: replica.probe.remote(list(context), list(continuation), span, affinity),
            stay=True)

    async def _on_episode_replica(self, affinity: str | None,
                                  call: Callable[[ray.actor.ActorHandle], ray.ObjectRef[T]],
                                  stay: bool = False) -> T:
        """``call`` on the replica :meth:`choose` gives the episode; if that replica died, once more
        on the one that takes the episode over."""
        for attempt in (1, 2):
            index = await self._pick(affinity, stay)
            self.sent(index)
            try:
                return await call(self._replicas[index])
            except _DEAD:
                self._dead.add(index)
                log.warning("engine replica %d died; moving its episodes to the others", index)
                if attempt == 2:
                    raise
            finally:
                self.sent(index, -1)
        raise AssertionError("unreachable")

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        index = await self._pick(None)
        return await self._replicas[index].score.remote([list(s) for s in sequences], list(spans))

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Every live replica serves ``version``, or this raises naming the ones that do not."""
        behind = await self.update_replicas(version, weights, timeout_s=None)
        if behind:
            raise RuntimeError("; ".join(f"engine replica {i}: {why}" for i, why in sorted(behind.items())))

    async def update_replicas(self, version: int, weights: Mapping[str, torch.Tensor],
                              timeout_s: float | None) -> dict[int, str]:
        """Load ``weights`` as ``version`` into every live replica at once, each within ``timeout_s``
        (None: no limit). Returns the replicas left behind (id -> why: the update timed out or
        raised, or the replica then served another version), which leave this router; whoever runs
        the fleet replaces them. Replicas found dead are skipped, as everywhere."""
        # One object-store copy shared by every replica, kept for replicas that join later.
        ref = ray.put(dict(weights))
        self.published = (version, ref)
        live = [i for i in self._replicas if i not in self._dead]

        async def update(index: int) -> int | str:
            """The version the replica serves after the update, or why it is late (one deadline for
            the update and the check; an engine's own time-out is an error like any other)."""
            replica = self._replicas[index]
            deadline = asyncio.timeout(timeout_s)
            try:
                async with deadline:
                    await replica.update_weights.remote(version, ref)
                    return int(await replica.weights_version.remote())
            except TimeoutError:
                if deadline.expired():
                    return f"did not take version {version} within {timeout_s:g} s"
                raise

        results = await asyncio.gather(*(update(i) for i in live), return_exceptions=True)
        behind: dict[int, str] = {}
        for index, result in zip(live, results, strict=True):
            if isinstance(result, _DEAD):
                self._dead.add(index)
                log.warning("engine replica %d died; the other replicas carry on", index)
            elif isinstance(result, str):
                behind[index] = result
            elif isinstance(result, BaseException):
                behind[index] = f"failed to take version {version}: {describe_error(result)}"
            elif result != version:
                behind[index] = f"serves version {result} after loading version {version}"
        if behind:
            self._dead.update(behind)
            log.warning("engine replicas left behind at version %d: %s", version, behind)
        if not [i for i in live if i not in self._dead]:
            reasons = "; ".join(f"engine replica {i}: {why}" for i, why in sorted(behind.items()))
            raise RuntimeError(f"no engine replica serves version {version}" + (f" ({reasons})" if reasons else ""))
        return behind

    async def weights_version(self) -> int:
        versions: list[int] = await self._on_each_live(lambda replica: replica.weights_version.remote())
        return min(versions)

    async def _on_each_live(self, call: Callable[[ray.actor.ActorHandle], ray.ObjectRef[T]]) -> list[T]:
        """``call`` on every live replica at once; replicas found dead are marked and skipped."""
        live = [i for i in self._replicas if i not in self._dead]
        results = await asyncio.gather(*(call(self._replicas[i]) for i in live), return_exceptions=True)
        values = []
        for index, result in zip(live, results, strict=True):
            if isinstance(result, _DEAD):
                self._dead.add(index)
                log.warning("engine replica %d died; the other replicas carry on", index)
            elif isinstance(result, BaseException):
                raise result
            else:
                values.append(result)
        if not values:
            raise RuntimeError("every engine replica has died; the rollout cannot continue")
        return values

    async def aclose(self) -> None:
        return None  # the replicas belong to whoever started them

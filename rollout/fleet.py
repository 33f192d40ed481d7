"""Policy engines as Ray actors, and the router rollout workers call them through.

An :class:`EngineActor` holds one engine replica (vLLM on a GPU, or on a CPU here) built inside the
actor from a small picklable :class:`~rollout.engines.config.EngineConfig`. An
:class:`EngineRouter` is a :class:`~rollout.engines.base.PolicyEngine` over the replicas: each
episode sticks to one replica (its ``affinity``), so the replica's prefix cache holds the episode's
growing context; a new episode goes to the replica with the fewest requests in flight. When a
replica dies, its episodes move to another replica and the request is retried there once; weight
updates and version queries skip it from then on. A dead replica is not restarted (it would come back
serving the base weights, not the published version); the rest of the fleet carries on, and only
when every replica is gone does a call fail.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rollout.engines.base import Generation, SamplingParams
from rollout.engines.config import EngineConfig
from rollout.engines.registry import build_engine

log = logging.getLogger(__name__)
_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


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

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        await self._engine.update_weights(version, weights)

    async def weights_version(self) -> int:
        return await self._engine.weights_version()

    async def in_flight(self) -> int:
        return self._in_flight

    async def ready(self) -> int:
        """Wait until the engine can serve (vLLM starts lazily); returns its weights version."""
        return await self._engine.weights_version()

    async def aclose(self) -> None:
        await self._engine.aclose()


def start_engines(config: EngineConfig, replicas: int, num_cpus: float = 1.0,
                  num_gpus: float = 0.0, name_prefix: str = "") -> list[ray.actor.ActorHandle]:
    """Start ``replicas`` engine actors and wait until each serves; with a ``name_prefix`` they are
    named actors (``<prefix>engine-<i>``)."""
    if replicas < 1:
        raise ValueError("rollout.engine_replicas must be >= 1")
    # vLLM logs every start-up step at INFO; a rollout's console should show progress, not that.
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    actor = ray.remote(EngineActor)
    handles = [actor.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000,
                             runtime_env={"env_vars": env},
                             name=f"{name_prefix}engine-{i}" if name_prefix else None).remote(config)
               for i in range(replicas)]
    ray.get([handle.ready.remote() for handle in handles])
    return handles


class EngineRouter:
    """A PolicyEngine over engine replicas: least-loaded placement, per-episode affinity.

    Load is what this router has in flight on each replica; with several rollout workers each
    balances its own share, which evens out the total. Picklable (it holds actor handles only).
    """

    def __init__(self, replicas: Sequence[ray.actor.ActorHandle]) -> None:
        if not replicas:
            raise ValueError("the router needs at least one engine replica")
        self._replicas = list(replicas)
        self._alive = [True] * len(self._replicas)
        self._in_flight = [0] * len(self._replicas)
        self._affinity: dict[str, int] = {}

    def __getstate__(self) -> dict[str, object]:
        return {"_replicas": self._replicas}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["_replicas"])  # type: ignore[misc, arg-type]

    def _pick(self, affinity: str | None) -> int:
        if affinity is not None:
            index = self._affinity.get(affinity)
            if index is not None and self._alive[index]:
                return index
        alive = [i for i, ok in enumerate(self._alive) if ok]
        if not alive:
            raise RuntimeError("every engine replica has died; the rollout cannot continue")
        index = min(alive, key=lambda i: self._in_flight[i])
        if affinity is not None:
            self._affinity[affinity] = index
        return index

    def release(self, affinity: str) -> None:
        """Forget an episode's replica (call when the episode ends)."""
        self._affinity.pop(affinity, None)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       affinity: str | None = None) -> Generation:
        for attempt in (1, 2):
            index = self._pick(affinity)
            self._in_flight[index] += 1
            try:
                return await self._replicas[index].generate.remote(list(prompt_ids), sampling, affinity)
            except _DEAD:
                self._alive[index] = False
                log.warning("engine replica %d died; moving its episodes to the others", index)
                if attempt == 2:
                    raise
            finally:
                self._in_flight[index] -= 1
        raise AssertionError("unreachable")

    async def score(self, sequences: Sequence[Sequence[int]],
                    spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        index = self._pick(None)
        return await self._replicas[index].score.remote([list(s) for s in sequences], list(spans))

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        # One object-store copy shared by every replica.
        ref = ray.put(dict(weights))
        await self._on_each_live(lambda replica: replica.update_weights.remote(version, ref))

    async def weights_version(self) -> int:
        return min(await self._on_each_live(lambda replica: replica.weights_version.remote()))

    async def _on_each_live(self, call: Callable[[ray.actor.ActorHandle], ray.ObjectRef]) -> list[object]:
        """``call`` on every live replica at once; replicas found dead are marked and skipped."""
        live = [i for i, ok in enumerate(self._alive) if ok]
        results = await asyncio.gather(*(call(self._replicas[i]) for i in live), return_exceptions=True)
        values = []
        for index, result in zip(live, results, strict=True):
            if isinstance(result, _DEAD):
                self._alive[index] = False
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

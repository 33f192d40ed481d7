"""The trajectory store: the queues between rollout, the reward service and the learner.

``build_store(StoreConfig(kind="memory"))`` (default: a named Ray actor, lost with it) or
``build_store(StoreConfig(kind="redis", url="redis://127.0.0.1:6379/0", namespace="run-17"))``
(Redis Streams). Both implement :class:`TrajectoryStore`; its docstring is the contract, and
``tests/test_store.py`` runs the same tests on both (``pytest tests/test_store.py``).
"""

from __future__ import annotations

from rollout.store.base import (
    FINISHED,
    SCORED,
    Claimed,
    StoreConfig,
    StoreError,
    StoreUnavailableError,
    TrajectoryStore,
)
from rollout.store.memory import MemoryStoreActor, MemoryTrajectoryStore
from rollout.store.redis import RedisTrajectoryStore

STORE_BACKENDS: dict[str, type[MemoryTrajectoryStore | RedisTrajectoryStore]] = {
    "memory": MemoryTrajectoryStore,
    "redis": RedisTrajectoryStore,
}


def build_store(config: StoreConfig) -> TrajectoryStore:
    """The client of ``config.kind``. Cheap and picklable; it connects on first use (a memory store
    starts its actor here when no actor of that name exists yet)."""
    try:
        backend = STORE_BACKENDS[config.kind]
    except KeyError:
        known = ", ".join(sorted(STORE_BACKENDS))
        raise ValueError(f"store.kind={config.kind!r} is not known; use one of: {known}") from None
    return backend(config)


__all__ = [
    "FINISHED",
    "SCORED",
    "STORE_BACKENDS",
    "Claimed",
    "MemoryStoreActor",
    "MemoryTrajectoryStore",
    "RedisTrajectoryStore",
    "StoreConfig",
    "StoreError",
    "StoreUnavailableError",
    "TrajectoryStore",
    "build_store",
]

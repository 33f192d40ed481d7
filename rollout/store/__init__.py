"""The trajectory store: the queues between rollout, the reward service and the learner.

``build_store(StoreConfig(kind="memory"))`` (default: a named Ray actor, lost with it) or
``build_store(StoreConfig(kind="redis", url="redis://127.0.0.1:6379/0", namespace="run-17"))``
(Redis Streams). Both implement :class:`TrajectoryStore`; its docstring is the contract, and
``tests/test_store.py`` runs the same tests on both (``pytest tests/test_store.py``).
``check_durability(config)`` refuses, before a run starts, a Redis that would lose acknowledged
items on a restart (``tests/test_store_durability.py`` kills and restarts real servers).
"""

from __future__ import annotations

from turnstile.envs.plugins import Registry
from turnstile.rollout.store.base import (
    FINISHED,
    SCORED,
    Claimed,
    StoreConfig,
    StoreDataLostError,
    StoreError,
    StoreNotDurableError,
    StoreUnavailableError,
    TrajectoryStore,
    without_password,
)

# The built-in backends are entry points (pyproject.toml, group turnstile.stores), imported when a
# config names one (the memory store imports Ray): reading a config, or the contract, stays cheap.
# Another package's store is an entry point of its own, or store.kind=package.module:Class.
STORES: Registry[type[TrajectoryStore]] = Registry(
    "store.kind", "turnstile.stores", error=ValueError, expected="a TrajectoryStore class",
    accepts=lambda found: isinstance(found, type) and issubclass(found, TrajectoryStore))


def build_store(config: StoreConfig) -> TrajectoryStore:
    """The client of ``config.kind``. Cheap and picklable; it connects on first use (a memory store
    starts its actor here when no actor of that name exists yet)."""
    return _backend(config)(config)


def check_durability(config: StoreConfig) -> None:
    """Raise :class:`StoreNotDurableError`, naming the server setting to change, if the store of
    ``config`` would lose acknowledged items when its server restarts (unless
    ``config.require_durable`` is false). Call it in the driver before anything starts: it needs no
    Ray and builds no memory-store actor."""
    _backend(config).check_durability(config)


def _backend(config: StoreConfig) -> type[TrajectoryStore]:
    return STORES.load(config.kind)


__all__ = [
    "FINISHED",
    "SCORED",
    "STORES",
    "Claimed",
    "StoreConfig",
    "StoreDataLostError",
    "StoreError",
    "StoreNotDurableError",
    "StoreUnavailableError",
    "TrajectoryStore",
    "build_store",
    "check_durability",
    "without_password",
]

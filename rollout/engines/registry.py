"""From an :class:`EngineConfig` to a running engine, through the ``turnstile.engines`` entry points.

Engines are named in config (``engine.kind=hf``) and found through the entry-point group
``turnstile.engines`` of the installed packages, so core code never lists them and an outside
package adds an engine by declaring one entry point. ``package.module:Class`` works too. Each engine
class builds itself with ``Class.from_config(config)``; imports happen only when an engine is built
(vLLM takes seconds to import).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from turnstile.envs.plugins import Registry
from turnstile.rollout.engines.base import PolicyEngine
from turnstile.rollout.engines.config import EngineConfig

ENTRY_POINT_GROUP = "turnstile.engines"


class EngineClass(Protocol):
    """How an engine is built. An engine class may also define ``check_tasks(config, questions)``,
    raising ValueError when it cannot serve some of them (a scripted policy's unknown questions);
    drivers call it through :func:`check_engine_tasks` before starting any actor. It may define
    ``weight_sync(config) -> (mode, directory)``, how the driver publishes new weights to it
    (:func:`weight_sync`), ``probes = True`` when its ``probe`` measures information gain
    during rollout (:func:`can_probe`), and ``logprobs = True`` when the log-probs it returns are
    those of the policy that sampled (:func:`gives_logprobs`)."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> PolicyEngine: ...


ENGINES: Registry[EngineClass] = Registry(
    "engine.kind", ENTRY_POINT_GROUP, expected="an engine class (with from_config)",
    accepts=lambda found: callable(getattr(found, "from_config", None)))


def engine_names() -> list[str]:
    return ENGINES.names()


def resolve_engine(kind: str) -> EngineClass:
    return ENGINES.load(kind)


def check_engine_tasks(config: EngineConfig, questions: Sequence[str]) -> None:
    """Raise ValueError when the configured engine says it cannot serve these questions."""
    check = getattr(resolve_engine(config.kind), "check_tasks", None)
    if check is not None:
        check(config, questions)


def weight_sync(config: EngineConfig) -> tuple[str, str]:
    """How the driver publishes weights to the configured engine: ``("inplace", "")``, through Ray's
    object store (the default), or ``("checkpoint", directory)``, safetensors in a directory every
    replica reads (learner and engines on different nodes); the engine class says which."""
    sync = getattr(resolve_engine(config.kind), "weight_sync", None)
    return sync(config) if sync is not None else ("inplace", "")


def can_probe(config: EngineConfig) -> bool:
    """Whether the configured engine can measure information gain while episodes run
    (:mod:`turnstile.rollout.probes`): its class says ``probes = True`` (vllm, hf; not scripted)."""
    return bool(getattr(resolve_engine(config.kind), "probes", False))


def gives_logprobs(config: EngineConfig) -> bool:
    """Whether the configured engine's log-probs are the sampling policy's, which the learner's
    rollout correction weighs against its own: its class says ``logprobs = True`` (vllm, hf; not
    scripted, whose log-probs are made up, nor openai, which returns none)."""
    return bool(getattr(resolve_engine(config.kind), "logprobs", False))


def build_engine(config: EngineConfig) -> PolicyEngine:
    """Build the configured engine in this process (inside a Ray actor on a cluster)."""
    return resolve_engine(config.kind).from_config(config)

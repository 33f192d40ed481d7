"""From an :class:`EngineConfig` to a running engine, through the ``turnstile.engines`` entry points.

Engines are named in config (``engine.kind=hf``) and found through the entry-point group
``turnstile.engines`` of the installed packages, so core code never lists them and an outside
package adds an engine by declaring one entry point. ``package.module:Class`` works too. Each engine
class builds itself with ``Class.from_config(config)``; imports happen only when an engine is built
(vLLM takes seconds to import).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Protocol

from rollout.engines.base import PolicyEngine
from rollout.engines.config import EngineConfig

ENTRY_POINT_GROUP = "turnstile.engines"


class EngineClass(Protocol):
    """How an engine is built. An engine class may also define ``check_tasks(config, questions)``,
    raising ValueError when it cannot serve some of them (a scripted policy's unknown questions);
    drivers call it through :func:`check_engine_tasks` before starting any actor."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> PolicyEngine: ...


def engine_names() -> list[str]:
    return sorted(entry.name for entry in entry_points(group=ENTRY_POINT_GROUP))


def resolve_engine(kind: str) -> EngineClass:
    if ":" in kind:
        module_name, _, attribute = kind.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"engine.kind={kind!r}: cannot load {attribute!r} from {module_name!r} "
                             f"({error})") from None
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == kind:
            return entry.load()
    raise ValueError(f"engine.kind={kind!r} is not known; use one of {', '.join(engine_names())} or "
                     "'package.module:Class' (if you just added an engine, reinstall: pip install -e .)")


def check_engine_tasks(config: EngineConfig, questions: Sequence[str]) -> None:
    """Raise ValueError when the configured engine says it cannot serve these questions."""
    check = getattr(resolve_engine(config.kind), "check_tasks", None)
    if check is not None:
        check(config, questions)


def build_engine(config: EngineConfig) -> PolicyEngine:
    """Build the configured engine in this process (inside a Ray actor on a cluster)."""
    return resolve_engine(config.kind).from_config(config)

"""The reward plugin contract and the registry that finds plugins by name.

A reward plugin reads finished trajectories and writes reward fields into them: per trajectory
(``outcome``, a ``metadata`` entry) and per turn (``reward``, ``ig``, ``step_score``, ``events``, ...).
The reward service runs the configured plugins on each group (the G trajectories of one prompt, which
share a task) before the learner turns the fields into advantages. Plugins are chosen in config::

    rewards:
      - kind: exact_match            # a name from the ``turnstile.rewards`` entry points
        options: {format_penalty: true}
      - kind: mypkg.rewards:Mine     # or an import path, no registration needed

Each plugin class carries a typed options dataclass (``Options``); :func:`build_reward` merges the
spec's ``options`` into it and rejects an unknown option by name, so a typo never falls back to a
default. The registry never lists plugins itself: packages declare them as entry points, and
:func:`register_reward` adds one in process (tests, notebooks).

A :class:`PluginSpec` is small and picklable; the plugin (with its HTTP clients, tools, caches) is built
from it inside the process that scores, e.g. a Ray actor.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from turnstile.envs.plugins import PluginError, PluginSpec, Registry, typed_options
from turnstile.envs.tasks import Task
from turnstile.rollout.trajectory import Trajectory, Turn

ENTRY_POINT_GROUP = "turnstile.rewards"

TRAJECTORY_FIELDS = frozenset({"outcome", "metadata"})
TURN_FIELDS = frozenset({"ig_value", "ig_version", "ig", "reward", "step_score", "events"})


class RewardError(PluginError):
    """A reward plugin cannot be found, configured or run; the message says what to change."""


@dataclass(frozen=True)
class NoOptions:
    """The options of a plugin that takes none."""


class RewardPlugin(abc.ABC):
    """Scores finished trajectories by writing reward fields into them.

    Contract:
    - ``Options`` is the plugin's options dataclass; the plugin is built as ``Cls(config)``
      (by :func:`build_reward`). Heavy clients are built there or lazily, never pickled.
    - ``writes`` names every field the plugin may write, as ``"trajectory.<field>"`` or
      ``"turn.<field>"`` (fields of :class:`~turnstile.rollout.trajectory.Trajectory` and
      :class:`~turnstile.rollout.trajectory.Turn`); it must write no other field. The contract test checks this.
    - ``score`` is async and scores one trajectory of ``task``; it is idempotent (scoring twice
      writes the same values) and never changes the rollout's own fields (ids, text, actions).
    - ``score_group`` scores the G trajectories of one task; plugins that need the whole group
      (group-relative scores) override it, the others inherit the concurrent per-trajectory loop.
    - ``aclose`` releases clients; safe to call twice.
    - ``scores_with_policy``: the plugin scores with the policy's own weights (information gain).
      Its options then include ``model`` and ``versions_dir``, and ``turnstile train`` points
      ``versions_dir`` at the run's weights archive, so that each trajectory is scored with the
      version that generated it, unless the config sets either.
    - ``engine_options``: such a plugin may have its values measured by the rollout itself, on the
      policy engines (:mod:`turnstile.rollout.probes`); given its options and whether the run's
      engines can be probed, it returns the options to score with when that is how this run should
      measure them (``turnstile train`` then has every episode probe its boundaries), else None.
    """

    Options: ClassVar[type] = NoOptions
    writes: ClassVar[frozenset[str]] = frozenset()
    scores_with_policy: ClassVar[bool] = False

    @classmethod
    def engine_options(cls, options: Mapping[str, object], engine_probes: bool) -> dict[str, object] | None:
        return None

    @abc.abstractmethod
    async def score(self, trajectory: Trajectory, task: Task) -> None: ...

    async def score_group(self, group: Sequence[Trajectory], task: Task) -> None:
        await asyncio.gather(*(self.score(trajectory, task) for trajectory in group))

    async def aclose(self) -> None:
        return None


PluginClass = type[RewardPlugin]
REWARDS: Registry[PluginClass] = Registry(
    "reward kind", ENTRY_POINT_GROUP, error=RewardError, expected="a RewardPlugin class",
    accepts=lambda found: isinstance(found, type) and issubclass(found, RewardPlugin))


def register_reward(name: str) -> Callable[[PluginClass], PluginClass]:
    """Register a plugin class under ``name`` in this process (entry points do it for packages)."""
    return REWARDS.register(name)


def resolve_reward(kind: str) -> PluginClass:
    """The plugin class ``kind`` names (registered name or ``package.module:Class``)."""
    return REWARDS.load(kind)


def reward_options(spec: PluginSpec) -> object:
    """The plugin's typed options from ``spec`` (a RewardError names an unknown or bad one); a driver
    calls it to refuse a config before anything starts."""
    cls = resolve_reward(spec.kind)
    if any("config_type" in vars(klass) for klass in cls.__mro__):
        raise RewardError(f"reward {spec.kind!r}: its class declares 'config_type'; the options dataclass "
                          f"is now named 'Options', as estimators' and engines' are")
    return typed_options(cls.Options, spec.options, f"reward {spec.kind!r}", error=RewardError)


def build_reward(spec: PluginSpec) -> RewardPlugin:
    """Build the plugin ``spec`` describes, in this process."""
    cls = resolve_reward(spec.kind)
    config = reward_options(spec)
    unknown = sorted(name for name in cls.writes if not _is_reward_field(name))
    if unknown:
        raise RewardError(f"reward {spec.kind!r} declares writes {unknown}; plugins may write only "
                          f"trajectory.{{{', '.join(sorted(TRAJECTORY_FIELDS))}}} and "
                          f"turn.{{{', '.join(sorted(TURN_FIELDS))}}}")
    return cls(config)  # type: ignore[call-arg]


def _is_reward_field(name: str) -> bool:
    scope, _, field_name = name.partition(".")
    return (scope == "trajectory" and field_name in TRAJECTORY_FIELDS) or \
        (scope == "turn" and field_name in TURN_FIELDS)


def last_turn(trajectory: Trajectory) -> Turn | None:
    """The trajectory's final turn (across segments), or None for an episode with no turn."""
    for segment in reversed(trajectory.segments):
        if segment.turns:
            return segment.turns[-1]
    return None

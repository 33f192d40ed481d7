"""How big the rollout fleet should be: the autoscaling settings and the policies that decide.

A policy sees a :class:`FleetView` (what runs now, what waits) and answers a :class:`Want`: how
many engine replicas and rollout workers the fleet should have. It only decides; a
:class:`Sizer` clamps the answer into ``[min, max]`` and holds a change back until it has been
wanted for ``up_delay_s`` (growing) or ``down_delay_s`` (shrinking), and the fleet
(:class:`turnstile.cluster.fleet.elastic.ElasticFleet`, or the fleet simulator's stand-in) carries it out (start and
catch up, or drain and release).

Policies are plugins (``rollout.fleet.autoscale.kind``: a name registered here, an entry point of
the group ``turnstile.scale_policies``, or ``package.module:Class``); a class with an ``Options``
dataclass gets its ``options`` typed and checked before the run starts.

The default, ``target_load``, sizes the fleet by **episodes per engine replica** (running plus
waiting). We chose it over pending requests because a search agent's episode has at most one
generation in flight and spends the rest of its time in tools, so a replica's batch is its
episodes, not its queue: vLLM admits every request it has KV-cache room for, and its queue only
grows once latency has already suffered (and the CPU and scripted engines never queue at all).
Episodes are known to the driver before any replica sees them, so the fleet grows on demand that
is waiting, not on latency that is already lost.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from turnstile.envs.plugins import Registry, typed_options


@dataclass
class AutoscaleConfig:
    """``rollout.fleet.autoscale``. Off by default: the fleet keeps ``engine_replicas`` and
    ``workers`` (a dead one is still replaced)."""

    enabled: bool = False
    kind: str = "target_load"  # the policy: target_load | schedule | an entry point | pkg.mod:Class
    options: dict[str, Any] = field(default_factory=dict)
    min_engines: int = 1
    max_engines: int = 4
    min_workers: int = 1
    max_workers: int = 4
    up_delay_s: float = 5.0  # a larger fleet must be wanted this long before it starts
    down_delay_s: float = 30.0  # a smaller one this long before anything drains
    drain_timeout_s: float = 300.0  # a draining member still busy after this is stopped (its episodes rerun)
    start_timeout_s: float = 900.0  # a member not serving after this is stopped (no room came, or it hangs)
    interval_s: float = 1.0  # how often the fleet looks at its load

    def __post_init__(self) -> None:
        for low, high in (("min_engines", "max_engines"), ("min_workers", "max_workers")):
            if getattr(self, low) < 1:
                raise ValueError(f"{low}={getattr(self, low)} must be >= 1")
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high}={getattr(self, high)} must be >= {low}={getattr(self, low)}")
        for name in ("up_delay_s", "down_delay_s", "drain_timeout_s", "start_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s={self.interval_s} must be > 0")


@dataclass(frozen=True)
class FleetView:
    """What the fleet looks like to a policy at one moment."""

    elapsed_s: float  # since the fleet started
    engines: int  # replicas serving (ready), not counting draining ones
    workers: int  # rollout workers taking episodes
    running: int  # episodes running on the workers
    waiting: int  # episodes handed to the fleet that no worker has room for yet
    finished: int  # episodes finished since the fleet started
    episodes_per_worker: int
    replica_load: tuple[int, ...] = ()  # generation requests in flight on each ready replica


@dataclass(frozen=True)
class Want:
    engines: int
    workers: int
    reason: str  # said in the scale event


class ScalePolicy(Protocol):
    def decide(self, view: FleetView) -> Want: ...


SCALE_POLICIES: Registry[type[ScalePolicy]] = Registry(
    "rollout.fleet.autoscale.kind", "turnstile.scale_policies", error=ValueError,
    expected="a scale policy class (with decide)",
    accepts=lambda found: isinstance(found, type) and callable(getattr(found, "decide", None)))


def build_policy(config: AutoscaleConfig) -> ScalePolicy:
    """The configured policy, its options checked (raises ValueError naming the bad one)."""
    cls = SCALE_POLICIES.load(config.kind)
    options_type = getattr(cls, "Options", None)
    if options_type is None:
        if config.options:
            raise ValueError(f"scale policy {config.kind!r} takes no options, got {sorted(config.options)}")
        return cls()
    return cls(typed_options(options_type, config.options, f"scale policy {config.kind!r}",  # type: ignore[call-arg]
                             error=ValueError))


@SCALE_POLICIES.register("target_load")
class TargetLoad:
    """Enough replicas for ``episodes_per_replica`` episodes (running and waiting) each, and enough
    workers to run them all (``fleet.episodes_per_worker`` each)."""

    @dataclass
    class Options:
        episodes_per_replica: int = 16

        def __post_init__(self) -> None:
            if self.episodes_per_replica < 1:
                raise ValueError(f"episodes_per_replica={self.episodes_per_replica} must be >= 1")

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()

    def decide(self, view: FleetView) -> Want:
        demand = view.running + view.waiting
        engines = math.ceil(demand / self.options.episodes_per_replica)
        workers = math.ceil(demand / view.episodes_per_worker)
        return Want(engines, workers, f"{demand} episodes running or waiting "
                                      f"({self.options.episodes_per_replica} per replica)")


@SCALE_POLICIES.register("schedule")
class Schedule:
    """A fixed plan for tests and drills: after ``after`` finished episodes, ``engines`` replicas and
    ``workers`` workers (the last entry whose ``after`` has been reached)."""

    @dataclass
    class Step:
        after: int
        engines: int
        workers: int

    @dataclass
    class Options:
        steps: list[dict[str, int]] = field(default_factory=list)

    STEP_KEYS: ClassVar[tuple[str, ...]] = ("after", "engines", "workers")

    def __init__(self, options: Options | None = None) -> None:
        raw = (options or self.Options()).steps
        if not raw:
            raise ValueError("scale policy 'schedule' needs options.steps: [{after, engines, workers}, ...]")
        steps = []
        for entry in raw:
            if sorted(entry) != sorted(self.STEP_KEYS):
                raise ValueError(f"scale policy 'schedule': each step has exactly the keys "
                                 f"{', '.join(self.STEP_KEYS)}; got {dict(entry)}")
            steps.append(self.Step(**{key: int(entry[key]) for key in self.STEP_KEYS}))
        self.steps = sorted(steps, key=lambda step: step.after)

    def decide(self, view: FleetView) -> Want:
        current = [step for step in self.steps if view.finished >= step.after]
        step = current[-1] if current else self.steps[0]
        return Want(step.engines, step.workers, f"schedule: {step.engines} replicas and {step.workers} "
                                                f"workers after {step.after} episodes")


class Sizer:
    """The size a fleet should have now, from the policy's answers (each clamped into ``[min, max]``)
    over time, for replicas and workers each: it grows to the smallest answer of the last
    ``up_delay_s`` when every one of them wanted more, and shrinks to the largest answer of the last
    ``down_delay_s`` when every one of them wanted less (a stabilisation window, as Kubernetes'
    horizontal autoscaler has). A load that keeps falling is followed down step by step; a single
    dip or spike shorter than the delay changes nothing. With no policy (autoscaling off) the size
    stays what it was configured. Time is the caller's, so the same rule runs on a real clock (the
    fleet) and a simulated one (``benchmarks/fleet_sim.py``)."""

    def __init__(self, config: AutoscaleConfig, policy: ScalePolicy | None, engines: int, workers: int) -> None:
        self.config, self.policy = config, policy
        self.wanted = self.clamp(engines, workers)
        self.reason = "the configured size"  # why the fleet has its wanted size
        self._answers: deque[tuple[float, tuple[int, int]]] = deque()  # (when, clamped answer), oldest first

    def clamp(self, engines: int, workers: int) -> tuple[int, int]:
        if self.policy is None:
            return max(engines, 1), max(workers, 1)
        a = self.config
        return min(max(engines, a.min_engines), a.max_engines), min(max(workers, a.min_workers), a.max_workers)

    def update(self, view: FleetView, now: float) -> Want | None:
        """Ask the policy; the new wanted size when it changes now, else None."""
        if self.policy is None:
            return None
        want = self.policy.decide(view)
        self._answers.append((now, self.clamp(want.engines, want.workers)))
        longest = max(self.config.up_delay_s, self.config.down_delay_s)
        while len(self._answers) > 1 and self._answers[1][0] <= now - longest:
            self._answers.popleft()  # keep the one in effect at the start of the longest window
        size = self._settle(0, now), self._settle(1, now)
        if size == self.wanted:
            return None
        self.wanted, self.reason = size, want.reason
        return Want(*size, want.reason)

    def _settle(self, d: int, now: float) -> int:
        current = self.wanted[d]
        up = self._window(d, now, self.config.up_delay_s)
        if up and min(up) > current:
            return min(up)
        down = self._window(d, now, self.config.down_delay_s)
        if down and max(down) < current:
            return max(down)
        return current

    def _window(self, d: int, now: float, delay: float) -> list[int]:
        """The answers in effect over the last ``delay`` seconds; empty when the answers do not reach
        back that far yet."""
        start = now - delay
        if not self._answers or self._answers[0][0] > start:
            return []
        first = max(i for i, (at, _) in enumerate(self._answers) if at <= start)
        return [answer[d] for _, answer in list(self._answers)[first:]]

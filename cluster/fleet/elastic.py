"""The rollout fleet of a run: engine replicas and rollout workers that grow, shrink and heal.

:class:`ElasticFleet` starts the fleet and then looks after it from a thread of the driver, every
``autoscale.interval_s``:

- **Health.** Each serving replica is asked its load (requests in flight); one that is dead leaves
  the routers' membership and is replaced. A worker Ray could not bring back (``worker_restarts``
  used up, or its node lost) is replaced too. With autoscaling off, this is all the thread does:
  the fleet keeps ``engine_replicas`` and ``workers``.
- **Size** (``autoscale.enabled``). The policy (:mod:`turnstile.cluster.fleet.autoscale`) says how many replicas
  and workers it wants; a larger fleet must be wanted for ``up_delay_s``, a smaller one for
  ``down_delay_s``, and the answer is clamped into ``[min, max]``. Ray places what is started; when
  the cluster has no room, :func:`ray.autoscaler.sdk.request_resources` asks Ray's autoscaler for
  the whole wanted fleet, so nodes come (and, asked for less, may go).
- **Up.** A new replica starts, loads the published weights (the object-store copy of the last
  publish, or the checkpoint directory the engines read), and joins the routers' membership only
  once it reports that version: no episode ever reaches a replica serving older weights than the
  fleet. A publish and a catch-up never overlap (one lock), so a replica that catches up during a
  publish ends on the newer version. A new worker joins the dispatch pool once it answers.
- **Down.** A leaving replica leaves the membership first (every worker's router is told, and
  answers), then finishes the requests it has in flight and is released. A leaving worker takes no
  new episode and is released when its episodes are done. After ``drain_timeout_s`` either is
  stopped: a replica's requests are retried on another, a worker's episodes run again elsewhere
  from their checkpoints (:mod:`turnstile.cluster.fleet.dispatch`). Nothing is lost or run twice.

Publishing follows the membership (:meth:`publish`): no collective group is sized at the start.
Every change is a :class:`ScaleEvent` with its reason, logged and counted in the step metrics.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from turnstile.cluster.fleet.autoscale import AutoscaleConfig, FleetView, Sizer, build_policy
from turnstile.cluster.fleet.dispatch import WorkerPool
from turnstile.cluster.fleet.room import Demand, check_room
from turnstile.learner.publish import publish
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.errors import describe_error
from turnstile.rollout.fleet import EngineRouter, EngineStartError, engine_actor
from turnstile.rollout.workers import WorkerSpec, worker_actor

log = logging.getLogger(__name__)
_CALL_TIMEOUT_S = 30.0  # a membership push or a catch-up that takes longer is retried next look
MAX_FAILED_STARTS = 3  # members in a row that fail to start: then a dead one is no longer replaced


@dataclass
class FleetConfig:
    engine_replicas: int = 1
    engine_cpus: float = 1.0
    engine_gpus: float = 0.0
    workers: int = 1
    episodes_per_worker: int = 16  # concurrent episodes in one worker
    worker_cpus: float = 0.5
    worker_restarts: int = 2
    max_episode_attempts: int = 2
    checkpoint_every: int = 4  # turns between checkpoints of a running episode in the store (train)
    # Each replica's weight update (train): one that does not serve the new version within this is
    # replaced; a publish no replica completes stops the run
    publish_timeout_s: float = 300.0
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # off: the sizes above, healed

    def __post_init__(self) -> None:
        for name in ("engine_replicas", "workers", "episodes_per_worker", "max_episode_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("engine_cpus", "engine_gpus", "worker_cpus", "worker_restarts", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not self.publish_timeout_s > 0:
            raise ValueError(f"publish_timeout_s={self.publish_timeout_s} must be > 0")


@dataclass(frozen=True)
class ScaleEvent:
    at_s: float  # since the fleet started
    action: str  # up (started) | ready | down (draining) | released | stopped (late or failed) | replace (died)
    member: str  # engine-<id> | worker-<id>
    reason: str


@dataclass
class _Replica:
    handle: ray.actor.ActorHandle
    state: str  # starting | ready | draining
    since: float
    ready: ray.ObjectRef | None = None  # the start-up call while starting
    load: int = 0  # requests in flight at the last look


@dataclass
class _Pending:
    """A worker on its way: started, not yet answering."""

    handle: ray.actor.ActorHandle
    ping: ray.ObjectRef
    name: str
    since: float


class ElasticFleet:
    """Engine replicas behind a router and rollout workers in a dispatch pool (see the module
    docstring). ``router`` is the driver's (publishing), ``pool`` the dispatchers'."""

    def __init__(self, engine: EngineConfig, config: FleetConfig, spec: WorkerSpec, name: str,
                 events_path: Path | None = None) -> None:
        self.engine, self.config, self.spec, self.name = engine, config, spec, name
        self.events_path = events_path  # each scale event as a JSON line, when given
        self.autoscale = config.autoscale
        policy = build_policy(self.autoscale) if self.autoscale.enabled else None
        self.sizer = Sizer(self.autoscale, policy, config.engine_replicas, config.workers)
        self.router = EngineRouter({})
        self.pool = WorkerPool([], config.episodes_per_worker)
        self.events: list[ScaleEvent] = []
        self._replicas: dict[int, _Replica] = {}
        self._pending_workers: list[_Pending] = []
        self._draining_since: dict[int, float] = {}  # worker index -> when it began draining
        self._worker_names: dict[int, str] = {}
        self._next_id = {"engine": 0, "worker": 0}
        self._lock = threading.RLock()  # publish vs catch-up vs membership changes
        self._asked: tuple[int, int] | None = None  # the fleet last asked of Ray's autoscaler
        self._started = time.monotonic()
        self._failed_starts = 0  # in a row; at MAX_FAILED_STARTS the fleet stops replacing
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> ElasticFleet:
        """Start the initial fleet, wait until it serves, and start looking after it."""
        engines, workers = self.sizer.wanted
        for _ in range(engines):
            self._start_replica("the configured size")
        # The workers start beside the replicas (both spend their start-up importing libraries);
        # each is told the serving replicas when it answers, after the replicas serve.
        for _ in range(workers):
            self._start_worker("the configured size")
        for replica_id in list(self._replicas):
            ready = self._replicas[replica_id].ready
            assert ready is not None  # each was started just above
            try:
                served = ray.get(ready)
            except (RayTaskError, RayActorError) as error:
                raise EngineStartError(f"engine-{replica_id} could not start: {describe_error(error)}") from None
            self._replica_came_up(replica_id, served)
        ray.get([pending.ping for pending in self._pending_workers])
        self._workers_came_up()
        self.pool.replacing = True
        self._thread = threading.Thread(target=self._watch, name=f"{self.name}-fleet", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.pool.replacing = False
        if self._thread is not None:
            self._thread.join(timeout=max(10.0, 2 * self.autoscale.interval_s))
        with self._lock:
            for replica in self._replicas.values():
                ray.kill(replica.handle)
            for pending in self._pending_workers:
                ray.kill(pending.handle)
            for worker in self.pool.workers:
                ray.kill(worker)
            self._replicas.clear()
            self._pending_workers.clear()
            if self._asked is not None:  # the standing request would keep the nodes after the run
                from ray.autoscaler.sdk import request_resources

                with contextlib.suppress(Exception):  # closing must finish; Ray may be going down
                    request_resources(bundles=[])
                self._asked = None

    # -- publishing ------------------------------------------------------------------------------
    async def publish(self, weights: Mapping[str, torch.Tensor], version: int, *, mode: str,
                      checkpoint_dir: str | None) -> int:
        """``weights`` to every serving replica (:func:`turnstile.learner.publish.publish`), each within
        ``publish_timeout_s``; a replica starting meanwhile catches up to this version before it
        serves. A replica that does not serve the new version in time (or whose update raises)
        leaves every router and is replaced, and the replacement catches up before it serves; a
        publish that no replica completes raises :class:`~turnstile.learner.publish.PublishError`."""
        with self._lock:
            # The router keeps what it sent (the object-store copy, or nothing: load the
            # directory) for the replicas that join later.
            done = await publish(self.router, weights, version, mode=mode, checkpoint_dir=checkpoint_dir,
                                 timeout_s=self.config.publish_timeout_s)
            for replica_id, why in sorted(done.behind.items()):
                replica = self._replicas.pop(replica_id, None)
                if replica is not None:
                    with contextlib.suppress(Exception):  # it may be gone already
                        ray.kill(replica.handle, no_restart=True)
                    self._event("replace", f"engine-{replica_id}", why)
            if done.behind:
                self._push_membership()
            return done.version

    # -- what the fleet looks like -----------------------------------------------------------------
    def view(self) -> FleetView:
        with self._lock:
            ready = [r for r in self._replicas.values() if r.state == "ready"]
            return FleetView(
                elapsed_s=time.monotonic() - self._started, engines=len(ready),
                workers=self.pool.count(WorkerPool.READY), running=sum(self.pool.load),
                waiting=self.pool.waiting, finished=self.pool.finished,
                episodes_per_worker=self.config.episodes_per_worker,
                replica_load=tuple(r.load for r in ready))

    def metrics(self) -> dict[str, float]:
        """The fleet now, for the step metrics: wanted / ready / starting / draining replicas and
        workers, episodes running and waiting, replica load, and scale events so far."""
        view = self.view()
        with self._lock:
            states = [r.state for r in self._replicas.values()]
            events = len(self.events)
        return {"fleet/engines_wanted": float(self.sizer.wanted[0]), "fleet/engines_ready": float(view.engines),
                "fleet/engines_starting": float(states.count("starting")),
                "fleet/engines_draining": float(states.count("draining")),
                "fleet/workers_wanted": float(self.sizer.wanted[1]), "fleet/workers_ready": float(view.workers),
                "fleet/workers_starting": float(len(self._pending_workers)),
                "fleet/workers_draining": float(self.pool.count(WorkerPool.DRAINING)),
                "fleet/episodes_running": float(view.running), "fleet/episodes_waiting": float(view.waiting),
                "fleet/replica_load_max": float(max(view.replica_load, default=0)),
                "fleet/replica_load_mean": sum(view.replica_load) / max(len(view.replica_load), 1),
                "fleet/scale_events": float(events)}

    # -- the watch -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.autoscale.interval_s):
            try:
                self.tick()
            except Exception:  # the fleet's upkeep must not end the run; next look retries
                log.exception("looking after the rollout fleet failed; trying again in %.1f s",
                              self.autoscale.interval_s)

    def tick(self) -> None:
        """One look: health, new members up, the wanted size, drains."""
        with self._lock:
            self._check_replicas()
            self._progress_replicas()
            self._workers_came_up()
            self._reconnect_revived()
            self._decide()
            self._scale()
            self._finish_drains()
            self.pool.starting = len(self._pending_workers)  # the dispatchers wait for these

    def _check_replicas(self) -> None:
        serving = [i for i, r in self._replicas.items() if r.state in ("ready", "draining")]
        calls: dict[ray.ObjectRef, int] = {self._replicas[i].handle.in_flight.remote(): i for i in serving}
        done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=min(5.0, self.autoscale.interval_s * 5))
        dead = []
        for ref in done:
            replica_id = calls[ref]
            try:
                self._replicas[replica_id].load = int(ray.get(ref))
            except RayActorError:
                dead.append(replica_id)
        for replica_id in dead:
            was = self._replicas.pop(replica_id).state
            if was == "ready":
                self._push_membership()
                self._event("replace", f"engine-{replica_id}", "the replica died")
            else:
                self._event("released", f"engine-{replica_id}", "died while draining")

    def _progress_replicas(self) -> None:
        for replica_id, replica in list(self._replicas.items()):
            if replica.state != "starting" or replica.ready is None:
                continue
            done, _ = ray.wait([replica.ready], timeout=0)
            if not done:
                if time.monotonic() - replica.since > self.autoscale.start_timeout_s:
                    ray.kill(self._replicas.pop(replica_id).handle)
                    self._failed_start(f"engine-{replica_id}",
                                       f"not serving after {self.autoscale.start_timeout_s:.0f} s")
                continue
            try:
                self._replica_came_up(replica_id, ray.get(replica.ready))
                self._failed_starts = 0
            except (RayTaskError, RayActorError, GetTimeoutError) as error:
                with contextlib.suppress(RayActorError):  # one whose start raised is still alive
                    ray.kill(self._replicas.pop(replica_id).handle)
                self._failed_start(f"engine-{replica_id}", f"it failed to start ({describe_error(error)})")

    def _replica_came_up(self, replica_id: int, served: int) -> None:
        """A started replica serves: bring it to the published version, then route to it."""
        replica = self._replicas[replica_id]
        published = self.router.published
        if published is not None and served != published[0]:
            version, weights = published
            # as long as a publish may take (a slow engine's update must not fail every replacement)
            ray.get(replica.handle.update_weights.remote(version, weights),
                    timeout=max(_CALL_TIMEOUT_S * 4, self.config.publish_timeout_s))
            served = ray.get(replica.handle.weights_version.remote(), timeout=_CALL_TIMEOUT_S)
            if served != version:
                raise RuntimeError(f"engine-{replica_id} serves version {served} after loading {version}")
        replica.state, replica.ready, replica.since = "ready", None, time.monotonic()
        self._push_membership()
        self._event("ready", f"engine-{replica_id}", f"serves weights version {served}")

    def _workers_came_up(self) -> None:
        for pending in list(self._pending_workers):
            done, _ = ray.wait([pending.ping], timeout=0)
            if not done:
                if time.monotonic() - pending.since > self.autoscale.start_timeout_s:
                    self._pending_workers.remove(pending)
                    ray.kill(pending.handle)
                    self._failed_start(pending.name, f"not answering after {self.autoscale.start_timeout_s:.0f} s")
                continue
            self._pending_workers.remove(pending)
            try:
                ray.get(pending.ping)
            except RayActorError as error:
                self._failed_start(pending.name, f"it failed to start ({type(error).__name__})")
                continue
            self._failed_starts = 0
            # It was started with the membership of its start: tell it the current one.
            pending.handle.set_replicas.remote(self._membership())
            index = self.pool.add(pending.handle)
            self._worker_names[index] = pending.name
            self._event("ready", pending.name, "takes episodes")

    def _reconnect_revived(self) -> None:
        """A worker Ray restarted was rebuilt with the membership of its first start."""
        for index in list(self.pool.revived):
            self.pool.workers[index].set_replicas.remote(self._membership())
            self.pool.revived.discard(index)

    def _decide(self) -> None:
        was = self.sizer.wanted
        want = self.sizer.update(self.view(), time.monotonic())
        if want is not None:
            log.info("fleet: %d -> %d replicas, %d -> %d workers (%s)", was[0], want.engines, was[1],
                     want.workers, want.reason)

    def _scale(self) -> None:
        """Start or drain members until the fleet has its wanted size (a dead one is made up here)."""
        engines, workers = self.sizer.wanted
        reason = self.sizer.reason
        active = [i for i, r in self._replicas.items() if r.state in ("starting", "ready")]
        for have in range(len(active), engines):
            self._start_replica(f"{have} of {engines} replicas ({reason})")
        for have in range(len(active), engines, -1):
            self._drain_replica(f"{have} replicas, {engines} wanted ({reason})")
        live = self.pool.count(WorkerPool.READY, WorkerPool.LOST) + len(self._pending_workers)
        for have in range(live, workers if self.pool.replacing else live):
            self._start_worker(f"{have} of {workers} workers ({reason})")
        for have in range(live, workers, -1):
            self._drain_worker(f"{have} workers, {workers} wanted ({reason})")
        self._ask_ray()

    def _finish_drains(self) -> None:
        now = time.monotonic()
        for replica_id, replica in list(self._replicas.items()):
            if replica.state != "draining":
                continue
            late = now - replica.since > self.autoscale.drain_timeout_s
            if replica.load == 0 or late:
                ray.kill(replica.handle)
                del self._replicas[replica_id]
                self._event("released" if not late else "stopped", f"engine-{replica_id}",
                            "drained" if not late else f"still busy after {self.autoscale.drain_timeout_s:.0f} s")
        for index in self.pool.indices(WorkerPool.DRAINING):
            late = now - self._draining_since.get(index, now) > self.autoscale.drain_timeout_s
            if self.pool.load[index] == 0 or late:
                ray.kill(self.pool.workers[index])
                if not late:
                    self.pool.remove(index)  # a late one's episodes fail over first (dispatch)
                self._event("released" if not late else "stopped", self._worker_names.get(index, f"worker-{index}"),
                            "drained" if not late else f"still busy after {self.autoscale.drain_timeout_s:.0f} s")
                self._draining_since.pop(index, None)

    # -- members ---------------------------------------------------------------------------------
    def _start_replica(self, reason: str) -> None:
        replica_id = self._take_id("engine")
        handle = engine_actor(replace(self.engine, model=self.spec.model), self.config.engine_cpus,
                              self.config.engine_gpus, name=f"{self.name}-engine-{replica_id}")
        self._replicas[replica_id] = _Replica(handle, "starting", time.monotonic(), ready=handle.ready.remote())
        self._event("up", f"engine-{replica_id}", reason)

    def _drain_replica(self, reason: str) -> None:
        serving = [i for i, r in self._replicas.items() if r.state == "ready"]
        starting = [i for i, r in self._replicas.items() if r.state == "starting"]
        if starting:  # one that does not serve yet leaves first, at no cost
            replica_id = starting[-1]
            ray.kill(self._replicas.pop(replica_id).handle)
            self._event("released", f"engine-{replica_id}", f"no longer wanted ({reason})")
            return
        replica_id = min(serving, key=lambda i: (self._replicas[i].load, -i))
        self._replicas[replica_id].state, self._replicas[replica_id].since = "draining", time.monotonic()
        self._push_membership()
        self._event("down", f"engine-{replica_id}", reason)

    def _start_worker(self, reason: str) -> None:
        name = f"worker-{self._take_id('worker')}"
        # Built with the current membership; the pool takes it once it answers.
        handle = worker_actor(self.spec, EngineRouter(self._membership()), self.config.episodes_per_worker,
                              self.config.worker_cpus, self.config.worker_restarts, name=f"{self.name}-{name}")
        self._pending_workers.append(_Pending(handle, handle.ping.remote(), name, time.monotonic()))
        self._event("up", name, reason)

    def _drain_worker(self, reason: str) -> None:
        if self._pending_workers:  # one that does not answer yet leaves first
            pending = self._pending_workers.pop()
            ray.kill(pending.handle)
            self._event("released", pending.name, f"no longer wanted ({reason})")
            return
        ready = self.pool.indices(WorkerPool.READY)
        if not ready:
            return
        index = min(ready, key=lambda i: (self.pool.load[i], -i))
        self.pool.drain(index)
        self._draining_since[index] = time.monotonic()
        self._event("down", self._worker_names.get(index, f"worker-{index}"), reason)

    def _failed_start(self, member: str, why: str) -> None:
        """A member that never came up. After MAX_FAILED_STARTS in a row the fleet stops replacing
        dead workers, so a run whose workers are all gone ends (NoWorkersLeft) instead of waiting."""
        self._failed_starts += 1
        self._event("stopped", member, why)
        if self._failed_starts >= MAX_FAILED_STARTS:
            log.error("%d members in a row failed to start; dead workers are no longer replaced",
                      self._failed_starts)
            self.pool.replacing = False

    def _membership(self) -> dict[int, ray.actor.ActorHandle]:
        return {i: r.handle for i, r in self._replicas.items() if r.state == "ready"}

    def _push_membership(self) -> None:
        """Every router the new membership: the driver's now, each worker's before this returns
        (a worker that does not answer in time gets it again when it comes back)."""
        members = self._membership()
        self.router.set_replicas(members)
        workers = [self.pool.workers[i] for i in self.pool.indices(WorkerPool.READY, WorkerPool.DRAINING)]
        calls: list[ray.ObjectRef] = [worker.set_replicas.remote(members) for worker in workers]
        for call in calls:
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(call, timeout=_CALL_TIMEOUT_S)

    def _ask_ray(self) -> None:
        """Ask Ray's autoscaler for room for the wanted fleet (only when autoscaling; a fixed fleet
        was placed at the start and needs no standing request)."""
        if self.sizer.policy is None or self._asked == self.sizer.wanted:
            return
        from ray.autoscaler.sdk import request_resources

        engines, workers = self.sizer.wanted
        engine = {"CPU": self.config.engine_cpus,
                  **({"GPU": self.config.engine_gpus} if self.config.engine_gpus else {})}
        bundles = [engine] * engines + [{"CPU": self.config.worker_cpus}] * workers
        request_resources(bundles=[{k: v for k, v in b.items() if v > 0} or {"CPU": 0.01} for b in bundles])
        self._asked = self.sizer.wanted

    def _take_id(self, kind: str) -> int:
        """Ids are never reused, so every actor of a run has its own name (``<run>-engine-<id>``)."""
        self._next_id[kind] += 1
        return self._next_id[kind] - 1

    def _event(self, action: str, member: str, reason: str) -> None:
        event = ScaleEvent(round(time.monotonic() - self._started, 3), action, member, reason)
        self.events.append(event)
        log.info("fleet %s %s: %s", action, member, reason)
        if self.events_path is not None:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            with self.events_path.open("a", encoding="utf-8") as sink:
                sink.write(json.dumps(asdict(event)) + "\n")


def fleet_demands(config: FleetConfig) -> list[Demand]:
    """What the initial fleet asks Ray for: its engine replicas and rollout workers."""
    policy = build_policy(config.autoscale) if config.autoscale.enabled else None
    engines, workers = Sizer(config.autoscale, policy, config.engine_replicas, config.workers).wanted
    return [Demand("rollout.fleet.engine_replicas", engines, config.engine_cpus, config.engine_gpus),
            Demand("rollout.fleet.workers", workers, config.worker_cpus)]


@contextlib.contextmanager
def elastic_fleet(engine: EngineConfig, config: FleetConfig, spec: WorkerSpec, name: str,
                  events_path: Path | None = None) -> Iterator[ElasticFleet]:
    """An :class:`ElasticFleet`, started, and stopped with all its actors on exit. Nothing starts
    where a local Ray has no room for the initial fleet (:mod:`turnstile.cluster.fleet.room`)."""
    check_room(fleet_demands(config))
    fleet = ElasticFleet(engine, config, spec, name, events_path)
    try:
        yield fleet.start()
    finally:
        fleet.close()

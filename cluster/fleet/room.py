"""Whether the Ray cluster has room for a run's actors, checked before the first one starts.

A Ray actor that asks for more than the cluster has free is not refused: it waits, with nothing
said, until room appears. On a cluster that can grow (one the driver joined: its autoscaler may add
nodes) that is right; on the local Ray a command started itself nothing will ever come, and a run
whose engines, rollout workers, learner and reward workers do not fit at once would wait forever
on the last of them. :func:`check_room` adds up what the run asks for and, where it cannot fit,
refuses to start on a local Ray (:class:`ClusterTooSmall`, naming what was asked and what there is)
and says it is waiting for nodes on a joined one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import ray

log = logging.getLogger(__name__)


class ClusterTooSmall(ValueError):
    """The run's actors cannot all be placed on this Ray cluster, and it cannot grow."""


@dataclass(frozen=True)
class Demand:
    """``count`` actors of one kind, each asking Ray for ``cpus`` CPUs and ``gpus`` GPUs."""

    what: str  # as the config names it, e.g. "rollout.fleet.workers"
    count: int
    cpus: float
    gpus: float = 0.0

    def __str__(self) -> str:
        each = f"{self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")
        return f"{self.what}: {self.count} x {each}"


def shortfall(demands: Sequence[Demand], nodes: Sequence[dict[str, float]]) -> str:
    """What ``demands`` ask for beyond the resources of ``nodes`` (each node's total resources),
    worded for the user; "" when they fit. Totals are compared, and each actor with the largest
    node (an actor runs on one node); packing several actors onto nodes is left to Ray."""
    asked = {"CPU": sum(d.count * d.cpus for d in demands), "GPU": sum(d.count * d.gpus for d in demands)}
    have = {kind: sum(node.get(kind, 0.0) for node in nodes) for kind in asked}
    problems = [f"{asked[kind]:g} {kind}s at once, the cluster has {have[kind]:g}"
                for kind in asked if asked[kind] > have[kind] + 1e-9]
    for demand in demands:
        if demand.count and not any(node.get("CPU", 0.0) + 1e-9 >= demand.cpus
                                    and node.get("GPU", 0.0) + 1e-9 >= demand.gpus for node in nodes):
            problems.append(f"one of {demand.what} asks for {demand.cpus:g} CPU and {demand.gpus:g} GPU, "
                            "more than any node has")
    if not problems:
        return ""
    return f"the run needs {'; '.join(problems)} ({', '.join(str(d) for d in demands if d.count)})"


def check_room(demands: Sequence[Demand]) -> None:
    """Refuse to start what a local Ray cannot hold; on a joined cluster, say the run waits for nodes."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    missing = shortfall(demands, nodes)
    if not missing:
        return
    if not started_here():
        message = f"waiting for the cluster to grow: {missing}"
        log.warning(message)
        print(f"turnstile: {message}", file=sys.stderr)
        return
    raise ClusterTooSmall(f"{missing}. This Ray was started by this command and cannot grow: give it more "
                          "(rollout.ray.num_cpus=N) or ask for less (the settings named above)")


def started_here() -> bool:
    """Whether this process started the Ray it uses (a local one, which no autoscaler grows), as
    opposed to joining a cluster."""
    try:
        from ray._private import worker

        node = worker._global_node  # noqa: SLF001
        return bool(node is not None and node.is_head())
    except (ImportError, AttributeError):  # another Ray version: assume it may grow (and only warn)
        return False

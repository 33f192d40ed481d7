"""A `turnstile train` job on Ray's own autoscaling test cluster (run by tests/test_autoscaling.py).

Run inside private PID, mount and network namespaces (the test does that), because the cluster's
start and stop (`ray stop --force`) see every Ray on the machine otherwise. The cluster is Ray's
fake multi-node provider with autoscaler v2 (`ray.cluster_utils.AutoscalingCluster`): a head with
room for the learner, one engine replica and one rollout worker, and up to three one-CPU nodes the
autoscaler adds when actors wait for room and removes when they have been idle for six seconds.

The job trains in sync mode with the sim engine, so each step's rollout is a wave of load: the fleet
(`target_load`, 4 episodes per replica) wants two replicas and two workers, which do not fit on the
head, so nodes come; between waves it shrinks and the nodes go. Once a replica serves on an added
node, that node is killed (its processes, as a lost spot node). Prints one JSON line: the nodes
seen over time, where the replicas ran, the kill, the fleet's events and the samples trained on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import ray
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from ray.cluster_utils import AutoscalingCluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = 2


class DrillCluster(AutoscalingCluster):
    """Ray's autoscaling test cluster with its config written here. The wheel lacks the fake
    provider's example.yaml, which both the base class and the autoscaler's monitor read for the
    provider's defaults, so the same provider class is named as an ``external`` one (whose
    defaults are built in)."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):  # noqa: ANN001, ANN003, ANN202
        config = {
            "cluster_name": "turnstile-drill", "max_workers": 3, "upscaling_speed": 1.0,
            "idle_timeout_minutes": 0.1, "head_node_type": "ray.head.default",
            "provider": {"type": "external",
                         "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "launch_multiple": True,
                         "head_node_id": FAKE_HEAD_NODE_ID},
            "available_node_types": {**worker_node_types, "ray.head.default": {
                "resources": head_resources, "node_config": {}, "max_workers": 0}},
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": []}
        config.update(config_kwargs)
        return config


def kill_node(node_id: str) -> int:
    """Kill every process of a fake node (each carries its node id in its environment)."""
    killed = 0
    for process in psutil.process_iter():
        try:
            if process.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                process.send_signal(signal.SIGKILL)
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


class Watcher(threading.Thread):
    """Records the alive nodes and where the run's engine replicas live; kills the first added node
    that holds a serving replica."""

    def __init__(self, run_name: str) -> None:
        super().__init__(daemon=True)
        self.run_name = run_name
        self.nodes: list[tuple[float, int]] = []
        self.replica_nodes: dict[str, str] = {}
        self.killed: dict[str, object] = {}
        self.stop = threading.Event()
        self.started = time.monotonic()

    def run(self) -> None:
        from ray.util.state import list_actors

        while not self.stop.wait(1.0):
            try:
                alive = [n for n in ray.nodes() if n["Alive"]]
                self.nodes.append((round(time.monotonic() - self.started, 1), len(alive)))
                actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            except Exception:  # noqa: BLE001 - the state API can miss a beat while a node dies
                continue
            for actor in actors:
                name = actor.name or ""
                if name.startswith(f"{self.run_name}-engine-"):
                    self.replica_nodes[name.removeprefix(f"{self.run_name}-")] = actor.node_id
            if not self.killed:
                added = {node_id for node_id in self.replica_nodes.values() if node_id != FAKE_HEAD_NODE_ID}
                serving = [n for n in added if self._serving_on(n)]
                if serving:
                    node_id = serving[0]
                    self.killed = {"node": node_id, "at_s": round(time.monotonic() - self.started, 1),
                                   "processes": kill_node(node_id),
                                   "replicas": sorted(r for r, n in self.replica_nodes.items() if n == node_id)}

    def _serving_on(self, node_id: str) -> bool:
        events = Path(os.environ["DRILL_OUT"]) / "fleet.jsonl"
        if not events.is_file():
            return False
        ready = {json.loads(line)["member"] for line in events.read_text().splitlines()
                 if json.loads(line)["action"] == "ready"}
        return any(r in ready for r, n in self.replica_nodes.items() if n == node_id)


def main() -> None:
    from turnstile.cluster.cli.config import load_config
    from turnstile.cluster.jobs.run import TrainJob
    from turnstile.cluster.jobs.train import run_train
    from turnstile.rollout.trajectory import load_trajectories

    out = Path(os.environ["DRILL_OUT"])
    cluster = DrillCluster(head_resources={"CPU": 3},
                           worker_node_types={"fleet": {"resources": {"CPU": 1}, "node_config": {},
                                                        "min_workers": 0, "max_workers": 3}},
                           autoscaler_v2=True)
    cluster.start()
    try:
        ray.init(address="auto", configure_logging=False, log_to_driver=False)
        name = "drill"
        job = load_config(TrainJob, ROOT / "examples" / "train.yaml", [
            f"out={out}", f"name={name}", "mode=sync", f"steps={STEPS}", "tasks_per_step=4",
            "rollout.group_size=4", "eval_every=0", "rollout.engine.kind=sim",
            "rollout.engine.options={decode_s_per_token: 0.06, concurrency: 4}",
            "rollout.episode.max_new_tokens=512",
            "rollout.fleet.engine_cpus=1", "rollout.fleet.worker_cpus=1", "rollout.fleet.episodes_per_worker=8",
            "rollout.fleet.autoscale.enabled=true", "rollout.fleet.autoscale.max_engines=2",
            "rollout.fleet.autoscale.max_workers=2", "rollout.fleet.autoscale.options={episodes_per_replica: 4}",
            "rollout.fleet.autoscale.up_delay_s=0", "rollout.fleet.autoscale.down_delay_s=5",
            "rollout.fleet.autoscale.interval_s=0.5", "learner.mini_batch=16", "learner.micro_batch=4",
            "learner.threads=0", "rollout.corpus.port=0", "rollout.ray.address=auto"])
        watcher = Watcher(name)
        watcher.start()
        state = run_train(job, progress=False)
        time.sleep(20)  # the fleet is gone: the added nodes go idle and the autoscaler removes them
        watcher.stop.set()
        watcher.join(timeout=10)
        trained = [t for step in range(STEPS) for t in load_trajectories(out / "scored" / f"step{step}.jsonl")]
        counts = Counter((t.uid, t.sample) for t in trained)
        events = [json.loads(line) for line in (out / "fleet.jsonl").read_text().splitlines()]
        print(json.dumps({"steps": state.step, "weights_version": state.weights_version,
                          "samples": len(trained), "distinct_samples": len(counts),
                          "groups": Counter(uid for uid, _ in counts).most_common(),
                          "nodes": watcher.nodes, "replica_nodes": watcher.replica_nodes,
                          "head": FAKE_HEAD_NODE_ID, "killed": watcher.killed, "events": events}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

"""The Kubernetes manifests (cluster/k8s/) against what turnstile relies on in them.

The KubeRay CRD schema cannot be had on this machine (no network beyond the package registries, and
no package ships it), so these tests check the fields turnstile depends on, including the CRD's
own typing where it matters (``rayStartParams`` is a map of strings), and that the RayJob's command
line is a valid ``turnstile train`` configuration whose fleet fits the cluster's worker groups.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import ray
import yaml

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "cluster" / "k8s"


def manifests(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def pod_templates(cluster: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"], *(group["template"] for group in spec["workerGroupSpecs"])]


def limits(template: dict) -> dict[str, str]:
    (container,) = template["spec"]["containers"]
    return container["resources"]["limits"]


def test_the_raycluster_autoscales_with_autoscaler_v2_on_this_ray() -> None:
    (cluster,) = manifests("raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__  # the Ray the image runs is the Ray we test with
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    head_env = {e["name"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert "RAY_enable_autoscaler_v2" in head_env  # KubeRay before 1.4 reads the variable instead
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no actor on the head
    for template in pod_templates(cluster):
        assert template["spec"]["restartPolicy"] == "Never"  # autoscaler v2 replaces failed pods
        images = {c["image"] for c in template["spec"]["containers"]}
        assert images == {"turnstile:0.1"}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # CRD: map of strings
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    assert limits(groups["gpu"]["template"])["nvidia.com/gpu"] == groups["gpu"]["rayStartParams"]["num-gpus"] == "1"
    assert "nvidia.com/gpu" not in limits(groups["cpu"]["template"])


def test_the_rayjob_runs_a_valid_train_config_that_fits_the_cluster() -> None:
    (cluster,) = manifests("raycluster.yaml")
    (job,) = manifests("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    # The entrypoint reads examples/ from the image's copy of the repository.
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {"working_dir": "/home/ray/turnstile"}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["turnstile", "train", "--config"]
    config = ROOT / argv[3]
    assert config.is_file(), argv[3]
    train = load_config(TrainJob, config, argv[4:])  # every override a known key with a valid value
    fleet, autoscale = train.rollout.fleet, train.rollout.fleet.autoscale
    assert autoscale.enabled and autoscale.min_engines <= fleet.engine_replicas <= autoscale.max_engines
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    gpu_pods, cpu_pods = groups["gpu"], groups["cpu"]
    # One GPU pod per engine replica and per learner rank (the policy's, and the KL reference's), at
    # the largest fleet.
    assert fleet.engine_gpus == 1 and train.learner.gpu
    learner_gpus = train.learner.processes * (2 if train.learner.kl_coef > 0 else 1)
    assert autoscale.max_engines + learner_gpus <= gpu_pods["maxReplicas"]
    assert 1 + learner_gpus <= gpu_pods["minReplicas"]
    assert fleet.engine_cpus <= float(limits(gpu_pods["template"])["cpu"])
    per_pod = float(limits(cpu_pods["template"])["cpu"]) // fleet.worker_cpus
    assert autoscale.max_workers <= per_pod * cpu_pods["maxReplicas"]
    # The store is the Redis of redis.yaml, with its password from the Secret every pod reads.
    service = next(doc for doc in manifests("redis.yaml") if doc["kind"] == "Service")
    assert train.store.kind == "redis" and train.store.url.startswith(f"redis://{service['metadata']['name']}:6379/")
    for template in pod_templates(cluster):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env[train.store.password_env]["valueFrom"]["secretKeyRef"]["name"] == service["metadata"]["name"]


def test_the_redis_keeps_an_append_only_file() -> None:
    stateful = next(doc for doc in manifests("redis.yaml") if doc["kind"] == "StatefulSet")
    args = stateful["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"  # turnstile refuses a Redis without one
    assert args[args.index("--appendfsync") + 1] in ("everysec", "always")

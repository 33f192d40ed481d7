"""A run that the local Ray cannot hold is refused before any actor starts, naming what it asks
for and what there is; on a joined cluster (which an autoscaler may grow) it waits, and says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_train import EXAMPLE, SMALL
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.fleet import room
from turnstile.cluster.fleet.room import ClusterTooSmall, Demand, check_room, shortfall
from turnstile.cluster.jobs.run import TrainJob
from turnstile.cluster.jobs.train import run_train

ONE_NODE = [{"CPU": 4.0}]


def test_what_fits_is_not_reported() -> None:
    demands = [Demand("rollout.fleet.engine_replicas", 1, 1.0), Demand("rollout.fleet.workers", 2, 0.5),
               Demand("learner.dp", 1, 1.0), Demand("reward_service.workers", 1, 1.0)]
    assert shortfall(demands, ONE_NODE) == ""  # exactly 4 CPUs
    assert shortfall([Demand("rollout.fleet.workers", 0, 8.0)], ONE_NODE) == ""  # none of them


def test_too_many_cpus_in_all_names_each_part_and_the_totals() -> None:
    demands = [Demand("rollout.fleet.engine_replicas", 2, 0.5), Demand("rollout.fleet.workers", 2, 0.5),
               Demand("learner.dp", 1, 1.0), Demand("reward_service.workers", 2, 1.0)]
    said = shortfall(demands, ONE_NODE)
    assert "5 CPUs at once, the cluster has 4" in said
    for part in ("rollout.fleet.engine_replicas: 2 x 0.5 CPU", "rollout.fleet.workers: 2 x 0.5 CPU",
                 "learner.dp: 1 x 1 CPU", "reward_service.workers: 2 x 1 CPU"):
        assert part in said
    assert "GPU" not in said.split("(")[0]  # only what is short is named as short


def test_a_gpu_that_no_node_has_and_an_actor_larger_than_any_node_are_named() -> None:
    said = shortfall([Demand("rollout.fleet.engine_replicas", 1, 1.0, 1.0)], [{"CPU": 8.0}, {"CPU": 8.0}])
    assert "1 GPUs at once, the cluster has 0" in said and "more than any node has" in said
    # 6 CPUs in all on two 4-CPU nodes fit in total, but no node holds one 6-CPU worker.
    said = shortfall([Demand("learner.dp", 1, 6.0)], [{"CPU": 4.0}, {"CPU": 4.0}])
    assert "at once" not in said and "one of learner.dp asks for 6 CPU and 0 GPU, more than any node has" in said


@pytest.mark.integration
def test_on_a_joined_cluster_it_waits_and_says_so(ray_local: None, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert room.started_here()  # the session's Ray was started in this process
    too_many = [Demand("rollout.fleet.workers", 1000, 1.0)]
    with pytest.raises(ClusterTooSmall, match=r"1000 CPUs at once, the cluster has \d+.*cannot grow"):
        check_room(too_many)
    monkeypatch.setattr(room, "started_here", lambda: False)  # as a driver that joined a cluster
    check_room(too_many)
    assert "turnstile: waiting for the cluster to grow: the run needs 1000 CPUs" in capsys.readouterr().err


@pytest.mark.integration
def test_a_train_run_the_local_ray_cannot_hold_is_refused_before_any_actor_starts(
        ray_local: None, tmp_path: Path) -> None:
    # Before this check, the run below started its fleet and learner, then waited forever on a
    # reward worker for which the session's Ray had no CPU left.
    import ray

    cpus = ray.cluster_resources()["CPU"]
    workers = int(cpus)  # the reward workers alone take every CPU; the fleet and learner need more
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "mode=async", f"reward_service.workers={workers}",
                                          "name=toobig", f"out={tmp_path}"])
    with pytest.raises(ClusterTooSmall) as refused:
        run_train(job, progress=False)
    said = str(refused.value)  # the plan's check (cluster/jobs/plan.py), before the fleet's own
    assert f"the run does not fit this machine (1 x ({cpus:g} CPUs" in said
    room = re.search(rf"reward worker: {workers} x \(1 CPU, [0-9.]+ GB host\) do not fit beside the other roles; "
                     r"room for (\d+): lower reward_service.workers to (\d+)", said)
    assert room and room[1] == room[2] and 0 < int(room[1]) < workers, said
    assert not [name for name in ray.util.list_named_actors() if name.startswith("toobig")]

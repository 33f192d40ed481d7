"""The scheduling rules the fleet simulator drives (router placement, the sizer's delays) and the
simulator itself (benchmarks/fleet_sim.py) on a small fleet: every episode reaches the store once,
async beats sync, the autoscaled fleet keeps up with the static maximum on bursts at less cost,
and without the router's rebalancing the replicas that join later would idle."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import fleet_sim
from turnstile.cluster.fleet.autoscale import AutoscaleConfig, FleetView, Sizer, build_policy
from turnstile.rollout.fleet import EngineRouter


def test_an_episode_stays_on_its_replica_until_it_is_much_busier_than_the_least_loaded() -> None:
    router = EngineRouter({0: "replica-0"})
    assert router.choose("a") == 0
    router.set_replicas({0: "replica-0", 1: "replica-1"})  # a replica joins
    for _ in range(EngineRouter.MOVE_AFTER):
        router.sent(0)
    assert router.choose("a") == 0  # the prefix cache is worth a small imbalance
    assert router.choose("new") == 1  # a new episode goes to the least loaded
    router.sent(0)
    assert router.choose("a") == 1  # past MOVE_AFTER it moves, and stays there
    router.sent(0, -5)
    assert router.choose("a") == 1
    router.set_replicas({})
    assert router.choose("a") is None


def _view(at: float, running: int) -> FleetView:
    return FleetView(elapsed_s=at, engines=1, workers=1, running=running, waiting=0, finished=0,
                     episodes_per_worker=8)


def test_the_sizer_holds_a_change_for_its_delay_and_clamps_it() -> None:
    config = AutoscaleConfig(enabled=True, min_engines=1, max_engines=3, max_workers=4,
                             up_delay_s=5, down_delay_s=30, options={"episodes_per_replica": 4})
    sizer = Sizer(config, build_policy(config), 1, 1)
    assert sizer.update(_view(0, 40), 0.0) is None  # wanted 10 replicas: clamped to 3, held
    assert sizer.update(_view(4, 40), 4.9) is None
    grown = sizer.update(_view(5, 40), 5.0)
    assert grown is not None and (grown.engines, grown.workers) == (3, 4) == sizer.wanted
    assert sizer.update(_view(6, 0), 6.0) is None  # shrinking waits down_delay_s
    assert sizer.update(_view(20, 40), 20.0) is None  # wanted the same again: the hold resets
    assert sizer.update(_view(21, 0), 21.0) is None and sizer.update(_view(50, 0), 50.0) is None
    shrunk = sizer.update(_view(51, 0), 51.0)
    assert shrunk is not None and sizer.wanted == (1, 1)
    # A load that keeps falling is followed down within the delay, not held until it settles.
    falling = Sizer(config, build_policy(config), 3, 4)
    sizes = [falling.update(_view(t, max(0, 12 - t // 4)), float(t)) and falling.wanted[0] for t in range(80)]
    assert falling.wanted == (1, 1) and sizes.index(2) < sizes.index(1) <= 30 + 4 * 12, sizes
    fixed = Sizer(AutoscaleConfig(), None, 2, 3)  # autoscaling off: the configured size, always
    assert fixed.update(_view(0, 100), 100.0) is None and fixed.wanted == (2, 3)


@pytest.fixture(scope="module")
def small(shared_data: Path) -> tuple[fleet_sim.Setup, AutoscaleConfig, list, fleet_sim.Workload]:
    workload = fleet_sim.Workload(turns_median=6)
    base = fleet_sim.Setup("", "async", engines=4, workers=8, tasks_per_step=8, steps=4, learner_s=100.0,
                           episodes_per_worker=16, bursts=2, burst_every_s=2400.0,
                           latency=fleet_sim.SimOptions(prefill_s_per_token=1e-4, decode_s_per_token=0.015,
                                                        concurrency=8, load_s=10.0))
    autoscale = AutoscaleConfig(enabled=True, min_engines=1, max_engines=4, min_workers=1, max_workers=8,
                                up_delay_s=5, down_delay_s=60, options={"episodes_per_replica": 8})
    trace = fleet_sim.make_trace(256, workload, fleet_sim.token_samples(shared_data / fleet_sim.TRAJECTORIES), 0)
    return base, autoscale, trace, workload


def _run(setup: fleet_sim.Setup, trace: list, workload: fleet_sim.Workload) -> dict[str, float]:
    result = fleet_sim.FleetSim(setup, trace, workload).run()
    assert result.trained + result.stale == setup.steps * setup.tasks_per_step * setup.group_size
    return result.row(setup.latency.concurrency)


def test_async_trains_more_samples_per_second_than_sync(small) -> None:  # noqa: ANN001
    base, _, trace, workload = small
    sync = _run(replace(base, mode="sync"), trace, workload)
    fast = _run(base, trace, workload)
    assert sync["stale"] == 0 and sync["learner_idle"] > fast["learner_idle"]
    assert fast["samples_per_s"] > 1.5 * sync["samples_per_s"], (sync, fast)


def test_on_bursts_the_autoscaled_fleet_keeps_up_at_less_cost_and_needs_the_rebalancing(
        small, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    base, autoscale, trace, workload = small
    big = _run(replace(base, mode="bursty"), trace, workload)
    lean = replace(base, mode="bursty", engines=1, workers=1, autoscale=autoscale)
    auto = _run(lean, trace, workload)
    assert auto["samples_per_s"] >= 0.85 * big["samples_per_s"], (auto, big)
    assert auto["replica_s"] <= 0.75 * big["replica_s"], (auto, big)
    # Episodes that began on the one replica of a small fleet never leave it without rebalancing:
    monkeypatch.setattr(EngineRouter, "MOVE_AFTER", 10**9)
    stuck = _run(lean, trace, workload)
    assert stuck["moves"] < auto["moves"] and stuck["samples_per_s"] < 0.9 * auto["samples_per_s"], (stuck, auto)

"""The elastic rollout fleet (cluster/fleet/elastic.py, cluster/fleet/autoscale.py) on a local Ray: it grows and
shrinks while episodes run and nothing is lost or run twice; a replica that joins serves the
published weights before it gets a request; a dead replica or worker is replaced. The policies and
the settings are checked without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from tests.tools_for_tests import WorkerKiller
from turnstile.cluster.cli.config import ConfigError, load_config
from turnstile.cluster.fleet.autoscale import AutoscaleConfig, FleetView, Schedule, TargetLoad, build_policy
from turnstile.cluster.fleet.elastic import ElasticFleet, elastic_fleet
from turnstile.cluster.jobs.rollout import fleet_events, run_rollout
from turnstile.cluster.jobs.session import RolloutJob, serve_corpus
from turnstile.envs.answers import answer_matches
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.model_store import resolve_model
from turnstile.rollout.trajectory import StopReason, load_trajectories
from turnstile.rollout.workers import WorkerSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ONE_HOP = "{min_hops: 1, max_hops: 1, entity_answer_fraction: 1.0, aggregation_fraction: 0.0, count: 200}"


def view(running: int = 0, waiting: int = 0, finished: int = 0) -> FleetView:
    return FleetView(elapsed_s=0.0, engines=1, workers=1, running=running, waiting=waiting,
                     finished=finished, episodes_per_worker=8)


def test_target_load_sizes_the_fleet_by_episodes_per_replica() -> None:
    policy = TargetLoad(TargetLoad.Options(episodes_per_replica=16))
    assert (policy.decide(view()).engines, policy.decide(view()).workers) == (0, 0)  # the fleet clamps to min
    want = policy.decide(view(running=16, waiting=17))
    assert (want.engines, want.workers) == (3, 5) and "33 episodes" in want.reason


def test_schedule_follows_finished_episodes_and_refuses_bad_steps() -> None:
    policy = build_policy(AutoscaleConfig(enabled=True, kind="schedule", options={"steps": [
        {"after": 10, "engines": 3, "workers": 2}, {"after": 0, "engines": 1, "workers": 1}]}))
    assert isinstance(policy, Schedule)
    assert (policy.decide(view(finished=9)).engines, policy.decide(view(finished=10)).engines) == (1, 3)
    with pytest.raises(ValueError, match="exactly the keys"):
        build_policy(AutoscaleConfig(kind="schedule", options={"steps": [{"after": 0, "engines": 1}]}))
    with pytest.raises(ValueError, match=r"needs options.steps"):
        build_policy(AutoscaleConfig(kind="schedule"))
    with pytest.raises(ValueError, match="unknown option 'target'"):
        build_policy(AutoscaleConfig(kind="target_load", options={"target": 3}))
    with pytest.raises(ValueError, match=r"rollout.fleet.autoscale.kind"):
        build_policy(AutoscaleConfig(kind="no_such_policy"))


def test_autoscale_settings_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="max_engines=1 must be >= min_engines=2"):
        load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml",
                    ["fleet.autoscale.min_engines=2", "fleet.autoscale.max_engines=1"])
    with pytest.raises(ConfigError, match="down_delay_s"):
        load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml", ["fleet.autoscale.down_delay_s=-1"])


def sim_rollout(*extra: str) -> RolloutJob:
    # The scripted expert at a model server's pace (20 ms a token, 4 sequences per replica) on
    # one-relation questions (about 5 turns): an episode takes seconds, so the fleet changes while
    # episodes run.
    return load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml", [
        "data.limit=8", "group_size=4", "engine.kind=sim", f"data.options={ONE_HOP}",
        "engine.options={decode_s_per_token: 0.02, concurrency: 4}", "fleet.workers=1",
        "fleet.episodes_per_worker=4", "fleet.engine_cpus=0.5", "fleet.worker_cpus=0.5",
        "fleet.autoscale.interval_s=0.2", *extra])


def events_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.integration
def test_the_fleet_grows_and_shrinks_mid_run_and_every_episode_runs_once(ray_local: None,
                                                                         tmp_path: Path) -> None:
    # A user's policy, loaded by import path: two of each once running, one of each again later.
    cfg = sim_rollout("fleet.autoscale.enabled=true", "fleet.autoscale.kind=tests.user_plugins:GrowThenShrink",
                      "fleet.autoscale.options={more_episodes: 2}", "fleet.autoscale.up_delay_s=0",
                      "fleet.autoscale.down_delay_s=0")
    out = tmp_path / "elastic.jsonl"
    summary = run_rollout(cfg, out, progress=False)
    trajectories = load_trajectories(out)
    keys = [(t.uid, t.sample) for t in trajectories]
    assert len(keys) == len(set(keys)) == 32 and summary.failed == 0  # every episode, each once
    # Episodes that moved replica (theirs drained) carried on there: every one answered right.
    assert all(t.stop_reason is StopReason.ANSWERED and answer_matches(t.answer, t.answers) for t in trajectories)
    events = [(e["action"], e["member"]) for e in events_of(fleet_events(out))]
    for expected in [("up", "engine-1"), ("ready", "engine-1"), ("up", "worker-1"), ("ready", "worker-1")]:
        assert expected in events, events
    assert {a for a, m in events if m.startswith("engine")} >= {"down", "released"}, events
    assert {a for a, m in events if m.startswith("worker")} >= {"down", "released"}, events
    # A replica drains before it goes: released after down, and never "stopped" (late).
    assert all(action != "stopped" for action, _ in events), events
    replicas = {m for _, m in events if m.startswith("engine")}
    served = {m for t in trajectories for turn in t.turns for m in [turn.weights_version]}
    assert len(replicas) == 2 and served == {0}


@pytest.mark.integration
def test_a_dead_worker_is_replaced(ray_local: None, tmp_path: Path) -> None:
    # The only worker, killed for good: its episodes wait (not failed) until the replacement answers.
    cfg = sim_rollout("fleet.worker_restarts=0")
    out = tmp_path / "replaced.jsonl"
    with WorkerKiller(out, for_good=True):
        summary = run_rollout(cfg, out, progress=False)
    assert summary.episodes == 32 and summary.failed == 0 and summary.rerun >= 1
    events = [(e["action"], e["member"]) for e in events_of(fleet_events(out))]
    assert ("up", "worker-1") in events and ("ready", "worker-1") in events, events


def perturbed(model: str) -> dict[str, torch.Tensor]:
    """The model's weights, each moved by a function of itself (tied tensors stay tied): a version
    whose log-probs differ."""
    return {name: tensor + 0.05 * torch.sin(1000.0 * tensor) for name, tensor in base_weights(model).items()}


def reference_log_probs(model: str, weights: dict[str, torch.Tensor], ids: list[int], start: int) -> list[float]:
    """What the learner computes on these tokens: a plain transformers forward with these weights."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.load_state_dict(weights)
    with torch.no_grad():
        logits = policy(torch.tensor([ids])).logits[0].float()
    picked = torch.log_softmax(logits[start - 1:len(ids) - 1], dim=-1)
    return picked.gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.integration
async def test_a_replica_that_joins_or_replaces_serves_the_published_weights(ray_local: None,
                                                                            tmp_path: Path) -> None:
    model = str(resolve_model(""))
    rollout = sim_rollout()
    steps = "[{after: 0, engines: 2, workers: 1}]"
    config = load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml", [
        "fleet.engine_cpus=0.5", "fleet.worker_cpus=0.5", "fleet.autoscale.enabled=true",
        "fleet.autoscale.kind=schedule", f"fleet.autoscale.options={{steps: {steps}}}",
        "fleet.autoscale.up_delay_s=0", "fleet.autoscale.interval_s=0.2"]).fleet
    weights = perturbed(model)
    ids, start = list(range(5, 40)), 20
    name = f"j{tmp_path.name[-10:]}"
    with serve_corpus(rollout.corpus) as corpus, elastic_fleet(
            EngineConfig(kind="hf", model=model), config,
            WorkerSpec(tools=rollout.tools, episode=rollout.episode, context=rollout.context, corpus=corpus,
                       model=model), name, tmp_path / "fleet.jsonl") as fleet:
        # Published while the fleet has one replica; the schedule then wants two.
        assert await fleet.publish(weights, 1, mode="inplace", checkpoint_dir=None) == 1
        deadline = time.monotonic() + 120
        while fleet.view().engines < 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - a thread grows it
            await asyncio.sleep(0.2)
        assert fleet.view().engines == 2, fleet.events
        expected = reference_log_probs(model, weights, ids, start)
        joined = ray.get_actor(f"{name}-engine-1")
        served = ray.get(joined.score.remote([ids], [(start, len(ids))]))[0]
        assert ray.get(joined.weights_version.remote()) == 1
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4
        base = reference_log_probs(model, base_weights(model), ids, start)
        assert max(abs(a - b) for a, b in zip(served, base, strict=True)) > 1e-2  # not the base weights
        # A replica that dies is replaced by one that catches up the same way.
        ray.kill(ray.get_actor(f"{name}-engine-0"), no_restart=True)
        deadline = time.monotonic() + 120
        while not any(e.member == "engine-2" and e.action == "ready" for e in fleet.events) \
                and time.monotonic() < deadline:  # noqa: ASYNC110 - the fleet's thread replaces it
            await asyncio.sleep(0.2)
        replacement = ray.get_actor(f"{name}-engine-2")
        assert ray.get(replacement.weights_version.remote()) == 1
        served = ray.get(replacement.score.remote([ids], [(start, len(ids))]))[0]
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4
        assert fleet.router.replica_ids() == [1, 2]
    actions = [(e["action"], e["member"]) for e in events_of(tmp_path / "fleet.jsonl")]
    assert ("replace", "engine-0") in actions and ("ready", "engine-2") in actions


def base_weights(model: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()


@pytest.mark.integration
def test_a_training_run_grows_and_shrinks_and_the_learner_gets_every_sample_once(ray_local: None,
                                                                                 tmp_path: Path) -> None:
    from tests.test_train import EXAMPLE
    from tests.test_train_faults import STEPS, assert_exactly_once, overrides
    from turnstile.cluster.jobs.run import TrainJob
    from turnstile.cluster.jobs.train import run_train

    # Async training with the expert at a model server's pace; the fleet doubles once the run is
    # going, publishes reach whoever serves, and it shrinks back before the end.
    job = load_config(TrainJob, EXAMPLE, overrides(tmp_path, "memory", "", *[
        "rollout.engine.kind=sim", "rollout.engine.options={decode_s_per_token: 0.01, concurrency: 8}",
        "rollout.fleet.workers=1", "rollout.fleet.engine_cpus=0.5",
        "rollout.fleet.worker_cpus=0.5", "rollout.fleet.autoscale.enabled=true",
        "rollout.fleet.autoscale.kind=tests.user_plugins:GrowThenShrink",
        "rollout.fleet.autoscale.options={more_episodes: 4}", "rollout.fleet.autoscale.up_delay_s=0",
        "rollout.fleet.autoscale.down_delay_s=0", "rollout.fleet.autoscale.interval_s=0.2",
        "rollout.episode.max_new_tokens=512"]))
    state = run_train(job, progress=False)
    assert state.step == STEPS and state.weights_version == STEPS
    assert_exactly_once(tmp_path)
    events = [(e["action"], e["member"]) for e in events_of(tmp_path / "fleet.jsonl")]
    assert ("ready", "engine-1") in events and ("ready", "worker-1") in events, events
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert all(row["fleet/engines_ready"] >= 1 and row["fleet/workers_ready"] >= 1 for row in history)
    assert 0 < history[-1]["fleet/scale_events"] <= len(events)


@contextlib.contextmanager
def stuck_fleet(tmp_path: Path, replicas: int, hang: list[int], fail: list[int]) -> Iterator[tuple[ElasticFleet, str]]:
    """``replicas`` replicas of the scripted expert whose weight update hangs on ``hang`` and raises
    on ``fail``, with a publish time-out of 2 s; the fleet and its actors' name prefix."""
    rollout = sim_rollout()
    config = load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml", [
        f"fleet.engine_replicas={replicas}", "fleet.engine_cpus=0.5", "fleet.worker_cpus=0.5",
        "fleet.publish_timeout_s=2", "fleet.autoscale.interval_s=0.2"]).fleet
    engine = EngineConfig(kind="tests.user_plugins:StuckUpdateExpert", options={"hang": hang, "fail": fail})
    name = f"w{tmp_path.name[-10:]}"
    with serve_corpus(rollout.corpus) as corpus, elastic_fleet(
            engine, config, WorkerSpec(tools=rollout.tools, episode=rollout.episode, context=rollout.context,
                                       corpus=corpus, model=str(resolve_model(""))),
            name, tmp_path / "fleet.jsonl") as fleet:
        yield fleet, name


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["inplace", "checkpoint"])
async def test_replicas_that_do_not_take_the_new_weights_are_replaced(ray_local: None, tmp_path: Path,
                                                                      mode: str) -> None:
    """The weight-sync watchdog: engine-0's update hangs and engine-1's raises; the publish returns
    within its time-out with engine-2 serving the new version, the other two leave the routers at
    once and are replaced, and each replacement catches up to the published version before it serves."""
    with stuck_fleet(tmp_path, 3, hang=[0], fail=[1]) as (fleet, name):
        started = time.monotonic()
        assert await fleet.publish({}, 1, mode=mode, checkpoint_dir=str(tmp_path / "weights")) == 1
        assert time.monotonic() - started < 30  # the 2 s time-out, not the hour the update would hang
        assert fleet.router.replica_ids() == [2]  # out of the routers before the next request
        deadline = time.monotonic() + 120
        while sum(e.action == "ready" and e.member in ("engine-3", "engine-4") for e in fleet.events) < 2 \
                and time.monotonic() < deadline:  # noqa: ASYNC110 - the fleet's thread replaces them
            await asyncio.sleep(0.2)
        for replacement in (3, 4):
            assert ray.get(ray.get_actor(f"{name}-engine-{replacement}").weights_version.remote()) == 1
        assert fleet.router.replica_ids() == [2, 3, 4]
    replaced = {e["member"]: str(e["reason"]) for e in events_of(tmp_path / "fleet.jsonl") if e["action"] == "replace"}
    assert sorted(replaced) == ["engine-0", "engine-1"]
    assert "did not take version 1 within 2 s" in replaced["engine-0"]
    assert "failed to take version 1: RuntimeError: the new weights could not be loaded" in replaced["engine-1"]


@pytest.mark.integration
async def test_a_publish_that_no_replica_completes_stops_with_an_error(ray_local: None, tmp_path: Path) -> None:
    from turnstile.learner.publish import PublishError

    with stuck_fleet(tmp_path, 2, hang=[0, 1], fail=[]) as (fleet, _):
        started = time.monotonic()
        with pytest.raises(PublishError, match=r"no engine replica serves version 1 \(engine replica 0: did not "
                                               r"take version 1 within 2 s; engine replica 1: did not"):
            await fleet.publish({}, 1, mode="inplace", checkpoint_dir=None)
        assert time.monotonic() - started < 30

"""The rollout fleet on Ray: engine actors, routing, workers running concurrent episodes, the
trajectory file, and a worker killed mid-run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.tools_for_tests import WorkerKiller
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.rollout import run_rollout
from turnstile.cluster.jobs.session import RolloutJob
from turnstile.envs.answers import answer_matches
from turnstile.rollout.trajectory import StopReason, load_trajectories

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def scripted(limit: int, group: int, workers: int = 2, per_worker: int = 4) -> RolloutJob:
    return load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml",
                       [f"data.limit={limit}", f"group_size={group}", f"fleet.workers={workers}",
                        f"fleet.episodes_per_worker={per_worker}"])


def test_every_example_config_loads() -> None:
    for path in sorted(EXAMPLES.glob("rollout*.yaml")):
        assert isinstance(load_config(RolloutJob, path), RolloutJob), path


def check_file(out: Path, expected: set[tuple[str, int]]) -> list:
    trajectories = load_trajectories(out)
    assert {(t.uid, t.sample) for t in trajectories} == expected  # each exactly once
    assert len(trajectories) == len(expected)
    for trajectory in trajectories:
        for segment in trajectory.segments:
            assert len(segment.flat_ids()) == len(segment)
            assert segment.turns[-1].context_len <= len(segment)
    return trajectories


def test_scripted_rollout_answers_through_the_fleet(ray_local: None, tmp_path: Path) -> None:
    cfg = scripted(limit=3, group=2)
    out = tmp_path / "scripted.jsonl"
    summary = run_rollout(cfg, out, progress=False)
    tasks = {t.uid for t in load_trajectories(out)}
    trajectories = check_file(out, {(uid, g) for uid in tasks for g in range(2)})
    assert len(tasks) == 3 and summary.episodes == 6 and summary.failed == 0
    assert all(t.stop_reason is StopReason.ANSWERED and answer_matches(t.answer, t.answers)
               for t in trajectories)
    assert summary.accuracy == 1.0 and summary.turns == sum(len(t.turns) for t in trajectories)
    assert summary.tool_calls == sum(t.tool is not None for tr in trajectories for t in tr.turns)


def test_killed_worker_episodes_are_rerun_not_lost(ray_local: None, tmp_path: Path) -> None:
    cfg = scripted(limit=4, group=2, workers=2, per_worker=2)
    out = tmp_path / "killed.jsonl"
    with WorkerKiller(out):  # Ray restarts it
        summary = run_rollout(cfg, out, progress=False)
    tasks = {t.uid for t in load_trajectories(out)}
    check_file(out, {(uid, g) for uid in tasks for g in range(2)})
    assert len(tasks) == 4 and summary.failed == 0 and summary.episodes == 8
    assert summary.rerun >= 1  # the killed worker's running episodes went elsewhere


def test_vllm_rollout_writes_trajectories(ray_local: None, tmp_path: Path) -> None:
    cfg = load_config(RolloutJob, EXAMPLES / "rollout.yaml", ["data.limit=2", "group_size=2"])
    out = tmp_path / "vllm.jsonl"
    summary = run_rollout(cfg, out, progress=False)
    tasks = {t.uid for t in load_trajectories(out)}
    trajectories = check_file(out, {(uid, g) for uid in tasks for g in range(2)})
    assert summary.episodes == 4 and summary.turns > 4
    for trajectory in trajectories:
        turns = trajectory.turns
        assert all(turn.weights_version == 0 for turn in turns)
        assert all(len(turn.response_ids) == len(turn.response_logprobs) for turn in turns)
        assert all(-1e4 < lp <= 0 for turn in turns for lp in turn.response_logprobs)


# iter_research starts every round from a fresh workspace, so the random model's episodes never fill
# the context and would run the example's 200 turns: 24 rounds show the same; discard_all keeps the
# example's limits (its resets come from a full context).
LIMITS = {"iter_research": ["episode.env.max_turns=24"], "discard_all": []}


@pytest.mark.parametrize("kind", ["iter_research", "discard_all"])
def test_other_context_managers_roll_out(ray_local: None, tmp_path: Path, kind: str) -> None:
    cfg = load_config(RolloutJob, EXAMPLES / f"rollout_{kind}.yaml",
                      ["data.limit=2", "group_size=2", "episode.max_new_tokens=64", *LIMITS[kind]])
    out = tmp_path / f"{kind}.jsonl"
    summary = run_rollout(replace(cfg), out, progress=False)
    trajectories = load_trajectories(out)
    assert summary.episodes == 4 and all(t.context_manager == kind for t in trajectories)
    if kind == "iter_research":
        assert all(len(t.segments) == len(t.turns) for t in trajectories)
    else:
        assert all(1 <= len(t.segments) <= 3 for t in trajectories)


def test_hostile_turns_do_not_end_the_run(ray_local: None, tmp_path: Path) -> None:
    from tests.hostile import HOSTILE_TURNS

    cfg = load_config(RolloutJob, EXAMPLES / "rollout_scripted.yaml",
                      ["data.limit=3", "group_size=2", "fleet.workers=1", "engine.kind=tests.hostile:HostileEngine",
                       "episode.max_new_tokens=4096"])
    out = tmp_path / "hostile.jsonl"
    summary = run_rollout(cfg, out, progress=False)
    tasks = {t.uid for t in load_trajectories(out)}
    trajectories = check_file(out, {(uid, g) for uid in tasks for g in range(2)})
    assert len(tasks) == 3 and summary.episodes == 6 and summary.errors == 0
    hostile = [t.turns[1] for t in trajectories if t.sample == 0]
    assert sorted(turn.response_text for turn in hostile) == sorted(HOSTILE_TURNS)
    assert all(not turn.format_ok and turn.tool_ok is None for turn in hostile)
    assert {e.split(" (")[0] for turn in hostile for e in turn.format_errors} >= {
        "the tool call is nested too deeply", "the tool call holds a lone UTF-16 surrogate"}
    assert all(len(t.turns) > 2 for t in trajectories if t.sample == 0)  # the episodes went on


def test_a_run_where_every_episode_fails_exits_nonzero(ray_local: None, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from turnstile.cluster.cli.commands import rollout as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)  # the command's own arguments, as the CLI parses them
    args = parser.parse_args(["--config", str(EXAMPLES / "rollout_scripted.yaml"), "--out", str(tmp_path / "f.jsonl"),
                              "--no-progress", "data.limit=2", "engine.kind=tests.hostile:FailingEngine"])
    assert command.run(args) == 1
    printed = capsys.readouterr().out
    assert "every episode failed; the first said: the engine failed on turn 0: RuntimeError: this engine " \
           "serves nothing" in printed
    assert len(load_trajectories(tmp_path / "f.jsonl")) == 4  # each recorded with its error


def test_an_engine_that_cannot_start_ends_the_run_once_saying_why(ray_local: None, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The replica starts its engine before any episode runs; its failure ends the command there,
    with the engine's own reason, instead of failing every episode one by one."""
    import argparse

    from turnstile.cluster.cli.commands import rollout as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--config", str(EXAMPLES / "rollout_scripted.yaml"), "--out", str(tmp_path / "f.jsonl"),
                              "--no-progress", "data.limit=2", "engine.kind=tests.hostile:UnstartableEngine"])
    assert command.run(args) == 1
    printed = capsys.readouterr().out
    assert ("turnstile rollout: engine-0 could not start: RuntimeError: this engine cannot start "
            "(tests.hostile:UnstartableEngine)") in printed
    assert "Traceback" not in printed
    assert not (tmp_path / "f.jsonl").exists()  # no episode ran


def test_a_second_env_runs_through_the_same_rollout(ray_local: None, tmp_path: Path) -> None:
    # The calculator environment and the arithmetic dataset, chosen by config alone; the policy is a
    # user's scripted engine (tests.user_plugins) that is right in sample 0 and off by one in sample 1.
    cfg = load_config(RolloutJob, EXAMPLES / "rollout_calculator.yaml",
                      ["data.limit=3", "group_size=2", "engine.kind=tests.user_plugins:CalculatorExpert"])
    out = tmp_path / "calculator.jsonl"
    summary = run_rollout(cfg, out, progress=False)
    trajectories = load_trajectories(out)
    assert summary.episodes == 6 and summary.failed == 0 and summary.accuracy == 0.5
    assert all(t.stop_reason is StopReason.ANSWERED and len(t.turns) == 2 for t in trajectories)
    assert all(t.turns[0].tool == "calculate" and t.turns[0].tool_ok for t in trajectories)
    assert all(f"= {t.answers[0]}" in t.turns[0].observation_text for t in trajectories)
    assert {answer_matches(t.answer, t.answers) for t in trajectories if t.sample == 0} == {True}


def test_a_local_ray_keeps_a_bounded_number_of_task_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every actor call leaves a record in the GCS until ``ray.task_events`` are kept (Ray's own
    default, 100,000, is ~330 MB a long run reaches): a local Ray's GCS is started with the bound, a
    joined cluster keeps its own settings."""
    import os

    import ray

    from turnstile.cluster.jobs.session import TASK_EVENTS_VARIABLE, RayConfig, init_ray

    started: list[str | None] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: started.append(os.environ.get(TASK_EVENTS_VARIABLE)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(TASK_EVENTS_VARIABLE, raising=False)
    init_ray(RayConfig(address="127.0.0.1:6379"))
    init_ray(RayConfig(num_cpus=2, task_events=500))
    assert started == [None, "500"]
    assert RayConfig().task_events == 10_000
    with pytest.raises(ValueError, match="task_events"):
        RayConfig(task_events=0)

"""turnstile train (synchronous): steps run end to end, weights are published, resume continues."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnstile.cluster.cli import main
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import (
    TrainError,
    TrainJob,
    check,
    needs_archive,
    placed_rewards,
    probing,
    step_tasks,
    trainable,
)
from turnstile.cluster.jobs.train import learning_line, run_train
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.rollout.model_store import BUILD_INFO, WARM_MODEL, ensure_default_model, resolve_model
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn, load_trajectories

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.yaml"
SMALL = ["steps=2", "tasks_per_step=1", "rollout.group_size=4", "rollout.engine.kind=hf",
         "rollout.episode.max_new_tokens=24", "rollout.episode.env.max_turns=2", "eval_every=2",
         "eval_data.limit=1", "learner.mini_batch=4", "learner.micro_batch=2", "learner.threads=0",
         "rollout.corpus.port=0"]


def test_step_tasks_walk_the_list_and_wrap() -> None:
    tasks = [Task(id=str(i), question="q", answers=("a",)) for i in range(5)]
    assert [t.id for t in step_tasks(tasks, 0, 2, shuffle=False, seed=0)] == ["0", "1"]
    assert [t.id for t in step_tasks(tasks, 2, 2, shuffle=False, seed=0)] == ["4", "0"]


def test_shuffled_steps_visit_every_task_once_a_pass_in_a_new_order() -> None:
    tasks = [Task(id=str(i), question="q", answers=("a",)) for i in range(20)]
    walk = [t.id for step in range(10) for t in step_tasks(tasks, step, 4, shuffle=True, seed=7)]
    first, second = walk[:20], walk[20:]
    assert sorted(first) == sorted(second) == sorted(t.id for t in tasks)  # each pass: all, once
    assert first != [t.id for t in tasks] and first != second  # shuffled, and anew each pass
    # A function of the step alone (a resumed run continues the walk); the seed changes it.
    assert [t.id for t in step_tasks(tasks, 3, 4, shuffle=True, seed=7)] == walk[12:16]
    assert walk != [t.id for step in range(10) for t in step_tasks(tasks, step, 4, shuffle=True, seed=8)]


def test_a_step_trains_on_scored_fresh_turns_and_counts_the_rest() -> None:
    """An episode the reward service gave up on (no outcome) is left out of credit and counted,
    not handed to the estimator (which refuses it and would stop an async run)."""
    def episode(sample: int, versions: list[int], outcome: float | None = 1.0) -> Trajectory:
        turns = [Turn(index=i, response_ids=[5, 6], response_logprobs=[-0.1, -0.2], weights_version=v,
                      context_len=4, finish_reason="stop") for i, v in enumerate(versions)]
        return Trajectory(uid="g", sample=sample, task_id="t", question="q?", answers=["a"],
                          segments=[Segment(prompt_ids=[1, 2], turns=turns)] if turns else [],
                          stop_reason=StopReason.ANSWERED, outcome=outcome)

    batch = [episode(0, [3, 4]), episode(1, [1, 4]), episode(2, []), episode(3, [4], outcome=None),
             episode(4, [2])]
    fresh, left_out = trainable(batch, version=4, staleness=2)
    assert [t.sample for t in fresh] == [0, 4]
    assert left_out == {"empty": 1, "unscored": 1, "stale": 1, "environment": 0}


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="mode='turbo'"):
        TrainJob(mode="turbo")
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        TrainJob(steps=0)
    with pytest.raises(TrainError, match=r"estimator.kind: unknown estimator 'nope'"):
        check(TrainJob(estimator=PluginSpec(kind="nope")))


def test_the_example_is_the_embedded_default() -> None:
    """`turnstile train` with no config and examples/train.yaml run the same experiment."""
    from dataclasses import asdict

    assert asdict(load_config(TrainJob, EXAMPLE, [])) == asdict(TrainJob())


@pytest.mark.integration
@pytest.mark.timeout(1200)  # two runs with their evaluations
def test_train_then_resume_without_repeating_a_step(ray_local: None, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "eval_samples=2", f"out={tmp_path}"])
    state = run_train(job, progress=False)
    printed = capsys.readouterr().out
    assert state.step == 2 and state.weights_version == 2
    assert "step 1 | reward" in printed and "step 2 | reward" in printed and "eval @ step 2" in printed
    assert "eval @ step 0" in printed  # the policy before its first update
    line = learning_line(tmp_path, state)  # `turnstile train` ends with it
    assert line.startswith("held-out accuracy ") and "(step 0 -> 2)" in line and "over 1 tasks" in line
    first = load_trajectories(tmp_path / "rollouts" / "step0.jsonl")
    second = load_trajectories(tmp_path / "rollouts" / "step1.jsonl")
    assert len(first) == len(second) == 4
    # Step 1's rollouts ran on the weights published after step 0.
    assert {turn.weights_version for t in first for turn in t.turns} == {0}
    assert {turn.weights_version for t in second for turn in t.turns} == {1}
    scored = load_trajectories(tmp_path / "scored" / "step1.jsonl")
    assert [t.sample for t in scored] == [t.sample for t in second]
    assert all(t.outcome is not None and all(turn.advantage is not None for turn in t.turns)
               for t in scored)

    resumed = run_train(load_config(TrainJob, EXAMPLE, [*SMALL, "steps=3", "resume=true",
                                                          f"out={tmp_path}"]), progress=False)
    printed = capsys.readouterr().out
    assert "resumed at step 2 (weights version 2)" in printed
    assert "step 3 | reward" in printed and "step 1 | reward" not in printed and "step 2 | reward" not in printed
    assert resumed.step == 3 and resumed.weights_version == 3
    assert "eval @ step 0" not in printed  # a resumed run does not measure its start again
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert [int(m["step"]) for m in history] == [0, 1, 2, 3]
    assert history[0]["eval/episodes"] == 2 and 0.0 <= history[0]["eval/accuracy"] <= 1.0  # 1 task x 2 samples
    assert "eval/accuracy_low" in history[0] and "eval/format_rate" in history[0]
    # the default's held-out questions are one-hop: accuracy by hop count has that one entry
    assert history[0]["eval/accuracy_hops1"] == history[0]["eval/accuracy"]
    assert history[0]["eval/episodes_hops1"] == 2 and not any("hops2" in key for key in history[0])
    assert "eval/accuracy" in history[2] and "eval/accuracy" in history[3]  # every 2 steps, and the last
    assert all("format/ok_rate" in m and "time/rollout_s" in m and "learner/loss" in m for m in history[1:])
    assert (tmp_path / "tensorboard").is_dir() and any((tmp_path / "tensorboard").iterdir())
    third = load_trajectories(tmp_path / "rollouts" / "step2.jsonl")
    assert {turn.weights_version for t in third for turn in t.turns} == {2}
    # The policy of the last checkpoint, a model directory `turnstile eval` takes by the run's name.
    assert resolve_model(str(tmp_path)) == str(tmp_path / "model")
    info = json.loads((tmp_path / "model" / BUILD_INFO).read_text())
    assert info["step"] == 3 and info["weights_version"] == 3 and info["base"]["name"] == WARM_MODEL


def test_gpu_cluster_example_is_a_valid_experiment() -> None:
    from turnstile.envs.datasets.registry import resolve_loader
    from turnstile.rewards.base import resolve_reward
    from turnstile.rollout.engines.registry import resolve_engine

    # The example's Redis lives on the cluster: its persistence is checked there, at start.
    job = load_config(TrainJob, EXAMPLE.parent / "train_gpu.yaml", ["store.require_durable=false"])
    check(job)  # the estimator's and the rewards' options
    assert job.mode == "async" and job.learner.gpu is True
    # four policy GPUs, each sample split over two, a token budget that holds half of the longest
    assert job.learner.processes == 4 and job.learner.sequence_parallel == 2
    assert job.learner.max_tokens_per_gpu * job.learner.sequence_parallel >= job.learner.max_length
    assert job.rollout.fleet.engine_replicas > 1 and job.rollout.fleet.engine_gpus == 1
    assert job.rollout.engine.vllm.weight_sync == "checkpoint" and job.store.kind == "redis"
    assert job.learner.mini_batch % job.learner.dp == 0
    # information gain measured on the vLLM replicas: no model copy, no GPU for the reward workers
    assert [on for spec, on in placed_rewards(job) if spec.kind == "information_gain"] == [True]
    assert probing(job).rollout.episode.ig_probe.enabled and not needs_archive(job)
    assert job.reward_service.worker_gpus == 0
    for entry in job.rewards:
        resolve_reward(entry.kind)
    resolve_engine(job.rollout.engine.kind)
    resolve_loader(job.rollout.data.kind)
    resolve_loader(job.eval_data.kind)


def test_command_rejects_unknown_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", str(EXAMPLE), "learner.lr_typo=1"])
    assert done.value.code == 2 and "lr_typo" in capsys.readouterr().out


@pytest.mark.parametrize(("override", "says"), [
    ("learner.rollout_correction.rollout_is=tokens", "learner.rollout_correction.rollout_is='tokens' is not one of"),
    ("learner.rollout_correction.rollout_is_threshold=0.5",
     "learner.rollout_correction.rollout_is_threshold=0.5 is below 1"),
    ("learner.rollout_correction.rollout_is=turn", "learner: rollout_correction: turn-level weights"),
])
def test_a_bad_correction_setting_is_one_line_naming_the_key(capsys: pytest.CaptureFixture[str], override: str,
                                                             says: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", str(EXAMPLE), override])
    out = capsys.readouterr().out
    assert done.value.code == 2 and says in out and len(out.strip().splitlines()) == 1


def test_a_correction_needs_engines_that_give_log_probs() -> None:
    job = load_config(TrainJob, EXAMPLE, ["rollout.engine.kind=scripted", "learner.recompute_old_log_probs=true",
                                          "learner.rollout_correction.rollout_is=token"])
    with pytest.raises(TrainError, match=r"rollout\.engine\.kind=scripted returns no log-probs"):
        check(job)


@pytest.mark.integration
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_async_mode_bounds_staleness_and_trains(ray_local: None, redis_url: str, tmp_path: Path,
                                                store: str, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*SMALL, "mode=async", "staleness=1", "steps=3", "eval_every=0", f"out={tmp_path}",
                 f"store.kind={store}", f"store.namespace=t{tmp_path.name}",
                 "rollout.fleet.episodes_per_worker=16", *([f"store.url={redis_url}"] if store == "redis" else [])]
    job = load_config(TrainJob, EXAMPLE, overrides)
    # after the fact, by the archived version that generated each sample (the engine path, the
    # default on hf and vLLM, runs in test_train_faults.py)
    job.rewards.append(PluginSpec("information_gain", {"scorer": "kv_cache"}))
    state = run_train(job, progress=False)
    assert state.step == 3 and state.weights_version == 3
    # Admission: never more than (η + version + 1) batches of samples started.
    assert state.accepted <= (1 + 3 + 1) * 4
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert [int(m["step"]) for m in history] == [1, 2, 3]
    trained_on = [load_trajectories(tmp_path / "scored" / f"step{i}.jsonl") for i in range(3)]
    assert all(len(batch) == 4 and all(t.outcome is not None for t in batch) for batch in trained_on)
    # Every sample trained on is at most η versions old at its update (older ones are dropped).
    for step, batch in enumerate(trained_on):
        assert all(step - min(turn.weights_version for turn in t.turns) <= 1 + state.dropped_stale
                   for t in batch)
    keys = [(t.uid, t.sample) for batch in trained_on for t in batch]
    assert len(keys) == len(set(keys))  # each sample reached the learner once
    for t in (t for batch in trained_on for t in batch):
        versions = Counter(turn.weights_version for turn in t.turns)
        generating = max(versions, key=lambda v: (versions[v], v))
        assert t.metadata["ig_weights_version"] == generating  # kept: η + 2 versions
        assert all(turn.ig_value is not None and turn.ig_version == generating for turn in t.turns)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith("v")) == ["v1", "v2", "v3"]
    assert "step 3 | reward" in capsys.readouterr().out
    # Throughput is per second of the run: a step's wall time runs from the previous update's start,
    # so it covers that update (not the moment this step's ready batch waited).
    for before, after in itertools.pairwise(history):
        assert after["time/step_s"] >= before["time/credit_s"] + before["time/learner_s"] + before["time/publish_s"]
    for metrics, batch in zip(history, trained_on, strict=True):
        turns = sum(len(t.turns) for t in batch)
        assert metrics["throughput/turns_per_s"] * metrics["time/step_s"] == pytest.approx(turns)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_and_hostile_episodes_are_counted_not_fatal(ray_local: None, tmp_path: Path,
                                                          mode: str) -> None:
    # Sample 0 of every group fails on its first turn (an empty engine_error sample); sample 1 writes
    # a hostile turn (nesting, a surrogate, an unclosed call). The run trains on the rest.
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "steps=1", "eval_every=1", f"mode={mode}",
                                          "rollout.engine.kind=tests.hostile:FailsThenHostileEngine",
                                          "rollout.episode.max_new_tokens=4096",
                                          "rollout.episode.context_budget=200000",
                                          "rollout.episode.env.max_turns=8", f"out={tmp_path}"])
    state = run_train(job, progress=False)
    assert state.step == 1  # (an update needs signal: the expert's other samples may all be right)
    metrics = json.loads((tmp_path / "run.json").read_text())["history"][-1]
    assert metrics["rollout/stop_engine_error"] == 0.25
    # the empty engine_error sample is the environment's doing: left out as such, not as "empty"
    assert metrics["rollout/environment_left_out"] == 1 and metrics["rollout/empty"] == 0
    scored = load_trajectories(tmp_path / "scored" / "step0.jsonl")
    hostile = [t.turns[1] for t in scored if t.sample == 1]
    assert hostile and all(not turn.format_ok and turn.format_errors for turn in hostile)
    assert load_trajectories(tmp_path / "eval" / "step1.jsonl")  # the evaluation ran on the same fleet


@pytest.mark.integration
def test_a_second_env_trains_unchanged(ray_local: None, tmp_path: Path) -> None:
    # The calculator environment (examples/train_calculator.yaml) through the same driver, rewards and
    # learner; the policy is a user's scripted engine, right in sample 0 and off by one in sample 1,
    # so every group has signal and the learner updates the model on it.
    job = load_config(TrainJob, EXAMPLE.with_name("train_calculator.yaml"), [
        "steps=1", "tasks_per_step=2", "rollout.group_size=2", "eval_every=1", "eval_data.limit=2",
        "rollout.engine.kind=tests.user_plugins:CalculatorExpert", "learner.mini_batch=4",
        "learner.micro_batch=2", "learner.threads=0", f"out={tmp_path}"])
    state = run_train(job, progress=False)
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert state.step == 1 and history[-1]["learner/trained"] > 0 and history[-1]["learner/grad_norm"] > 0
    assert history[-1]["reward/accuracy"] == 0.5 and history[-1]["eval/accuracy"] == 1.0
    scored = load_trajectories(tmp_path / "scored" / "step0.jsonl")
    assert {turn.tool for t in scored for turn in t.turns} == {"calculate", None}


@pytest.mark.integration
def test_a_step_in_which_every_episode_fails_stops_the_run(ray_local: None, tmp_path: Path) -> None:
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "steps=1", "eval_every=0",
                                          "rollout.engine.kind=tests.hostile:FailingEngine", f"out={tmp_path}"])
    with pytest.raises(TrainError, match="every episode of step 1 failed; the first said: the engine failed "
                                         "on turn 0: RuntimeError: this engine serves nothing"):
        run_train(job, progress=False)


@pytest.mark.integration
def test_tasks_the_engine_cannot_serve_are_refused_at_start(ray_local: None, tmp_path: Path) -> None:
    # The corpus and the expert know the world of seed 0 only: seed 3's questions (their clue pages
    # absent from the corpus) are refused before any actor starts.
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "rollout.engine.kind=scripted", "rollout.data.seed=3",
                                          "eval_data.seed=3", f"out={tmp_path}"])
    with pytest.raises(ValueError, match=r"\d+ of \d+ tasks have clue pages the corpus .* does not serve"):
        run_train(job, progress=False)
    assert not (tmp_path / "rollouts").exists()


def test_a_reward_that_scores_with_the_policy_gets_the_runs_weights(tmp_path: Path) -> None:
    # The driver asks the plugin (scores_with_policy), it does not know information_gain by name.
    from types import SimpleNamespace

    from turnstile.cluster.jobs.console import TrainConsole
    from turnstile.cluster.jobs.run import Run
    from turnstile.envs.plugins import PluginSpec

    job = load_config(TrainJob, EXAMPLE, [f"out={tmp_path}"])
    job.rewards = [PluginSpec("tests.user_plugins:PolicyScore"), PluginSpec("exact_match"),
                   PluginSpec("information_gain", {"model": "own"})]
    session = SimpleNamespace(tasks=[[], []])
    run = Run(job, tmp_path, None, session, None, None, TrainConsole(1, live=False))  # type: ignore[arg-type]
    assert [spec.options for spec in run.reward_specs()] == [{}, {}, {"model": "own"}]  # no archive yet
    run.archive = SimpleNamespace(root=tmp_path / "weights")  # type: ignore[assignment]
    assert [spec.options for spec in run.reward_specs()] == [
        {"versions_dir": str(tmp_path / "weights")}, {}, {"model": "own"}]


def test_each_checkpoint_saves_the_learners_policy_whole_as_a_model_eval_takes_by_the_runs_name(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from turnstile.cluster.jobs.console import TrainConsole
    from turnstile.cluster.jobs.run import Run

    base = ensure_default_model()
    weights = {name: p.detach() for name, p in AutoModelForCausalLM.from_pretrained(base).named_parameters()}
    learner = SimpleNamespace(config=SimpleNamespace(model=str(base)), full_weights=lambda: trained)
    job = load_config(TrainJob, EXAMPLE, [f"out={tmp_path}"])
    run = Run(job, tmp_path, learner, SimpleNamespace(tasks=[[], []]), None, None,  # type: ignore[arg-type]
              TrainConsole(1, live=False))
    for step in (1, 2):
        trained = {name: w + step for name, w in weights.items()}
        run.state.step = run.state.weights_version = step
        run.save_model()
        model = AutoModelForCausalLM.from_pretrained(resolve_model(str(tmp_path)))
        assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())
        info = json.loads((tmp_path / "model" / BUILD_INFO).read_text())
        assert info["step"] == step and info["base"]["name"] == "tiny-qwen3"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left
    assert resolve_model(str(base)) == str(base)  # a model directory is itself


def test_a_worker_killed_for_memory_ends_the_run_with_one_line_and_the_way_to_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ray's memory monitor kills the learner's worker mid-step (seen with a 135M model beside an SFT
    run on 24 GB): the command says so in one line, names the checkpoint to resume from, exits 1."""
    import ray.exceptions

    import turnstile.cluster.jobs.session
    import turnstile.cluster.jobs.train
    from turnstile.cluster.cli import main

    def out_of_memory(*_: object, **__: object) -> None:
        raise ray.exceptions.OutOfMemoryError("3 worker(s) were killed due to the node running low on memory.\n"
                                              "Memory on the node was 22.40GB used / 23.54GB limit")

    monkeypatch.setattr(turnstile.cluster.jobs.train, "run_train", out_of_memory)
    monkeypatch.setattr(turnstile.cluster.jobs.session, "init_ray", lambda *_, **__: None)
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "learner.json").write_text('{"step": 3}')
    with pytest.raises(SystemExit) as exited:
        main(["train", f"out={out}", "--no-progress"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert exited.value.code == 1
    assert printed[-1] == (f"turnstile train: OutOfMemoryError: 3 worker(s) were killed due to the node running "
                           f"low on memory.; the last checkpoint (step 3) is in {out / 'checkpoint'}: continue "
                           "with --resume")
    assert "Traceback" not in "\n".join(printed)

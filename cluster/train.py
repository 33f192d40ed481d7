"""``turnstile train``: the main job, synchronous form.

Each step: the step's tasks × G samples → the rollout fleet (Ray workers driving the policy engines)
→ reward plugins on every group → credit assignment → one learner update (downsampled to the
data-parallel size) → the new weights published to the engines under the next version. Every
``eval_every`` steps the policy is measured on held-out tasks; every ``checkpoint_every`` steps the
learner and the run's position are saved, and ``resume=true`` continues from there without repeating
or skipping a step.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray

from cluster.metrics import MetricsConfig, MetricsSink, step_metrics
from cluster.rollout import RolloutConfig, collect, init_ray, serve_corpus
from cluster.score import EstimatorEntry, RewardEntry, find_tasks, run_plugins
from envs.corpus_server import PAGE_PREFIX
from envs.datasets.registry import DatasetConfig, load_tasks
from envs.tasks import Task
from learner.credit import build_estimator, estimator_class
from learner.credit.rollout import assign_credit
from learner.publish import publish
from learner.sft import well_formed_share
from learner.trainer import Learner, LearnerConfig
from rewards.base import RewardSpec, build_reward, parse_options
from rollout.fleet import EngineRouter, start_engines
from rollout.model_store import resolve_model
from rollout.trajectory import Trajectory, save_trajectories
from rollout.workers import WorkerSpec, start_workers

MODES = ("sync",)


def _default_rollout() -> RolloutConfig:
    rollout = RolloutConfig()
    rollout.data = DatasetConfig(kind="synthetic", path="", split="train")
    return rollout


@dataclass
class TrainJob:
    mode: str = "sync"
    steps: int = 4
    tasks_per_step: int = 2  # tasks per step; each gets rollout.group_size samples
    rollout: RolloutConfig = field(default_factory=_default_rollout)  # data, engine, fleet, episode, ...
    eval_data: DatasetConfig = field(default_factory=lambda: DatasetConfig(kind="synthetic", path="",
                                                                           split="eval", limit=4))
    rewards: list[RewardEntry] = field(default_factory=lambda: [RewardEntry("exact_match"),
                                                                RewardEntry("format")])
    estimator: EstimatorEntry = field(default_factory=lambda: EstimatorEntry(name="grpo"))
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(mini_batch=4, micro_batch=2,
                                                                         lr=1e-4, max_length=4096))
    eval_every: int = 0  # 0 = no evaluation during training
    checkpoint_every: int = 1
    out: str = "runs/train"
    resume: bool = False
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # tensorboard_dir "" = out/tensorboard


@dataclass
class RunState:
    step: int = 0
    weights_version: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class TrainError(ValueError):
    """A training job that cannot run as configured; the message names the setting."""


def check(job: TrainJob) -> None:
    if job.mode not in MODES:
        raise TrainError(f"mode={job.mode!r} is not one of {', '.join(MODES)}")
    if job.steps < 1 or job.tasks_per_step < 1:
        raise TrainError("steps and tasks_per_step must be at least 1")
    estimator_class(job.estimator.name)


def step_tasks(tasks: list[Task], step: int, per_step: int) -> list[Task]:
    """The tasks of ``step``: a fixed walk through the task list, so a resumed run continues it."""
    return [tasks[(step * per_step + i) % len(tasks)] for i in range(per_step)]


def run_train(job: TrainJob, *, progress: bool = True) -> RunState:
    check(job)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    init_ray(job.rollout.ray)
    model = resolve_model(job.rollout.engine.model or job.learner.model)
    estimator = build_estimator(job.estimator.name, parse_options(
        estimator_class(job.estimator.name).Options, job.estimator.options,
        f"estimator {job.estimator.name!r}"))
    state = RunState()
    learner = Learner(replace(job.learner, model=model))
    sink = MetricsSink(replace(job.metrics, tensorboard_dir=job.metrics.tensorboard_dir or str(out / "tensorboard")),
                       run_name=out.name)
    with serve_corpus(job.rollout.corpus) as corpus:
        prefix = corpus.base_url + PAGE_PREFIX
        tasks = load_tasks(replace(job.rollout.data, url_prefix=job.rollout.data.url_prefix or prefix))
        if not tasks:
            raise TrainError("rollout.data gave no tasks: check rollout.data.kind/path/limit")
        eval_tasks = load_tasks(replace(job.eval_data, url_prefix=job.eval_data.url_prefix or prefix))
        engines = start_engines(replace(job.rollout.engine, model=model), job.rollout.fleet.engine_replicas,
                                job.rollout.fleet.engine_cpus, job.rollout.fleet.engine_gpus)
        router = EngineRouter(engines)
        spec = WorkerSpec(tools=job.rollout.tools, episode=job.rollout.episode, context=job.rollout.context,
                          corpus=corpus, tokenizer=model, policy_name=f"{job.rollout.engine.kind}:{Path(model).name}")
        workers = start_workers(spec, router, job.rollout.fleet.workers,
                                job.rollout.fleet.episodes_per_worker, job.rollout.fleet.worker_cpus,
                                job.rollout.fleet.worker_restarts,
                                name_prefix=f"turnstile-{uuid.uuid4().hex[:8]}-")
        try:
            learner.start()
            if job.resume and (out / "checkpoint" / "learner.json").is_file():
                learner.load(out / "checkpoint")
                state = _load_state(out)
                asyncio.run(publish(router, learner.full_weights(), state.weights_version))
                print(f"resumed at step {state.step} (weights version {state.weights_version})")
            while state.step < job.steps:
                started = time.monotonic()
                batch = step_tasks(tasks, state.step, job.tasks_per_step)
                episodes = [(task, f"s{state.step}-{task.id}", sample)
                            for task in batch for sample in range(job.rollout.group_size)]
                trajectories, failed, rerun = collect(workers, episodes, job.rollout.fleet,
                                                      out / "rollouts" / f"step{state.step}.jsonl",
                                                      progress)
                rolled = time.monotonic()
                asyncio.run(_score(job, trajectories))
                assign_credit(trajectories, estimator)
                save_trajectories(trajectories, out / "scored" / f"step{state.step}.jsonl")
                scored = time.monotonic()
                report = learner.rl_step(trajectories, estimator, seed=job.learner.seed + state.step)
                trained = time.monotonic()
                if report.trained:
                    state.weights_version += 1
                    learner.weights_version = state.weights_version
                    asyncio.run(publish(router, learner.full_weights(), state.weights_version))
                published = time.monotonic()
                state.step += 1
                metrics = step_metrics(trajectories, wall_s=rolled - started, report=report,
                                       current_version=state.weights_version,
                                       timings={"rollout": rolled - started, "reward": scored - rolled,
                                                "learner": trained - scored, "publish": published - trained})
                metrics.update({"rollout/failed": float(failed), "rollout/rerun": float(rerun),
                                "weights/version": float(state.weights_version)})
                if job.eval_every and state.step % job.eval_every == 0:
                    metrics.update(_evaluate(job, workers, eval_tasks, state.step, out, progress))
                    print(f"eval @ step {state.step}: accuracy {metrics['eval/accuracy']:.1%}, "
                          f"format {metrics['eval/format_rate']:.1%}")
                state.history.append({"step": float(state.step), **sink.log(metrics, state.step)})
                if job.checkpoint_every and state.step % job.checkpoint_every == 0:
                    learner.save(out / "checkpoint")
                    _save_state(out, state)
        finally:
            sink.close()
            learner.close()
            for actor in [*workers, *engines]:
                ray.kill(actor)
    return state


def _evaluate(job: TrainJob, workers: list, tasks: list[Task], step: int, out: Path,
              progress: bool) -> dict[str, float]:
    """One sample per held-out task on the current weights: accuracy and format rate."""
    episodes = [(task, f"eval{step}-{task.id}", 0) for task in tasks]
    trajectories, _, _ = collect(workers, episodes, job.rollout.fleet, out / "eval" / f"step{step}.jsonl",
                                 progress)
    from envs.answers import answer_matches

    correct = sum(bool(t.answer) and answer_matches(t.answer, t.answers) for t in trajectories)
    share, _ = well_formed_share(trajectories)
    return {"eval/accuracy": correct / max(len(trajectories), 1), "eval/format_rate": share}


async def _score(job: TrainJob, trajectories: list[Trajectory]) -> None:
    plugins = [build_reward(RewardSpec(entry.kind, dict(entry.options))) for entry in job.rewards]
    await run_plugins(plugins, trajectories, find_tasks(job.rollout.data, trajectories))


def _save_state(out: Path, state: RunState) -> None:
    tmp = out / "run.json.tmp"
    tmp.write_text(json.dumps({"step": state.step, "weights_version": state.weights_version,
                               "history": state.history}))
    os.replace(tmp, out / "run.json")


def _load_state(out: Path) -> RunState:
    data = json.loads((out / "run.json").read_text())
    return RunState(step=int(data["step"]), weights_version=int(data["weights_version"]),
                    history=list(data.get("history", [])))

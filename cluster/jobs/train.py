"""``turnstile train``: the main job.

``mode=sync`` — each step: the step's tasks × G samples → the rollout fleet (Ray workers driving the policy engines)
→ reward plugins on every group → credit assignment → one learner update (downsampled to the
data-parallel size) → the new weights published to the engines under the next version. Every
``eval_every`` steps the policy is measured on held-out tasks; every ``checkpoint_every`` steps the
learner and the run's position are saved, and ``resume=true`` continues from there without repeating
or skipping a step. ``mode=async`` keeps rollout running while rewards and updates happen, under a
staleness bound (:mod:`turnstile.cluster.jobs.train_async`); both modes share :meth:`Run.learn`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from pathlib import Path

from turnstile.cluster.fleet.logs import LOGS
from turnstile.cluster.fleet.room import Demand
from turnstile.cluster.jobs.console import TrainConsole
from turnstile.cluster.jobs.metrics import (
    MetricsSink,
    is_correct,
    paired_difference,
)
from turnstile.cluster.jobs.plan import check_fit
from turnstile.cluster.jobs.run import (
    Run,
    RunState,
    TrainJob,
    check,
    needs_archive,
    probing,
)
from turnstile.cluster.jobs.session import fleet_session, init_ray, learner_demand
from turnstile.cluster.jobs.train_async import async_loop
from turnstile.learner.credit import estimator_from_options
from turnstile.learner.publish import WeightsArchive
from turnstile.learner.trainer import Learner
from turnstile.rollout.model_store import RUN_MODEL, resolve_model
from turnstile.rollout.store import build_store
from turnstile.rollout.trajectory import load_trajectories


def run_train(job: TrainJob, *, progress: bool = True) -> RunState:
    """Set up the fleet, the learner and the metrics, run the configured loop, tear everything down."""
    check(job)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    init_ray(job.rollout.ray)
    with TrainConsole.for_this_terminal(job.steps, progress=progress, logs=out / LOGS) as console:
        return _train(job, out, console)


def _train(job: TrainJob, out: Path, console: TrainConsole) -> RunState:
    job = probing(job)  # information gain measured on the engines while episodes run, where it can be
    model = resolve_model(job.rollout.engine.model or job.learner.model)
    check_fit(job, model)  # memory and placement on this Ray, before any actor (turnstile plan prints it all)
    estimator = estimator_from_options(job.estimator.kind, job.estimator.options)
    name = job.name or f"turnstile-{uuid.uuid4().hex[:8]}"
    # Each start of the driver gets its own namespace in the store: a resumed run regenerates
    # what came after its last checkpoint, and must not meet the dead driver's half-done items.
    store_config = replace(job.store, namespace=f"{job.store.namespace}.{name}.{uuid.uuid4().hex[:6]}")
    console.stage("starting the fleet and the learner")
    learner = Learner(replace(job.learner, model=model))
    try:
        # The store is built here, in the driver: a memory store's actor must outlive the workers it serves.
        with fleet_session(job.rollout, [job.rollout.data, job.eval_data], name=name, events=out / "fleet.jsonl",
                           model=model, store=build_store(store_config), beside=beside_the_fleet(job, learner),
                           alongside=learner.start) as session:
            console.fleet = session.fleet.view
            sink = MetricsSink(replace(job.metrics, tensorboard_dir=job.metrics.tensorboard_dir
                                       or str(out / "tensorboard")), run_name=out.name, show=console.step)
            run = Run(job, out, learner, session, estimator, sink, console, name=name, store_config=store_config)
            if needs_archive(job):
                run.archive = WeightsArchive(out / "weights", model, keep=job.staleness + 2)
            try:
                console.stage("starting the learner")
                if session.beside is not None:
                    session.beside.result()
                run.resume_if_asked()
                run.evaluate_before()
                if job.mode == "sync":
                    run.sync_loop()
                else:
                    asyncio.run(async_loop(run))
            finally:
                console.fleet = None  # the view outlives the fleet
                sink.close()
    finally:
        learner.close()
    return run.state


def beside_the_fleet(job: TrainJob, learner: Learner) -> list[Demand]:
    """What a training run asks Ray for besides its fleet: the learner's ranks and, in async mode, the
    reward workers."""
    demands = [learner_demand(learner)]
    if job.mode == "async":
        service = job.reward_service
        demands.append(Demand("reward_service.workers", service.workers, service.worker_cpus, service.worker_gpus))
    return demands


def where_outputs_are(out: Path) -> str:
    """The line that says what a run wrote and how to look at it."""
    parts = [name for name in ("run.json", "scored/", "eval/", RUN_MODEL + "/", "tensorboard/", LOGS + "/")
             if (out / name.rstrip("/")).exists()]
    return f"outputs in {out}: {', '.join(parts)}; look at the trajectories: turnstile view {out}"


def resume_hint(out: Path, resume: str = "--resume") -> str:
    """What a run (train's, or sft's: ``resume="resume=true"``) that stopped on a failure left to
    continue from."""
    try:
        step = int(json.loads((out / "checkpoint" / "learner.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no checkpoint was written yet: start the run again"
    return f"the last checkpoint (step {step}) is in {out / 'checkpoint'}: continue with {resume}"


def learning_line(out: Path, state: RunState) -> str:
    """The run's before → after on the held-out tasks: accuracy (with the 95% interval of the paired
    difference over the same tasks, each task's share of correct samples) and format rate; "" without
    a step-0 and a later evaluation."""
    rows = {int(row["step"]): row for row in state.history if "eval/accuracy" in row}
    if 0 not in rows or len(rows) < 2:
        return ""
    last = max(rows)
    before, after = _correct_by_task(out / "eval" / "step0.jsonl"), _correct_by_task(
        out / "eval" / f"step{last}.jsonl")
    shared = sorted(set(before) & set(after))
    interval = ""
    if shared:
        mean, low, high = paired_difference([before[k] for k in shared], [after[k] for k in shared])
        interval = (f" ({mean * 100:+.1f} points, 95% interval {low * 100:+.1f} to {high * 100:+.1f} "
                    f"over {len(shared)} tasks)")
    first, end = rows[0], rows[last]
    return (f"held-out accuracy {first['eval/accuracy']:.1%} -> {end['eval/accuracy']:.1%}{interval}, "
            f"format {first['eval/format_rate']:.1%} -> {end['eval/format_rate']:.1%} "
            f"(step 0 -> {last})")


def _correct_by_task(path: Path) -> dict[str, float]:
    """Each held-out task's share of correct samples in one evaluation."""
    if not path.is_file():
        return {}
    samples: dict[str, list[float]] = {}
    for trajectory in load_trajectories(path):
        samples.setdefault(trajectory.task_id, []).append(float(is_correct(trajectory)))
    return {task: sum(values) / len(values) for task, values in samples.items()}

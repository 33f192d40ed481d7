"""One training run's state and step, shared by both modes of ``turnstile train`` (:mod:`turnstile.cluster.jobs.train`
starts the run, :mod:`turnstile.cluster.jobs.train_async` drives the asynchronous mode): the job's config
(:class:`TrainJob`), what a run has done (:class:`RunState`, saved in ``run.json`` for resuming), and
:class:`Run`, which holds the fleet, the learner and the estimator and does the synchronous loop, one
learner update (:meth:`Run.learn`) and a held-out evaluation.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from turnstile.cluster.jobs.console import TrainConsole
from turnstile.cluster.jobs.defaults import default_eval_data, default_rollout
from turnstile.cluster.jobs.metrics import (
    MetricsConfig,
    MetricsSink,
    step_metrics,
)
from turnstile.cluster.jobs.score import find_tasks
from turnstile.cluster.jobs.session import FleetSession, RolloutJob
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.files import atomic_write
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.tasks import Task
from turnstile.learner.correction import guard_message
from turnstile.learner.credit import estimator_class, estimator_from_options
from turnstile.learner.credit.assign import assign_credit
from turnstile.learner.credit.registry import Estimator
from turnstile.learner.publish import WeightsArchive, replace_model
from turnstile.learner.trainer import Learner, LearnerConfig
from turnstile.rewards.apply import score_groups
from turnstile.rewards.base import resolve_reward, reward_options
from turnstile.rewards.service import RewardServiceConfig
from turnstile.rollout.engines.registry import can_probe, gives_logprobs
from turnstile.rollout.faults import VERDICT_KEY
from turnstile.rollout.model_store import RUN_MODEL
from turnstile.rollout.store import StoreConfig, check_durability
from turnstile.rollout.summary import nothing_ran
from turnstile.rollout.trajectory import Trajectory, save_trajectories

MODES = ("sync", "async")


ENVIRONMENT_FAULTS = ("mask", "keep", "drop_group")  # what training does with an environment-decided episode


@dataclass
class TrainJob:
    mode: str = "sync"  # sync | async (see cluster/jobs/train_async.py)
    name: str = ""  # prefix of the run's Ray actor names (<name>-worker-0, -engine-0, -reward-0); "" = random
    staleness: int = 1  # η: async rollout runs at most this many versions ahead; older samples drop
    # An episode whose result the environment decided (rollout.episode.faults, rollout/faults.py):
    # mask (left out of the loss and of its group's statistics), keep (trained as it ended), or
    # drop_group (its whole group left out)
    environment_faults: str = "mask"
    steps: int = 10
    tasks_per_step: int = 8  # tasks per step; each gets rollout.group_size samples
    shuffle: bool = True  # train tasks in a new random order each pass (seed: learner.seed); false = list order
    rollout: RolloutJob = field(default_factory=default_rollout)  # data, engine, fleet, episode, ...
    eval_data: DatasetConfig = field(default_factory=default_eval_data)  # all 110 held out
    rewards: list[PluginSpec] = field(default_factory=lambda: [PluginSpec("exact_match"), PluginSpec("format")])
    estimator: PluginSpec = field(default_factory=lambda: PluginSpec(kind="grpo"))
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(
        mini_batch=32, micro_batch=1, lr=1e-4, max_length=4096, threads=2))
    eval_every: int = 5  # evaluate before the first update, every N steps and after the last; 0 = never
    eval_samples: int = 1  # samples per held-out task in each evaluation (at the rollout's temperature)
    checkpoint_every: int = 1
    out: str = "runs/train"
    resume: bool = False
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)  # async: memory (default) or redis
    # its tensorboard_dir "" means out/tensorboard
    reward_service: RewardServiceConfig = field(default_factory=lambda: RewardServiceConfig(workers=1))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.environment_faults not in ENVIRONMENT_FAULTS:
            raise ValueError(f"environment_faults={self.environment_faults!r} is not one of "
                             f"{', '.join(ENVIRONMENT_FAULTS)}")
        for name in ("steps", "tasks_per_step", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("staleness", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        fleet = self.rollout.fleet
        capacity = fleet.workers * fleet.episodes_per_worker
        if self.mode == "async" and self.rollout.group_size > capacity:
            raise ValueError(f"rollout.group_size={self.rollout.group_size} must be <= rollout.fleet.workers x "
                             f"rollout.fleet.episodes_per_worker ({capacity}): async starts a group "
                             f"only when all its samples can run")


@dataclass
class RunState:
    step: int = 0
    weights_version: int = 0
    cursor: int = 0  # async: groups started so far (the next task and uid)
    accepted: int = 0  # async: samples finished so far
    dropped_stale: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class TrainError(ValueError):
    """A training job that cannot run as configured; the message names the setting."""


def check(job: TrainJob) -> None:
    """What the config's own types cannot check (the plugins' options, where information gain is
    measured, the store's server), before anything starts."""
    try:
        estimator_class(job.estimator.kind)
    except KeyError as error:
        raise TrainError(f"estimator.kind: {error.args[0]}") from None
    estimator_from_options(job.estimator.kind, job.estimator.options)
    for spec in job.rewards:
        reward_options(spec)
    placed_rewards(job)  # a reward that must measure on engines that cannot be probed (RewardError)
    if job.learner.rollout_correction.active and not gives_logprobs(job.rollout.engine):
        raise TrainError(f"learner.rollout_correction weighs the engines' log-probs against the learner's, and "
                         f"rollout.engine.kind={job.rollout.engine.kind} returns no log-probs of its policy: use "
                         f"a vllm or hf engine, or leave rollout_is and rollout_rs empty")
    check_durability(job.store)  # a Redis that would lose acknowledged items (StoreError)


def placed_rewards(job: TrainJob) -> list[tuple[PluginSpec, bool]]:
    """Each reward plugin with the options it scores with, and whether the rollout measures its
    values on the policy engines (the plugin says, :meth:`RewardPlugin.engine_options`: information
    gain, whenever the engines can be probed)."""
    probes = can_probe(job.rollout.engine)
    placed = []
    for entry in job.rewards:
        options = resolve_reward(entry.kind).engine_options(dict(entry.options), probes)
        placed.append((entry, False) if options is None else (PluginSpec(entry.kind, options), True))
    return placed


def probing(job: TrainJob) -> TrainJob:
    """The job with its training episodes probing their boundaries (``rollout.episode.ig_probe``)
    when a reward measures on the engines; unchanged otherwise."""
    if not any(on_engines for _, on_engines in placed_rewards(job)):
        return job
    episode = job.rollout.episode
    episode = replace(episode, ig_probe=replace(episode.ig_probe, enabled=True))
    return replace(job, rollout=replace(job.rollout, episode=episode))


def needs_archive(job: TrainJob) -> bool:
    """Whether a reward scores after the fact with the weights that generated each trajectory, so
    the run must keep its published versions (``out/weights``)."""
    return any(resolve_reward(spec.kind).scores_with_policy and not on_engines
               for spec, on_engines in placed_rewards(job))


def task_at(tasks: list[Task], k: int, shuffle: bool, seed: int) -> Task:
    """The ``k``-th task the run trains on: pass ``k // len(tasks)`` over the list, in a random order
    drawn from ``seed`` and the pass (``shuffle``, as veRL's ``data.shuffle``), or in list order. A
    function of ``k`` alone, so a resumed run continues the same walk."""
    n = len(tasks)
    return tasks[_pass_order(n, seed, k // n)[k % n] if shuffle else k % n]


@functools.lru_cache(maxsize=2)  # a step's tasks lie in one or two passes: shuffle a pass once
def _pass_order(n: int, seed: int, pass_: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}/{pass_}").shuffle(order)
    return tuple(order)


def trainable(trajectories: Sequence[Trajectory], version: int, staleness: int,
              environment_faults: str = "mask") -> tuple[list[Trajectory], dict[str, int]]:
    """The samples a step trains on, and how many of each kind it leaves out:

    - ``empty``: no turn (the engine failed before the first one; nothing to learn from; counted
      under ``environment`` instead when it is left out for that);
    - ``unscored``: no outcome (the reward service gave up on it after its last delivery,
      ``metadata["reward_error"]``; its group trains on the others);
    - ``stale``: its oldest turn is more than ``staleness`` versions behind ``version`` (only the
      asynchronous loop produces them);
    - ``environment``: the environment decided its result (``metadata["environment_fault"]``,
      rollout/faults.py) and ``environment_faults`` is ``mask``; with ``drop_group``, every sample
      of a group that has one; with ``keep``, none. Left out before credit, so its group is
      normalised over the others.
    """
    faulted = {t.uid for t in trajectories if VERDICT_KEY in t.metadata} if environment_faults == "drop_group" \
        else set()
    left_out = {"empty": 0, "unscored": 0, "stale": 0, "environment": 0}
    fresh = []
    for trajectory in trajectories:
        if (environment_faults == "mask" and VERDICT_KEY in trajectory.metadata) or trajectory.uid in faulted:
            left_out["environment"] += 1
        elif not trajectory.turns:
            left_out["empty"] += 1
        elif trajectory.outcome is None:
            left_out["unscored"] += 1
        elif too_stale(min(turn.weights_version for turn in trajectory.turns), version, staleness):
            left_out["stale"] += 1
        else:
            fresh.append(trajectory)
    return fresh, left_out


def too_stale(oldest_version: int, version: int, staleness: int) -> bool:
    """Whether a sample whose oldest turn came from ``oldest_version`` is too old to train at ``version``."""
    return version - oldest_version > staleness


def step_tasks(tasks: list[Task], step: int, per_step: int, shuffle: bool, seed: int) -> list[Task]:
    """The tasks of ``step``: the next ``per_step`` of the walk (:func:`task_at`)."""
    return [task_at(tasks, step * per_step + i, shuffle, seed) for i in range(per_step)]


class Run:
    """What one training run holds, and the bookkeeping both loops share."""

    def __init__(self, job: TrainJob, out: Path, learner: Learner, session: FleetSession,
                 estimator: Estimator, sink: MetricsSink, console: TrainConsole, name: str = "turnstile",
                 store_config: StoreConfig | None = None) -> None:
        self.job, self.out, self.learner, self.session = job, out, learner, session
        self.tasks, self.eval_tasks = session.tasks  # the training data's, the held-out data's
        self.estimator, self.sink, self.console = estimator, sink, console
        self.state = RunState()
        self.rerun = 0
        self.failed = 0  # episodes recorded as failed by the driver (worker gone too often, or it raised)
        self.name = name  # the prefix of the run's actor names
        self.store_config = store_config or self.job.store  # this driver's namespace in the store
        self.archive: WeightsArchive | None = None
        self.mismatch_warned = False  # the mismatch guard warns once a run

    def resume_if_asked(self) -> None:
        if not (self.job.resume and (self.out / "checkpoint" / "learner.json").is_file()):
            return
        self.learner.load(self.out / "checkpoint")
        self.state = _load_state(self.out)
        self.console.done = self.console.first_step = self.state.step
        asyncio.run(self.publish(self.state.weights_version))
        print(f"resumed at step {self.state.step} (weights version {self.state.weights_version})")

    def task(self, k: int) -> Task:
        """The ``k``-th task of the run's walk over its training tasks (:func:`task_at`)."""
        return task_at(self.tasks, k, self.job.shuffle, self.job.learner.seed)

    def sync_loop(self) -> None:
        """Generate a batch, score it, update, publish; repeat."""
        job, state = self.job, self.state
        while state.step < job.steps:
            started = time.monotonic()
            batch = step_tasks(self.tasks, state.step, job.tasks_per_step, job.shuffle, job.learner.seed)
            episodes = [(task, f"s{state.step}-{task.id}", sample)
                        for task in batch for sample in range(job.rollout.group_size)]
            trajectories, failed, rerun = self.session.generate(episodes,
                                                                self.out / "rollouts" / f"step{state.step}.jsonl",
                                                                self.console.stage("rollout", total=len(episodes)))
            self.rerun += rerun
            self.failed += failed
            rolled = time.monotonic()
            self.console.stage("rewards")
            asyncio.run(_score(job, self.reward_specs(), trajectories))
            self.learn(trajectories, rolled - started, extra={"time/rollout_s": rolled - started,
                                                              "time/rewards_s": time.monotonic() - rolled})

    def learn(self, trajectories: list[Trajectory], wall_s: float,
              extra: dict[str, float] | None = None) -> None:
        """Credit, one update, publish, metrics, evaluation and checkpoint for one step's samples.

        What :func:`trainable` leaves out is saved with the rest and counted: samples whose oldest
        turn is more than ``staleness`` versions behind, samples without a turn, and samples the
        reward service could not score.
        """
        job, state = self.job, self.state
        started = time.monotonic()
        self.console.stage("credit")
        failure = nothing_ran(trajectories, f"episode of step {state.step + 1}")
        if failure:  # stop instead of "training" on nothing
            raise TrainError(failure)
        fresh, left_out = trainable(trajectories, state.weights_version, job.staleness, job.environment_faults)
        state.dropped_stale += left_out["stale"]
        if fresh:
            assign_credit(fresh, self.estimator)
        save_trajectories(trajectories, self.out / "scored" / f"step{state.step}.jsonl")
        scored = time.monotonic()
        self.console.stage("learner")
        report = self.learner.rl_step(fresh, self.estimator, seed=job.learner.seed + state.step) if fresh \
            else None
        trained = time.monotonic()
        if report is not None and report.trained:
            self.guard_mismatch(report.metrics, state.step + 1)
            version = state.weights_version + 1
            self.console.stage("publish")
            asyncio.run(self.publish(version))
            # Only now, with the engines serving it: admission (async) reads this version.
            state.weights_version = self.learner.weights_version = version
        published = time.monotonic()
        state.step += 1
        metrics = step_metrics(trajectories, wall_s=wall_s, report=report,
                               current_version=state.weights_version - 1 if report and report.trained
                               else state.weights_version,
                               timings={"credit": scored - started, "learner": trained - scored,
                                        "publish": published - trained},
                               dropped=left_out["stale"])
        metrics.update({"rollout/rerun": float(self.rerun), "rollout/failed": float(self.failed),
                        "staleness/dropped_total": float(state.dropped_stale),
                        "rollout/empty": float(left_out["empty"]),
                        "rollout/environment_left_out": float(left_out["environment"]),
                        "rewards/unscored": float(left_out["unscored"]),
                        "weights/version": float(state.weights_version), **self.session.fleet.metrics(),
                        **(extra or {})})
        if job.eval_every and (state.step % job.eval_every == 0 or state.step == job.steps):
            metrics.update(self.evaluate(state.step))
        state.history.append({"step": float(state.step), **self.sink.log(metrics, state.step)})
        if job.checkpoint_every and state.step % job.checkpoint_every == 0:
            self.console.stage("checkpoint")
            self.learner.save(self.out / "checkpoint")
            self.save_model()
            _save_state(self.out, state)

    def guard_mismatch(self, metrics: dict[str, float], step: int) -> None:
        """The mismatch guard (:func:`turnstile.learner.correction.guard_message`): a step whose
        engine/learner KL passes ``learner.rollout_correction.max_kl`` warns once a run, or, with
        ``on_excess: stop``, ends the run before its update is published (the last checkpoint stays
        the previous step's)."""
        correction = self.job.learner.rollout_correction
        message = guard_message(metrics, correction, step)
        if message is None:
            return
        if correction.on_excess == "stop":
            raise TrainError(f"{message} (stopped: learner.rollout_correction.on_excess=stop)")
        if not self.mismatch_warned:
            self.mismatch_warned = True
            print(f"warning: {message} (said once a run)")

    def save_model(self) -> None:
        """The policy as a Hugging Face model directory, ``OUT/model`` (replaced whole at each
        checkpoint): what ``turnstile eval rollout.engine.model=OUT`` evaluates."""
        state = self.state
        replace_model(self.learner.full_weights(), self.learner.config.model, self.out / RUN_MODEL, about={
            "name": f"{self.out.name}@step{state.step}", "step": state.step,
            "weights_version": state.weights_version,
            "what": f"the policy of the turnstile train run {self.out.name} after step {state.step}",
            "made_by": "turnstile train (saved with each checkpoint)"})

    def evaluate_before(self) -> None:
        """The step-0 evaluation (the policy before any update), once per run: a resumed run that
        has it in its history does not repeat it."""
        if not self.job.eval_every or any(row.get("step") == 0.0 for row in self.state.history):
            return
        metrics = self.evaluate(0)
        self.state.history.append({"step": 0.0, **self.sink.log(metrics, 0)})
        _save_state(self.out, self.state)

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval_samples`` samples per held-out task on the current weights, scored
        (:meth:`~turnstile.cluster.jobs.session.FleetSession.evaluate`) and printed."""
        if not self.eval_tasks:
            return {}
        started = time.monotonic()
        tally = self.console.stage("eval", total=len(self.eval_tasks) * self.job.eval_samples)
        # the trajectories go to out/eval/step<N>.jsonl (read by learning_line, the viewer, the benchmarks)
        metrics = self.session.evaluate(self.eval_tasks, self.job.eval_samples,
                                        self.out / "eval" / f"step{step}.jsonl", tally, label=f"eval{step}")
        metrics["time/eval_s"] = time.monotonic() - started
        print(f"eval @ step {step}: accuracy {metrics['eval/accuracy']:.1%} (95% interval "
              f"{metrics['eval/accuracy_low']:.1%}-{metrics['eval/accuracy_high']:.1%}, "
              f"{metrics['eval/episodes']:.0f} episodes), format {metrics['eval/format_rate']:.1%}"
              + "".join(f", {key.removeprefix('eval/accuracy_hops')} hops {value:.1%}"
                        for key, value in metrics.items() if key.startswith("eval/accuracy_hops")))
        return metrics

    async def publish(self, version: int) -> None:
        """The learner's weights to every engine replica (:meth:`FleetSession.publish`), kept first in
        the run's archive when a reward scores with the policy that generated a trajectory."""
        weights = self.learner.full_weights()
        if self.archive is not None:  # before any trajectory of this version can reach the rewards
            await asyncio.to_thread(self.archive.add, version, weights)
        await self.session.publish(weights, version)

    def reward_specs(self) -> list[PluginSpec]:
        """The reward plugins as this run scores with them (:func:`placed_rewards`); one that scores
        with the policy's weights after the fact (``scores_with_policy``: information gain on an
        engine that cannot be probed) and has no model of its own scores each trajectory with the
        weights version that generated it (the run's archive)."""
        specs = []
        for entry, on_engines in placed_rewards(self.job):
            options = dict(entry.options)
            own_weights = options.get("model") or options.get("versions_dir")
            after_the_fact = not on_engines and resolve_reward(entry.kind).scores_with_policy
            if after_the_fact and self.archive is not None and not own_weights:
                options["versions_dir"] = str(self.archive.root)
            specs.append(PluginSpec(entry.kind, options))
        return specs

    def set_queue_depths(self, depths: dict[str, float]) -> None:
        self.sink.set_queue_depths(depths)


async def _score(job: TrainJob, specs: list[PluginSpec], trajectories: list[Trajectory]) -> None:
    """The sync loop's rewards, applied as the reward service applies them (a group a plugin fails
    on is left unscored and counted by :func:`trainable`)."""
    await score_groups(specs, trajectories, find_tasks(job.rollout.data, trajectories),
                       job.reward_service.worker.score_timeout_s)


def _save_state(out: Path, state: RunState) -> None:
    with atomic_write(out / "run.json") as file:
        file.write(json.dumps({"step": state.step, "weights_version": state.weights_version,
                               "cursor": state.cursor, "accepted": state.accepted,
                               "dropped_stale": state.dropped_stale, "history": state.history}))


def _load_state(out: Path) -> RunState:
    data = json.loads((out / "run.json").read_text())
    return RunState(step=int(data["step"]), weights_version=int(data["weights_version"]),
                    cursor=int(data.get("cursor", 0)), accepted=int(data.get("accepted", 0)),
                    dropped_stale=int(data.get("dropped_stale", 0)), history=list(data.get("history", [])))

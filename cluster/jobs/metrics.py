"""Per-step training metrics, and the sinks a run reports them to.

A long-horizon RL run fails quietly: rewards flat because every episode hits the context budget,
information gain collapsing to zero, samples growing stale behind a slow learner. :func:`step_metrics`
turns one step's trajectories (and the learner's :class:`~turnstile.learner.trainer.StepReport`) into flat
``namespace/name`` numbers that show those things; :class:`MetricsSink` sends them to the console,
TensorBoard, Weights & Biases (optional, ``pip install wandb``) and Ray's metrics (Prometheus, and
the Ray dashboard when it runs).

Averages over an empty set (no scored trajectory, no turn with information gain) are left out rather
than written as 0: a missing point on a chart is honest, a zero is not.
"""

from __future__ import annotations

import importlib
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, Self

from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import Fault
from turnstile.learner.credit.normalize import all_equal
from turnstile.rollout.faults import VERDICT_KEY
from turnstile.rollout.probes import COST_KEY, MISSING_KEY
from turnstile.rollout.summary import is_correct, well_formed_share
from turnstile.rollout.trajectory import StopReason, Trajectory

if TYPE_CHECKING:
    from turnstile.learner.trainer import StepReport

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline")


class MetricsError(ValueError):
    """A metrics setting that cannot work; the message says what to change."""


@dataclass
class MetricsConfig:
    """Where step metrics go (``metrics.*`` in an experiment's YAML)."""

    tensorboard_dir: str = ""  # "" = no TensorBoard files (the train driver sets one under the run dir)
    wandb_project: str = ""  # "" = no Weights & Biases
    wandb_mode: str = "online"  # online | offline (offline: sync later with `wandb sync`)
    console: bool = True  # a two-line summary per step on stdout
    ray_metrics: bool = True  # Ray gauges and counters, when Ray runs in this process

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise MetricsError(f"metrics.wandb_mode={self.wandb_mode!r} is not one of "
                               f"{', '.join(WANDB_MODES)}")


# ---- what a step amounts to ---------------------------------------------------------------------

Z95 = 1.959964  # the two-sided 95% normal quantile


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (well-behaved at 0, 1 and small counts)."""
    if trials <= 0:
        return 0.0, 1.0
    p, z2 = successes / trials, Z95 * Z95
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float]:
    """Mean of ``after - before`` over paired items (the same held-out tasks) and its 95% interval
    (normal approximation with the sample standard deviation of the differences)."""
    if len(before) != len(after) or not before:
        raise ValueError("paired_difference needs two equally long, non-empty sequences")
    diffs = [b - a for a, b in zip(before, after, strict=True)]
    mean = sum(diffs) / len(diffs)
    spread = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5 if len(diffs) > 1 else 0.0
    half = Z95 * spread / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def evaluation_metrics(trajectories: Sequence[Trajectory], tasks: Sequence[Task]) -> dict[str, float]:
    """What an evaluation of ``tasks`` measured: accuracy with its 95% Wilson interval (over
    episodes), the share answered, the share of turns well formed, turns, browse ratio, and accuracy by
    the tasks' hop count where they give one (``eval/accuracy_hops<n>``)."""
    episodes = max(len(trajectories), 1)
    correct = sum(is_correct(t) for t in trajectories)
    low, high = wilson_interval(correct, len(trajectories))
    share, turns = well_formed_share(trajectories)
    metrics = {"eval/accuracy": correct / episodes, "eval/accuracy_low": low, "eval/accuracy_high": high,
               "eval/answer_rate": sum(t.answered for t in trajectories) / episodes,
               "eval/format_rate": share, "eval/turns": float(turns), "eval/episodes": float(len(trajectories)),
               "eval/turns_mean": sum(len(t.turns) for t in trajectories) / episodes,
               "eval/browse_ratio": browse_ratio(trajectories)}
    hops = {task.id: task.metadata.get("hops") for task in tasks}
    by_hops: dict[int, list[bool]] = {}
    for trajectory in trajectories:
        count = hops.get(trajectory.task_id)
        if isinstance(count, int):
            by_hops.setdefault(count, []).append(is_correct(trajectory))
    for count, results in sorted(by_hops.items()):
        metrics[f"eval/accuracy_hops{count}"] = sum(results) / len(results)
        metrics[f"eval/episodes_hops{count}"] = float(len(results))
    return metrics


def browse_ratio(trajectories: Sequence[Trajectory]) -> float:
    """The share of tool calls that read a page (``visit``) rather than search (DR-Venus' browse
    ratio); 0 without tool calls."""
    tools = [turn.tool for trajectory in trajectories for turn in trajectory.turns if turn.tool]
    return sum(tool == "visit" for tool in tools) / len(tools) if tools else 0.0


def probe_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What measuring information gain on the engines cost this step (rollout/probes.py), when it
    did: boundaries probed, tokens forwarded per boundary against the pseudo-response's length R
    (its limit), cache misses, the episodes' wait for their last probes, and trajectories whose
    information gain is missing (trained on outcome and format only)."""
    costs = [t.metadata[COST_KEY] for t in trajectories if isinstance(t.metadata.get(COST_KEY), dict)]
    if not costs:
        return {}

    def total(key: str) -> float:
        return float(sum(cost.get(key, 0) for cost in costs))  # type: ignore[union-attr,misc]
    boundaries = total("boundaries")
    metrics = {"ig/probes": boundaries, "ig/cache_misses": total("cache_misses"),
               "ig/missing": float(sum(MISSING_KEY in t.metadata for t in trajectories)),
               "ig/probe_wait_s": total("wait_s") / len(costs)}
    if boundaries:
        metrics["ig/prefill_per_probe"] = total("prefill_tokens") / boundaries
        metrics["ig/pseudo_tokens_per_probe"] = total("pseudo_tokens") / boundaries
    return metrics


def step_metrics(trajectories: Sequence[Trajectory], *, wall_s: float,
                 report: StepReport | None = None, timings: Mapping[str, float] | None = None,
                 current_version: int | None = None, dropped: int = 0) -> dict[str, float]:
    """The numbers of one training step.

    ``wall_s``: seconds the step took (throughput is over it); ``report``: the learner's update, if
    one ran; ``timings``: seconds per stage (``{"rollout": 12.0}`` → ``time/rollout_s``);
    ``current_version``: the weights version being trained now (staleness of each turn is this minus
    the version that generated it); ``dropped``: samples the step threw away before the learner
    (too stale, failed episodes).
    """
    turns = [turn for trajectory in trajectories for turn in trajectory.turns]
    response_tokens = sum(len(turn.response_ids) for turn in turns)
    metrics: dict[str, float] = {
        "rollout/episodes": float(len(trajectories)),
        "rollout/turns": float(len(turns)),
        "rollout/dropped": float(dropped),
        "tokens/response": float(response_tokens),
        "tokens/observation": float(sum(len(turn.observation_ids) for turn in turns)),
    }
    if trajectories:
        per_episode = [len(trajectory.turns) for trajectory in trajectories]
        metrics["rollout/turns_mean"] = statistics.fmean(per_episode)
        metrics["rollout/turns_max"] = float(max(per_episode))
        metrics["rollout/answer_rate"] = _share(t.answered for t in trajectories)
        metrics["reward/accuracy"] = _share(is_correct(t) for t in trajectories)
        for reason in StopReason:
            metrics[f"rollout/stop_{reason.value}"] = _share(t.stop_reason is reason for t in trajectories)
        metrics["rollout/environment_decided"] = float(sum(VERDICT_KEY in t.metadata for t in trajectories))
    outcomes = [t.outcome for t in trajectories if t.outcome is not None]
    if outcomes:
        metrics["reward/mean"] = statistics.fmean(outcomes)
        metrics["reward/std"] = statistics.pstdev(outcomes)
        metrics["reward/positive_rate"] = _share(outcome > 0 for outcome in outcomes)
    metrics.update(group_metrics(trajectories))
    metrics["reward/scored"] = float(len(outcomes))
    turn_rewards = [turn.reward for turn in turns if turn.reward is not None]
    if turn_rewards:
        metrics["reward/turn_mean"] = statistics.fmean(turn_rewards)
    if turns:
        metrics["format/ok_rate"] = _share(turn.format_ok for turn in turns)
        calls = [turn for turn in turns if turn.tool_ok is not None]  # turns that ran a tool
        metrics["rollout/tool_calls"] = float(len(calls))
        metrics["rollout/tool_failures"] = float(sum(turn.tool_ok is False for turn in calls))
        metrics["rollout/tool_error_rate"] = _share(turn.tool_ok is False for turn in calls)
        for fault in Fault:  # whose doing each failure was
            metrics[f"rollout/tool_failures_{fault.value}"] = float(sum(turn.tool_fault == fault for turn in calls))
    gains = [turn.ig for turn in turns if turn.ig is not None]
    metrics["ig/coverage"] = len(gains) / len(turns) if turns else 0.0
    if gains:
        metrics["ig/mean"] = statistics.fmean(gains)
        metrics["ig/std"] = statistics.pstdev(gains)  # over the step's turns: a population
        metrics["ig/min"] = min(gains)
        metrics["ig/max"] = max(gains)
    metrics.update(probe_metrics(trajectories))
    if current_version is not None and turns:
        lags = [current_version - turn.weights_version for turn in turns]
        metrics["staleness/mean"] = statistics.fmean(lags)
        metrics["staleness/max"] = float(max(lags))
    metrics["time/step_s"] = float(wall_s)
    if wall_s > 0:
        metrics["throughput/episodes_per_s"] = len(trajectories) / wall_s
        metrics["throughput/turns_per_s"] = len(turns) / wall_s
        metrics["throughput/tokens_per_s"] = response_tokens / wall_s  # generated tokens
    for stage, seconds in (timings or {}).items():
        metrics[f"time/{stage}_s"] = float(seconds)
    if report is not None:
        metrics.update(learner_metrics(report))
    return metrics


def group_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Over the step's groups of two or more scored samples (same ``uid``): the share whose
    outcomes are all equal, as the estimators' normalisation sees it (``reward/uniform_groups``: an
    outcome-only estimator has no signal there), and the share with no correct sample
    (``reward/all_wrong_groups``)."""
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        if trajectory.outcome is not None:
            groups.setdefault(trajectory.uid, []).append(trajectory)
    sized = [group for group in groups.values() if len(group) >= 2]
    if not sized:
        return {}
    return {"reward/uniform_groups": _share(all_equal([float(t.outcome or 0.0) for t in group]) for group in sized),
            "reward/all_wrong_groups": _share(not any(is_correct(t) for t in group) for group in sized)}


def learner_metrics(report: StepReport) -> dict[str, float]:
    """A learner step: veRL's metrics under ``learner/``, the estimator's statistics under ``credit/``."""
    metrics = {
        "learner/trained": float(report.trained),
        "learner/samples": float(report.samples),
        "learner/waiting": float(report.waiting),
        "learner/tokens": float(report.tokens),
        "learner/truncated_tokens": float(report.truncated_tokens),
        "learner/downsample_dropped": float(report.dropped),
        "learner/downsample_lost_fraction": float(report.lost_fraction),
    }
    metrics.update({f"learner/{key}": float(value) for key, value in report.metrics.items()})
    metrics.update({f"credit/{key}": float(value) for key, value in report.stats.items()})
    return metrics


def _share(flags: Iterable[object]) -> float:
    values = [bool(flag) for flag in flags]
    return sum(values) / len(values) if values else 0.0


# ---- where the numbers go -----------------------------------------------------------------------

class _WandbRun(Protocol):
    def log(self, data: dict[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class MetricsSink:
    """Fans step metrics out to the console, TensorBoard, W&B and Ray metrics, as configured.

    ``log`` skips values that are not finite numbers (counted in :attr:`skipped`, warned once per
    key) so one NaN loss never ends a run. The latest queue depths given to :meth:`set_queue_depths`
    are also logged with each step as ``queue/<stream>``. ``close`` flushes and is safe to call twice.
    """

    def __init__(self, config: MetricsConfig, *, run_name: str = "",
                 run_config: Mapping[str, object] | None = None,
                 show: Callable[[Mapping[str, float], int], None] | None = None) -> None:
        self.config = config
        self.show = show or _print_step  # where the console summary goes (a live view: cluster.jobs.console)
        self.skipped = 0
        self._warned: set[str] = set()
        self._queue_depths: dict[str, float] = {}
        self._closed = False
        self._wandb = _start_wandb(config, run_name, run_config) if config.wandb_project else None
        self._writer = None
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=config.tensorboard_dir)
        self._ray = _RayMetrics() if config.ray_metrics else None

    def log(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        """Send one step's metrics everywhere; returns the finite values that were sent."""
        if self._closed:
            raise MetricsError("this MetricsSink is closed: log before calling close()")
        values = self._finite({**{f"queue/{s}": d for s, d in self._queue_depths.items()}, **metrics})
        if self.config.console and "reward/mean" in values:  # an evaluation alone prints its own line
            self.show(values, step)
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(dict(values), step=step)
        if self._ray is not None:
            self._ray.record(values, step)
        return values

    def set_queue_depths(self, depths: Mapping[str, float]) -> None:
        """The number of items waiting in each stream (``{"trajectories": 12, "scored": 3}``)."""
        finite = self._finite({f"queue/{stream}": depth for stream, depth in depths.items()})
        self._queue_depths.update({key.removeprefix("queue/"): depth for key, depth in finite.items()})
        if self._ray is not None:
            self._ray.queue_depths(self._queue_depths)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _finite(self, metrics: Mapping[str, object]) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, value in metrics.items():
            number = _as_float(value)
            if number is None or not math.isfinite(number):
                self.skipped += 1
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("metric %s=%r is not a finite number; skipped (warned once per key)",
                                key, value)
                continue
            values[key] = number
        return values


def _as_float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _start_wandb(config: MetricsConfig, run_name: str,
                 run_config: Mapping[str, object] | None) -> _WandbRun:
    try:
        wandb = importlib.import_module("wandb")
    except ImportError:
        raise MetricsError(f"metrics.wandb_project={config.wandb_project!r} needs Weights & Biases, "
                           "which is not installed: `pip install wandb`, or set "
                           "metrics.wandb_project='' to turn it off") from None
    return wandb.init(project=config.wandb_project, mode=config.wandb_mode, name=run_name or None,
                      config=dict(run_config or {}))


class _RayMetrics:
    """Ray gauges and counters, built the first time they are used while Ray runs in this process
    (the driver may start Ray after building its sink); without Ray every call does nothing."""

    GAUGES: ClassVar[dict[str, str]] = {  # step metric -> Ray gauge
        "reward/mean": "turnstile_reward_mean",
        "throughput/turns_per_s": "turnstile_turns_per_s",
        "throughput/tokens_per_s": "turnstile_tokens_per_s",
        "staleness/max": "turnstile_staleness_max",
        "fleet/engines_wanted": "turnstile_fleet_engines_wanted",
        "fleet/engines_ready": "turnstile_fleet_engines_ready",
        "fleet/engines_draining": "turnstile_fleet_engines_draining",
        "fleet/workers_wanted": "turnstile_fleet_workers_wanted",
        "fleet/workers_ready": "turnstile_fleet_workers_ready",
        "fleet/workers_draining": "turnstile_fleet_workers_draining",
        "fleet/episodes_waiting": "turnstile_fleet_episodes_waiting",
        "fleet/replica_load_max": "turnstile_fleet_replica_load_max",
    }
    COUNTERS: ClassVar[dict[str, str]] = {  # step metric -> Ray counter of its sum over steps
        "rollout/turns": "turnstile_turns",
        "rollout/episodes": "turnstile_episodes",
    }

    def __init__(self) -> None:
        self._built = False

    def _ready(self) -> bool:
        import ray

        if not ray.is_initialized():
            return False
        if not self._built:
            from ray.util.metrics import Counter, Gauge

            self._gauges = {key: Gauge(name, description=f"turnstile step metric {key}")
                            for key, name in self.GAUGES.items()}
            self._counters = {key: Counter(name, description=f"turnstile {key}, summed over steps")
                              for key, name in self.COUNTERS.items()}
            self._step = Gauge("turnstile_step", description="the last training step logged")
            self._queue = Gauge("turnstile_queue_depth", description="items waiting in a stream",
                                tag_keys=("stream",))
            self._built = True
        return True

    def record(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._ready():
            return
        self._step.set(float(step))
        for key, gauge in self._gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        for key, counter in self._counters.items():
            if metrics.get(key, 0.0) > 0:  # a Ray counter refuses increments <= 0
                counter.inc(metrics[key])

    def queue_depths(self, depths: Mapping[str, float]) -> None:
        if not self._ready():
            return
        for stream, depth in depths.items():
            self._queue.set(depth, tags={"stream": str(stream)})


# ---- the console line ---------------------------------------------------------------------------

def _print_step(metrics: Mapping[str, float], step: int) -> None:
    print(render(metrics, step), flush=True)


def render(metrics: Mapping[str, float], step: int) -> str:
    """Two lines: what the policy did this step, then where the time went and what the learner saw."""

    def show(key: str, spec: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
        return f"{metrics[key] * scale:{spec}}{suffix}" if key in metrics else "-"

    first = [
        f"step {step}",
        f"reward {show('reward/mean')} acc {show('reward/accuracy', '.1f', 100, '%')}"
        + (f" (same reward in {show('reward/uniform_groups', '.0f', 100, '%')} of groups)"
           if "reward/uniform_groups" in metrics else ""),
        f"turns {show('rollout/turns_mean', '.1f')} (max {show('rollout/turns_max', '.0f')})",
        f"fmt {show('format/ok_rate', '.1f', 100, '%')}",
    ]
    if metrics.get("ig/coverage", 0.0):  # only where a reward computes information gain
        first.append(f"ig {show('ig/mean')}±{show('ig/std')} ({show('ig/coverage', '.0f', 100, '%')} of turns)")
    if "staleness/max" in metrics:
        first.append(f"stale {show('staleness/mean', '.2g')} (max {show('staleness/max', '.0f')})")
    first.append(f"{show('throughput/turns_per_s', '.3g')} turns/s "
                 f"{show('throughput/tokens_per_s', '.4g')} tok/s")
    if metrics.get("rollout/tool_failures", 0.0):
        first.append(f"tool failures {show('rollout/tool_failures', '.0f')}/"
                     f"{show('rollout/tool_calls', '.0f')} (environment "
                     f"{show('rollout/tool_failures_environment', '.0f')})")
    if metrics.get("rollout/environment_decided", 0.0):
        first.append(f"environment-decided episodes {show('rollout/environment_decided', '.0f')}"
                     f" (left out {show('rollout/environment_left_out', '.0f')})")
    if metrics.get("rollout/dropped", 0.0):
        first.append(f"dropped {show('rollout/dropped', '.0f')}")
    second = []
    stages = [(key[5:-2], value) for key, value in metrics.items()
              if key.startswith("time/") and key.endswith("_s") and key != "time/step_s"]
    second.append("time " + " ".join([f"{stage} {value:.1f}s" for stage, value in stages]
                                     + [f"step {show('time/step_s', '.1f')}s"]))
    learner = [f"{name} {show('learner/' + name)}" for name in ("loss", "grad_norm", "kl_loss")
               if f"learner/{name}" in metrics]
    if "learner/mismatch/ratio_mean" in metrics:  # engine vs learner log-probs on the same tokens
        learner.append(f"ratio {show('learner/mismatch/ratio_mean', '.3f')} (max "
                       f"{show('learner/mismatch/ratio_max', '.3g')}, clipped "
                       f"{show('learner/mismatch/clipped', '.1f', 100, '%')})")
    if "learner/rollout_corr/kl" in metrics:  # veRL's KL(engine || learner) per token, and its k3 estimate
        learner.append(f"mismatch kl {show('learner/rollout_corr/kl', '.2g')} (k3 "
                       f"{show('learner/rollout_corr/k3_kl', '.2g')})")
    if "learner/correction/is_weight_mean" in metrics or "learner/correction/masked" in metrics:
        learner.append(f"IS weight {show('learner/correction/is_weight_mean', '.3f')} (max "
                       f"{show('learner/correction/is_weight_max', '.3g')}, truncated "
                       f"{show('learner/correction/truncated', '.1f', 100, '%')}, masked "
                       f"{show('learner/correction/masked', '.1f', 100, '%')})")
    if "learner/downsample_dropped" in metrics:
        learner.append(f"downsampled -{show('learner/downsample_dropped', '.0f')}")
    if learner:
        second.append("learner " + " ".join(learner))
    queues = [f"{key[6:]} {value:.0f}" for key, value in metrics.items() if key.startswith("queue/")]
    if queues:
        second.append("queue " + " ".join(queues))
    return " | ".join(first) + "\n  " + " | ".join(second)

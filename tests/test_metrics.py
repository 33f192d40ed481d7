"""Step metrics computed from hand-built trajectories, and the sinks they go to: console, TensorBoard
(read back from its event files), W&B (missing module, and a fake one), Ray metrics with and without
Ray. The Ray test uses the session cluster and is marked ``integration``."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from ray.util.metrics import Metric
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.metrics import (
    MetricsConfig,
    MetricsError,
    MetricsSink,
    render,
    step_metrics,
)
from turnstile.learner.trainer import StepReport
from turnstile.rollout.summary import is_correct
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory, Turn


def turn(index: int, *, response: int, observation: int, version: int, ok: bool = True,
         ig: float | None = None, reward: float | None = None, tool_ok: bool | None = None) -> Turn:
    return Turn(index=index, response_ids=[5] * response, response_logprobs=[-0.5] * response,
                weights_version=version, context_len=10, finish_reason="stop", format_ok=ok,
                observation_ids=[7] * observation, ig=ig, reward=reward, tool_ok=tool_ok)


def trajectory(sample: int, turns: list[Turn], *, stop: StopReason = StopReason.ANSWERED,
               answer: str | None = "Paris", outcome: float | None = 1.0,
               metadata: dict | None = None) -> Trajectory:
    return Trajectory(uid="q", sample=sample, task_id="q", question="Capital of France?",
                      answers=["Paris"], segments=[Segment(prompt_ids=[1, 2], turns=turns)],
                      stop_reason=stop, answer=answer, outcome=outcome, metadata=metadata or {})


def batch() -> list[Trajectory]:
    """Four episodes, seven turns; the expected numbers below are worked out by hand."""
    return [
        # exact-match answer: correct
        trajectory(0, [turn(0, response=3, observation=4, version=3, ig=0.5, tool_ok=True),
                       turn(1, response=2, observation=0, version=4)]),
        # no answer, format penalty; one malformed middle turn with a turn reward
        trajectory(1, [turn(0, response=1, observation=2, version=2, ok=False, ig=-0.1, reward=-1.0,
                            tool_ok=False),
                       turn(1, response=4, observation=1, version=4, ig=0.2, tool_ok=True),
                       turn(2, response=1, observation=0, version=4, ok=False)],
                   stop=StopReason.NO_ANSWER, answer=None, outcome=-1.0),
        # not an exact match, but the judge said correct
        trajectory(2, [turn(0, response=2, observation=0, version=4)], answer="paris, france",
                   metadata={"llm_judge": {"correct": True, "by": "judge"}}),
        # partial credit (F1), not correct
        trajectory(3, [turn(0, response=1, observation=0, version=4)], answer="Paris France",
                   outcome=0.5),
    ]


def test_step_metrics_exact_values() -> None:
    m = step_metrics(batch(), wall_s=2.0, current_version=4, dropped=3,
                     timings={"rollout": 1.5, "train": 0.25})
    assert m["rollout/episodes"] == 4 and m["rollout/turns"] == 7 and m["rollout/dropped"] == 3
    assert m["rollout/turns_mean"] == 1.75 and m["rollout/turns_max"] == 3
    assert m["rollout/answer_rate"] == 0.75 and m["rollout/stop_no_answer"] == 0.25
    assert m["rollout/stop_answered"] == 0.75 and m["rollout/stop_timeout"] == 0.0
    assert m["rollout/tool_calls"] == 3 and m["rollout/tool_failures"] == 1
    assert m["rollout/tool_error_rate"] == pytest.approx(1 / 3)  # of the turns that ran a tool
    # outcomes 1, -1, 1, 0.5
    assert m["reward/mean"] == pytest.approx(0.375)
    assert m["reward/std"] == pytest.approx(math.sqrt((0.625**2 * 2 + 1.375**2 + 0.125**2) / 4))
    assert m["reward/positive_rate"] == 0.75  # the F1 half-answer is positive ...
    assert m["reward/accuracy"] == 0.5  # ... but not correct; the judged one is
    assert m["reward/scored"] == 4 and m["reward/turn_mean"] == -1.0
    assert m["format/ok_rate"] == pytest.approx(5 / 7)
    # IG over the three turns that carry it: 0.5, -0.1, 0.2
    assert m["ig/coverage"] == pytest.approx(3 / 7)
    assert m["ig/mean"] == pytest.approx(0.2)
    assert m["ig/std"] == pytest.approx(math.sqrt(0.06))
    assert (m["ig/min"], m["ig/max"]) == (-0.1, 0.5)
    # versions 3, 4 | 2, 4, 4 | 4 | 4 against current 4
    assert m["staleness/max"] == 2 and m["staleness/mean"] == pytest.approx(3 / 7)
    assert m["tokens/response"] == 14 and m["tokens/observation"] == 7
    assert m["throughput/turns_per_s"] == 3.5 and m["throughput/tokens_per_s"] == 7.0
    assert m["throughput/episodes_per_s"] == 2.0
    assert m["time/rollout_s"] == 1.5 and m["time/train_s"] == 0.25 and m["time/step_s"] == 2.0
    assert not any(k.startswith(("learner/", "credit/")) for k in m)


def test_step_metrics_leave_out_averages_over_nothing() -> None:
    unscored = [trajectory(0, [turn(0, response=2, observation=1, version=0)], outcome=None)]
    m = step_metrics(unscored, wall_s=0.0)
    assert m["reward/scored"] == 0 and "reward/mean" not in m and "reward/std" not in m
    assert m["ig/coverage"] == 0 and "ig/mean" not in m
    assert "staleness/max" not in m  # no current version given
    assert not any(k.startswith("throughput/") for k in m)  # no time elapsed
    empty = step_metrics([], wall_s=1.0, current_version=3)
    assert empty["rollout/turns"] == 0 and "rollout/turns_mean" not in empty
    assert "format/ok_rate" not in empty and "staleness/mean" not in empty
    assert all(math.isfinite(v) for v in [*m.values(), *empty.values()])


def test_groups_whose_samples_all_scored_the_same_are_counted() -> None:
    """Four groups of two (and a lone sample, left out): outcomes (1, 1), (0, 0), (0, 1), (-1, 0)."""
    def sample(uid: str, index: int, outcome: float) -> Trajectory:
        answer = "Paris" if outcome == 1.0 else "Lyon"
        return replace(trajectory(index, [turn(0, response=1, observation=0, version=0)], answer=answer,
                                  outcome=outcome), uid=uid)
    outcomes = {"a": (1.0, 1.0), "b": (0.0, 0.0), "c": (0.0, 1.0), "d": (-1.0, 0.0)}
    batch = [sample(uid, i, o) for uid, pair in outcomes.items() for i, o in enumerate(pair)]
    m = step_metrics([*batch, sample("e", 0, 1.0)], wall_s=1.0)
    assert m["reward/uniform_groups"] == 0.5  # a and b: no signal for an outcome-only estimator
    assert m["reward/all_wrong_groups"] == 0.5  # b and d
    assert "(same reward in 50% of groups)" in render(m, 1)
    assert "reward/uniform_groups" not in step_metrics([sample("e", 0, 1.0)], wall_s=1.0)


@pytest.mark.parametrize(("stop", "answer", "metadata", "correct"), [
    (StopReason.ANSWERED, "The Paris!", {}, True),  # exact match after normalisation
    (StopReason.ANSWERED, "Lyon", {}, False),
    (StopReason.MALFORMED_ANSWER, "Paris", {}, False),  # right text, but not a well-formed answer
    (StopReason.ANSWERED, "Lyon", {"llm_judge": {"correct": True}}, True),
    (StopReason.ANSWERED, "Paris", {"llm_judge": {"correct": False}}, False),  # the judge decides
    (StopReason.ANSWERED, "Paris", {"llm_judge": {"correct": None}}, True),  # no verdict: exact match
])
def test_correct_means_judged_or_exact(stop: StopReason, answer: str, metadata: dict,
                                       correct: bool) -> None:
    episode = trajectory(0, [turn(0, response=1, observation=0, version=0)], stop=stop, answer=answer,
                         metadata=metadata)
    assert is_correct(episode) is correct


def test_learner_report_is_prefixed() -> None:
    report = StepReport(trained=True, samples=8, dropped=2, lost_fraction=0.125, tokens=300,
                        truncated_tokens=4, metrics={"loss": 0.5, "actor/pg_loss": -0.25, "grad_norm": 1.5},
                        stats={"ig_scale": 2.0})
    m = step_metrics(batch(), wall_s=1.0, report=report)
    assert m["learner/loss"] == 0.5 and m["learner/actor/pg_loss"] == -0.25
    assert m["learner/downsample_dropped"] == 2 and m["learner/downsample_lost_fraction"] == 0.125
    assert m["learner/samples"] == 8 and m["learner/trained"] == 1.0 and m["learner/tokens"] == 300
    assert m["learner/truncated_tokens"] == 4 and m["credit/ig_scale"] == 2.0
    waiting = step_metrics([], wall_s=1.0, report=StepReport(trained=False, waiting=5))
    assert waiting["learner/trained"] == 0.0 and waiting["learner/waiting"] == 5


def test_config_rejects_unknown_wandb_mode() -> None:
    assert load_config(MetricsConfig, overrides=["wandb_mode=offline"]).wandb_mode == "offline"
    with pytest.raises(MetricsError, match=r"metrics.wandb_mode='cloud'"):
        MetricsConfig(wandb_mode="cloud")


def quiet(**overrides: object) -> MetricsConfig:
    return MetricsConfig(**{"console": False, "ray_metrics": False, **overrides})  # type: ignore[arg-type]


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    first = step_metrics(batch(), wall_s=2.0, current_version=4)
    second = step_metrics(batch()[:2], wall_s=1.0, current_version=5)
    with MetricsSink(quiet(tensorboard_dir=str(tmp_path / "tb"))) as sink:
        sink.log(first, step=1)
        sink.log(second, step=2)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(first) | set(second)
    for key in ("reward/mean", "ig/std", "staleness/mean", "throughput/turns_per_s"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([first[key], second[key]], rel=1e-6)


def test_non_finite_values_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsSink(quiet(tensorboard_dir=str(tmp_path), console=True)) as sink:
        sent = sink.log({"learner/loss": math.nan, "learner/grad_norm": math.inf, "reward/mean": 0.5,
                         "learner/kl_loss": -math.inf}, step=3)
        sink.log({"learner/loss": math.nan}, step=4)
        assert sent == {"reward/mean": 0.5}
        assert sink.skipped == 4
    assert "reward 0.5" in capsys.readouterr().out
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]


def test_console_summary(capsys: pytest.CaptureFixture[str]) -> None:
    report = StepReport(trained=True, samples=8, dropped=2, metrics={"loss": 0.5, "grad_norm": 1.5})
    metrics = step_metrics(batch(), wall_s=2.0, current_version=4, dropped=1, report=report,
                           timings={"rollout": 1.5})
    with MetricsSink(quiet(console=True)) as sink:
        sink.set_queue_depths({"trajectories": 12})
        sink.log(metrics, step=7)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 7 | reward 0.375 acc 50.0% (same reward in 0% of groups) | turns 1.8 (max 3) "
                               "| fmt 71.4%")
    assert "stale 0.43 (max 2)" in lines[0] and "3.5 turns/s 7 tok/s" in lines[0]
    assert "dropped 1" in lines[0]
    assert lines[1] == ("  time rollout 1.5s step 2.0s | learner loss 0.5 grad_norm 1.5 downsampled -2"
                        " | queue trajectories 12")
    assert render({}, 0).startswith("step 0 | reward - acc -")  # nothing known yet: no crash


def test_wandb_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises ImportError
    with pytest.raises(MetricsError, match=r"pip install wandb"):
        MetricsSink(quiet(wandb_project="turnstile-test"))


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = 0

    def log(self, data: dict[str, float], step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished += 1


def test_wandb_logging_path(monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeRun()
    inits: list[dict[str, object]] = []

    def init(**kwargs: object) -> FakeRun:
        inits.append(kwargs)
        return run

    fake = types.ModuleType("wandb")
    fake.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = MetricsSink(quiet(wandb_project="turnstile-test", wandb_mode="offline"), run_name="r1",
                       run_config={"group_size": 4})
    assert inits == [{"project": "turnstile-test", "mode": "offline", "name": "r1",
                      "config": {"group_size": 4}}]
    sink.log({"reward/mean": 0.25, "learner/loss": math.nan}, step=1)
    sink.log({"reward/mean": 0.5}, step=2)
    sink.close()
    sink.close()  # twice is fine
    assert run.logged == [(1, {"reward/mean": 0.25}), (2, {"reward/mean": 0.5})]
    assert run.finished == 1
    with pytest.raises(MetricsError, match="closed"):
        sink.log({"reward/mean": 1.0}, step=3)


class RayCalls:
    """Wraps Ray's Gauge.set and Counter.inc: the real methods still run, and each call is kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ray.util import metrics

        self.calls: list[tuple[str, str, float, dict[str, str] | None]] = []
        for cls, method in ((metrics.Gauge, "set"), (metrics.Counter, "inc")):
            monkeypatch.setattr(cls, method, self._wrap(getattr(cls, method), method))

    def _wrap(self, real: Callable[..., None], method: str) -> Callable[..., None]:
        def spy(metric: Metric, value: float, tags: dict[str, str] | None = None) -> None:
            self.calls.append((method, metric._name, value, tags))
            real(metric, value, tags)
        return spy


def test_ray_metrics_without_ray_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    spy = RayCalls(monkeypatch)
    # Another test file may have started the session's Ray already: this sink must see none.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with MetricsSink(quiet(ray_metrics=True)) as sink:
        sink.set_queue_depths({"trajectories": 3})
        sink.log(step_metrics(batch(), wall_s=2.0), step=1)
    assert spy.calls == []


@pytest.mark.integration
def test_ray_metrics_with_ray(ray_local: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = RayCalls(monkeypatch)
    with MetricsSink(quiet(ray_metrics=True)) as sink:
        sink.set_queue_depths({"trajectories": 3, "scored": 0, "bad": math.nan})
        sink.log(step_metrics(batch(), wall_s=2.0, current_version=4), step=5)
        sink.log(step_metrics([], wall_s=1.0), step=6)  # no turns: the counters are not touched
    assert ("set", "turnstile_queue_depth", 3.0, {"stream": "trajectories"}) in spy.calls
    assert ("set", "turnstile_queue_depth", 0.0, {"stream": "scored"}) in spy.calls
    assert not any(tags == {"stream": "bad"} for *_, tags in spy.calls)
    assert ("set", "turnstile_turns_per_s", 3.5, None) in spy.calls
    assert ("set", "turnstile_staleness_max", 2.0, None) in spy.calls
    assert ("set", "turnstile_step", 6.0, None) in spy.calls
    assert [c for c in spy.calls if c[0] == "inc"] == [("inc", "turnstile_turns", 7.0, None),
                                                      ("inc", "turnstile_episodes", 4.0, None)]
    assert sink.skipped == 1


def test_wilson_interval_and_paired_difference() -> None:
    from turnstile.cluster.jobs.metrics import paired_difference, wilson_interval

    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    mean, low, high = paired_difference([0, 0, 1, 1], [1, 1, 1, 0])
    assert mean == pytest.approx(0.25) and high - mean == pytest.approx(mean - low)
    assert high - mean == pytest.approx(1.959964 * (2.75 / 3) ** 0.5 / 2)
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1], [1, 0])

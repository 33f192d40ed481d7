"""turnstile train with bfloat16 engines and an fp32 learner: the gap is measured every step and
corrected through veRL's rollout correction; engines serving other weights trip the guard (a
warning once a run, or a stop before the update is published)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_train import EXAMPLE, SMALL
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainError, TrainJob
from turnstile.cluster.jobs.train import run_train

BF16 = [*SMALL, "steps=2", "eval_every=0", "rollout.engine.dtype=bfloat16"]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_bf16_engines_are_measured_corrected_and_the_guard_warns_once(
        ray_local: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Decoupled mode with token TIS; max_kl far below bf16's gap, so both steps pass it.
    job = load_config(TrainJob, EXAMPLE, [*BF16, f"out={tmp_path}", "learner.recompute_old_log_probs=true",
                                          "learner.rollout_correction.rollout_is=token",
                                          "learner.rollout_correction.rollout_is_threshold=1.001",
                                          "learner.rollout_correction.max_kl=1e-12"])
    state = run_train(job, progress=False)
    assert state.step == 2 and state.weights_version == 2  # warned, not stopped
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    for metrics in history:
        assert metrics["learner/rollout_corr/k3_kl"] > 0  # bf16 against fp32: a real gap
        # TIS at 1.001: some weights of a bf16 gap reach the bound and none passes it
        assert 0 < metrics["learner/correction/is_weight_max"] <= 1.001 + 1e-6
        assert 0 < metrics["learner/correction/truncated"] < 1
    out = capsys.readouterr().out
    assert out.count("warning: step 1: the engines' log-probs differ from the learner's") == 1
    assert out.count("said once a run") == 1 and "correction is on and the gap is this large" in out
    assert "mismatch kl" in out and "IS weight" in out  # the console's learner line


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_engines_serving_other_weights_stop_the_run_at_the_default_bound(ray_local: None, tmp_path: Path) -> None:
    # The injected mismatch: engines whose weights are off by noise (tests.hostile.PerturbedEngine),
    # bypass mode with token-k3 rejection, veRL's default bound (max_kl 0.1) and on_excess=stop.
    job = load_config(TrainJob, EXAMPLE, [*SMALL, "steps=2", "eval_every=0", f"out={tmp_path}",
                                          "rollout.engine.kind=tests.hostile:PerturbedEngine",
                                          "learner.rollout_correction.rollout_rs=token_k3",
                                          "learner.rollout_correction.rollout_rs_threshold=10",
                                          "learner.rollout_correction.on_excess=stop"])
    with pytest.raises(TrainError, match=r"step 1: the engines' log-probs differ from the learner's by KL "
                                         r"[0-9.e+-]+ per token .* above learner.rollout_correction.max_kl=0.1; "
                                         r"the correction is on .* \(stopped: "
                                         r"learner.rollout_correction.on_excess=stop\)"):
        run_train(job, progress=False)
    assert not [p for p in (tmp_path / "weights").glob("v*")]  # the update was never published

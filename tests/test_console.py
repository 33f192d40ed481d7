"""The console of `turnstile train` (cluster/jobs/console.py): plain lines off a terminal, a live view on one."""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from turnstile.cluster.fleet.autoscale import FleetView
from turnstile.cluster.jobs.console import NATIVE_LOG, TrainConsole
from turnstile.cluster.jobs.metrics import render

STEP = {"reward/mean": 0.25, "reward/accuracy": 0.375, "rollout/turns_mean": 6.5, "rollout/turns_max": 9.0,
        "format/ok_rate": 0.875, "staleness/mean": 0.5, "staleness/max": 1.0, "throughput/tokens_per_s": 812.0,
        "learner/loss": -0.0123, "time/step_s": 41.2, "time/rollout_s": 30.0}


def shown(console: TrainConsole, width: int = 100) -> str:
    screen = Console(width=width, record=True, file=io.StringIO())
    screen.print(console.view())
    return screen.export_text()


def test_off_a_terminal_each_step_is_its_two_plain_lines_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    console = TrainConsole(3, live=False)
    with console:
        tally = console.stage("rollout", total=8)
        for _ in range(8):
            tally.update(1)
        console.stage("learner")
        console.step(STEP, 1)
    assert capsys.readouterr().out == render(STEP, 1) + "\n"
    assert console.stage_name == "done"


def test_the_live_view_shows_progress_the_stage_with_its_episodes_the_fleet_and_the_last_steps() -> None:
    console = TrainConsole(5, live=False)
    console.fleet = lambda: FleetView(elapsed_s=1.0, engines=2, workers=3, running=7, waiting=4,
                                      finished=0, episodes_per_worker=4)
    console.step(STEP, 1)
    console.step({**STEP, "reward/mean": -0.5, "eval/accuracy": 0.1}, 2)
    tally = console.stage("rollout", total=8)
    for _ in range(3):
        tally.update(1)
    text = shown(console)
    assert "step 3/5" in text
    assert "rollout 3/8 episodes" in text
    assert "2 engine replicas, 3 workers, 7 episodes running, 4 waiting" in text
    assert "left" in text  # two steps done: an estimate of the rest
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert rows == [["1", "0.25", "37.5%", "6.5", "88%", "0.5", "812", "-0.0123", "-", "41.2s"],
                    ["2", "-0.5", "37.5%", "6.5", "88%", "0.5", "812", "-0.0123", "10.0%", "41.2s"]]


def test_the_table_keeps_the_last_steps_only() -> None:
    console = TrainConsole(20, live=False)
    for step in range(1, 13):
        console.step({**STEP, "reward/mean": float(step)}, step)
    steps = [line.split()[0] for line in shown(console).splitlines()
             if line.split() and line.split()[0].isdigit()]
    assert steps == [str(step) for step in range(13 - TrainConsole.ROWS, 13)]


def test_a_stage_without_episodes_counts_nothing() -> None:
    console = TrainConsole(2, live=False)
    console.stage("learner").update(5)
    assert console.stage_done == 0
    assert "learner (" in shown(console) and "episodes" not in shown(console)


def test_live_log_records_print_through_the_view_and_the_handlers_get_their_streams_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handler = logging.StreamHandler(sys.__stderr__)
    logging.getLogger().addHandler(handler)
    try:
        with TrainConsole(2, live=True) as console:
            assert handler.stream is not sys.__stderr__  # redirected above the live view
            console.step(STEP, 1)
        assert handler.stream is sys.__stderr__
        assert console.stage_name == "done"
    finally:
        logging.getLogger().removeHandler(handler)


def test_a_run_that_raises_leaves_the_view_saying_it_stopped() -> None:
    console = TrainConsole(2, live=False)
    with pytest.raises(RuntimeError), console:
        console.stage("learner")
        raise RuntimeError("boom")
    assert console.stage_name == "stopped"


def test_while_live_native_output_goes_to_the_file_and_prints_above_the_view(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Ray's C++ core writes to descriptor 2; live, that lands in OUT/logs/ and is copied above the view."""
    before = os.fstat(2).st_ino
    native = tmp_path / "logs" / NATIVE_LOG
    with TrainConsole(2, live=True, native=native) as console:
        os.write(2, b"[E core_worker.cc:2465] a native warning\n")
        os.write(2, b"a line without its end")
        console.step(STEP, 1)
    assert os.fstat(2).st_ino == before  # the descriptor is back
    assert native.read_text() == "[E core_worker.cc:2465] a native warning\na line without its end"
    shown_out = capfd.readouterr().out
    assert "a native warning" in shown_out and "a line without its end" in shown_out

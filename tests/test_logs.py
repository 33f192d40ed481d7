"""A command's console: the workers' output goes to OUT/logs/, errors still reach the console, and
the end of the run says where its outputs are (cluster/fleet/logs.py, cluster/cli/logs.py)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train import EXAMPLE, SMALL

REPO = Path(__file__).resolve().parent.parent

WORKER = """
import logging, os, subprocess, sys
os.environ["TURNSTILE_LOG_DIR"] = sys.argv[1]
from turnstile.cluster.fleet.logs import redirect_worker_output
print("before the hook")
sys.stdout.flush()
redirect_worker_output()
print("a print")
print("a print to stderr", file=sys.stderr)
os.write(2, b"C++ writes to fd 2\\n")
subprocess.run(["sh", "-c", "echo a child process"], check=True)
logging.getLogger("worker").warning("a warning")
logging.getLogger("worker").error("an error")
"""


def test_a_worker_process_writes_to_its_file_and_only_errors_reach_the_console(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-c", WORKER, str(logs)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before the hook\n"
    assert done.stderr.strip().splitlines() == ["ERROR worker: an error"]
    files = list(logs.glob("worker-*.log"))
    assert len(files) == 1
    text = files[0].read_text()
    for line in ("a print", "a print to stderr", "C++ writes to fd 2", "a child process", "a warning",
                 "an error"):
        assert line in text, (line, text)
    assert "before the hook" not in text


def test_without_the_variable_nothing_moves(tmp_path: Path) -> None:
    script = WORKER.replace('os.environ["TURNSTILE_LOG_DIR"] = sys.argv[1]', "")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "a print" in done.stdout and "C++ writes to fd 2" in done.stderr
    assert not list(tmp_path.iterdir())


def on_a_terminal(command: list[str], timeout: float) -> tuple[int, str]:
    """Run ``command`` with its stdout and stderr on a pseudo-terminal, as a person would; its exit
    status and what the terminal received, ANSI control sequences removed."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    received = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal closed: every process holding it has exited
                break
            if not chunk:
                break
            received += chunk
    else:
        process.kill()
    os.close(primary)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", received.decode("utf-8", errors="replace"))
    return process.wait(timeout=60), text.replace("\r", "")


@pytest.mark.integration
def test_a_train_run_on_a_terminal_shows_the_live_view_and_not_the_workers_start_up(tmp_path: Path) -> None:
    """A real `turnstile train` that starts its own Ray, on a terminal: the live view (progress,
    stage, the steps' table) and the evaluations, the vLLM/veRL workers' output in OUT/logs/, and
    the last lines say where everything is."""
    out = tmp_path / "run"
    code, console = on_a_terminal([sys.executable, "-c", "from turnstile.cluster.cli import main; main()", "train",
                                   "--config", str(EXAMPLE), *SMALL, "steps=2", "eval_every=2", f"out={out}",
                                   "rollout.ray.num_cpus=4"], timeout=600)
    assert code == 0, console[-3000:]
    lines = [line.rstrip() for line in console.strip().splitlines()]
    worker_lines = [line for line in lines if "pid=" in line]  # Ray's prefix of forwarded output
    assert not worker_lines, worker_lines[:5]
    assert not any("Token authentication is enabled" in line for line in lines)
    assert any("step 2/2" in line and "elapsed" in line for line in lines)  # the live view's progress
    assert any("now rollout" in line and "/4 episodes" in line for line in lines)  # a stage with its count
    # Printed above the view (a frame's last line, erased on the screen, shares its line in this text).
    assert any("eval @ step 2: accuracy" in line for line in lines)
    table = [line.split() for line in lines if line.split()[:2] in (["1", "-1"], ["2", "-1"])]
    assert {row[0] for row in table} == {"1", "2"}, lines[-20:]  # the steps' table
    end = lines.index(next(line for line in lines if line.startswith("done: 2 steps")))
    assert lines[end + 1].startswith("outputs in ") and lines[end + 1].endswith(f"turnstile view {out}")
    assert "logs/" in lines[end + 1] and "scored/" in lines[end + 1]
    assert lines[end + 2].startswith("held-out accuracy ")
    logged = "".join(path.read_text(errors="replace") for path in (out / "logs").glob("worker-*.log"))
    assert "Qwen3ForCausalLM" in logged  # the learner's and engines' start-up went to the files


@pytest.mark.integration
def test_off_a_terminal_the_same_run_prints_plain_step_lines(tmp_path: Path) -> None:
    """With --no-progress (or a pipe) the steps are two plain lines each, nothing redrawn."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", "from turnstile.cluster.cli import main; main()", "train", "--config",
                           str(EXAMPLE), "--no-progress", *SMALL, "steps=1", "eval_every=0", f"out={out}",
                           "rollout.ray.num_cpus=4"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          check=False)
    console = done.stdout
    assert done.returncode == 0, console[-3000:]
    lines = console.strip().splitlines()
    assert "\x1b[" not in console and "\r" not in console
    assert any(line.startswith("step 1 |") for line in lines)
    assert " ig " not in next(line for line in lines if line.startswith("step 1 |"))  # no IG reward here
    assert not any(line.startswith("now ") for line in lines)
    assert lines[-1].startswith("outputs in ") and lines[-1].endswith(f"turnstile view {out}")
    assert len(lines) < 20, lines

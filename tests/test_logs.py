"""A command's console: the workers' output goes to OUT/logs/, errors still reach the console, and
the end of the run says where its outputs are (cluster/logs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import EXAMPLE, SMALL

REPO = Path(__file__).resolve().parent.parent

WORKER = """
import logging, os, subprocess, sys
os.environ["TURNSTILE_LOG_DIR"] = sys.argv[1]
from cluster.logs import redirect_worker_output
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
                          timeout=60)
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
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "a print" in done.stdout and "C++ writes to fd 2" in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.integration
def test_a_train_run_on_its_own_ray_prints_its_steps_not_the_workers_start_up(tmp_path: Path) -> None:
    """A real `turnstile train` that starts its own Ray: the console holds the run's lines, the
    vLLM/veRL workers' output is in OUT/logs/, and the last lines say where everything is."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", "from cluster.cli import main; main()", "train", "--config",
                           str(EXAMPLE), "--no-progress", *SMALL, "steps=1", "eval_every=0", f"out={out}",
                           "rollout.ray.num_cpus=4"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    console = done.stdout
    assert done.returncode == 0, console[-3000:]
    lines = console.strip().splitlines()
    worker_lines = [line for line in lines if "pid=" in line]  # Ray's prefix of forwarded output
    assert not worker_lines, worker_lines[:5]
    assert any(line.startswith("step 1 |") for line in lines)
    assert " ig " not in next(line for line in lines if line.startswith("step 1 |"))  # no IG reward here
    assert lines[-1].startswith("outputs in ") and lines[-1].endswith(f"turnstile view {out}")
    assert "logs/" in lines[-1] and "scored/" in lines[-1]
    logged = "".join(path.read_text(errors="replace") for path in (out / "logs").glob("worker-*.log"))
    assert "Qwen3ForCausalLM" in logged  # the learner's and engines' start-up went to the files
    assert len(lines) < 20, lines

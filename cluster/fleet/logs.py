"""Where the workers' output goes.

By default Ray forwards every worker's output to the driver's console, where vLLM's and veRL's
start-up warnings (Triton, NUMA binding, libtcmalloc, deprecations) bury the step lines. A command
that starts its own Ray sends each worker process's output to ``OUT/logs/worker-<pid>.log`` instead:
Ray runs :func:`redirect_worker_output` in every worker process of the job before any actor code
(``worker_process_setup_hook``), which points the process's file descriptors 1 and 2 at that file,
so C++ output and the processes a worker starts (vLLM's engine core) land there too. Log records
at ERROR and above still go to the worker's original stderr, which Ray forwards: errors reach the
console. Exceptions raised in actors reach the driver through Ray as before.

A driver that joins a running cluster (``rollout.ray.address``, ``RAY_ADDRESS`` under ``ray job
submit``) leaves the workers' output to that cluster's own logs (the dashboard's log view), as Ray
keeps them there. What the command itself prints: ``cluster/cli/logs.py``.
"""


from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "TURNSTILE_LOG_DIR"
LOGS = "logs"  # OUT/logs


def worker_runtime_env(logs: Path) -> dict[str, object]:
    """The job's runtime environment that sends every worker's output to files in ``logs``."""
    return {"worker_process_setup_hook": f"{__name__}.redirect_worker_output",
            "env_vars": {LOG_DIR_ENV: str(logs.resolve())}}


def redirect_worker_output() -> None:
    """In a worker process: stdout and stderr (the descriptors, so C++ and child processes too) to
    ``$TURNSTILE_LOG_DIR/worker-<pid>.log``; records at ERROR and above still to the old stderr."""
    directory = os.environ.get(LOG_DIR_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    console = os.dup(2)
    target = os.open(os.path.join(directory, f"worker-{os.getpid()}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    line = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    if not root.handlers:  # what logging's last resort would print, to the file now
        everything = logging.StreamHandler(sys.stderr)
        everything.setFormatter(line)
        root.addHandler(everything)
    errors = logging.StreamHandler(os.fdopen(console, "w", buffering=1))
    errors.setLevel(logging.ERROR)
    errors.setFormatter(line)
    root.addHandler(errors)

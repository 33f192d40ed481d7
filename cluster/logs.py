"""What a command prints, and where the rest goes.

By default Ray forwards every worker's output to the driver's console, where vLLM's and veRL's
start-up warnings (Triton, NUMA binding, libtcmalloc, deprecations) bury the step lines. A command
that starts its own Ray sends each worker process's output to ``OUT/logs/worker-<pid>.log`` instead:
Ray runs :func:`redirect_worker_output` in every worker process of the job before any actor code
(``worker_process_setup_hook``), which points the process's file descriptors 1 and 2 at that file,
so C++ output and the processes a worker starts (vLLM's engine core) land there too. Log records
at ERROR and above still go to the worker's original stderr, which Ray forwards: errors reach the
console. Exceptions raised in actors reach the driver through Ray as before.

``-v`` (``verbose``) leaves everything on the console. A driver that joins a running cluster
(``rollout.ray.address``, ``RAY_ADDRESS`` under ``ray job submit``) leaves the workers' output to
that cluster's own logs (the dashboard's log view), as Ray keeps them there.

:func:`console_logging` sets up the driver's own logging: warnings and errors, without the
start-up notices of the libraries it imports, unless verbose.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "TURNSTILE_LOG_DIR"
LOGS = "logs"  # OUT/logs
# Driver-side notices that say nothing to a user of turnstile (each seen on every run).
QUIET_LOGGERS = ("torch.fx._symbolic_trace",)
# Ray's notice that the local cluster it starts uses token authentication (the safe default, said on
# every start); its warning that authentication is *off* still shows.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_ON = "Token authentication is enabled for this Ray cluster"


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


def worker_logs(out: Path, verbose: bool) -> Path | None:
    """Where a command writing to ``out`` (a directory) sends its workers' output: ``out/logs``,
    or nowhere (the console) when verbose."""
    return None if verbose else out / LOGS


def console_logging(verbose: bool) -> None:
    """The driver's logging: warnings and errors (everything from INFO when verbose), one line each."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # A library that sets its own logger's level (veRL at INFO) still stops at the handler.
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger(RAY_AUTH_LOGGER).addFilter(_not_the_auth_notice)


def _not_the_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(RAY_AUTH_ON)


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` on a command that starts workers."""
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="workers' output and library notices on the console (default: in OUT/logs/)")

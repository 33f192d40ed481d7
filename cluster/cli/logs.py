"""What a command prints: the driver's logging, and ``-v`` to keep the workers' output on the
console (where it goes otherwise: ``cluster/fleet/logs.py``).

:func:`console_logging` sets up the driver's own logging: warnings and errors, without the
start-up notices of the libraries it imports, unless verbose.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from turnstile.cluster.fleet.logs import LOGS

# Driver-side notices that say nothing to a user of turnstile (each seen on every run).
QUIET_LOGGERS = ("torch.fx._symbolic_trace",)
# Ray's notice that the local cluster it starts uses token authentication (the safe default, said on
# every start); its warning that authentication is *off* still shows.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_ON = "Token authentication is enabled for this Ray cluster"


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

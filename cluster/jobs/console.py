"""What ``turnstile train`` shows while it runs.

On a terminal, a live view at the bottom of the screen (rich's ``Live``, redrawn four times a
second):

- the run's progress: steps done of all, time so far and an estimate of the time left;
- what the run does now: starting the fleet and the learner (side by side), then waiting on the
  learner; then the current step's stage
  (rollout, rewards, credit, learner, publish, eval, checkpoint) with
  its episodes done of all where it has them and its time so far, and the fleet's replicas,
  workers and running episodes;
- a table of the last steps: reward, accuracy, turns, format, staleness, throughput, the loss and
  the step's time.

What the run prints meanwhile (an evaluation's line, an error a worker reports) scrolls above the
view; when the run ends the view stays on the screen as its last state. Output written to the
driver's file descriptor 2 by native code (Ray's C++ core worker) would land in the middle of the
view, so while it is live, descriptor 2 points at ``OUT/logs/driver-stderr.log`` and a thread copies
each new line from there to the console, above the view: the file keeps it even if the process
dies before the line is shown. Anywhere else (a pipe, a
log file, CI) and with ``--no-progress``, the same steps are plain lines (:func:`render`), one pair
per step and nothing in between, so logs stay short and greppable.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from turnstile.cluster.jobs.metrics import render

if TYPE_CHECKING:
    from rich.console import Group, RenderableType
    from rich.live import Live

    from turnstile.cluster.fleet.autoscale import FleetView

NATIVE_LOG = "driver-stderr.log"  # in OUT/logs: what native code writes to the driver's stderr while live


class Tally(Protocol):
    """What counts finished episodes: a tqdm bar, or the console's current stage."""

    def update(self, n: int = 1) -> object: ...


class _Uncounted:
    def update(self, n: int = 1) -> None:
        return None


UNCOUNTED = _Uncounted()  # a tally nobody reads


class TrainConsole:
    """The console of one training run: :meth:`stage` says what the run does now, :meth:`step`
    reports a finished step. Live on a terminal, plain lines elsewhere (see the module)."""

    ROWS = 8  # steps in the table

    def __init__(self, steps: int, *, live: bool, native: Path | None = None) -> None:
        self.steps, self.live = steps, live
        self.first_step = 0  # the step the run started from (a resumed run's checkpoint)
        self.native = native  # where descriptor 2 goes while live (None: left alone)
        self._native_fd: int | None = None
        self._copying: threading.Thread | None = None
        self._stop_copying = threading.Event()
        self.done = 0
        self.rows: deque[tuple[int, Mapping[str, float]]] = deque(maxlen=self.ROWS)
        self.stage_name, self.stage_done, self.stage_total = "starting", 0, 0
        self.fleet: Callable[[], FleetView] | None = None  # the running fleet's view, once it runs
        self._lock = threading.Lock()
        self._started = self._stage_started = time.monotonic()
        self._live: Live | None = None
        self._streams: list[tuple[logging.StreamHandler, object]] = []

    @classmethod
    def for_this_terminal(cls, steps: int, *, progress: bool, logs: Path) -> TrainConsole:
        """Live when asked for progress and stdout is a terminal; native output to ``logs``."""
        return cls(steps, live=progress and sys.stdout.isatty(), native=logs / NATIVE_LOG)

    def __enter__(self) -> TrainConsole:
        if self.live:
            from rich.live import Live

            self._live = Live(get_renderable=self.view, refresh_per_second=4, transient=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()
            # Log handlers keep the stream they were made with: point them at the redirected one,
            # so a warning prints above the view instead of through it.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, sys.__stdout__):
                    self._streams.append((handler, handler.stream))
                    handler.setStream(sys.stderr)
            if self.native is not None:
                self._divert_native(self.native)
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        self.stage("done" if error is None else "stopped")
        if self._live is not None:
            if self._native_fd is not None:
                _flush_python_stderr()
                os.dup2(self._native_fd, 2)
                os.close(self._native_fd)
                self._native_fd = None
                self._stop_copying.set()
                assert self._copying is not None
                self._copying.join(timeout=5)
            for handler, stream in self._streams:
                handler.setStream(stream)
            self._live.stop()
            self._live = None

    def _divert_native(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        start = os.lseek(target, 0, os.SEEK_END)
        _flush_python_stderr()
        self._native_fd = os.dup(2)
        os.dup2(target, 2)
        os.close(target)
        self._copying = threading.Thread(target=self._copy_native, args=(path, start), daemon=True,
                                         name="turnstile-native-output")
        self._copying.start()

    def _copy_native(self, path: Path, start: int) -> None:
        """Each new line of ``path`` to the console, above the live view, until told to stop."""
        assert self._live is not None
        console = self._live.console
        with path.open("rb") as lines:
            lines.seek(start)
            partial = b""
            while True:
                stopping = self._stop_copying.is_set()  # read once more after the last write
                partial += lines.read()
                *complete, partial = partial.split(b"\n")
                if stopping and partial:  # a last line without its end
                    complete.append(partial)
                for line in complete:
                    console.print(line.decode(errors="replace"), markup=False, highlight=False,
                                  soft_wrap=True, style="dim")
                if stopping:
                    return
                self._stop_copying.wait(0.2)

    def stage(self, name: str, total: int = 0) -> Tally:
        """The current step is now in stage ``name``; with ``total`` episodes to run, the returned
        tally counts them (what :meth:`turnstile.cluster.jobs.session.FleetSession.generate` updates)."""
        with self._lock:
            self.stage_name, self.stage_done, self.stage_total = name, 0, total
            self._stage_started = time.monotonic()
        return self if total else UNCOUNTED

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.stage_done += n

    def step(self, metrics: Mapping[str, float], step: int) -> None:
        """A finished step: a row of the table (live), or its two lines (plain)."""
        with self._lock:
            self.done = step
            self.rows.append((step, dict(metrics)))
        if not self.live:
            print(render(metrics, step), flush=True)

    # ---- the live view ----------------------------------------------------------------------------

    def view(self) -> Group:
        """The live view now (a rich renderable)."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            now = time.monotonic()
            elapsed, in_stage = now - self._started, now - self._stage_started
            done_now = self.done - self.first_step
            left = elapsed / done_now * (self.steps - self.done) if done_now else None
            head = Table.grid(padding=(0, 1))
            head.add_row(Text(f"step {min(self.done + 1, self.steps)}/{self.steps}", style="bold"),
                         ProgressBar(total=max(self.steps, 1), completed=self.done, width=30),
                         Text(f"{_clock(elapsed)} elapsed" + (f", about {_clock(left)} left" if left is not None
                                                            else "")))
            counted = f" {self.stage_done}/{self.stage_total} episodes" if self.stage_total else ""
            stage = Text.assemble(("now ", "dim"), (self.stage_name, "cyan"), f"{counted} ({in_stage:.0f}s)")
            table = Table(box=None, padding=(0, 1), header_style="bold")
            for column in ("step", "reward", "acc", "turns", "fmt", "stale", "tok/s", "loss", "eval", "time"):
                table.add_column(column, justify="right")
            for step, row in self.rows:
                table.add_row(str(step), _cell(row, "reward/mean", "{:.3g}"),
                              _cell(row, "reward/accuracy", "{:.1%}"), _cell(row, "rollout/turns_mean", "{:.1f}"),
                              _cell(row, "format/ok_rate", "{:.0%}"), _cell(row, "staleness/mean", "{:.2g}"),
                              _cell(row, "throughput/tokens_per_s", "{:.0f}"), _cell(row, "learner/loss", "{:.3g}"),
                              _cell(row, "eval/accuracy", "{:.1%}"), _cell(row, "time/step_s", "{:.1f}s"))
            parts: list[RenderableType] = [head, stage]
            if self.fleet is not None:
                fleet = self.fleet()
                parts.append(Text(f"fleet {fleet.engines} engine replica{'s' * (fleet.engines != 1)}, "
                                  f"{fleet.workers} worker{'s' * (fleet.workers != 1)}, {fleet.running} "
                                  f"episodes running, {fleet.waiting} waiting", style="dim"))
            if self.rows:
                parts.append(table)
        return Group(*parts)


def _flush_python_stderr() -> None:
    """Write out what Python holds for descriptor 2 before the descriptor changes."""
    if sys.__stderr__ is not None:  # None in a process started without a descriptor 2
        sys.__stderr__.flush()


def _cell(row: Mapping[str, float], key: str, spec: str) -> str:
    return spec.format(row[key]) if key in row else "-"


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"

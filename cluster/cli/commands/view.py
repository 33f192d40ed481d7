"""``turnstile view``: trajectory files as one HTML page to read in a browser, offline.

Takes rollout, scored or credited trajectory files, directories of them, or a training run's
``OUT/`` (each step of ``scored/``, ``rollouts/`` and ``eval/`` becomes an entry of the page's file
picker)::

    turnstile view runs/train/scored/step3.jsonl
    turnstile view runs/train --out train.html

The page shows each group's samples side by side, their turns coloured by advantage, and a turn's
full response and observation on click; see ``cluster/tools/view.py`` for how it is built.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cluster.tools.view import PageSummary, ViewError, find_sources, write_page

NAME = "view"
HELP = ("Write one self-contained HTML page to browse trajectory files (rollouts, scored, credited) or a "
        "training run's steps.")
DEFAULT_OUT = "turnstile-view.html"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="FILE_OR_DIR",
                        help="trajectory JSONL files, directories of them, or a training run's output "
                             "directory (its scored/, rollouts/ and eval/ steps)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="PAGE.html",
                        help=f"where to write the page (default: {DEFAULT_OUT} in the current directory)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        page = write_page(find_sources(args.paths), out)
    except ViewError as error:
        print(f"turnstile view: {error}")
        return 2
    except OSError as error:  # the inputs were read; writing the page failed
        print(f"turnstile view: cannot write {out}: {error.strerror or error}; pick another --out")
        return 1
    print(closing_lines(page))
    return 0


def closing_lines(page: PageSummary) -> str:
    """What the page holds, where it is and how to open it."""
    where = page.path.resolve()
    lines = [f"view: {page.files} file(s), {page.groups} groups, {page.trajectories} trajectories, "
             f"{page.turns} turns"]
    if page.empty:
        lines.append(f"no trajectories in: {', '.join(page.empty)}")
    lines += [f"written: {where} ({page.bytes / 1e6:.1f} MB, self-contained: no server or network needed)",
              f"open it in a browser: {where.as_uri()}  (e.g. chromium {where}; from a remote machine, copy "
              "the file over first)"]
    return "\n".join(lines)

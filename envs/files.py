"""Files and directories written whole or not at all.

Each writer works on a temporary name beside the target and renames it over the target when it is
complete (a rename within one directory is atomic), so a reader, or a run resumed after a crash,
finds the previous version or the new one, never half of one. Whatever fails or is interrupted
removes the temporary name and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


def _beside(target: Path) -> Path:
    return target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """A path beside ``target`` to write a file to, renamed over ``target`` when the block ends; for
    writers that take a path (safetensors, ``torch.save``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = _beside(target)
    try:
        yield temporary
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_write(target: str | Path, errors: str = "strict") -> Iterator[TextIO]:
    """A UTF-8 text file that becomes ``target`` when the block ends."""
    with atomic_path(target) as temporary, temporary.open("w", encoding="utf-8", errors=errors) as file:
        yield file


@contextlib.contextmanager
def atomic_directory(target: str | Path, *, force: bool) -> Iterator[Path]:
    """A directory beside ``target`` to fill, which replaces ``target`` when the block ends, its files
    readable by all (``save_pretrained`` writes weights 0600). An existing ``target`` (a directory,
    file or link) is replaced only with ``force``; without it that is a ``FileExistsError``, raised
    before anything is written."""
    target = Path(target)
    if not force and (target.exists() or target.is_symlink()):
        raise FileExistsError(f"{target} exists; pass force=True (--force) to rebuild it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _beside(target)
    staging.mkdir()
    try:
        yield staging
        for path in staging.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        staging.chmod(0o755)
        if target.exists() or target.is_symlink():
            _remove(target)
        os.replace(staging, target)
    except BaseException:
        _remove(staging)
        raise

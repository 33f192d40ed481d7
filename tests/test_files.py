"""Files and directories written whole or not at all (envs/files.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from turnstile.envs.files import atomic_directory, atomic_path, atomic_write


class Interrupted(Exception):
    pass


def test_a_file_is_replaced_only_once_it_is_complete(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    target.write_text("old")
    with pytest.raises(Interrupted), atomic_write(target) as file:
        file.write("half of the new")
        assert target.read_text() == "old"  # a reader meanwhile sees the old file
        raise Interrupted
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # nothing left beside it
    with atomic_write(target) as file:
        file.write("new ✓")
    assert target.read_text(encoding="utf-8") == "new ✓"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_writer_that_takes_a_path_writes_beside_the_target(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "model.safetensors"
    with atomic_path(target) as temporary:
        assert temporary.parent == target.parent and temporary != target
        temporary.write_bytes(b"\x00\x01")
        assert not target.exists()
    assert target.read_bytes() == b"\x00\x01"
    with pytest.raises(Interrupted), atomic_path(target) as temporary:
        temporary.write_bytes(b"torn")
        raise Interrupted
    assert target.read_bytes() == b"\x00\x01" and sorted(target.parent.iterdir()) == [target]


def test_a_surrogate_is_written_as_its_escape_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "page.html"
    with atomic_write(target, errors="backslashreplace") as file:
        file.write("a\ud800b")
    assert target.read_text() == "a\\ud800b"
    with pytest.raises(UnicodeEncodeError), atomic_write(target) as file:
        file.write("\ud800")
    assert target.read_text() == "a\\ud800b"


def test_a_directory_appears_whole_readable_by_all(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with atomic_directory(target, force=False) as staging:
        (staging / "weights").write_bytes(b"w")
        (staging / "weights").chmod(0o600)  # as save_pretrained writes them
        (staging / "sub").mkdir()
        (staging / "sub" / "x").write_text("x")
        assert not target.exists()
    assert (target / "weights").read_bytes() == b"w" and (target / "sub" / "x").read_text() == "x"
    assert stat.S_IMODE((target / "weights").stat().st_mode) == 0o644
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_an_existing_directory_is_kept_unless_forced_and_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(FileExistsError, match="--force"), atomic_directory(target, force=False):
        pytest.fail("the block must not run")
    with pytest.raises(Interrupted), atomic_directory(target, force=True) as staging:
        (staging / "new").write_text("new")
        raise Interrupted
    assert [p.name for p in target.iterdir()] == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # the staging directory is gone
    with atomic_directory(target, force=True) as staging:
        (staging / "new").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new"]


def test_a_link_in_the_way_is_replaced_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep")
    target = tmp_path / "current"
    target.symlink_to(elsewhere)
    with atomic_directory(target, force=True) as staging:
        (staging / "new").write_text("new")
    assert not target.is_symlink() and [p.name for p in target.iterdir()] == ["new"]
    assert (elsewhere / "keep").read_text() == "keep"

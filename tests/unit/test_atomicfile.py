"""atomicfile: a file is replaced whole or not at all, never written through a planted link."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bistouri import atomicfile


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "f"
    dest.write_bytes(b"old")
    atomicfile.write(dest, b"new", mode=0o640)
    assert dest.read_bytes() == b"new"
    assert names(tmp_path) == ["f"]
    assert dest.stat().st_mode & 0o777 == 0o640 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_an_exception_in_the_block_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "f"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomicfile.replacing(dest) as out:
        out.file.write(b"half")
        raise RuntimeError("stop")
    assert dest.read_bytes() == b"old"
    assert names(tmp_path) == ["f"]


def test_a_discarded_file_is_not_renamed_at_the_end_of_the_block(tmp_path: Path) -> None:
    dest = tmp_path / "f"
    with atomicfile.replacing(dest) as out:
        out.file.write(b"bad")
        out.finish()
        assert Path(out.path).read_bytes() == b"bad"  # finished: readable to check it
        out.discard()
    assert names(tmp_path) == []


def test_a_link_planted_at_the_destination_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "out").symlink_to(victim)
    atomicfile.write(tmp_path / "out", b"new")
    assert victim.read_bytes() == b"keep"
    assert not (tmp_path / "out").is_symlink()
    assert (tmp_path / "out").read_bytes() == b"new"


def test_the_temporary_name_is_fresh_and_names_its_writer(tmp_path: Path) -> None:
    seen = set()
    for _ in range(3):
        with atomicfile.replacing(tmp_path / "f", tmp_dir=tmp_path) as out:
            seen.add(os.path.basename(out.path))
    assert len(seen) == 3
    for name in seen:
        assert re.fullmatch(rf"\.tmp\.{os.getpid()}\.[0-9a-f]{{16}}", name)


def test_relative_to_a_directory_fd_and_synced(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        atomicfile.write("f", b"x", fsync=True, dir_fd=fd)
    finally:
        os.close(fd)
    atomicfile.fsync_dir(tmp_path)
    assert names(tmp_path) == ["f"]
    assert (tmp_path / "f").read_bytes() == b"x"


def test_commit_inside_the_block_renames_at_once(tmp_path: Path) -> None:
    dest = tmp_path / "f"
    with atomicfile.replacing(dest, fsync=True) as out:
        out.file.write(b"now")
        out.commit()
        assert dest.read_bytes() == b"now"
    assert names(tmp_path) == ["f"]

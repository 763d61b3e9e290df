"""A small tmpfs that a test fills up: a real ENOSPC for the symbolizer, no mock.

`small_tmpfs(path)` mounts a tmpfs of `size` bytes on `path` (root only; the test is
skipped elsewhere) and unmounts it afterwards. `fill(path)` writes a filler file until
the file system is full and returns it: deleting the filler clears the fault.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int = 4 << 20) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(fs: Path) -> Path:
    """Fill the file system holding `fs` with one file; returns that file."""
    filler = fs / "filler"
    chunk = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    # Smaller writes take what the big ones left.
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    assert os.statvfs(fs).f_bavail == 0
    return filler

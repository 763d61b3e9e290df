"""Files replaced whole: written under a fresh temporary name, then renamed over the final one.

The one way bistouri writes a file another process may read, or that a link may have been planted at
(a root `record` writing into a named directory, caches under /var). The temporary file is opened with
O_EXCL | O_NOFOLLOW under an unpredictable name (`.tmp.<pid>.<random>`) in the destination's directory
(or another of the same filesystem), so nothing planted is ever written through; it is renamed over the
final name only once complete, so a reader sees the old file or the new one, never half of one; on any
failure it is removed. The pid in the name lets a sweep tell a dead writer's file from a live one
(symbolizer/tempfiles.py).

Durability is the caller's choice: `fsync=True` syncs the data before the rename (a spool that must
survive a power cut); a cache that can be rebuilt skips it. A rename is durable only once its directory
is synced too: `fsync_dir`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Union

# Not typing's: `record` imports this before its first sample (typing costs ~2 ms).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO

TEMP_PREFIX = ".tmp."
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

StrPath = Union[str, os.PathLike[str]]  # Union: a 3.9 runtime alias


def temp_name() -> str:
    """A fresh temporary file name: `.tmp.<pid>.<16 random hex digits>`. os.urandom, not secrets:
    that imports hashlib, which maps libcrypto into `record` while it captures."""
    return f"{TEMP_PREFIX}{os.getpid()}.{os.urandom(8).hex()}"


class Staged:
    """The temporary file being written, given by `replacing`.

    `path` is where it is (relative to `dir_fd` when one was given): call `finish()` before reading it
    back to check it. `commit()` renames it over the destination at once, for a caller that must do so
    under its own lock; otherwise the end of the `with` block does it.
    """

    def __init__(self, file: BinaryIO, path: str, dest: StrPath, fsync: bool, dir_fd: int | None) -> None:
        self.file = file
        self.path = path
        self._dest = dest
        self._fsync = fsync
        self._dir_fd = dir_fd
        self.committed = False
        self.discarded = False

    def finish(self) -> None:
        """Flush and close the file (synced first if `fsync` was asked). Idempotent."""
        if self.file.closed:
            return
        try:
            self.file.flush()
            if self._fsync:
                os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def commit(self) -> None:
        """Finish the file and rename it over the destination. Idempotent."""
        if self.committed:
            return
        if self.discarded:
            raise ValueError(f"{self.path}: discarded, cannot be committed")
        self.finish()
        os.replace(self.path, self._dest, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self.committed = True

    def discard(self) -> None:
        """Close and remove the file, unless it was committed: the end of the block then keeps `dest`
        as it was (for a block that finds the file bad and returns)."""
        self.discarded = True
        with contextlib.suppress(OSError):
            self.file.close()
        if not self.committed:
            with contextlib.suppress(OSError):
                os.unlink(self.path, dir_fd=self._dir_fd)


@contextlib.contextmanager
def replacing(
    dest: StrPath,
    *,
    fsync: bool = False,
    mode: int = 0o600,
    tmp_dir: StrPath | None = None,
    dir_fd: int | None = None,
) -> Iterator[Staged]:
    """Write `dest` whole: yields the temporary file (a `Staged`); when the block ends without an
    exception, the file is closed (synced first if `fsync`) and renamed over `dest`. An exception removes
    it, `dest` untouched (unless the block had committed it already).

    `tmp_dir`: where the temporary file goes, if not beside `dest` (it must be on the same filesystem).
    `dir_fd`: `dest` and `tmp_dir` are relative to this open directory.
    """
    tmp = os.path.join(os.fspath(tmp_dir) if tmp_dir is not None else os.path.dirname(dest), temp_name())
    fd = os.open(tmp, _FLAGS, mode, dir_fd=dir_fd)
    staged = Staged(os.fdopen(fd, "wb"), tmp, dest, fsync, dir_fd)
    try:
        yield staged
        if not staged.discarded:
            staged.commit()
    except BaseException:
        staged.discard()
        raise


def write(
    dest: StrPath, data: bytes, *, fsync: bool = False, mode: int = 0o600, dir_fd: int | None = None
) -> None:
    """Replace `dest` with `data` (see `replacing`)."""
    with replacing(dest, fsync=fsync, mode=mode, dir_fd=dir_fd) as out:
        out.file.write(data)


def fsync_dir(path: StrPath) -> None:
    """Make the renames and removals done in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

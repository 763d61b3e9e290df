"""Files a watched process controls, opened without trusting it.

A target chooses what lies at the paths the agent reads as root: its perf map, the
files under its own root, the files it maps. Opened by path, a FIFO there blocks the
open for good (the agent froze, SIGTERM ignored) and a symlink to a root-only file
puts that file into a profile. Every such file is opened here, and only here:

- never blocking: `O_NONBLOCK` (a FIFO or a device opens at once, then is refused);
- no symlink followed: under a process's root, `openat2(RESOLVE_IN_ROOT |
  RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` (absolute links and `..` stay inside
  that root), else a walk component by component with `O_NOFOLLOW`;
- then `fstat` on the descriptor: a regular file only, owned by whom the caller
  expects, at most `max_bytes`.

The caller reads from the descriptor it gets (or through `fd_path` for a reader that
takes a path: that reopens the very file, no name is resolved again), never from the
path a second time. Refusals are counted by reason (`REFUSED`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections import Counter
from collections.abc import Collection

_NR_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_IN_ROOT = 0x10
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


# Files refused, by reason (metric bistouri_files_refused_total): symlink, not_regular,
# owner, too_large. Updated from several threads: a Counter's += under the GIL is enough
# for a count read at scrape time.
REASONS = ("symlink", "not_regular", "owner", "too_large")
REFUSED: Counter[str] = Counter()
_openat2_works = True  # cleared at the first ENOSYS (or a seccomp EPERM): the walk then


class Refused(OSError):
    """A file the caller must not read: `reason` is the metric label."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(errno.EPERM, f"refused ({reason})", path)
        self.reason = reason


def _refuse(path: str, reason: str) -> Refused:
    REFUSED[reason] += 1
    return Refused(path, reason)


def open_root(root: str) -> int:
    """A directory to resolve paths in: `/proc/PID/root` (its magic link is the process's own
    root, the one link followed here) or `/`."""
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def open_in_root(
    root_fd: int,
    path: str,
    *,
    owners: Collection[int] | None = None,
    max_bytes: int | None = None,
) -> int:
    """`path` (absolute or not) resolved inside `root_fd`, without following any symlink,
    checked (see `check`). OSError when it is absent, `Refused` when it is not to be read."""
    rel = path.lstrip("/")
    try:
        fd = _openat2(root_fd, rel) if _openat2_works else _walk(root_fd, rel)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "symlink") from None
        raise
    return check(fd, path, owners=owners, max_bytes=max_bytes)


def open_mapped(path: str, *, max_bytes: int | None = None) -> int:
    """A file through a magic link of /proc (`/proc/PID/map_files/<range>`): the kernel names
    the very file mapped, so that one link is followed; checked (see `check`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return check(fd, path, max_bytes=max_bytes)


def open_regular(path: str, *, max_bytes: int | None = None) -> int:
    """A file of the host's own (the operator's debug tree): links followed, but never blocking
    and a regular file only."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return check(fd, path, max_bytes=max_bytes)


def check(fd: int, path: str, *, owners: Collection[int] | None = None, max_bytes: int | None = None) -> int:
    """`fd` if it is a regular file owned by one of `owners` (any when None) and at most
    `max_bytes` long; else it is closed and `Refused` raised."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "not_regular")
        if owners is not None and st.st_uid not in owners:
            raise _refuse(path, "owner")
        if max_bytes is not None and st.st_size > max_bytes:
            raise _refuse(path, "too_large")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """A path that reopens the file of `fd` itself (for readers that take a path)."""
    return f"/proc/self/fd/{fd}"


def _openat2(root_fd: int, rel: str) -> int:
    global _openat2_works
    how = _OpenHow(_FLAGS, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    while True:
        fd = _libc.syscall(_NR_OPENAT2, root_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
            _openat2_works = False
            return _walk(root_fd, rel)
        raise OSError(err, os.strerror(err), rel)


def _walk(root_fd: int, rel: str) -> int:
    """openat2's resolution done by hand: each directory with O_NOFOLLOW, `..` refused (the
    paths read here come canonical from the kernel)."""
    parts = [p for p in rel.split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), rel)
    fd = os.dup(root_fd)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                # O_NOFOLLOW|O_DIRECTORY on a symlink says ENOTDIR: tell a link apart
                if stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel) from None
                raise
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], _FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


__all__ = [
    "REFUSED",
    "Refused",
    "check",
    "fd_path",
    "open_in_root",
    "open_mapped",
    "open_regular",
    "open_root",
]

"""Watches the targets file for changes with inotify (ctypes: the stdlib has no binding).

The directory is watched, not the file: editors and config management replace
files by atomic rename, and Kubernetes ConfigMaps swap a `..data` symlink; a
watch on the file itself would be lost at the first such change. Changes are
debounced, and a reload happens only when the content really changed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import struct

log = logging.getLogger(__name__)

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_init1.restype = ctypes.c_int
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_add_watch.restype = ctypes.c_int


def file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


class ConfigWatcher:
    """An inotify fd on the config's directory; `changed()` says whether to reload."""

    DEBOUNCE_S = 0.2

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.digest = file_digest(self.path)
        self.pending_since: float | None = None
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        if _libc.inotify_add_watch(fd, self.directory.encode(), _MASK) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch({self.directory}): {os.strerror(err)}")

    def fileno(self) -> int:
        return self.fd

    def read_events(self, now: float) -> None:
        """Drain the inotify fd; any event in the directory arms the debounce timer."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        if data:
            self.pending_since = now

    def deadline(self) -> float | None:
        return None if self.pending_since is None else self.pending_since + self.DEBOUNCE_S

    def changed(self, now: float) -> bool:
        """True once the debounce elapsed and the file's content differs from the last accepted one."""
        if self.pending_since is None or now < self.pending_since + self.DEBOUNCE_S:
            return False
        self.pending_since = None
        digest = file_digest(self.path)
        if digest is None:
            log.warning("Config file unreadable, keeping the running config. path=%s", self.path)
            return False
        return digest != self.digest

    def accept(self) -> None:
        """Remember the current content as the running one."""
        self.digest = file_digest(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

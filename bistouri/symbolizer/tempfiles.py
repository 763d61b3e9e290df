"""Temporary files of the state directory, swept once the process writing them is gone.

A worker killed while it writes an upload or a snapshot (an OOM kill, a restart) leaves its partial
file behind. Each one is named `.tmp.<pid>.<random>` (atomicfile.py writes them): a file whose
writer is no longer alive, or that no one touched for MAX_AGE_S, is deleted by `sweep()`, at a
worker's start and periodically (Ingest.maybe_retention). Files of the older form `.tmp.<random>`
are swept once MAX_AGE_S old.
"""

from __future__ import annotations

import logging
import os
import time

from .. import atomicfile

log = logging.getLogger(__name__)

PREFIX = atomicfile.TEMP_PREFIX
MAX_AGE_S = 24 * 3600.0  # an upload at a crawl still writes at least once a minute


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive
    return True


def sweep(directory: str | os.PathLike[str], now: float | None = None) -> int:
    """Delete the temporary files of `directory` left by writers that are gone. Returns how many."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        pid_text = entry.name[len(PREFIX) :].partition(".")[0]
        try:
            stale = now - entry.stat(follow_symlinks=False).st_mtime > MAX_AGE_S
        except OSError:
            continue
        if pid_text.isdigit() and not stale:
            pid = int(pid_text)
            stale = pid != os.getpid() and not _alive(pid)
        if stale:
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
    if removed:
        log.info("Removed temporary files left by stopped workers. dir=%s count=%d", directory, removed)
    return removed

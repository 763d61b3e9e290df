"""The agent's threads: named `bistouri-<role>` in Python and `<role>` in the kernel.

Python 3.11 does not give threads an OS name, so `top -H`, `ps -L` and
/proc/PID/task/*/comm would show every thread as the process. The kernel keeps
15 bytes of a thread name, hence the role alone there (the process itself is
`bistouri`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

PREFIX = "bistouri-"
_PR_SET_NAME = 15
_COMM_MAX = 15  # TASK_COMM_LEN - 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.prctl.restype = ctypes.c_int


def set_os_name(name: str) -> None:
    """Name the calling thread in the kernel (best effort: a name is not worth failing for)."""
    if _libc.prctl(_PR_SET_NAME, name.encode()[:_COMM_MAX], 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_NAME, %r) failed: errno %d", name, ctypes.get_errno())


def start(role: str, target: Callable[[], object]) -> threading.Thread:
    """Start a daemon thread `bistouri-<role>` running `target`."""

    def run() -> None:
        set_os_name(role)
        target()

    thread = threading.Thread(target=run, name=PREFIX + role, daemon=True)
    thread.start()
    return thread

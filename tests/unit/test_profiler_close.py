"""Profiler.close() never frees the ring buffer under a drain thread still running.

Under arm64 emulation `record`'s last drain (raw stack copies walked) outlasted stop()'s join,
and close() freed the ring buffer it was reading: SIGSEGV. No BPF here: the thread and the
ring buffer are stand-ins.
"""

from __future__ import annotations

import threading

import pytest

from bistouri import compat
from bistouri.capture import profiler as profiler_mod
from bistouri.capture.profiler import Profiler, ProfilerOptions


class _Ring:
    def __init__(self, drain_done: threading.Event) -> None:
        self.drain_done = drain_done
        self.freed_while_draining = False
        self.closed = False

    def close(self) -> None:
        self.freed_while_draining = not self.drain_done.is_set()
        self.closed = True


def _profiler(drain_s: float) -> tuple[Profiler, _Ring]:
    p = Profiler(ProfilerOptions())
    done = threading.Event()
    ring = _Ring(done)

    def last_drain() -> None:  # the stop eventfd is read, then a long final drain
        done.wait(drain_s)
        done.set()

    p._rb = ring  # type: ignore[assignment]
    p._stop_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
    p._kick_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
    p._thread = threading.Thread(target=last_drain, daemon=True)
    p._thread.start()
    return p, ring


def test_close_waits_for_a_last_drain_stop_did_not_see_end() -> None:
    p, ring = _profiler(drain_s=0.5)
    p.stop(timeout=0.05)
    assert p._thread is not None  # kept: it still runs
    p.close(timeout=0.05)
    assert ring.closed and not ring.freed_while_draining
    assert p._thread is None


def test_a_drain_that_never_ends_leaves_the_ring_buffer_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler_mod, "_LAST_DRAIN_WAIT_S", 0.1)
    p, ring = _profiler(drain_s=5.0)
    p.close(timeout=0.05)
    assert not ring.closed  # leaked, not freed under the thread
    assert p._thread is not None and p._thread.is_alive()
    ring.drain_done.set()  # the stand-in thread ends

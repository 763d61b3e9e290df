"""PSI: pressure files, PSI watches, and the one poll loop that polls them.

A PSI watch (what the kernel's documentation calls a PSI trigger) is a pressure
file opened read-write into which we write "<some|full> <stall_us> <window_us>",
a `PressureThreshold`; the kernel then raises POLLPRI on that fd whenever the
stall time within a window exceeds stall_us. Each fd holds one threshold.
Without CAP_SYS_RESOURCE the kernel only accepts windows that are a
multiple of 2 s (kernel commit d82caa273565, 6.4+); we then fall back to the
nearest allowed window keeping the stall/window ratio.

When a cgroup is removed its pressure fds report POLLERR: the watch is dropped
and reported as dead. Everything runs on the caller's thread: one select.poll,
no thread per fd.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from ..compat import SLOTS
from ..pressure import STALLS, PressureFigures, PressureThreshold, stall_threshold_us

log = logging.getLogger(__name__)

WINDOW_US_MIN = 500_000  # kernel WINDOW_MIN_US
WINDOW_US_MAX = 10_000_000  # kernel WINDOW_MAX_US
UNPRIVILEGED_WINDOW_STEP_US = 2_000_000  # window granularity without CAP_SYS_RESOURCE

_DEAD = select.POLLERR | select.POLLNVAL | select.POLLHUP

_fallback_logged = False
_fallback_lock = threading.Lock()
# Set once the kernel refused a window for lack of CAP_SYS_RESOURCE: later watches skip the doomed try.
_two_second_windows = False


@dataclass(frozen=True, **SLOTS)
class Pressure:
    some: PressureFigures
    full: PressureFigures | None  # absent in /proc/pressure/cpu before 5.13

    def line(self, stall: str) -> PressureFigures:
        if stall == "full":
            return self.full or PressureFigures()
        return self.some


def _parse_line(fields: list[bytes]) -> PressureFigures:
    values: dict[bytes, bytes] = {}
    for f in fields:
        k, sep, v = f.partition(b"=")
        if sep:
            values[k] = v
    try:
        return PressureFigures(
            avg10=float(values.get(b"avg10", 0)),
            avg60=float(values.get(b"avg60", 0)),
            avg300=float(values.get(b"avg300", 0)),
            total_us=int(values.get(b"total", 0)),
        )
    except ValueError:
        return PressureFigures()


def parse_pressure(data: bytes) -> Pressure:
    """Parse a *.pressure file by key (never by position)."""
    some = PressureFigures()
    full: PressureFigures | None = None
    for line in data.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == b"some":
            some = _parse_line(fields[1:])
        elif fields[0] == b"full":
            full = _parse_line(fields[1:])
    return Pressure(some=some, full=full)


def read_pressure(path: str) -> Pressure:
    """Read a pressure file. Raises OSError if it cannot be read (e.g. the cgroup is gone)."""
    with open(path, "rb", buffering=0) as f:
        return parse_pressure(f.read(4096))


def allowed_window_us(window_us: int) -> int:
    """The nearest window the kernel accepts from a writer without CAP_SYS_RESOURCE."""
    steps = max(1, round(window_us / UNPRIVILEGED_WINDOW_STEP_US))
    return min(WINDOW_US_MAX, steps * UNPRIVILEGED_WINDOW_STEP_US)


def _log_fallback_once(path: str, window_us: int, new_window_us: int) -> None:
    global _fallback_logged, _two_second_windows
    with _fallback_lock:
        _two_second_windows = True
        if _fallback_logged:
            return
        _fallback_logged = True
    log.warning(
        "PSI window not allowed without CAP_SYS_RESOURCE, using the nearest multiple of 2 s instead "
        "(logged once; grant CAP_SYS_RESOURCE for exact windows) path=%s window_ms=%d used_window_ms=%d",
        path,
        window_us // 1000,
        new_window_us // 1000,
    )


def _open_watch(path: str, stall: str, stall_us: int, window_us: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        # One write() per fd (a second gives EBUSY). The trailing NUL matters: /proc/pressure/*
        # overwrites the last byte written with NUL, so without it "... 2000000" becomes "200000".
        os.write(fd, f"{stall} {stall_us} {window_us}\0".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _watch_error(e: OSError, path: str, what: str) -> OSError:
    hints = {
        errno.ENOENT: "no such cgroup or pressure file (process gone, or PSI disabled: boot with psi=1)",
        errno.ENODEV: "the cgroup was removed",
        errno.EACCES: "permission denied: the agent needs root (or CAP_DAC_OVERRIDE) to write pressure files",
        errno.EPERM: "not permitted: run as root; kernels before 6.4 also need CAP_SYS_RESOURCE",
        errno.EOPNOTSUPP: "PSI is disabled on this kernel (boot with psi=1)",
        errno.EBUSY: "a threshold is already set on this fd",
        errno.EINVAL: "the kernel refused the threshold (stall > 0 and <= window, window 500 ms..10 s)",
    }
    err = e.errno or errno.EIO
    hint = hints.get(err, os.strerror(err))
    return OSError(err, f"cannot register PSI watch {what!r} on {path}: {hint}", path)


class PsiWatch:
    """One PSI watch: a pressure fd with its threshold written in. Created by PsiLoop.add_watch;
    closed by the loop."""

    def __init__(self, key: Hashable, path: str, threshold: PressureThreshold, cooldown_s: float) -> None:
        stall = threshold.stall
        if stall not in STALLS:
            raise ValueError(f"stall must be one of {', '.join(STALLS)}, got {stall!r}")
        if not 0 < threshold.threshold < 100:
            raise ValueError(f"threshold must be in (0, 100) percent, got {threshold.threshold}")
        self.key = key
        self.path = path
        self.threshold = threshold  # as configured; window_us/stall_us below are what the kernel accepted
        self.resource = threshold.resource
        self.stall = stall
        self.cooldown_s = cooldown_s
        self.requested_window_us = threshold.window_us
        self.window_us = self.requested_window_us
        self.stall_us = threshold.stall_us
        self.last_event = float("-inf")  # monotonic time of the last reported event
        self.events = 0
        self.suppressed = 0
        self._fd = -1
        self._registered_fd = -1  # the fd number the loop polls, kept after _detach()
        what = f"{stall} {self.stall_us} {self.window_us}"
        try:
            if _two_second_windows and allowed_window_us(self.window_us) != self.window_us:
                raise OSError(errno.EINVAL, "window known to be refused")
            self._fd = _open_watch(path, stall, self.stall_us, self.window_us)
        except OSError as e:
            new_window = allowed_window_us(self.window_us)
            if e.errno != errno.EINVAL or new_window == self.window_us:
                raise _watch_error(e, path, what) from e
            new_stall = stall_threshold_us(threshold.threshold, new_window)
            what = f"{stall} {new_stall} {new_window}"
            try:
                self._fd = _open_watch(path, stall, new_stall, new_window)
            except OSError as e2:
                raise _watch_error(e2, path, what) from e2
            _log_fallback_once(path, self.window_us, new_window)
            self.window_us, self.stall_us = new_window, new_stall
        self._registered_fd = self._fd

    @property
    def fallback(self) -> bool:
        """True when the kernel forced a different window than the one asked for."""
        return self.window_us != self.requested_window_us

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError(f"PSI watch {self.key!r} is closed")
        return self._fd

    def read_pressure(self) -> Pressure | None:
        """Current content of the pressure file, or None if it is gone."""
        if self._fd >= 0:
            try:
                return parse_pressure(os.pread(self._fd, 4096, 0))
            except OSError:
                pass
        try:
            return read_pressure(self.path)
        except OSError:
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _detach(self) -> None:
        """Forget the fd without closing it (it was closed elsewhere)."""
        self._fd = -1

    def __enter__(self) -> PsiWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PsiWatch(key={self.key!r}, path={self.path!r}, {self.stall} "
            f"{self.stall_us}us/{self.window_us}us, fd={self._fd})"
        )


@dataclass(frozen=True, **SLOTS)
class PsiEvent:
    """A watch fired, its pressure above its threshold (dead=False), or died with its cgroup (dead=True)."""

    key: Hashable
    resource: str
    stall: str
    threshold_us: int
    window_us: int
    path: str
    time_ns: int  # wall clock
    # The pressure file's line for `stall` when it fired.
    pressure: PressureFigures = field(default_factory=PressureFigures)
    dead: bool = False


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.events = Counter(
            "bistouri_psi_events",
            "PSI events reported: a watched pressure crossed its threshold",
            ["resource"],
            registry=registry,
        )
        self.suppressed = Counter(
            "bistouri_psi_events_suppressed",
            "PSI events ignored because the watch was cooling down",
            ["resource"],
            registry=registry,
        )
        self.lost = Counter(
            "bistouri_psi_watchers_lost",
            "PSI watches dropped because their cgroup disappeared",
            ["resource"],
            registry=registry,
        )
        self.watchers = Gauge(
            "bistouri_psi_watchers",
            "PSI watches registered (pressure fds with a threshold)",
            registry=registry,
        )


class PsiLoop:
    """Owns one select.poll: PSI watches plus the main loop's other fds.

    Not thread-safe: call every method from the thread that runs poll().
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = REGISTRY,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._poll = select.poll()
        self._watches: dict[Hashable, PsiWatch] = {}
        self._by_fd: dict[int, PsiWatch] = {}
        self._fds: dict[int, Callable[[int, int], None]] = {}
        self._clock = clock
        self._wall_ns = wall_clock_ns
        self._m = _Metrics(registry)

    # -- PSI watches

    def add_watch(
        self, key: Hashable, path: str, threshold: PressureThreshold, cooldown_s: float
    ) -> PsiWatch:
        """Register a watch. The same key with the same path and threshold returns the existing
        watch; a different one replaces it. Raises OSError (with a hint) if the kernel refuses."""
        old = self._watches.get(key)
        if old is not None:
            if (old.path, old.threshold) == (path, threshold):
                old.cooldown_s = cooldown_s
                return old
            self.remove(key)
        w = PsiWatch(key, path, threshold, cooldown_s)
        fd = w.fileno()
        self._poll.register(fd, select.POLLPRI)
        self._watches[key] = w
        self._by_fd[fd] = w
        self._m.watchers.set(len(self._watches))
        return w

    def remove(self, key: Hashable) -> bool:
        w = self._watches.pop(key, None)
        if w is None:
            return False
        self._forget(w)
        return True

    def _forget(self, w: PsiWatch) -> None:
        fd = w._registered_fd
        if self._by_fd.get(fd) is w:
            del self._by_fd[fd]
            try:
                self._poll.unregister(fd)
            except KeyError:
                pass
        w.close()
        self._m.watchers.set(len(self._watches))

    def clear(self) -> None:
        """Close every watch (hot reload); other fds stay registered."""
        for key in list(self._watches):
            self.remove(key)

    def keys(self) -> list[Hashable]:
        return list(self._watches)

    def get(self, key: Hashable) -> PsiWatch | None:
        return self._watches.get(key)

    def __len__(self) -> int:
        return len(self._watches)

    # -- other fds of the main loop

    def add_fd(self, fd: int, callback: Callable[[int, int], None], events: int = select.POLLIN) -> None:
        """Watch a non-PSI fd; `callback(fd, revents)` runs inside poll()."""
        if fd in self._by_fd:
            raise ValueError(f"fd {fd} is a PSI watch")
        self._poll.register(fd, events)
        self._fds[fd] = callback

    def remove_fd(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            try:
                self._poll.unregister(fd)
            except KeyError:
                pass

    # -- the loop

    def poll(self, timeout_ms: int | None) -> list[PsiEvent]:
        """Wait up to timeout_ms (None: forever), run fd callbacks, return PSI events.

        Signals interrupt the wait only if their handler raises (PEP 475), so put
        the signal wakeup fd in the loop with add_fd.
        """
        ready = self._poll.poll(timeout_ms)
        out: list[PsiEvent] = []
        for fd, revents in ready:
            w = self._by_fd.get(fd)
            if w is None:
                cb = self._fds.get(fd)
                if cb is not None:
                    cb(fd, revents)
                continue
            if revents & _DEAD:
                out.append(self._event(w, dead=True))
                self._watches.pop(w.key, None)
                if revents & select.POLLNVAL:
                    w._detach()  # someone else closed the fd: do not close a number now reused
                self._forget(w)
                self._m.lost.labels(w.resource).inc()
                log.info("PSI watch lost: its cgroup is gone key=%r path=%s", w.key, w.path)
                continue
            if revents & select.POLLPRI:
                now = self._clock()
                if now - w.last_event < w.cooldown_s:
                    w.suppressed += 1
                    self._m.suppressed.labels(w.resource).inc()
                    continue
                w.last_event = now
                w.events += 1
                self._m.events.labels(w.resource).inc()
                out.append(self._event(w, dead=False))
        return out

    def _event(self, w: PsiWatch, dead: bool) -> PsiEvent:
        p = None if dead else w.read_pressure()
        figures = p.line(w.stall) if p is not None else PressureFigures()
        return PsiEvent(
            key=w.key,
            resource=w.resource,
            stall=w.stall,
            threshold_us=w.stall_us,
            window_us=w.window_us,
            path=w.path,
            time_ns=self._wall_ns(),
            pressure=figures,
            dead=dead,
        )

    def close(self) -> None:
        """Close every watch and forget the other fds (they belong to their owners)."""
        self.clear()
        for fd in list(self._fds):
            self.remove_fd(fd)

    def __enter__(self) -> PsiLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

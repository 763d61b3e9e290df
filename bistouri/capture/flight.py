"""FlightRecorder: the last seconds of stack samples of watched processes, so a session starts
before its trigger.

PSI fires once pressure has built up for a whole window; the onset is before
that. Watched processes therefore stay in the BPF pid filter all the time (the
perf event samples every CPU at --freq anyway: the filter only decides whose
stacks are kept), and their samples go into one ring, in arrival order, bounded
in time (the longest `recorder_secs` of the watching targets) and in bytes. When
a session starts it takes the samples of its processes from the last
`recorder_secs`, marked as before the trigger. Runs on the main thread.

Samples are timed by the kernel's clock (CLOCK_MONOTONIC, as time.monotonic_ns): an
on-CPU sample when it was taken, a wait when it ended, repeats counted in the
kernel when the drain read their count (StackSample.counted_ns). Not at arrival:
while only the recorder samples, the ring is drained every 1 to 8 s (longer after
drains that found nothing) and its samples wait up to 5 s more for the main
thread (Profiler._wait_ms, _announce); a session drains the ring as it starts
(Profiler.catch_up). The ring stays in arrival order, which is that order but
for a drain's repeats, timed at its end: trimming and `recent` may keep or skip
a sample at the horizon's edge a drain early or late.

The waits of a process only the recorder watches (D, S, reclaim, run-queue: most
of what an idle process does) are not sent at all: the kernel counts them by
thread, kind, stack and second (bpf/recorder.bpf.h), and `kernel_waits`
(Profiler.recorded_waits) reads those of a session's processes when it starts,
timed at their second's start. They are bounded by the kernel's map, not by
max_bytes, until a session takes them.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from ..compat import SLOTS
from .events import StackSample

# Python objects around one held sample beyond its stacks (StackSample.nbytes): the deque slot, the
# entry, the StackSample and its ints and comm (tracemalloc: 288 measured, tests/unit/test_recorder.py).
# Python 3.9 has no slotted dataclasses: a __dict__ per entry and per sample, 516 measured.
ENTRY_OVERHEAD_BYTES = 320 if sys.version_info >= (3, 10) else 576
DEFAULT_MAX_BYTES = 16 << 20
# A sample reaches the recorder at most ~15 s after the kernel timed it (the longest drain interval
# and the wait for the main thread): a time farther back, or ahead, is not on this clock (a
# synthetic event); such a sample is timed at arrival.
_LATEST_NS = 60 * 10**9


@dataclass(frozen=True, **SLOTS)
class Recorded:
    """A sample the recorder held, with when it arrived (monotonic ns)."""

    at_ns: int
    sample: StackSample


class FlightRecorder:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        on_dropped: Callable[[int], None] = lambda n: None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        kernel_waits: Callable[[Collection[int], int], list[Recorded]] | None = None,
    ) -> None:
        """`kernel_waits(pids, since_ns)`: the waits of `pids` the kernel counted since then, on the
        same clock as `clock_ns`; None: every sample comes through add()."""
        self.max_bytes = max_bytes
        self.kernel_waits = kernel_waits
        self.nbytes = 0
        self.dropped = 0  # samples let go before their time because of max_bytes
        self._on_dropped = on_dropped
        self._clock_ns = clock_ns
        self._keep_s: dict[int, float] = {}  # watched pid -> seconds it wants kept
        self._horizons: Counter[float] = Counter()  # how many pids want each horizon
        self._ring: deque[Recorded] = deque()

    def __len__(self) -> int:
        return len(self._ring)

    def now_ns(self) -> int:
        return self._clock_ns()

    @property
    def processes(self) -> int:
        """How many processes are watched."""
        return len(self._keep_s)

    @property
    def watching(self) -> bool:
        return bool(self._keep_s)

    def watches(self, pid: int) -> bool:
        return pid in self._keep_s

    def watch(self, pid: int, seconds: float) -> bool:
        """Keep the samples of `pid` for `seconds`. True if it was not watched before."""
        old = self._keep_s.get(pid)
        if old == seconds:
            return False
        if old is not None:
            self._drop_horizon(old)
        self._keep_s[pid] = seconds
        self._horizons[seconds] += 1
        return old is None

    def unwatch(self, pid: int) -> bool:
        """Stop keeping `pid`'s new samples (held ones expire with time). True if it was watched."""
        old = self._keep_s.pop(pid, None)
        if old is None:
            return False
        self._drop_horizon(old)
        return True

    def _drop_horizon(self, seconds: float) -> None:
        self._horizons[seconds] -= 1
        if self._horizons[seconds] <= 0:
            del self._horizons[seconds]

    def add(self, samples: Iterable[StackSample]) -> None:
        """Hold the samples of watched processes, then let go of what is too old or too much."""
        now = self._clock_ns()
        keep = self._keep_s
        ring = self._ring
        for s in samples:
            if s.pid in keep:
                at = s.counted_ns or s.timestamp_ns + s.blocked_ns  # a wait: when it ended
                ring.append(Recorded(at if now - _LATEST_NS <= at <= now else now, s))
                self.nbytes += s.nbytes + ENTRY_OVERHEAD_BYTES
        self._trim(now)

    def expiry_ns(self) -> int | None:
        """When every held sample will have aged out (None: none held). Until then add() and
        recent() let go of the old ones as they run: a timer is needed only once samples stop coming."""
        if not self._ring or not self._horizons:
            return None if not self._ring else self._clock_ns()
        return self._ring[-1].at_ns + int(max(self._horizons) * 1e9)

    def expire(self) -> None:
        """Let go of the samples older than every horizon."""
        self._trim(self._clock_ns())

    def _trim(self, now_ns: int) -> None:
        ring = self._ring
        if not self._horizons:  # nobody watched: no session can want what is held
            ring.clear()
            self.nbytes = 0
            return
        horizon_s = max(self._horizons)
        oldest_ns = now_ns - int(horizon_s * 1e9)
        while ring and ring[0].at_ns < oldest_ns:
            self.nbytes -= ring.popleft().sample.nbytes + ENTRY_OVERHEAD_BYTES
        dropped = 0
        while ring and self.nbytes > self.max_bytes:
            self.nbytes -= ring.popleft().sample.nbytes + ENTRY_OVERHEAD_BYTES
            dropped += 1
        if dropped:
            self.dropped += dropped
            self._on_dropped(dropped)

    def recent(self, pids: Iterable[int], seconds: float) -> list[Recorded]:
        """The held samples of `pids` from the last `seconds`, oldest first: those that came
        through add() and the waits the kernel counted."""
        now = self._clock_ns()
        self._trim(now)
        wanted = set(pids)
        since = now - int(seconds * 1e9)
        out = []
        for r in reversed(self._ring):  # newest first: stop at the first one too old
            if r.at_ns < since:
                break
            if r.sample.pid in wanted:
                out.append(r)
        out.reverse()
        if self.kernel_waits is not None and wanted:
            kept = self.kernel_waits(wanted, since)
            if kept:
                out = sorted(out + kept, key=lambda r: r.at_ns)
        return out

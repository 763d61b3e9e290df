"""SessionCapture: capture sessions, from a PSI event to a spooled msgpack file.

A session arms the BPF pid filter for its processes (refcounted, so overlapping
sessions work), aggregates the samples that arrive while it runs, and when its
time is up becomes a `wire.Session` written to the spool.

Aggregation is cheap: samples are keyed by their raw stack bytes and their named
Python frames (named as they arrived: two Python stacks over one native stack are
two traces), and a stack is decoded into frames only once per session, when the
session finishes; a CPython process's Python frames are then spliced in place of
the eval-loop frames that ran them (cpython/splice.py).
Memory is bounded in bytes across all running sessions (`max_bytes`, from
--capture-max-bytes): each distinct stack costs its raw frames (8 bytes a kernel
frame, 32 a user frame, PY_FRAME_BYTES a Python frame) plus a fixed overhead; a new
stack beyond the bound is dropped and counted, while the stacks already held keep
counting samples.
Processes a target watches with its flight recorder (flight.py) stay in the
pid filter between sessions; a session starts with their recorded samples,
marked as before the trigger.
Everything runs on the main thread; nothing here blocks on the network.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .. import wire
from ..bpf import abi
from ..compat import SLOTS
from ..cpython.processes import PythonFrame
from ..cpython.splice import EvalLoop, splice
from ..discard import Discarded
from ..host import cgroupnames
from ..host.kernel import KernelMeta
from ..host.procmaps import FrameStatus, ProcMaps, Unmapped
from .episode import NO_EPISODE_PROBE, EpisodeProbe, EpisodeStart, NoEpisodeProbe
from .events import PY_FRAME_BYTES, StackSample, split_stacks
from .flight import DEFAULT_MAX_BYTES as DEFAULT_RECORDER_BYTES
from .flight import FlightRecorder, Recorded
from .jitnote import jit_notes
from .metrics import CaptureMetrics

log = logging.getLogger(__name__)

_FILE, _VDSO, _ANON = int(FrameStatus.FILE), int(FrameStatus.VDSO), int(FrameStatus.ANON)
_UNMAPPED_REASONS = {int(r): r.name.lower() for r in Unmapped}
# Stack-event kind -> what its off-CPU time waited in; on-CPU samples are absent.
_ON_CPU = int(abi.EventKind.ON_CPU)
_WAIT_OF_KIND = {
    int(abi.EventKind.OFF_CPU): wire.WAIT_D,
    int(abi.EpisodeKind.SLEEP): wire.WAIT_S,
    int(abi.EpisodeKind.RECLAIM): wire.WAIT_RECLAIM,
    int(abi.EpisodeKind.RUNQUEUE): wire.WAIT_RUNQUEUE,
}


# What a session samples its processes for by default: on and off CPU, and the episode's times.
FILTER_FLAGS = abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU | abi.EpisodeFilter.ON


class Sampler(Protocol):
    """What a session needs of the profiler: the pid filter (who is sampled, and how), and the
    address maps its user frames were mapped with."""

    maps: ProcMaps

    def set_pid_filter(self, pid: int, flags: int) -> None: ...


class SessionSink(Protocol):
    def put(self, session_id: str, data: bytes) -> str | None:
        """Store an encoded session; falsy if it was dropped (the sink counts why)."""
        ...


@dataclass(**SLOTS)
class _Agg:
    """The counts of one stack in a session: samples on and off CPU, and off-CPU time."""

    on_cpu: int = 0
    off_cpu: int = 0
    off_cpu_ns: int = 0
    kernel_len: int = 0
    walk: bytes = b"\0\0\0"  # how its user stack was walked (StackSample.walk)
    eval_loop: EvalLoop | None = None  # where its Python frames go (PythonStack.eval_loop)


def _add_walk(summary: wire.UnwindSummary, agg: _Agg) -> None:
    """A trace's user walk into the session's summary, weighted by its samples."""
    by_table, by_fp, end = agg.walk
    n = agg.on_cpu + agg.off_cpu
    if by_table:
        summary.frames["table"] = summary.frames.get("table", 0) + by_table * n
    if by_fp:
        summary.frames["frame_pointer"] = summary.frames.get("frame_pointer", 0) + by_fp * n
    reason = abi.WALK_ENDS.get(end)
    if reason is not None:
        summary.walks[reason] = summary.walks.get(reason, 0) + n


_Key = tuple[int, int, bytes, tuple[PythonFrame, ...], bool, int]


def random_uuid() -> str:
    """`str(uuid.uuid4())`, without importing uuid: it imports platform and re (~2.5 ms of record's
    CPU after the first sample)."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _MadeFrames:
    """The wire frames made for one session's traces, by what they were made from: traces mostly
    differ at their leaf only, and making a frozen frame costs ~10x a dict lookup."""

    __slots__ = ("files", "python")

    def __init__(self) -> None:
        # by eval loop (None: not a CPython process), then (file id, offset, a return address?):
        # the frame, and whether it runs the eval loop
        self.files: dict[EvalLoop | None, dict[tuple[int, int, bool], tuple[wire.UserFrame, bool]]] = {}
        self.python: dict[PythonFrame, wire.UserFrame] = {}


def _python_frame(f: PythonFrame, made: dict[PythonFrame, wire.UserFrame]) -> wire.UserFrame:
    made[f] = frame = wire.UserFrame(wire.FRAME_PYTHON, b"", f.line, f.name, f.filename)
    return frame


@dataclass(**SLOTS)
class ActiveSession:
    """A session being captured: its trigger, processes and stacks so far."""

    session_id: str
    trigger: wire.Trigger
    service: str
    labels: dict[str, str]
    processes: dict[int, str]
    start_ns: int
    start_mono: float
    deadline: float
    # (pid, tid, stacks, Python frames, pre_trigger, wait state or -1 on-CPU)
    traces: dict[_Key, _Agg] = field(default_factory=dict)
    threads: dict[int, str] = field(default_factory=dict)
    dropped_traces: int = 0
    nbytes: int = 0  # estimated memory of `traces` and `threads`
    pre_trigger_ns: int = 0  # start_ns is this much before the trigger (flight recorder)
    episode_start: EpisodeStart | None = None  # the victims' and cgroups' counters at start
    python: dict[str, int] = field(default_factory=dict)  # samples of CPython processes by note


# Python objects around one distinct stack beyond its raw bytes: its dict slot, key tuple and
# ints, bytes header, _Agg and thread entry (tracemalloc over 50 000 traces: 362, rounded up).
TRACE_OVERHEAD_BYTES = 384
DEFAULT_MAX_BYTES = 64 << 20

# Processes the flight recorder keeps in the BPF pid filter (4096 entries) at most: the rest
# stays free for sessions, so recording many processes cannot stop a capture.
RECORDER_MAX_PROCESSES = 3072

# Reasons of bistouri_traces_dropped_total.
DROP_SESSION_FULL = "session_full"  # MAX_TRACES distinct stacks in this session
DROP_MEMORY = "memory"  # max_bytes reached across all sessions
DROP_SESSION_TOO_LARGE = "session_too_large"  # over wire.MAX_SESSION_OBJECTS when encoded


class SessionCapture:
    MAX_SESSIONS = 64  # concurrent sessions
    MAX_TRACES = 50_000  # distinct (thread, stack) pairs per session

    def __init__(
        self,
        pid_filter: Sampler,
        sink: SessionSink,
        metrics: CaptureMetrics | Discarded,
        kernel: KernelMeta,
        *,
        tenant: str,
        host: str,
        labels: dict[str, str],
        period_ns: int,
        filter_flags: int = FILTER_FLAGS,
        proc_root: str = "/proc",
        on_spooled: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = DEFAULT_MAX_BYTES,
        recorder_max_bytes: int = DEFAULT_RECORDER_BYTES,
        episode: EpisodeProbe | NoEpisodeProbe = NO_EPISODE_PROBE,
        catch_up: Callable[[Collection[int]], None] | None = None,
        on_start: Callable[[Collection[int]], None] | None = None,
        degraded: Collection[str] = (),
        recorded_waits: Callable[[Collection[int], int], list[Recorded]] | None = None,
    ) -> None:
        """`filter_flags`: what sessions sample their processes for; with FilterFlags.RAW_STACK
        (the agent's unless turned off, `record`'s) a process sends raw stack copies while its
        tables are not in (the profiler clears the bit once they are), and only for sessions.
        `degraded`: what the kernel lacks (bpf/features.py), said in each session's note.
        `recorded_waits` (Profiler.recorded_waits): the waits the kernel counts for the flight
        recorder; with it, a process only recorded is marked so (abi.FilterFlags.RECORDED) and
        its waits are not sent."""
        self._filter = pid_filter
        # Delivers the samples still in the kernel (add_samples): before a session takes the
        # recorder's, and before sessions end (with their processes: the raw stack copies held for
        # them come too, as they are).
        self._catch_up = catch_up
        self._on_start = on_start  # told of a session's processes as it starts (JVM perf maps)
        self._sink = sink
        self.metrics = metrics
        self.kernel = kernel
        self.degraded = tuple(degraded)
        self.tenant = tenant
        self.host = host
        self.labels = dict(labels)
        self.period_ns = period_ns
        self.filter_flags = int(filter_flags)
        self.proc_root = proc_root
        self._on_spooled = on_spooled
        self._clock = clock
        self.max_bytes = max_bytes
        self.nbytes = 0  # estimated, across the running sessions
        self.sessions: dict[str, ActiveSession] = {}
        self._by_pid: dict[int, list[ActiveSession]] = {}
        self._refs: dict[int, int] = {}
        self._filter_values: dict[int, int] = {}  # pid -> what its filter entry holds
        self._divisors: dict[int, int] = {}  # pid -> 1 on-CPU sample kept in this many, outside sessions
        self.recorder = FlightRecorder(
            recorder_max_bytes,
            on_dropped=metrics.recorder_dropped.labels(DROP_MEMORY).inc,
            kernel_waits=recorded_waits,
        )
        self._memory_full_logged = -60.0
        self.episode = episode

    # -- flight recorder ---------------------------------------------------------
    def watch(self, pid: int, recorder_secs: float, recorder_hz: float | None = None) -> None:
        """Sample `pid` from now on, at `recorder_hz` (None: the sampling rate) outside
        sessions, and keep its last `recorder_secs` of samples."""
        if self.recorder.max_bytes == 0:
            return
        # The perf event fires at the agent's rate: a lower one keeps 1 sample in `divisor`
        # (in BPF), and each kept sample stands for `divisor`.
        freq = 1e9 / self.period_ns
        divisor = 1 if recorder_hz is None else min(max(round(freq / recorder_hz), 1), abi.FILTER_DIVISOR_MAX)
        if divisor != self._divisors.get(pid, 1):
            self._divisors[pid] = divisor
            if pid in self._refs:
                self._sync_filter(pid)
        if not self.recorder.watches(pid) and self.recorder.processes >= RECORDER_MAX_PROCESSES:
            self.metrics.recorder_dropped.labels("filter_full").inc()
            return
        if not self.recorder.watch(pid, recorder_secs):
            return
        try:
            self._ref(pid)
        except OSError as e:  # pid filter full: this process gets no recording
            self.recorder.unwatch(pid)
            self.metrics.recorder_dropped.labels("filter_full").inc()
            log.debug("Cannot add a watched process to the BPF filter. pid=%d error=%s", pid, e)

    def unwatch(self, pid: int) -> None:
        if self.recorder.unwatch(pid):
            self._unref(pid)
        self._divisors.pop(pid, None)

    # -- sessions ---------------------------------------------------------------
    def start_session(
        self,
        trigger: wire.Trigger,
        service: str,
        labels: dict[str, str],
        processes: dict[int, str],
        duration_s: float,
        *,
        recorder_secs: float = 0.0,
        session_id: str | None = None,
    ) -> str | None:
        """Arm the filter for `processes` and open a session; None when it cannot start.

        With `recorder_secs`, the session starts with the flight recorder's samples of
        its processes from that many seconds before now, marked as before the trigger.
        """
        res = trigger.resource
        if not processes:
            self.metrics.sessions_dropped.labels("no_process").inc()
            return None
        if recorder_secs > 0 and self._catch_up is not None:
            self._catch_up(())  # before this session counts any sample as after its trigger
        if len(self.sessions) >= self.MAX_SESSIONS:
            self.metrics.sessions_dropped.labels("too_many_sessions").inc()
            log.warning(
                "Session not started: %d sessions already run. service=%s", len(self.sessions), service
            )
            return None
        armed: dict[int, str] = {}
        for pid, comm in processes.items():
            try:
                self._ref(pid)
            except OSError as e:  # pid filter full: sample what we can
                log.warning("Cannot add a process to the BPF filter. pid=%d error=%s", pid, e)
                self.metrics.sessions_dropped.labels("filter_full").inc()
                continue
            armed[pid] = comm
        if not armed:
            return None
        now = self._clock()
        s = ActiveSession(
            session_id=session_id or random_uuid(),
            trigger=trigger,
            service=service,
            labels={**self.labels, **labels},
            processes=armed,
            start_ns=time.time_ns(),
            start_mono=now,
            deadline=now + duration_s,
        )
        s.episode_start = self.episode.start(armed)
        if self._on_start is not None:
            self._on_start(armed)
        self.sessions[s.session_id] = s
        for pid in armed:
            self._by_pid.setdefault(pid, []).append(s)
            self._sync_filter(pid)
        if recorder_secs > 0:
            self._add_recorded(s, recorder_secs)
        self.metrics.sessions_started.labels(res).inc()
        self.metrics.sessions_active.set(len(self.sessions))
        log.info(
            "Capture started. session=%s service=%s kind=%s resource=%s processes=%d duration=%.1fs "
            "avg10=%.2f pre_trigger=%.1fs",
            s.session_id,
            service,
            trigger.kind,
            res,
            len(armed),
            duration_s,
            trigger.pressure.avg10,
            s.pre_trigger_ns / 1e9,
        )
        return s.session_id

    def _add_recorded(self, s: ActiveSession, seconds: float) -> None:
        """Open `s` with the recorder's samples of its processes: the onset before the trigger."""
        recorded = self.recorder.recent(s.processes, seconds)
        if not recorded:
            return
        now_ns = self.recorder.now_ns()
        s.pre_trigger_ns = max(0, now_ns - recorded[0].at_ns)
        s.start_ns -= s.pre_trigger_ns
        drops = {DROP_SESSION_FULL: 0, DROP_MEMORY: 0}
        for r in recorded:
            sample = r.sample
            wait = _WAIT_OF_KIND.get(sample.kind, -1)
            key = (sample.pid, sample.tid, sample.stacks, sample.py.frames, True, wait)
            dropped = self._count(s, key, sample, wait >= 0)
            if dropped is not None:
                drops[dropped] += 1
        self._count_drops(drops)
        self.metrics.capture_bytes.set(self.nbytes)

    def extend_session(self, session_id: str, processes: dict[int, str]) -> None:
        """Add processes to a running session (new members of a cgroup, forks of a command)."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        for pid, comm in processes.items():
            if pid in s.processes:
                continue
            try:
                self._ref(pid)
            except OSError as e:
                log.warning("Cannot add a process to the BPF filter. pid=%d error=%s", pid, e)
                continue
            s.processes[pid] = comm
            self._by_pid.setdefault(pid, []).append(s)
            self._sync_filter(pid)  # a session's value (full rate, raw copies), as start_session's

    def _ref(self, pid: int) -> None:
        n = self._refs.get(pid, 0)
        if n == 0:
            self._filter.set_pid_filter(pid, self._filter_value(pid))
            self._filter_values[pid] = self._filter_value(pid)
        self._refs[pid] = n + 1

    def _filter_value(self, pid: int) -> int:
        """Full rate while a session samples `pid`, the recorder's rate otherwise (its waits then
        counted in the kernel, when a reader of them was given)."""
        if pid in self._by_pid:
            return abi.filter_value(self.filter_flags)
        # Raw stack copies for sessions only: the recorder's samples wait for nobody.
        flags = self.filter_flags & ~abi.FilterFlags.RAW_STACK
        if self.recorder.kernel_waits is not None and self.recorder.watches(pid):
            flags |= abi.FilterFlags.RECORDED
        return abi.filter_value(flags, self._divisors.get(pid, 1))

    def _sync_filter(self, pid: int) -> None:
        """Write `pid`'s filter value again if its rate changed (a session began or ended)."""
        value = self._filter_value(pid)
        if pid in self._refs and self._filter_values.get(pid) != value:
            try:
                self._filter.set_pid_filter(pid, value)
                self._filter_values[pid] = value
            except OSError as e:
                log.debug("Cannot change the sampling rate of pid %d: %s", pid, e)

    def _unref(self, pid: int) -> None:
        n = self._refs.get(pid, 0) - 1
        if n <= 0:
            self._refs.pop(pid, None)
            self._filter_values.pop(pid, None)
            try:
                self._filter.set_pid_filter(pid, 0)
            except Exception as e:  # the object may already be closed at shutdown
                log.debug("Removing pid %d from the filter failed: %s", pid, e)
        else:
            self._refs[pid] = n

    def next_deadline(self) -> float | None:
        return min((s.deadline for s in self.sessions.values()), default=None)

    def recorder_deadline(self) -> float | None:
        """When the flight recorder's held samples will all have aged out, in seconds of its clock
        (monotonic), for tick() to let them go; None while it holds none."""
        ns = self.recorder.expiry_ns()
        return None if ns is None else ns / 1e9

    # -- samples ----------------------------------------------------------------
    def add_samples(self, samples: Iterable[StackSample]) -> None:
        """Count a batch of samples into their sessions. The hot path at high frequency:
        metrics are updated once per batch, not per sample."""
        recorder = self.recorder
        by_pid = self._by_pid
        if recorder.watching:
            samples = list(samples)
            divisors = self._divisors
            # Sampled on-CPU at the recorder's lower rate: each stands for `divisor` samples (BPF
            # divides on-CPU samples only: a wait stands for its own).
            recorder.add(
                s
                if s.pid in by_pid or s.kind != _ON_CPU or divisors.get(s.pid, 1) == 1
                else s.weighed(s.weight * divisors[s.pid])
                for s in samples
            )
            self.metrics.recorder_bytes.set(recorder.nbytes)
        wait_of_kind = _WAIT_OF_KIND
        count = self._count
        drops = {DROP_SESSION_FULL: 0, DROP_MEMORY: 0}
        on = off = unmatched = 0
        for sample in samples:
            sessions = by_pid.get(sample.pid)
            if not sessions:
                if not recorder.watches(sample.pid):
                    unmatched += 1
                continue
            wait = wait_of_kind.get(sample.kind, -1)
            key = (sample.pid, sample.tid, sample.stacks, sample.py.frames, False, wait)
            is_off = wait >= 0
            for s in sessions:
                dropped = count(s, key, sample, is_off)
                if dropped is not None:
                    drops[dropped] += 1
            if is_off:
                off += sample.weight
            else:
                on += sample.weight
        if unmatched:
            self.metrics.samples_unmatched.inc(unmatched)
        self._count_drops(drops)
        self.metrics.capture_bytes.set(self.nbytes)
        if on:
            self.metrics.samples.labels("on_cpu").inc(on)
        if off:
            self.metrics.samples.labels("off_cpu").inc(off)

    def _count(self, s: ActiveSession, key: _Key, sample: StackSample, is_off: bool) -> str | None:
        """Count one sample into `s` under `key`; the reason it was dropped (a new stack without
        room), else None. The one place a sample joins a session: live or from the recorder."""
        agg = s.traces.get(key)
        if agg is None:
            if len(s.traces) >= self.MAX_TRACES:
                s.dropped_traces += 1
                return DROP_SESSION_FULL
            cost = len(sample.stacks) + PY_FRAME_BYTES * len(sample.py.frames) + TRACE_OVERHEAD_BYTES
            if self.nbytes + cost > self.max_bytes:
                s.dropped_traces += 1
                return DROP_MEMORY
            agg = s.traces[key] = _Agg(
                kernel_len=sample.kernel_len, walk=sample.walk, eval_loop=sample.py.eval_loop
            )
            s.threads.setdefault(sample.tid, sample.comm)
            s.nbytes += cost
            self.nbytes += cost
        # weight: repeats counted in the kernel (on-CPU), or the waits a rate-limited
        # capture stands for (off-CPU).
        weight = sample.weight
        if is_off:
            agg.off_cpu += weight
            agg.off_cpu_ns += sample.blocked_ns * weight
        else:
            agg.on_cpu += weight
        note = sample.py.note
        if note:  # a CPython process's sample: named, or why not
            s.python[note] = s.python.get(note, 0) + weight
        return None

    def _count_drops(self, drops: dict[str, int]) -> None:
        """The stacks `_count` dropped, by reason, into the metrics (memory full: logged too)."""
        for reason, n in drops.items():
            if n:
                self.metrics.traces_dropped.labels(reason).inc(n)
        if drops.get(DROP_MEMORY):
            now = self._clock()
            if now - self._memory_full_logged >= 60.0:
                self._memory_full_logged = now
                log.warning(
                    "Capture memory full: new stacks dropped (logged at most once a minute). "
                    "held_bytes=%d max_bytes=%d sessions=%d: raise --capture-max-bytes",
                    self.nbytes,
                    self.max_bytes,
                    len(self.sessions),
                )

    # -- finishing ----------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[str]:
        """Finish the sessions whose time is up; returns their ids."""
        now = self._clock() if now is None else now
        if len(self.recorder):
            self.recorder.expire()  # samples age out even when none arrive
            self.metrics.recorder_bytes.set(self.recorder.nbytes)
        done = [s for s in self.sessions.values() if s.deadline <= now]
        if done and self._catch_up is not None:
            # The samples, counts and raw copies still in the kernel or held belong to these sessions.
            self._catch_up({pid for s in done for pid in s.processes})
        for s in done:
            self._finish(s, now)
        return [s.session_id for s in done]

    def flush_all(self) -> list[str]:
        """Finish every running session now (shutdown): what was captured is kept."""
        now = self._clock()
        ids = list(self.sessions)
        for sid in ids:
            self._finish(self.sessions[sid], now)
        return ids

    def finish_session(self, session_id: str, now: float | None = None) -> wire.Session:
        """End a running session and return it built, with its episode report; delivering it is
        the caller's (`record` renders it; the agent's sessions go to the spool when they end).
        Its processes leave the pid filter, or go back to the recorder's rate. KeyError when no
        such session runs."""
        return self._end(self.sessions[session_id], self._clock() if now is None else now)

    def _end(self, s: ActiveSession, now: float) -> wire.Session:
        episode = None
        if s.episode_start is not None:
            # Before the filter lets go of the processes: unwatching forgets their thread times.
            episode = self.episode.finish(s.episode_start, s.processes, s.trigger.resource)
        del self.sessions[s.session_id]
        self.nbytes -= s.nbytes
        self.metrics.capture_bytes.set(self.nbytes)
        for pid in s.processes:
            lst = self._by_pid.get(pid, [])
            if s in lst:
                lst.remove(s)
            if not lst:
                self._by_pid.pop(pid, None)
            self._unref(pid)
            self._sync_filter(pid)  # still recorded: back to the recorder's rate
        self.metrics.sessions_active.set(len(self.sessions))
        return self._build(s, now, episode)

    def _finish(self, s: ActiveSession, now: float) -> None:
        """End `s` and spool it (the agent's sessions)."""
        res = s.trigger.resource
        session = self._end(s, now)
        total = session.total_samples
        self.metrics.session_samples.observe(total)
        if total == 0:
            self.metrics.sessions_empty.labels(res).inc()
            log.info("Capture ended without samples. session=%s service=%s", s.session_id, s.service)
            return
        data, left_out = wire.encode_session_to_fit(session)
        if left_out:
            # Bigger than the symbolizer takes in one request: the lightest stacks are left out.
            self.metrics.traces_dropped.labels(DROP_SESSION_TOO_LARGE).inc(left_out)
            log.warning(
                "Capture too large for one request: lightest stacks left out. session=%s left_out=%d",
                s.session_id,
                left_out,
            )
        if not self._sink.put(s.session_id, data):
            # The spool counted why (bistouri_spool_dropped_total) and logs it at most once a minute.
            log.info(
                "Capture not spooled: dropped by the spool. session=%s service=%s", s.session_id, s.service
            )
            return
        self.metrics.sessions_completed.labels(res).inc()
        log.info(
            "Capture spooled. session=%s service=%s samples=%d traces=%d bytes=%d",
            s.session_id,
            s.service,
            total,
            len(session.traces),
            len(data),
        )
        if self._on_spooled:
            self._on_spooled()

    def _build(self, s: ActiveSession, now: float, episode: wire.Episode | None) -> wire.Session:
        traces = []
        unwind = wire.UnwindSummary(python=dict(s.python))
        # The traces share most of their frames (they differ at the leaf): each made once.
        made = _MadeFrames()
        for (pid, tid, stacks, python, pre, wait), agg in s.traces.items():
            _add_walk(unwind, agg)
            kernel, raw_user = split_stacks(stacks, agg.kernel_len)
            traces.append(
                wire.Trace(
                    kernel=kernel,
                    user=self._classify(pid, raw_user, python, agg.eval_loop, made),
                    pid=pid,
                    tid=tid,
                    on_cpu=agg.on_cpu,
                    off_cpu=agg.off_cpu,
                    off_cpu_ns=agg.off_cpu_ns,
                    pre_trigger=pre,
                    wait=max(wait, wire.WAIT_D),
                )
            )
        unwind.jit = jit_notes(self._filter.maps, traces)
        if self.degraded:  # every sample of the session was taken without them
            samples = sum(t.on_cpu + t.off_cpu for t in traces)
            unwind.kernel = dict.fromkeys(self.degraded, samples)
        names = cgroupnames.names_of(s.trigger.cgroup)  # what people call the target: unit, container
        return wire.Session(
            session_id=s.session_id,
            trigger=s.trigger,
            kernel=wire.KernelInfo(
                self.kernel.release, self.kernel.build_id, self.kernel.text_addr, self.kernel.boot_id
            ),
            start_ns=s.start_ns,
            duration_ns=int((now - s.start_mono) * 1e9) + s.pre_trigger_ns,
            period_ns=self.period_ns,
            tenant=self.tenant,
            service=s.service,
            host=self.host,
            labels=s.labels,
            processes=dict(s.processes),
            threads=dict(s.threads),
            traces=traces,
            pre_trigger_ns=s.pre_trigger_ns,
            unwind=unwind,
            episode=episode,
            unit=names.unit,
            container=names.container,
        )

    # -- user frames ----------------------------------------------------------------
    def _classify(
        self,
        pid: int,
        raw: list[tuple[int, int, int]],
        python: tuple[PythonFrame, ...] = (),
        eval_loop: EvalLoop | None = None,
        made: _MadeFrames | None = None,
    ) -> tuple[wire.UserFrame, ...]:
        """Mapped frames (procmaps.FrameStatus) as wire frames: a file and offset (with the
        file's name, so an unnamed frame still says `libc.so.6+0x…`), the vDSO, a JIT
        function named by the perf map, or an unmapped address counted by reason; and the
        Python frames of a CPython process in place of the eval-loop frames that ran them.
        `made`: the frames made so far for the traces of one session, reused."""
        made = made or _MadeFrames()
        files = made.files.setdefault(eval_loop, {})
        out: list[wire.UserFrame] = []
        in_eval: list[int] = []  # indexes in `out` of the frames in the eval loop
        maps = self._filter.maps
        counts: dict[str, int] = {}
        for i, (status, ref, value) in enumerate(raw):
            if status == _FILE:
                known = files.get((ref, value, i > 0))
                if known is None:
                    f = maps.file(ref)
                    frame = wire.UserFrame(wire.FRAME_RESOLVED, f.build_id, value, f.name)
                    # A return address (all but the leaf) is past its call: the call is in the loop.
                    loop = eval_loop is not None and eval_loop.holds(f.build_id, f.name, value - (i > 0))
                    known = files[(ref, value, i > 0)] = (frame, loop)
                if known[1]:
                    in_eval.append(len(out))
                out.append(known[0])
                label = "resolved"
            elif status == _VDSO:
                out.append(wire.UserFrame(wire.FRAME_VDSO, b"", value))
                label = "vdso"
            elif status == _ANON:
                # A return address points past its call: name the call (as the resolver does).
                name = maps.jit_name(pid, value if i == 0 else value - 1)
                if name is not None:
                    out.append(wire.UserFrame(wire.FRAME_JIT, b"", value, name))
                    label = "jit"
                else:
                    out.append(wire.UserFrame(wire.FRAME_UNKNOWN, b"", value))
                    label = "jit_unnamed"
            else:
                label = _UNMAPPED_REASONS.get(ref, "no_mapping")
                if ref == Unmapped.CORRUPTED:  # not an address: dropped, counted
                    counts[label] = counts.get(label, 0) + 1
                    continue
                out.append(wire.UserFrame(wire.FRAME_UNKNOWN, b"", value))
            counts[label] = counts.get(label, 0) + 1
        if python:
            out = self._splice(out, in_eval, python, counts, made.python)
        for label, n in counts.items():
            self.metrics.user_frames.labels(label).inc(n)
        return tuple(out)

    @staticmethod
    def _splice(
        native: list[wire.UserFrame],
        in_eval: list[int],
        python: tuple[PythonFrame, ...],
        counts: dict[str, int],
        made: dict[PythonFrame, wire.UserFrame],
    ) -> list[wire.UserFrame]:
        """`native` with each eval-loop frame (indexes `in_eval`) replaced by the Python frames it ran;
        `-X perf` trampolines (JIT frames named `py::…`) left out, as they only repeat a Python frame.
        Python frames no eval frame took go at the root end, counted as `python_unspliced`."""
        evals = set(in_eval)
        spliced = splice(
            range(len(native)),
            python,
            evals.__contains__,
            lambda i: native[i].kind == wire.FRAME_JIT and native[i].name.startswith("py::"),
        )
        out = [
            native[f] if isinstance(f, int) else made.get(f) or _python_frame(f, made) for f in spliced.frames
        ]
        counts["python"] = counts.get("python", 0) + len(python) - spliced.leftover
        if spliced.leftover:
            counts["python_unspliced"] = counts.get("python_unspliced", 0) + spliced.leftover
        return out

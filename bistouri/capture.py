"""CaptureOrchestrator: capture sessions, from a PSI event to a spooled msgpack file.

A session arms the BPF pid filter for its processes (refcounted, so overlapping
sessions work), aggregates the samples that arrive while it runs, and when its
time is up becomes a `wire.Session` written to the spool.

Aggregation is cheap: samples are keyed by their raw stack bytes, and a stack
is decoded into frames only once per session, when the session finishes.
Everything runs on the main thread; nothing here blocks on the network.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from . import abi, wire
from .events import StackSample, split_stacks
from .kernel import KernelMeta
from .metrics import AgentMetrics
from .procmaps import FrameStatus, ProcMaps, Unmapped

log = logging.getLogger(__name__)

_FILE, _VDSO, _ANON = int(FrameStatus.FILE), int(FrameStatus.VDSO), int(FrameStatus.ANON)
_UNMAPPED_REASONS = {int(r): r.name.lower() for r in Unmapped}


class PidFilter(Protocol):
    """The profiler: what it samples, and the address maps its user frames were mapped with."""

    maps: ProcMaps

    def set_pid_filter(self, pid: int, flags: int) -> None: ...


class SessionSink(Protocol):
    def put(self, session_id: str, data: bytes) -> object: ...


@dataclass(slots=True)
class _Agg:
    on_cpu: int = 0
    off_cpu: int = 0
    off_cpu_ns: int = 0
    kernel_len: int = 0


@dataclass(slots=True)
class ActiveSession:
    session_id: str
    trigger: wire.Trigger
    service: str
    labels: dict[str, str]
    processes: dict[int, str]
    start_ns: int
    start_mono: float
    deadline: float
    traces: dict[tuple[int, int, bytes], _Agg] = field(default_factory=dict)
    threads: dict[int, str] = field(default_factory=dict)
    dropped_traces: int = 0


class CaptureOrchestrator:
    MAX_SESSIONS = 64  # concurrent sessions
    MAX_TRACES = 50_000  # distinct (thread, stack) pairs per session

    def __init__(
        self,
        pid_filter: PidFilter,
        sink: SessionSink,
        metrics: AgentMetrics,
        kernel: KernelMeta,
        *,
        tenant: str,
        host: str,
        labels: dict[str, str],
        period_ns: int,
        filter_flags: int = abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU,
        proc_root: str = "/proc",
        on_spooled: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._filter = pid_filter
        self._sink = sink
        self.metrics = metrics
        self.kernel = kernel
        self.tenant = tenant
        self.host = host
        self.labels = dict(labels)
        self.period_ns = period_ns
        self.filter_flags = int(filter_flags)
        self.proc_root = proc_root
        self._on_spooled = on_spooled
        self._clock = clock
        self.sessions: dict[str, ActiveSession] = {}
        self._by_pid: dict[int, list[ActiveSession]] = {}
        self._refs: dict[int, int] = {}

    # -- sessions ---------------------------------------------------------------
    def start_session(
        self,
        trigger: wire.Trigger,
        service: str,
        labels: dict[str, str],
        processes: dict[int, str],
        duration_s: float,
    ) -> str | None:
        """Arm the filter for `processes` and open a session; None when it cannot start."""
        res = trigger.resource
        if not processes:
            self.metrics.sessions_dropped.labels("no_process").inc()
            return None
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
            session_id=str(uuid.uuid4()),
            trigger=trigger,
            service=service,
            labels={**self.labels, **labels},
            processes=armed,
            start_ns=time.time_ns(),
            start_mono=now,
            deadline=now + duration_s,
        )
        self.sessions[s.session_id] = s
        for pid in armed:
            self._by_pid.setdefault(pid, []).append(s)
        self.metrics.sessions_started.labels(res).inc()
        self.metrics.sessions_active.set(len(self.sessions))
        log.info(
            "Capture started. session=%s service=%s resource=%s processes=%d duration=%.1fs avg10=%.2f",
            s.session_id,
            service,
            res,
            len(armed),
            duration_s,
            trigger.avg10,
        )
        return s.session_id

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

    def _ref(self, pid: int) -> None:
        n = self._refs.get(pid, 0)
        if n == 0:
            self._filter.set_pid_filter(pid, self.filter_flags)
        self._refs[pid] = n + 1

    def _unref(self, pid: int) -> None:
        n = self._refs.get(pid, 0) - 1
        if n <= 0:
            self._refs.pop(pid, None)
            try:
                self._filter.set_pid_filter(pid, 0)
            except Exception as e:  # the object may already be closed at shutdown
                log.debug("Removing pid %d from the filter failed: %s", pid, e)
        else:
            self._refs[pid] = n

    def filter_refs(self) -> dict[int, int]:
        return dict(self._refs)

    def next_deadline(self) -> float | None:
        return min((s.deadline for s in self.sessions.values()), default=None)

    # -- samples ----------------------------------------------------------------
    def add_samples(self, samples: Iterable[StackSample]) -> None:
        """Count a batch of samples into their sessions. The hot path at high frequency:
        metrics are updated once per batch, not per sample."""
        by_pid = self._by_pid
        off_kind = abi.EventKind.OFF_CPU
        on = off = unmatched = 0
        for sample in samples:
            sessions = by_pid.get(sample.pid)
            if not sessions:
                unmatched += 1
                continue
            key = (sample.pid, sample.tid, sample.stacks)
            is_off = sample.kind == off_kind
            weight = sample.weight
            for s in sessions:
                agg = s.traces.get(key)
                if agg is None:
                    if len(s.traces) >= self.MAX_TRACES:
                        s.dropped_traces += 1
                        self.metrics.traces_dropped.inc()
                        continue
                    agg = s.traces[key] = _Agg(kernel_len=sample.kernel_len)
                    s.threads.setdefault(sample.tid, sample.comm)
                # weight: repeats counted in the kernel (on-CPU), or the waits a rate-limited
                # capture stands for (off-CPU).
                if is_off:
                    agg.off_cpu += weight
                    agg.off_cpu_ns += sample.blocked_ns * weight
                else:
                    agg.on_cpu += weight
            if is_off:
                off += weight
            else:
                on += weight
        if unmatched:
            self.metrics.samples_unmatched.inc(unmatched)
        if on:
            self.metrics.samples.labels("on_cpu").inc(on)
        if off:
            self.metrics.samples.labels("off_cpu").inc(off)

    # -- finishing ----------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[str]:
        """Finish the sessions whose time is up; returns their ids."""
        now = self._clock() if now is None else now
        done = [s for s in self.sessions.values() if s.deadline <= now]
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

    def _finish(self, s: ActiveSession, now: float) -> None:
        del self.sessions[s.session_id]
        for pid in s.processes:
            lst = self._by_pid.get(pid, [])
            if s in lst:
                lst.remove(s)
            if not lst:
                self._by_pid.pop(pid, None)
            self._unref(pid)
        self.metrics.sessions_active.set(len(self.sessions))
        res = s.trigger.resource
        session = self.build(s, now)
        total = session.total_samples
        self.metrics.session_samples.observe(total)
        if total == 0:
            self.metrics.sessions_empty.labels(res).inc()
            log.info("Capture ended without samples. session=%s service=%s", s.session_id, s.service)
            return
        data = wire.encode_session(session)
        self._sink.put(s.session_id, data)
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

    def build(self, s: ActiveSession, now: float) -> wire.Session:
        traces = []
        for (pid, tid, stacks), agg in s.traces.items():
            kernel, raw_user = split_stacks(stacks, agg.kernel_len)
            traces.append(
                wire.Trace(
                    kernel=kernel,
                    user=self._classify(pid, raw_user),
                    pid=pid,
                    tid=tid,
                    on_cpu=agg.on_cpu,
                    off_cpu=agg.off_cpu,
                    off_cpu_ns=agg.off_cpu_ns,
                )
            )
        return wire.Session(
            session_id=s.session_id,
            trigger=s.trigger,
            kernel=wire.KernelInfo(self.kernel.release, self.kernel.build_id, self.kernel.text_addr),
            start_ns=s.start_ns,
            duration_ns=int((now - s.start_mono) * 1e9),
            period_ns=self.period_ns,
            tenant=self.tenant,
            service=s.service,
            host=self.host,
            labels=s.labels,
            processes=dict(s.processes),
            threads=dict(s.threads),
            traces=traces,
        )

    # -- user frames ----------------------------------------------------------------
    def _classify(self, pid: int, raw: list[tuple[int, int, int]]) -> tuple[wire.UserFrame, ...]:
        """Mapped frames (procmaps.FrameStatus) as wire frames: a file and offset (with the
        file's name, so an unnamed frame still says `libc.so.6+0x…`), the vDSO, a JIT
        function named by the perf map, or an unmapped address counted by reason."""
        out = []
        maps = self._filter.maps
        counts: dict[str, int] = {}
        for i, (status, ref, value) in enumerate(raw):
            if status == _FILE:
                f = maps.file(ref)
                out.append(wire.UserFrame(wire.FRAME_RESOLVED, f.build_id, value, f.name))
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
        for label, n in counts.items():
            self.metrics.user_frames.labels(label).inc(n)
        return tuple(out)

"""The episode report: who waited, on what, for how long, and who caused it.

A session's episode has two halves, both measured over the session's own window
(a snapshot when it starts, another when it ends, and their difference):

- victims: the watched threads' time by state, counted by the BPF episode hooks
  (`thread_times`, bpf/episode.bpf.h): on-CPU, waiting for a CPU (run-queue),
  blocked uninterruptible (D) and interruptible (S), and in direct reclaim or
  compaction. Ranked by stall time (run-queue + D + reclaim: what PSI counts).
- aggressors: the leaf cgroups of the cgroup2 tree, and "/" for the root's own
  processes (system-wide: what no child cgroup holds), ranked by what they used of
  the trigger's resource: CPU (cpu.stat usage_usec), I/O (io.stat bytes, then
  ios) or memory (memory.current growth plus memory.stat pgsteal, in bytes); on a
  hybrid host the v1 hierarchies' files stand in for missing ones (cgroupfs.py,
  the one reader of cgroup files).

Bounded: at most MAX_CGROUPS cgroup directories are read per snapshot and
MAX_VICTIMS / MAX_AGGRESSORS rows kept; what is left out is counted.
The cgroup file parsers are pure (bytes in, numbers out).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from .. import wire
from ..bpf import abi
from ..compat import SLOTS
from ..errors import BistouriError

# The cgroup reader is imported by the probe that reads (an --on-pressure record, the agent):
# `record` without one imports this module for its null probe (cgroupfs ~2 ms of its start).
TYPE_CHECKING = False  # not typing's: compat.py says why
if TYPE_CHECKING:
    from ..host.cgroupfs import CgroupMounts, CgroupUsage

log = logging.getLogger(__name__)

MAX_CGROUPS = 2048  # cgroup directories read per snapshot (3 small files each)
MAX_VICTIMS = 256  # threads kept in one episode
MAX_AGGRESSORS = 20  # cgroups kept in one episode
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Reasons of bistouri_episode_dropped_total.
DROP_CGROUPS = "cgroups_scan_limit"  # a cgroup directory beyond MAX_CGROUPS not read
DROP_VICTIMS = "victims"  # a thread beyond MAX_VICTIMS left out
DROP_AGGRESSORS = "aggressors"  # a cgroup beyond MAX_AGGRESSORS left out


# -- victims ---------------------------------------------------------------------------


@dataclass(frozen=True, **SLOTS)
class StateTimes:
    """Cumulative nanoseconds of one thread by state, the open state counted up to `at_ns`."""

    pid: int
    tid: int
    comm: str
    on_cpu_ns: int = 0
    runqueue_ns: int = 0
    blocked_d_ns: int = 0
    blocked_s_ns: int = 0
    reclaim_ns: int = 0


def state_times(t: abi.ThreadTimes, now_ns: int) -> StateTimes:
    """A BPF thread_times entry with its current state (and reclaim) closed at `now_ns`
    (CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns)."""
    open_ns = max(0, now_ns - t.since_ns) if t.since_ns else 0
    state = t.state
    reclaim_open = max(0, now_ns - t.reclaim_start_ns) if t.reclaim_start_ns else 0
    return StateTimes(
        pid=t.pid,
        tid=t.tid,
        comm=abi.comm_bytes(bytes(t.comm)),
        on_cpu_ns=t.on_cpu_ns + (open_ns if state == abi.ThreadState.RUNNING else 0),
        runqueue_ns=t.runqueue_ns + (open_ns if state == abi.ThreadState.RUNNABLE else 0),
        blocked_d_ns=t.blocked_d_ns + (open_ns if state == abi.ThreadState.BLOCKED_D else 0),
        blocked_s_ns=t.blocked_s_ns + (open_ns if state == abi.ThreadState.BLOCKED_S else 0),
        reclaim_ns=t.reclaim_ns + reclaim_open,
    )


def victims(
    start: Mapping[int, StateTimes], end: Mapping[int, StateTimes], max_victims: int = MAX_VICTIMS
) -> tuple[list[wire.Victim], int]:
    """Each thread's time by state between two snapshots, ranked by stall time (run-queue + D +
    reclaim), then S; returns the kept rows and how many were left out. A thread absent from
    `start` was first seen after it: all its time is in the window."""
    rows = []
    for tid, e in end.items():
        s = start.get(tid)
        if s is not None and s.pid != e.pid:
            s = None  # the tid was reused by another process
        base = s or StateTimes(e.pid, tid, e.comm)
        v = wire.Victim(
            pid=e.pid,
            tid=tid,
            comm=e.comm,
            on_cpu_ns=max(0, e.on_cpu_ns - base.on_cpu_ns),
            runqueue_ns=max(0, e.runqueue_ns - base.runqueue_ns),
            blocked_d_ns=max(0, e.blocked_d_ns - base.blocked_d_ns),
            blocked_s_ns=max(0, e.blocked_s_ns - base.blocked_s_ns),
            reclaim_ns=max(0, e.reclaim_ns - base.reclaim_ns),
        )
        if v.on_cpu_ns or v.runqueue_ns or v.blocked_d_ns or v.blocked_s_ns or v.reclaim_ns:
            rows.append(v)
    rows.sort(key=lambda v: (v.stall_ns, v.blocked_s_ns, -v.tid), reverse=True)
    return rows[:max_victims], max(0, len(rows) - max_victims)


# -- aggressors --------------------------------------------------------------------------


def _rank_key(resource: str) -> Callable[[wire.Aggressor], tuple[int, ...]]:
    if resource == "io":
        return lambda a: (a.io_bytes, a.io_ops, a.cpu_ns)
    if resource == "memory":
        return lambda a: (a.memory_bytes + a.reclaim_bytes, a.io_bytes, a.cpu_ns)
    return lambda a: (a.cpu_ns, a.io_bytes)


def aggressors(
    start: Mapping[str, CgroupUsage],
    end: Mapping[str, CgroupUsage],
    resource: str,
    max_aggressors: int = MAX_AGGRESSORS,
) -> tuple[list[wire.Aggressor], int]:
    """What each cgroup used between two snapshots, ranked by the trigger's resource; a cgroup
    created meanwhile counts from zero. Returns the kept rows and how many were left out."""
    from ..host.cgroupfs import CgroupUsage

    rows = []
    zero = CgroupUsage()
    for cgroup, e in end.items():
        s = start.get(cgroup, zero)
        a = wire.Aggressor(
            cgroup=cgroup,
            cpu_ns=max(0, e.cpu_usec - s.cpu_usec) * 1000,
            io_bytes=max(0, e.io_bytes - s.io_bytes),
            io_ops=max(0, e.io_ops - s.io_ops),
            memory_bytes=max(0, e.memory_bytes - s.memory_bytes),
            reclaim_bytes=max(0, e.reclaimed_pages - s.reclaimed_pages) * PAGE_SIZE,
        )
        if a.cpu_ns or a.io_bytes or a.io_ops or a.memory_bytes or a.reclaim_bytes:
            rows.append(a)
    rows.sort(key=_rank_key(resource), reverse=True)
    return rows[:max_aggressors], max(0, len(rows) - max_aggressors)


# -- one episode: the two snapshots ------------------------------------------------------


@dataclass(frozen=True, **SLOTS)
class EpisodeStart:
    """The victims' thread states and the cgroups' usage when an episode began."""

    threads: dict[int, StateTimes]
    cgroups: dict[str, CgroupUsage]


ThreadTimesSource = Callable[[Collection[int]], Mapping[int, abi.ThreadTimes]]


class NoEpisodeProbe:
    """No episode report (`bistouri record` without --on-pressure): sessions carry none."""

    def start(self, pids: Collection[int]) -> None:
        return None

    def finish(self, start: EpisodeStart, pids: Collection[int], resource: str) -> None:
        return None


NO_EPISODE_PROBE = NoEpisodeProbe()


class EpisodeProbe:
    """Takes an episode's start snapshot and turns the end one into a `wire.Episode`.

    `thread_times` is the profiler's reader of the BPF map (None: no victims, e.g. without
    the episode hooks); `cgroup_root` the cgroup2 directory whose leaves are ranked (the
    mount; None: no aggressors); `mounts` the cgroup hierarchies (default: this host's, from
    /proc/self/mountinfo), for the v1 files that stand in for missing cgroup2 ones.
    """

    def __init__(
        self,
        thread_times: ThreadTimesSource | None,
        cgroup_root: str | None,
        on_dropped: Callable[[str, int], None] = lambda reason, n: None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        max_cgroups: int = MAX_CGROUPS,
        mounts: CgroupMounts | None = None,
    ) -> None:
        from ..host.cgroupfs import CgroupReader, find_mounts

        self._thread_times = thread_times
        self.cgroup_root = cgroup_root
        self._cgroups_reader = CgroupReader(mounts if mounts is not None else find_mounts())
        self._on_dropped = on_dropped
        self._clock_ns = clock_ns
        self.max_cgroups = max_cgroups

    def _threads(self, pids: Collection[int]) -> dict[int, StateTimes]:
        if self._thread_times is None:
            return {}
        try:
            raw = self._thread_times(pids)
        except (BistouriError, OSError) as e:
            # The BPF object is gone (it failed, or closed early): no victims then.
            log.debug("Episode thread times unreadable: no victims. error=%s", e)
            return {}
        now = self._clock_ns()
        return {tid: state_times(t, now) for tid, t in raw.items()}

    def _cgroups(self) -> dict[str, CgroupUsage]:
        if self.cgroup_root is None:
            return {}
        usage, dropped = self._cgroups_reader.scan(self.cgroup_root, self.max_cgroups)
        if dropped:
            self._on_dropped(DROP_CGROUPS, dropped)
        return usage

    def start(self, pids: Collection[int]) -> EpisodeStart:
        return EpisodeStart(self._threads(pids), self._cgroups())

    def finish(self, start: EpisodeStart, pids: Collection[int], resource: str) -> wire.Episode:
        end_threads = self._threads(pids)
        end_cgroups = self._cgroups()
        kept_victims, left_v = victims(start.threads, end_threads)
        kept_aggressors, left_a = aggressors(start.cgroups, end_cgroups, resource)
        if left_v:
            self._on_dropped(DROP_VICTIMS, left_v)
        if left_a:
            self._on_dropped(DROP_AGGRESSORS, left_a)
        return wire.Episode(victims=tuple(kept_victims), aggressors=tuple(kept_aggressors))


def summary_lines(ep: wire.Episode, victims_shown: int = 10, aggressors_shown: int = 5) -> list[str]:
    """The episode as text: `bistouri record` prints it, the UI shows the same numbers."""

    def ms(ns: int) -> str:
        return f"{ns / 1e6:9.1f}"

    lines = ["Victims (ms):      on-CPU  run-queue  blocked-D  blocked-S    reclaim  thread"]
    for v in ep.victims[:victims_shown]:
        lines.append(
            f"             {ms(v.on_cpu_ns)}  {ms(v.runqueue_ns)}  {ms(v.blocked_d_ns)}  "
            f"{ms(v.blocked_s_ns)}  {ms(v.reclaim_ns)}  {v.comm} (pid {v.pid} tid {v.tid})"
        )
    lines.append("Aggressors:   cpu (ms)   io (MiB)     io ops  memory+reclaim (MiB)  cgroup")
    for a in ep.aggressors[:aggressors_shown]:
        lines.append(
            f"             {a.cpu_ns / 1e6:9.1f}  {a.io_bytes / 2**20:9.1f}  {a.io_ops:9d}  "
            f"{(a.memory_bytes + a.reclaim_bytes) / 2**20:20.1f}  {a.cgroup}"
        )
    return lines

"""Discovery: which processes the targets name, found by walking /proc and the cgroup tree.

The exec hook (BPF comm trie, see watcher.py) sees new processes at once; the
walk here, on the bistouri-walk thread, finds the rest: processes started before
the agent, forks without exec, and every process of a target named by cgroup or
systemd unit (the kernel reports no event when a process enters a cgroup).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import threads
from ..compat import SLOTS
from ..host import procfs
from .config import Target
from .matcher import CommMatcher

log = logging.getLogger(__name__)

# A unit is searched this deep under the cgroup2 mount (systemd nests slices a few levels).
UNIT_SEARCH_DEPTH = 8


@dataclass(frozen=True, **SLOTS)
class FoundProcess:
    pid: int
    starttime: int  # with pid, identifies the process: pids are reused
    comm: str
    cgroup: str  # cgroup2 path relative to the mount, "/" for the root
    rule_ids: tuple[int, ...]


@dataclass(**SLOTS)
class WalkResult:
    generation: int
    started: float  # monotonic time the walk started
    duration_s: float
    found: list[FoundProcess]
    # rule_id -> cgroup path of each target named by cgroup or unit that exists now
    target_cgroups: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True, **SLOTS)
class WalkJob:
    """What a walk looks for: one config's comm rules and cgroup/unit targets."""

    matcher: CommMatcher
    generation: int
    cgroup_targets: tuple[Target, ...] = ()
    cgroup_root: str | None = None


def find_unit_cgroup(cgroup_root: str, unit: str, max_depth: int = UNIT_SEARCH_DEPTH) -> str | None:
    """The path (relative to the mount) of the system unit `unit`: the shallowest cgroup directory
    of that name reached through slices only.

    The system manager places a unit in its slice (system.slice/nginx.service,
    user.slice/user-1000.slice/user@1000.service, a-b.slice/x.service): searching by name finds it
    wherever its slice is. Below a service or a scope the cgroups are no longer the system
    manager's: a unit with `Delegate=` (user@UID.service, a container) hands its subtree to its
    processes, which may name a directory after any unit there. So the search never enters a
    cgroup that is not a `.slice`.
    """
    level = [cgroup_root]
    for _ in range(max_depth):
        below = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    entries = [e for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue  # removed meanwhile
            for e in entries:
                if e.name == unit:
                    return "/" + os.path.relpath(e.path, cgroup_root)
                if e.name.endswith(".slice"):
                    below.append(e.path)
        if not below:
            return None
        level = below
    return None


def _target_cgroup(cgroup_root: str, target: Target, units: dict[str, str]) -> str | None:
    if target.unit is not None:
        # Where the unit was last time is checked first: a search reads the whole tree.
        known = units.get(target.unit)
        if known is not None and os.path.isdir(os.path.join(cgroup_root, known.lstrip("/"))):
            return known
        found = find_unit_cgroup(cgroup_root, target.unit)
        if found is None:
            units.pop(target.unit, None)
        else:
            units[target.unit] = found
        return found
    assert target.cgroup is not None
    d = procfs.cgroup_dir(cgroup_root, target.cgroup)
    return target.cgroup if d is not None and os.path.isdir(d) else None


def _cgroup_members(cgroup_root: str, cgroup: str, cancel: threading.Event) -> dict[int, str]:
    """pid -> its cgroup path, for every process in `cgroup` and the cgroups below it."""
    top = procfs.cgroup_dir(cgroup_root, cgroup)
    out: dict[int, str] = {}
    if top is None:
        return out
    for d, _, _ in os.walk(top):
        if cancel.is_set():
            break
        rel = os.path.relpath(d, cgroup_root)
        rel = "/" if rel == "." else "/" + rel  # as /proc/PID/cgroup says it
        for pid in procfs.cgroup_procs(d):
            out[pid] = rel
    return out


def walk_processes(
    job: WalkJob,
    proc_root: str,
    cancel: threading.Event,
    units: dict[str, str] | None = None,
) -> WalkResult:
    """Find the processes the targets name (runs on the walk thread).

    `units` (unit -> cgroup path) remembers where units were found, across walks.
    """
    units = {} if units is None else units
    started = time.monotonic()
    found = []
    own = os.getpid()
    target_cgroups: dict[int, str] = {}
    in_targets: dict[int, list[int]] = {}  # pid -> rule ids of the cgroup/unit targets holding it
    member_cgroup: dict[int, str] = {}  # ... and its cgroup, read in the cgroup tree already
    if job.cgroup_root is not None:
        for t in job.cgroup_targets:
            cg = _target_cgroup(job.cgroup_root, t, units)
            if cg is None:
                continue  # not running now: looked up again at the next walk
            target_cgroups[t.rule_id] = cg
            members = _cgroup_members(job.cgroup_root, cg, cancel)
            member_cgroup.update(members)
            for pid in members:
                in_targets.setdefault(pid, []).append(t.rule_id)
    # Names first (`comm`, cheaper than `stat`): most processes match nothing and cost one read.
    for pid, comm in procfs.iter_comms(proc_root):
        if cancel.is_set():
            break
        rule_ids = job.matcher.match(comm)
        member_of = in_targets.get(pid)
        if not rule_ids and not member_of:
            continue  # most processes: no set built for them
        st = procfs.read_stat(pid, proc_root)
        if st is None or st.is_kernel_thread or pid == own:
            continue
        if st.comm != comm:  # renamed between the two reads
            rule_ids = job.matcher.match(st.comm)
        if member_of:
            rule_ids = sorted(set(rule_ids).union(member_of))
        elif not rule_ids:
            continue
        cgroup = member_cgroup.get(pid) or procfs.read_cgroup2_path(pid, proc_root)
        if cgroup is None:
            continue  # exited meanwhile
        found.append(FoundProcess(st.pid, st.starttime, st.comm, cgroup, tuple(rule_ids)))
    return WalkResult(job.generation, started, time.monotonic() - started, found, target_cgroups)


class Walker:
    """The periodic walk on its own thread; results go to a queue and wake the main loop."""

    def __init__(
        self,
        interval_s: float,
        proc_root: str,
        wake: Callable[[], None],
    ) -> None:
        self.interval_s = interval_s
        self.proc_root = proc_root
        self._wake = wake
        self.results: queue.Queue[WalkResult] = queue.Queue(maxsize=4)
        self._now = threading.Event()
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self._job: WalkJob | None = None
        self._units: dict[str, str] = {}  # where each unit was found (walk thread only)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threads.start("walk", self._run)

    def request(self, job: WalkJob) -> None:
        """Walk now for this job; an in-flight walk of an older config is cancelled."""
        with self._lock:
            self._job = job
        self._cancel.set()
        self._now.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._now.wait(self.interval_s)
            self._now.clear()
            if self._stop.is_set():
                return
            with self._lock:
                job = self._job
                self._cancel.clear()
            if job is None:
                continue
            try:
                result = walk_processes(job, self.proc_root, self._cancel, self._units)
            except Exception as e:  # a broken walk must not kill discovery for good
                log.error("Process walk failed: %s", e)
                continue
            if self._cancel.is_set():
                continue
            try:
                self.results.put_nowait(result)
            except queue.Full:
                pass
            self._wake()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._cancel.set()
        self._now.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

"""Watcher: which processes to watch, their PSI watches, and when to capture.

Processes are found two ways: exec events from the BPF comm trie (fast path)
and the periodic walk of discovery.py (processes started before the agent,
forks without exec, and the members of targets named by cgroup or unit).
Every matching process is tracked — not only the first one of its cgroup — and
a watcher goes away when no matching process is left in its cgroup. A target
named by cgroup or unit watches the pressure of that cgroup. A PSI event starts
one capture session per target watching that (cgroup, resource), with all of
the target's live processes in that cgroup; `capture_now` starts one without
pressure. Tracked processes of a target with a flight recorder stay sampled.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import wire
from ..capture.events import ExecMatch
from ..capture.sessions import SessionCapture
from ..compat import SLOTS
from ..host import procfs
from ..host.psi import PsiEvent, PsiLoop
from ..logtext import RateLimited
from ..pressure import PressureThreshold
from .config import Target, TargetsConfig
from .discovery import FoundProcess, WalkJob, WalkResult, walk_processes
from .matcher import CommMatcher
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

__all__ = ["SYSTEM", "FoundProcess", "WalkResult", "Watcher", "walk_processes"]

SYSTEM = "/"  # the cgroup of system-wide watches: /proc/pressure/*


# (cgroup, the configured threshold)
WatchKey = tuple[str, PressureThreshold]


@dataclass(**SLOTS)
class WatchGroup:
    key: WatchKey
    path: str
    rule_ids: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)


@dataclass(**SLOTS)
class Tracked:
    starttime: int
    comm: str
    cgroup: str
    rule_ids: tuple[int, ...]
    added: float  # monotonic
    keys: set[WatchKey] = field(default_factory=set)


class Watcher:
    def __init__(
        self,
        loop: PsiLoop,
        capture: SessionCapture,
        set_comm_rules: Callable[[list[tuple[bytes, int]]], None],
        metrics: AgentMetrics,
        *,
        proc_root: str,
        cgroup_root: str | None,
        default_capture_s: float,
    ) -> None:
        self.loop = loop
        self.capture = capture
        self._set_comm_rules = set_comm_rules
        self.metrics = metrics
        self.proc_root = proc_root
        self.cgroup_root = cgroup_root
        self.default_capture_s = default_capture_s
        self.config: TargetsConfig | None = None
        self.matcher = CommMatcher(())
        self.generation = 0
        self.processes: dict[int, Tracked] = {}
        self.groups: dict[WatchKey, WatchGroup] = {}
        self.target_cgroups: dict[int, str] = {}  # rule_id -> cgroup of a cgroup/unit target, from the walk
        self.watch_failures = 0
        # One line per matched process, up to a burst: an exec storm is counted, then summarised.
        self._matched_log = RateLimited(log, "Processes matched")

    # -- configuration ------------------------------------------------------------
    def apply_config(self, cfg: TargetsConfig) -> None:
        """Install a config: purge watchers, rebuild both tries. The caller then walks /proc."""
        matcher = CommMatcher(cfg.targets)
        # The BPF trie first: if it fails, the running config stays as it was.
        self._set_comm_rules(matcher.lpm_entries())
        self.generation += 1  # walk results of the old config are discarded
        self.loop.clear()
        self.groups.clear()
        for pid in list(self.processes):
            self.capture.unwatch(pid)
        self.processes.clear()
        self.target_cgroups.clear()
        self.matcher = matcher
        self.config = cfg
        self.metrics.processes.set(0)
        for line in cfg.summary():
            log.info("Watching target. %s", line)

    def walk_job(self) -> WalkJob:
        """What the walk must look for under the current config."""
        targets = self.config.targets if self.config else ()
        return WalkJob(
            self.matcher,
            self.generation,
            tuple(t for t in targets if t.rule is None),
            self.cgroup_root,
        )

    def _target(self, rule_id: int) -> Target | None:
        return self.config.target(rule_id) if self.config else None

    # -- discovery ---------------------------------------------------------------
    def on_exec(self, ev: ExecMatch) -> None:
        """An exec matched the BPF trie: re-validate against the current rules."""
        self.metrics.exec_events.inc()
        if not self.matcher.matches(ev.rule_id, ev.comm):
            # Stale: emitted under an older config, or the trie value was another target's id.
            rule_ids = self.matcher.match(ev.comm)
            if not rule_ids:
                self.metrics.stale_events.inc()
                return
        else:
            rule_ids = self.matcher.match(ev.comm)
        st = procfs.read_stat(ev.pid, self.proc_root)
        cgroup = procfs.read_cgroup2_path(ev.pid, self.proc_root)
        if st is None or cgroup is None:
            self.metrics.exec_gone.inc()  # a short-lived process: its exec is counted, never matched
            return
        self._track(FoundProcess(ev.pid, st.starttime, ev.comm, cgroup, tuple(rule_ids)))

    def on_walk(self, result: WalkResult) -> None:
        if result.generation != self.generation:
            return  # a reload happened while it ran
        self.metrics.proc_walk_duration.observe(result.duration_s)
        for rid, cg in result.target_cgroups.items():
            if self.target_cgroups.get(rid) != cg:
                log.info("Target cgroup found. rule_id=%d cgroup=%s", rid, cg)
                self.target_cgroups[rid] = cg
        seen = set()
        for p in result.found:
            seen.add(p.pid)
            self._track(p)
        # Forget processes that are gone, unless added after the walk started (exec during the walk).
        for pid, t in list(self.processes.items()):
            if pid not in seen and t.added < result.started:
                self._untrack(pid)
        self._matched_log.flush()  # an exec storm that stopped is told here
        log.debug("Process walk done. matched=%d duration=%.3fs", len(result.found), result.duration_s)

    def _track(self, p: FoundProcess) -> None:
        old = self.processes.get(p.pid)
        if old is not None and (old.starttime, old.cgroup, old.rule_ids, old.comm) == (
            p.starttime,
            p.cgroup,
            p.rule_ids,
            p.comm,
        ):
            return
        if old is not None:
            self._untrack(p.pid)  # moved cgroup, renamed, or another process got the pid: re-register
        t = Tracked(p.starttime, p.comm, p.cgroup, p.rule_ids, time.monotonic())
        self.processes[p.pid] = t
        recorder_s = 0.0
        recorder_hz: float | None = 0.0  # the fastest of its targets' (None: the agent's rate)
        for rid in p.rule_ids:
            target = self._target(rid)
            if target is None:
                continue
            recorder_s = max(recorder_s, target.recorder_secs)
            if target.recorder_secs > 0 and recorder_hz is not None:
                recorder_hz = None if target.recorder_hz is None else max(recorder_hz, target.recorder_hz)
            cgroup = SYSTEM if target.scope == "system" or self.cgroup_root is None else p.cgroup
            if target.rule is None and cgroup != SYSTEM:
                # A cgroup or unit target watches the pressure of the whole cgroup it names.
                cgroup = self.target_cgroups.get(rid, p.cgroup)
            for r in target.resources:
                key: WatchKey = (cgroup, r)
                group = self.groups.get(key)
                if group is None:
                    group = self._watch(key, target)
                    if group is None:
                        continue
                group.rule_ids.add(rid)
                group.pids.add(p.pid)
                t.keys.add(key)
        if recorder_s > 0:
            self.capture.watch(p.pid, recorder_s, recorder_hz)
        self.metrics.processes.set(len(self.processes))
        self._matched_log.log(
            "Process matched. pid=%d comm=%s cgroup=%s rules=%s", p.pid, p.comm, p.cgroup, list(p.rule_ids)
        )

    def _untrack(self, pid: int) -> None:
        t = self.processes.pop(pid, None)
        if t is None:
            return
        self.capture.unwatch(pid)
        for key in t.keys:
            group = self.groups.get(key)
            if group is None:
                continue
            group.pids.discard(pid)
            if not group.pids:
                del self.groups[key]
                self.loop.remove(key)
                log.info(
                    "PSI watch removed: no matching process left. cgroup=%s resource=%s",
                    key[0],
                    key[1].resource,
                )
        self.metrics.processes.set(len(self.processes))

    def pressure_path(self, cgroup: str, resource: str) -> str:
        if cgroup == SYSTEM or self.cgroup_root is None:
            return os.path.join(self.proc_root, "pressure", resource)
        d = procfs.cgroup_dir(self.cgroup_root, cgroup)
        if d is None:
            raise FileNotFoundError(f"cgroup {cgroup} is outside the cgroup2 mount {self.cgroup_root}")
        return os.path.join(d, f"{resource}.pressure")

    def _watch(self, key: WatchKey, target: Target) -> WatchGroup | None:
        cgroup, threshold = key
        try:
            path = self.pressure_path(cgroup, threshold.resource)
            self.loop.add_watch(key, path, threshold, target.cooldown(self.default_capture_s))
        except OSError as e:
            self.watch_failures += 1
            self.metrics.sessions_dropped.labels("watcher_failed").inc()
            log.warning("Cannot watch PSI. cgroup=%s resource=%s error=%s", cgroup, threshold.resource, e)
            return None
        group = WatchGroup(key, path)
        self.groups[key] = group
        log.info(
            "PSI watch added. path=%s stall=%s threshold=%g%% window_ms=%d",
            path,
            threshold.stall,
            threshold.threshold,
            threshold.window_ms,
        )
        return group

    # -- starting sessions -------------------------------------------------------------
    def on_psi(self, ev: PsiEvent) -> list[str]:
        """A watcher fired: one session per target of the watcher, with its live processes."""
        key = ev.key
        group = self.groups.get(key)  # type: ignore[call-overload]
        if group is None:
            return []
        if ev.dead:  # the cgroup was removed: its processes are gone or moved
            self.groups.pop(group.key, None)
            for pid in list(group.pids):
                t = self.processes.get(pid)
                if t is not None:
                    t.keys.discard(group.key)
            return []
        sessions = []
        for rid in sorted(group.rule_ids):
            target = self._target(rid)
            if target is None:
                continue
            procs = {}
            for pid in sorted(group.pids):
                t = self.processes.get(pid)
                if t is None or rid not in t.rule_ids:
                    continue
                if not procfs.is_same_process(pid, t.starttime, self.proc_root):
                    self._untrack(pid)  # exited, or its pid now belongs to another process
                    continue
                procs[pid] = t.comm
            sid = self.capture.start_session(
                wire.Trigger.from_psi(ev, group.key[0]),
                target.service_id,
                dict(target.labels),
                procs,
                target.capture_secs(self.default_capture_s),
                recorder_secs=target.recorder_secs,
            )
            if sid:
                sessions.append(sid)
        return sessions

    def capture_now(self, service_id: str, session_id: str) -> str | None:
        """A manual session of a target's live processes, without pressure (capture now)."""
        target = self.config.by_service(service_id) if self.config else None
        if target is None:
            return None  # the config changed since the request was accepted
        procs = {}
        for pid, t in sorted(self.processes.items()):
            if target.rule_id not in t.rule_ids:
                continue
            if not procfs.is_same_process(pid, t.starttime, self.proc_root):
                self._untrack(pid)
                continue
            procs[pid] = t.comm
        cgroups = {t.cgroup for pid, t in self.processes.items() if pid in procs}
        cgroup = self.target_cgroups.get(target.rule_id) or (cgroups.pop() if len(cgroups) == 1 else "")
        first = target.resources[0]
        trigger = wire.Trigger(
            resource=first.resource,
            stall=first.stall,
            cgroup=cgroup,
            time_ns=time.time_ns(),
            kind=wire.TRIGGER_MANUAL,
        )
        return self.capture.start_session(
            trigger,
            target.service_id,
            dict(target.labels),
            procs,
            target.capture_secs(self.default_capture_s),
            recorder_secs=target.recorder_secs,
            session_id=session_id,
        )

"""PID reuse: a tracked pid that now belongs to another process is not captured as the old one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri.agent.config import parse_targets_config
from bistouri.agent.discovery import walk_processes
from bistouri.agent.metrics import AgentMetrics
from bistouri.agent.watcher import Watcher
from bistouri.capture.sessions import SessionCapture
from bistouri.host.kernel import KernelMeta
from bistouri.host.procfs import is_same_process
from bistouri.host.psi import PsiEvent, PsiLoop

CONFIG = """
targets:
  - rule: {type: Exact, comm: burner}
    service_id: svc
    scope: system
    resources:
      - {resource: cpu, threshold: 50, window_ms: 2000}
"""


class _Filter:
    def set_pid_filter(self, pid: int, flags: int) -> None:
        pass


class _Sink:
    def put(self, session_id: str, data: bytes) -> str | None:
        return session_id


def _process(proc: Path, pid: int, comm: str, starttime: int) -> None:
    d = proc / str(pid)
    d.mkdir(exist_ok=True)
    rest = " ".join(["0"] * 10 + ["1", "0", str(starttime)] + ["0"] * 20)  # num_threads, starttime
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 {rest}\n")
    (d / "comm").write_text(f"{comm}\n")  # what the walk reads first
    (d / "cgroup").write_text("0::/system.slice/burner.service\n")


def test_is_same_process_compares_the_start_time(tmp_path):
    _process(tmp_path, 100, "burner", 4242)
    assert is_same_process(100, 4242, str(tmp_path))
    assert not is_same_process(100, 4243, str(tmp_path))
    assert not is_same_process(101, 4242, str(tmp_path))  # gone


def test_a_reused_pid_is_not_captured_as_the_tracked_process(tmp_path):
    if not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("no PSI on this kernel")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "pressure").symlink_to("/proc/pressure")  # real PSI watches, fixture processes
    _process(proc, 100, "burner", 4242)
    _process(proc, 101, "burner", 4300)
    reg = CollectorRegistry()
    metrics = AgentMetrics(reg)
    loop = PsiLoop(registry=reg)
    orch = SessionCapture(
        _Filter(),
        _Sink(),
        metrics,
        KernelMeta("6.18", b"\x01" * 20, 0),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(proc),
    )
    watcher = Watcher(
        loop,
        orch,
        lambda entries: None,
        metrics,
        proc_root=str(proc),
        cgroup_root=None,
        default_capture_s=10,
    )
    try:
        watcher.apply_config(parse_targets_config(CONFIG))
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        [group] = watcher.groups.values()
        assert group.pids == {100, 101}
        # Process 100 exits; another process named burner gets its pid before the next walk.
        _process(proc, 100, "burner", 9999)
        event = PsiEvent(group.key, "cpu", "some", 1_000_000, 2_000_000, group.path, time_ns=1)
        [sid] = watcher.on_psi(event)
        # Before: /proc/100 existed, so the stranger was captured as the tracked process.
        assert orch.sessions[sid].processes == {101: "burner"}
        assert 100 not in watcher.processes
        # The next walk finds the new process and tracks it as a process of its own.
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        assert watcher.processes[100].starttime == 9999
        # Reused again between two walks: the walk's start time replaces the tracked process.
        _process(proc, 100, "burner", 12345)
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        assert watcher.processes[100].starttime == 12345 and group.pids == {100, 101}
    finally:
        loop.clear()

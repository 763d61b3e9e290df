"""Real PSI watches in child cgroups of the cgroup2 mount: provoke CPU pressure and watch POLLPRI arrive.

Each test makes its own `bistouri-test-<random>` cgroup (system-wide pressure is
shared with everything else on the host), puts busy loops in it and removes it
afterwards. Without CAP_SYS_RESOURCE the kernel only takes 2 s multiples as
windows, so a 1000 ms request is shown to fall back to 2000 ms.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from bistouri.host import mounts, procfs, psi
from bistouri.host.psi import PsiEvent, PsiLoop
from bistouri.pressure import PressureThreshold

pytestmark = [pytest.mark.root]

CAP_SYS_RESOURCE = 24
BUSY = "while True: pass"


def _cgroup_root() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups and write PSI watches")
    root = mounts.find_cgroup2_mount()
    if root is None:
        pytest.skip("no cgroup2 mount in /proc/self/mountinfo")
    if not os.path.exists(os.path.join(root, "cpu.pressure")) and not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("kernel without PSI")
    return root


def _has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


@contextlib.contextmanager
def _child_cgroup(root: str) -> Iterator[str]:
    path = os.path.join(root, f"bistouri-test-{secrets.token_hex(4)}")
    os.mkdir(path)
    try:
        yield path
    finally:
        for _ in range(50):
            pids = procfs.cgroup_procs(path)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)  # EBUSY until killed tasks are reaped


@contextlib.contextmanager
def _burners(cgroup: str, n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """n busy loops inside `cgroup`; n > CPUs makes runnable tasks wait: CPU pressure."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", BUSY])
            procs.append(p)
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(p.pid))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _poll_until(loop: PsiLoop, seconds: float, stop_on_first: bool) -> tuple[list[PsiEvent], float]:
    events: list[PsiEvent] = []
    start = time.monotonic()
    first_at = -1.0
    while (remaining := seconds - (time.monotonic() - start)) > 0:
        got = loop.poll(int(remaining * 1000) + 1)
        if got and first_at < 0:
            first_at = time.monotonic() - start
        events.extend(got)
        if got and stop_on_first:
            break
    return events, first_at


def _burner_count() -> int:
    return max(3, 2 * (os.cpu_count() or 1))


def test_cpu_watch_fires_window_fallback_and_cooldown(caplog):
    root = _cgroup_root()
    reg = CollectorRegistry()
    with _child_cgroup(root) as busy, _child_cgroup(root) as idle, PsiLoop(registry=reg) as loop:
        privileged = _has_cap_sys_resource()
        psi._fallback_logged = psi._two_second_windows = False  # the once-per-process log must show here
        with caplog.at_level(logging.WARNING, logger="bistouri.host.psi"):
            w = loop.add_watch(
                "busy", os.path.join(busy, "cpu.pressure"), PressureThreshold("cpu", 10.0), cooldown_s=60
            )
            quiet = loop.add_watch(
                "idle", os.path.join(idle, "cpu.pressure"), PressureThreshold("cpu", 10.0), cooldown_s=0
            )
        if privileged:
            assert (w.window_us, w.stall_us, w.fallback) == (1_000_000, 100_000, False)
        else:
            # 1000 ms is refused without CAP_SYS_RESOURCE: 2000 ms, same 10 % ratio.
            assert (w.requested_window_us, w.window_us, w.stall_us) == (1_000_000, 2_000_000, 200_000)
            assert w.fallback and quiet.fallback
            fallback_logs = [r for r in caplog.records if "CAP_SYS_RESOURCE" in r.getMessage()]
            assert len(fallback_logs) == 1, "the fallback is logged once per process, not per watcher"
            assert "used_window_ms=2000" in fallback_logs[0].getMessage()

        assert loop.poll(0) == []  # nothing is stalling yet
        with _burners(busy, _burner_count()):
            events, first_at = _poll_until(loop, 12.0, stop_on_first=True)
            assert events, "no POLLPRI within 12 s although the cgroup is saturated"
            assert first_at < 8.0, f"first event after {first_at:.1f} s"
            [ev] = events
            assert (ev.key, ev.resource, ev.stall, ev.dead) == ("busy", "cpu", "some", False)
            assert ev.threshold_us == w.stall_us and ev.window_us == w.window_us
            assert ev.path.endswith("/cpu.pressure") and ev.path.startswith(busy)
            assert ev.pressure.total_us > 0  # read from the file at trigger time
            assert abs(ev.time_ns - time.time_ns()) < 60 * 10**9
            # Keep it stalling for three more windows: the 60 s cooldown swallows them.
            more, _ = _poll_until(loop, 3 * w.window_us / 1e6 + 0.5, stop_on_first=False)
        assert more == [], "events during the cooldown must be suppressed"
        assert w.suppressed >= 1 and w.events == 1
        assert reg.get_sample_value("bistouri_psi_events_total", {"resource": "cpu"}) == 1
        assert (
            reg.get_sample_value("bistouri_psi_events_suppressed_total", {"resource": "cpu"}) == w.suppressed
        )
        assert quiet.events == 0 and quiet.suppressed == 0, "the idle cgroup must never fire"
        assert reg.get_sample_value("bistouri_psi_watchers") == 2


def test_removed_cgroup_reports_dead_watches():
    root = _cgroup_root()
    reg = CollectorRegistry()
    with PsiLoop(registry=reg) as loop, _child_cgroup(root) as cg:
        for resource in ("cpu", "memory", "io"):
            loop.add_watch(
                (cg, resource),
                os.path.join(cg, f"{resource}.pressure"),
                PressureThreshold(resource, 50, window_ms=2000),
                0,
            )
        assert loop.poll(0) == []
        os.rmdir(cg)
        events = loop.poll(1000)
        assert sorted(e.resource for e in events) == ["cpu", "io", "memory"]
        assert all(e.dead for e in events)
        assert loop.keys() == []
        assert reg.get_sample_value("bistouri_psi_watchers") == 0
        assert reg.get_sample_value("bistouri_psi_watchers_lost_total", {"resource": "io"}) == 1


def test_system_wide_watch_registers():
    _cgroup_root()
    with PsiLoop(registry=None) as loop:
        w = loop.add_watch(
            "system", "/proc/pressure/memory", PressureThreshold("memory", 50, "full", 2000), 0
        )
        assert w.window_us == 2_000_000 and not w.closed
        p = w.read_pressure()  # read back through the watch fd itself
        assert p is not None and p.full is not None


def test_second_threshold_on_same_fd_is_refused_by_the_kernel():
    root = _cgroup_root()
    with _child_cgroup(root) as cg:
        w = psi.PsiWatch(
            "k", os.path.join(cg, "cpu.pressure"), PressureThreshold("cpu", 10, window_ms=2000), 0
        )
        try:
            with pytest.raises(OSError):
                os.write(w.fileno(), b"some 100000 2000000")  # one threshold per open file
        finally:
            w.close()


def test_missing_cgroup_raises_with_hint():
    root = _cgroup_root()
    with pytest.raises(OSError) as ei:
        psi.PsiWatch(
            "k",
            os.path.join(root, "bistouri-absent-cgroup", "cpu.pressure"),
            PressureThreshold("cpu", 10, window_ms=2000),
            0,
        )
    assert "no such cgroup" in str(ei.value)

"""PSI parsing and the poll loop, unprivileged. Real PSI watches: tests/integration/test_psi_cgroup.py."""

from __future__ import annotations

import ast
import errno
import os
import pathlib
import select
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import pressure, wire
from bistouri.agent import config
from bistouri.host import psi
from bistouri.host.psi import (
    Pressure,
    PsiLoop,
    allowed_window_us,
    parse_pressure,
    read_pressure,
)
from bistouri.pressure import PressureFigures, PressureThreshold

CGROUP = Path(__file__).resolve().parent.parent / "fixtures" / "cgroup"


@pytest.fixture(autouse=True)
def _fresh_window_state(monkeypatch):
    """A real PSI watch test earlier in the run may have learnt that 1 s windows are refused."""
    monkeypatch.setattr(psi, "_two_second_windows", False)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_read_pressure_cgroup_fixture():
    p = read_pressure(str(CGROUP / "system.slice" / "nginx.service" / "cpu.pressure"))
    assert p.some == PressureFigures(12.5, 3.25, 0.8, 123456789)
    assert p.full == PressureFigures(4.0, 1.0, 0.2, 45678901)
    assert p.line("full") is p.full and p.line("some") is p.some


def test_read_pressure_u64_total():
    p = read_pressure(str(CGROUP / "system.slice" / "nginx.service" / "io.pressure"))
    assert p.some.total_us == 2**64 - 1 and p.some.avg10 == 99.99


def test_parse_by_key_not_position_and_missing_full():
    p = read_pressure(str(CGROUP / "cpu.pressure"))
    assert p.some == PressureFigures(avg10=1.10, avg60=0.20, avg300=0.03, total_us=777)
    assert p.full is None
    assert p.line("full") == PressureFigures()


@pytest.mark.parametrize(
    "data", [b"", b"garbage\n", b"some avg10=x total=1\n", b"some avg10=1.0\nfull\n", b"\n\nsome\n"]
)
def test_parse_pressure_tolerates_junk(data):
    assert isinstance(parse_pressure(data), Pressure)


def test_read_pressure_missing_raises():
    with pytest.raises(FileNotFoundError):
        read_pressure(str(CGROUP / "gone" / "cpu.pressure"))


def test_live_system_pressure():
    if not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("kernel without PSI (/proc/pressure missing)")
    p = read_pressure("/proc/pressure/cpu")
    assert p.some.total_us > 0  # this host has run something since boot


@pytest.mark.parametrize(
    ("window_us", "allowed"),
    [
        (500_000, 2_000_000),
        (1_000_000, 2_000_000),
        (2_000_000, 2_000_000),
        (2_900_000, 2_000_000),
        (3_100_000, 4_000_000),
        (5_000_000, 4_000_000),  # ties round to even steps
        (9_000_000, 8_000_000),
        (10_000_000, 10_000_000),
    ],
)
def test_allowed_window(window_us, allowed):
    assert allowed_window_us(window_us) == allowed
    assert allowed % 2_000_000 == 0 and psi.WINDOW_US_MIN <= allowed <= psi.WINDOW_US_MAX


def test_a_watch_writes_one_threshold_line(tmp_path):
    # A regular file accepts the write: it shows exactly what the kernel would receive.
    f = tmp_path / "cpu.pressure"
    f.write_bytes(b"")
    with psi.PsiWatch("k", str(f), PressureThreshold("cpu", 12.5, "full", 1000), 5.0) as w:
        assert (w.stall_us, w.window_us, w.fallback) == (125_000, 1_000_000, False)
    assert f.read_bytes() == b"full 125000 1000000\0"  # NUL-terminated, as /proc/pressure needs
    assert w.closed


def test_a_watch_skips_a_window_already_known_to_be_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(psi, "_two_second_windows", True)
    f = tmp_path / "io.pressure"
    f.write_bytes(b"")
    with psi.PsiWatch("k", str(f), PressureThreshold("io", 10, "some", 1000), 0) as w:
        assert (w.requested_window_us, w.window_us, w.stall_us, w.fallback) == (
            1_000_000,
            2_000_000,
            200_000,
            True,
        )
    assert f.read_bytes() == b"some 200000 2000000\0"  # one write, straight to the allowed window


@pytest.mark.parametrize(
    ("stall", "threshold"), [("partial", 10.0), ("some", 0.0), ("some", 100.0), ("some", -1.0)]
)
def test_a_watch_rejects_bad_arguments(tmp_path, stall, threshold):
    with pytest.raises(ValueError):
        psi.PsiWatch("k", str(tmp_path / "x"), PressureThreshold("cpu", threshold, stall, 1000), 0)


def test_a_watch_missing_file_has_a_hint(tmp_path):
    with pytest.raises(OSError) as ei:
        psi.PsiWatch("k", str(tmp_path / "nope" / "cpu.pressure"), PressureThreshold("cpu", 10), 0)
    assert ei.value.errno == errno.ENOENT
    assert "cannot register PSI watch 'some 100000 1000000'" in str(ei.value)
    assert "no such cgroup" in str(ei.value)


def test_loop_other_fds_and_timeout():
    reg = CollectorRegistry()
    r, w = os.pipe()
    seen: list[tuple[int, int]] = []
    try:
        with PsiLoop(registry=reg) as loop:
            loop.add_fd(r, lambda fd, ev: seen.append((fd, ev)))
            assert loop.poll(0) == []
            assert seen == []
            os.write(w, b"x")
            assert loop.poll(1000) == []
            assert seen == [(r, select.POLLIN)]
            loop.remove_fd(r)
            loop.remove_fd(r)  # idempotent
            assert loop.poll(0) == []
            assert len(seen) == 1
    finally:
        os.close(r)
        os.close(w)


def test_loop_watches_bookkeeping(tmp_path):
    reg = CollectorRegistry()
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"")
    loop = PsiLoop(registry=reg)
    wa = loop.add_watch(("cg", "cpu"), str(tmp_path / "a"), PressureThreshold("cpu", 10), 3)
    assert loop.add_watch(("cg", "cpu"), str(tmp_path / "a"), PressureThreshold("cpu", 10), 3) is wa
    wb = loop.add_watch(("cg", "io"), str(tmp_path / "b"), PressureThreshold("io", 10), 3)
    assert sorted(loop.keys()) == [("cg", "cpu"), ("cg", "io")]
    assert sample(reg, "bistouri_psi_watchers") == 2
    # New parameters for an existing key replace the watch.
    wa2 = loop.add_watch(("cg", "cpu"), str(tmp_path / "a"), PressureThreshold("cpu", 20), 3)
    assert wa2 is not wa and wa.closed and not wa2.closed
    with pytest.raises(ValueError):
        loop.add_fd(wa2.fileno(), lambda fd, ev: None)
    assert loop.remove(("cg", "io")) and not loop.remove(("cg", "io"))
    assert wb.closed and len(loop) == 1
    loop.clear()
    assert loop.keys() == [] and wa2.closed
    assert sample(reg, "bistouri_psi_watchers") == 0
    assert loop.poll(0) == []


def test_loop_reports_a_dead_watch_once(tmp_path):
    reg = CollectorRegistry()
    (tmp_path / "memory.pressure").write_bytes(b"")
    loop = PsiLoop(registry=reg, wall_clock_ns=lambda: 123)
    w = loop.add_watch(
        "k", str(tmp_path / "memory.pressure"), PressureThreshold("memory", 5, window_ms=2000), 0
    )
    os.close(w.fileno())  # the poll set now holds an invalid fd: POLLNVAL, like a vanished cgroup's POLLERR
    [ev] = loop.poll(0)
    assert ev.dead and ev.key == "k" and ev.resource == "memory" and ev.time_ns == 123
    assert (ev.threshold_us, ev.window_us) == (100_000, 2_000_000)
    assert loop.keys() == [] and w.closed
    assert sample(reg, "bistouri_psi_watchers_lost_total", resource="memory") == 1
    assert loop.poll(0) == []


def test_event_to_trigger():
    ev = psi.PsiEvent(
        "k", "io", "full", 200_000, 2_000_000, "/x/io.pressure", 5, PressureFigures(1.5, 2.5, 3.5, 99)
    )
    t = wire.Trigger.from_psi(ev, "/x")
    assert (t.resource, t.stall, t.threshold_us, t.window_us, t.cgroup) == (
        "io",
        "full",
        200_000,
        2_000_000,
        "/x",
    )
    assert (t.time_ns, t.pressure) == (5, PressureFigures(1.5, 2.5, 3.5, 99))


def test_psi_does_not_import_the_wire_format():
    # The PSI vocabulary lives in pressure.py, below both; the session format stays wire's (issue 12).
    tree = ast.parse(pathlib.Path(psi.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "wire" not in imported and wire.RESOURCES is pressure.RESOURCES is config.RESOURCES
    assert wire.STALLS is pressure.STALLS is config.STALLS


@pytest.mark.parametrize(
    ("threshold", "window_us", "stall_us"), [(12.5, 1_000_000, 125_000), (1e-5, 2_000_000, 1)]
)
def test_one_stall_formula_for_config_and_kernel_fallback(
    tmp_path, monkeypatch, threshold, window_us, stall_us
):
    assert pressure.stall_threshold_us(threshold, window_us) == stall_us
    # A window the kernel forces on us keeps the ratio through the same formula.
    monkeypatch.setattr(psi, "_two_second_windows", True)
    f = tmp_path / "cpu.pressure"
    f.write_bytes(b"")
    t = PressureThreshold("cpu", threshold, window_ms=1000)
    with psi.PsiWatch("k", str(f), t, 0) as w:
        assert w.stall_us == pressure.stall_threshold_us(threshold, w.window_us) and w.threshold is t

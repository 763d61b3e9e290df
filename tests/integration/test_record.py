"""`bistouri record`, run as a user runs it, against real workloads."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import Cgroup

pytestmark = [pytest.mark.requires_bpf, pytest.mark.slow]


def record(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bistouri", "record", *args], capture_output=True, text=True, timeout=timeout
    )


def shares(stdout: str) -> dict[str, float]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+([\d.]+)%\s+(\S+)", line)
        if m:
            out[m.group(3)] = float(m.group(1))
    return out


def test_command_mode_reports_the_true_shares_and_stops_with_the_child(tmp_path, workloads):
    t0 = time.monotonic()
    r = record("-o", str(tmp_path / "out"), "--", str(workloads / "shares"), "6")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    got = shares(r.stdout)
    for fn, want in (("work_seventy", 70), ("work_twenty", 20), ("work_ten", 10)):
        assert abs(got.get(fn, 0) - want) <= 5, (fn, got)
    # No --duration: it follows the child and stops when the child exits (6 s), not at a default timer.
    assert took < 6 + 40, took
    out = tmp_path / "out"
    html = (out / "flamegraph.html").read_text()
    assert "work_seventy" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert gzip.decompress((out / "profile.pb.gz").read_bytes())
    folded = (out / "profile.folded").read_text()
    assert re.search(r"main;work_seventy \d+", folded), folded[:500]
    speedscope = json.loads((out / "profile.speedscope.json").read_text())
    assert speedscope["$schema"].startswith("https://www.speedscope.app/")


def test_pid_mode_with_duration(tmp_path, workloads):
    p = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        r = record("--pid", str(p.pid), "-d", "3", "-o", str(tmp_path / "o"))
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    assert shares(r.stdout).get("hot_spin", 0) > 80, r.stdout


def test_on_pressure_waits_for_psi_in_the_cgroup(tmp_path, workloads):
    with Cgroup.create() as cg:
        for _ in range(3):
            cg.spawn([str(workloads / "burner"), "40"])
        r = record(
            "--cgroup",
            cg.rel,
            "--on-pressure",
            "cpu:5",
            "--wait-timeout",
            "30",
            "-d",
            "3",
            "-o",
            str(tmp_path / "o"),
        )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Pressure: cpu" in r.stderr
    assert shares(r.stdout).get("hot_spin", 0) > 80, r.stdout


def test_bad_target_is_a_clear_error():
    r = record("--pid", "999999999", "-d", "1")
    assert r.returncode == 2 and "no process matches" in r.stderr
    r = record("-d", "1")
    assert r.returncode == 2 and "exactly one target" in r.stderr
    r = record("--comm", "x", "--on-pressure", "disk:5")
    assert r.returncode == 2 and "not a resource" in r.stderr

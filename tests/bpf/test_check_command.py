"""`bistouri check` on this machine, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bistouri.host import mounts

pytestmark = pytest.mark.bpf


def test_check_reports_this_machine_truthfully():
    import json

    out = subprocess.run(
        [sys.executable, "-m", "bistouri", "check", "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {r["name"]: r["status"] for r in json.loads(out.stdout)}
    human = subprocess.run(
        [sys.executable, "-m", "bistouri", "check"], capture_output=True, text=True, timeout=60
    )
    assert human.returncode == 0 and "WARN" in human.stdout
    assert lines["bpf object"] == "OK"
    assert lines["btf"] == "OK" and lines["psi"] == "OK" and lines["perf cpu-clock"] == "OK"
    status = Path("/proc/self/status").read_text().splitlines()
    caps = int(next(x for x in status if x.startswith("CapEff")).split()[1], 16)
    assert lines["cap CAP_SYS_RESOURCE"] == ("OK" if caps >> 24 & 1 else "WARN")
    tracefs = any(m.fstype == "tracefs" for m in mounts.read())
    assert lines["tracefs"] == ("OK" if tracefs else "WARN")


@pytest.mark.parametrize(
    "command", [["check", "--config-only", "--config"], ["check-config"]], ids=["check", "check-config"]
)
def test_check_config_reports_every_problem(tmp_path, command):
    bad = tmp_path / "trigger.yaml"
    bad.write_text(
        "targets:\n"
        "  - rule: {type: Exact, comm: this-comm-is-far-too-long}\n"
        "    service_id: Bad-Id\n"
        "    resources: [{resource: cpu, threshold: 150}]\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "bistouri", *command, str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "targets[0].rule.comm" in out.stdout
    assert "targets[0].service_id" in out.stdout
    assert "targets[0].resources[0].threshold" in out.stdout
    assert "cannot run" not in out.stderr  # a bad file is not a bad host

"""The compat programs (bistouri/bpf/features.py), for kernels 5.10-5.16, run with real BPF here:
BISTOURI_FORCE_DEGRADED takes this kernel's helpers as missing (for testing only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bistouri.bpf import features, loader
from bistouri.bpf.handles import BpfObject

pytestmark = [pytest.mark.bpf]

XZ = "/usr/bin/xz"


def _chosen(names: list[str], kernel: features.KernelFeatures) -> set[str]:
    return {features.program_for(n, kernel) for n in names if not features.is_compat(n)}


@pytest.mark.parametrize("old", [True, False], ids=["compat", "full"])
def test_the_verifier_accepts_the_programs_chosen_for_each_kernel(old):
    kernel = features.from_helpers(set()) if old else features.FULL
    with BpfObject(loader.default_object_path()) as obj:
        chosen = _chosen(list(obj.programs), kernel)
        assert any(features.is_compat(n) for n in chosen) == old
        for name, prog in obj.programs.items():
            prog.set_autoload(name in chosen)
        obj.load()
        assert all(obj.programs[n].fd > 0 for n in chosen)


def _folded(path: Path) -> list[tuple[list[str], int]]:
    rows = []
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        rows.append((stack.split(";"), int(n)))
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(XZ), reason="Debian's xz (frameless) is the measured target")
def test_record_with_the_fallbacks_forced_samples_and_says_what_they_cost(tmp_path):
    data = tmp_path / "in.bin"
    data.write_bytes(os.urandom(6 << 20))
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "bistouri", "record", "-o", str(out), "--format", "folded", "-F", "199"]
        + ["--", XZ, "-9", "-T1", "-k", "-f", str(data)],  # writes in.bin.xz
        capture_output=True,
        text=True,
        timeout=180,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            features.FORCE_ENV: "all",
        },
    )
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: no_")]
    assert [n.split(":")[1].strip() for n in notes] == list(features.DEGRADATIONS)
    assert "forced by " + features.FORCE_ENV in notes[0] and "frame pointers only" in notes[0]
    rows = _folded(out / "profile.folded")
    samples = sum(n for _, n in rows)
    assert samples > 50
    # The cost, as docs/agent.md states it: Debian's xz keeps no frame pointer, so the kernel's walk
    # stops at once (the full walk reaches its entry in >= 95 % of samples: tests/bpf/test_unwind.py).
    mean = sum(len(s) * n for s, n in rows) / samples
    assert mean < 4, mean

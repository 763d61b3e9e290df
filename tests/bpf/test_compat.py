"""The twins of the programs taking a stack (bistouri/bpf/features.py), *_bounded for kernels
5.12-5.16 and *_compat for 5.10-5.11, run with real BPF here: BISTOURI_FORCE_DEGRADED takes this
kernel's helpers as missing (for testing only)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bistouri.bpf import features, loader
from bistouri.bpf.handles import BpfObject

pytestmark = [pytest.mark.bpf]

XZ = "/usr/bin/xz"


def _chosen(names: list[str], kernel: features.KernelFeatures) -> set[str]:
    return {features.program_for(n, kernel) for n in names if not features.is_twin(n)}


KERNELS = {
    "5.10": features.from_helpers(set()),
    "5.14": features.from_helpers({"check_mtu"}),
    "5.15": features.from_helpers({"check_mtu", "task_pt_regs"}),
    "6.18": features.FULL,
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_verifier_accepts_the_programs_chosen_for_each_kernel(kernel):
    """On this kernel's verifier: an older one's is for the VM scenarios to try (docs/agent.md)."""
    features_ = KERNELS[kernel]
    with BpfObject(loader.default_object_path()) as obj:
        chosen = _chosen(list(obj.programs), features_)
        assert all(n.endswith(features_.suffix) for n in chosen if features.is_twin(n))
        assert any(features.is_twin(n) for n in chosen) == features_.compat
        for name, prog in obj.programs.items():
            prog.set_autoload(name in chosen)
        obj.load()
        assert all(obj.programs[n].fd > 0 for n in chosen)


# Helpers of kernels after 5.11, which neither twin may call (the full programs do).
NEWER_HELPERS = {"bpf_loop", "bpf_task_pt_regs", "bpf_get_current_task_btf"}


@pytest.mark.skipif(shutil.which("bpftool") is None, reason="bpftool lists the helpers called")
@pytest.mark.parametrize("kernel", ["5.10", "5.14"])
def test_the_twins_call_only_what_their_kernels_have(kernel):
    """As the kernel translated them: each helper call, and `call pc+N` for a BPF function, which
    5.10 and 5.11 cannot take pointers in (the compat twins have none)."""
    features_ = KERNELS[kernel]
    calls: set[str] = set()
    with BpfObject(loader.default_object_path()) as obj:
        chosen = _chosen(list(obj.programs), features_)
        for name, prog in obj.programs.items():
            prog.set_autoload(name in chosen)
        obj.load()
        for name in chosen:
            info = Path(f"/proc/self/fdinfo/{obj.programs[name].fd}").read_text()
            prog_id = re.search(r"prog_id:\s*(\d+)", info)
            assert prog_id, info
            out = subprocess.run(
                ["bpftool", "prog", "dump", "xlated", "id", prog_id.group(1)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            calls |= set(re.findall(r"call (\w+)", out))
    assert "bpf_ringbuf_output" in calls and not calls & NEWER_HELPERS, sorted(calls)
    assert ("pc" in calls) == (features_.suffix == features.BOUNDED_SUFFIX)


def _folded(path: Path) -> list[tuple[list[str], int]]:
    rows = []
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        rows.append((stack.split(";"), int(n)))
    return rows


def _record(tmp_path: Path, forced: str, *command: str) -> tuple[str, list[tuple[list[str], int]]]:
    out = tmp_path / f"out-{forced}"
    r = subprocess.run(
        [sys.executable, "-m", "bistouri", "record", "-o", str(out), "--format", "folded", "-F", "199"]
        + ["--", *command],
        capture_output=True,
        text=True,
        timeout=180,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            features.FORCE_ENV: forced,
        },
    )
    assert r.returncode == 0, r.stderr
    return r.stdout, _folded(out / "profile.folded")


def _notes(stdout: str) -> list[str]:
    return [line.split(":")[1].strip() for line in stdout.splitlines() if line.startswith("note: no_")]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(XZ), reason="Debian's xz (frameless) is the measured target")
def test_xz_with_the_fallbacks_forced(tmp_path):
    """The bounded walk reaches xz's entry as the full one does; the frame-pointer one cannot (the
    cost docs/agent.md states)."""
    data = tmp_path / "in.bin"
    data.write_bytes(os.urandom(6 << 20))
    command = (XZ, "-9", "-T1", "-k", "-f", str(data))  # writes in.bin.xz
    stdout, rows = _record(tmp_path, "no_bpf_loop", *command)
    assert _notes(stdout) == ["no_bpf_loop"] and "forced by " + features.FORCE_ENV in stdout
    samples = sum(n for _, n in rows)
    # xz's entry (_start, unnamed: its binary is stripped) is the root of its whole stacks.
    roots: dict[str, int] = {}
    for s, n in rows:
        roots[s[0]] = roots.get(s[0], 0) + n
    root, entry = max(roots.items(), key=lambda kv: kv[1])
    assert samples > 50 and root.startswith("xz+") and entry / samples >= 0.95, (root, entry, samples)

    stdout, rows = _record(tmp_path, "all", *command)
    assert _notes(stdout) == list(features.DEGRADATIONS)
    samples = sum(n for _, n in rows)
    assert samples > 50
    assert sum(len(s) * n for s, n in rows) / samples < 4  # xz keeps no frame pointer


@pytest.mark.slow
def test_a_python311_target_is_named_by_the_bounded_walk(tmp_path):
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip("no python3.11")
    script = tmp_path / "hot.py"
    script.write_text(HOT)
    _, rows = _record(tmp_path, "no_bpf_loop", python, str(script))
    samples = sum(n for _, n in rows)
    hot = sum(n for s, n in rows if any(f.startswith("hot") for f in s))
    assert samples > 50 and hot / samples >= 0.85, (hot, samples)


HOT = """
import time


def hot(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


def outer(k):
    return hot(10000) if k == 0 else outer(k - 1)


# By CPU time, not wall time: on a loaded host the loop still gets its ~400 samples at 199 Hz,
# and the interpreter's start (not `hot`) stays a few per cent of them.
end = time.process_time() + 2
while time.process_time() < end:
    outer(10)
"""

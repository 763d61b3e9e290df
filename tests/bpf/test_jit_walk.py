"""Java stacks walked through JIT code without -XX:+PreserveFramePointer (unwind/hotspot.py): the
compiled methods of the perf map the profiler asks for get unwind rows from their prologues, so a
sample in a C2 method that uses rbp as a register still walks up through its compiled callers, the
interpreter and the JVM to the thread's entry. Nobody runs jcmd.

Before these rows, 0.7 % (OpenJDK 17) and 0.9 % (Temurin 25) of these samples reached the thread's
entry; with -XX:+PreserveFramePointer 100 % (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bistouri.bpf import abi
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.compat import zip_strict
from bistouri.host import jvm
from bistouri.unwind.tables import UnwindTables
from testkit.helpers import wait_until
from tests.bpf.test_jit_names import JDKS, _hot_jvm, _jdk
from tests.integration.test_record import record

pytestmark = pytest.mark.bpf

# Each method its own frame: C2 would inline mix into middle, and middle into outer.
DONTINLINE = "-XX:CompileCommand=dontinline,Callers::*"
ENTRY = ("start_thread", "clone3", "__clone3", "thread_native_entry")


def _shares(folded: Path) -> tuple[int, float, float]:
    """Samples; the share ending in outer -> middle -> mix; the share reaching the thread's entry."""
    total = chain = whole = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        total += int(n)
        tail = frames[-3:]
        if len(tail) == 3 and all(
            f"Callers.{m}(" in f for f, m in zip_strict(tail, ("outer", "middle", "mix"))
        ):
            chain += int(n)
        if any(f.startswith(ENTRY) for f in frames):
            whole += int(n)
    return total, chain / max(total, 1), whole / max(total, 1)


@pytest.mark.parametrize("jdk", sorted(JDKS))
def test_record_walks_java_callers_through_jit_code_without_frame_pointers(tmp_path: Path, jdk: str):
    with _hot_jvm(_jdk(jdk), tmp_path, DONTINLINE, program="Callers", method="outer") as proc:
        out = tmp_path / "o"
        r = record("--pid", str(proc.pid), "-d", "4", "-F", "199", "-o", str(out), "--format", "folded")
        assert proc.poll() is None
    assert r.returncode == 0, r.stdout + r.stderr
    total, chain, whole = _shares(out / "profile.folded")
    # Measured 97 % each; samples taken before the perf map and its rows are in stop at the leaf.
    assert total >= 100 and chain >= 0.85 and whole >= 0.85, (total, chain, whole, r.stdout[-2000:])
    assert "PreserveFramePointer" not in r.stdout  # stacks whole: no note asks for the flag


def test_with_frame_pointers_the_walk_is_the_same(tmp_path: Path):
    """-XX:+PreserveFramePointer: prologues that keep rbp get no rows, the frame pointer walks them."""
    flags = (DONTINLINE, "-XX:+PreserveFramePointer")
    with _hot_jvm(_jdk("openjdk17"), tmp_path, *flags, program="Callers", method="outer") as proc:
        out = tmp_path / "o"
        r = record("--pid", str(proc.pid), "-d", "3", "-F", "199", "-o", str(out), "--format", "folded")
    assert r.returncode == 0, r.stdout + r.stderr
    total, chain, whole = _shares(out / "profile.folded")
    assert total >= 100 and chain >= 0.9 and whole >= 0.9, (total, chain, whole)


def test_each_perf_map_replaces_the_jvm_code_tables(tmp_path: Path):
    """The rows of a JVM's code cache follow its perf map: built when the profiler's request is
    answered, kept while the map says the same, built again when it changes, the older rows freed
    (not piled up in unwind_rows)."""
    with (
        _hot_jvm(_jdk("openjdk17"), tmp_path, DONTINLINE, program="Callers", method="outer") as proc,
        Profiler(ProfilerOptions(freq_hz=99, offcpu=False, exec_discovery=False)) as agent,
    ):
        agent.start()
        agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
        unwind = agent.unwind
        assert isinstance(unwind, UnwindTables)
        stats = unwind.stats
        assert wait_until(lambda: stats.jit_tables >= 1 and unwind.wait_idle(0), 60.0), stats
        assert stats.jit_framed >= 500, stats  # most of its ~1 000 compiled methods
        assert agent.jvm.attempt(proc.pid) == jvm.OK  # as at a session's start
        assert unwind.wait_idle(30.0)
        built, rows, keys = stats.jit_tables, stats.loaded_rows, set(unwind._jit_keys[proc.pid])
        # A map that no longer lists its last method (code freed): that mapping's table is replaced.
        read = unwind.jit_code
        assert read is not None
        unwind.jit_code = lambda pid: read(pid)[:-1]
        unwind.want(proc.pid)
        assert unwind.wait_idle(30.0)
        now = unwind._jit_keys[proc.pid]
        assert stats.jit_tables == built + 1 and len(now - keys) == 1, (built, stats)
        assert not any(k in unwind._loaded for k in keys - now)  # the old table's rows are free
        assert abs(stats.loaded_rows - rows) < 64, (rows, stats)
        agent.check_thread()

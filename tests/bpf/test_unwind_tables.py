"""Unwind tables in the real BPF maps: the disk cache per build id, and eviction within the row bound."""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bistouri.bpf import abi
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.unwind.tables import _PROC
from testkit.helpers import build_id, wait_until

pytestmark = pytest.mark.bpf


@contextmanager
def _spinning(argv: list[str]) -> Iterator[int]:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        # Its libraries are mapped once its maps name libc.
        assert wait_until(lambda: "libc.so" in Path(f"/proc/{proc.pid}/maps").read_text(), 10)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _opts(**kw: object) -> ProfilerOptions:
    return ProfilerOptions(
        freq_hz=19, offcpu=False, exec_discovery=False, unwind_cpu_share=1.0, unwind_nice=0, **kw
    )  # type: ignore[arg-type]


XZ = ["xz", "-9e", "-T1", "-c", "/dev/zero"]
PY = ["/usr/bin/python3.11", "-c", "while True: pass"]


def test_tables_are_cached_on_disk_per_build_id_and_read_back(tmp_path: Path) -> None:
    cache = tmp_path / "unwind"
    with _spinning(XZ) as pid:
        with Profiler(_opts(unwind_cache_dir=str(cache))) as agent:
            agent.start()
            agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
            assert agent.unwind is not None and agent.unwind.wait_idle(120)
            first = agent.unwind.stats
            assert first.built >= 3 and first.cache_hits == 0 and first.procs == 1
        names = {p.name for p in cache.iterdir()}
        assert f"{build_id(Path('/usr/bin/xz'))}.unw" in names
        assert f"{build_id(Path('/lib/x86_64-linux-gnu/liblzma.so.5'))}.unw" in names
        with Profiler(_opts(unwind_cache_dir=str(cache))) as agent:
            agent.start()
            agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
            assert agent.unwind is not None and agent.unwind.wait_idle(120)
            again = agent.unwind.stats
    assert again.built == 0 and again.cache_hits == first.built
    assert again.loaded_rows == first.loaded_rows


def test_a_process_past_the_row_bound_evicts_another_processs_files_and_unpublishes_them() -> None:
    """...and each change of the tables (a publication, an eviction, a process forgotten) bumps the
    generation that retires the rules BPF cached from them."""

    def published(agent: Profiler, pid: int) -> int:
        raw = agent._require().maps["unwind_procs"].lookup(struct.pack("<I", pid))
        assert raw is not None
        return int(_PROC.unpack(raw)[1])

    def generation(agent: Profiler) -> int:
        raw = agent._require().maps["unwind_generation"].lookup(struct.pack("<I", 0))
        assert raw is not None
        return int(struct.unpack("<Q", raw)[0])

    # xz, liblzma, libc and ld fit (~35 k rows); python3.11 (~70 k) needs xz's own files' room.
    with _spinning(XZ) as xz, _spinning(PY) as py, Profiler(_opts(unwind_rows=100_000)) as agent:
        agent.start()
        initial = generation(agent)
        agent.set_pid_filter(xz, abi.FilterFlags.ON_CPU)
        assert agent.unwind is not None and agent.unwind.wait_idle(120)
        xz_files = published(agent, xz)
        assert xz_files >= 4 and agent.unwind.stats.evicted == 0
        xz_published = generation(agent)
        assert xz_published > initial
        agent.set_pid_filter(py, abi.FilterFlags.ON_CPU)
        assert agent.unwind.wait_idle(120)
        # Python's rows loaded, xz's evicted file unpublished, python's mappings: three changes at least.
        assert generation(agent) >= xz_published + 3
        stats = agent.unwind.stats
        assert stats.evicted >= 1
        assert stats.loaded_rows <= 100_000
        assert published(agent, py) >= 3  # python3.11, libc, ld at least
        # The evicted files are no longer in xz's mappings: its frames there use frame pointers.
        assert published(agent, xz) < xz_files
        before_forget = generation(agent)
        agent.unwind.forget(xz)
        assert agent.unwind.wait_idle(120)
        assert generation(agent) == before_forget + 1


def test_a_watched_process_is_prepared_once_not_at_every_walk(tmp_path: Path) -> None:
    """The agent prepares (to the disk cache) the tables of the processes each 30 s walk finds:
    a process already prepared costs nothing at the next walk (reading the maps of every watched
    process each time was the largest idle cost)."""
    cache = tmp_path / "unwind"
    with _spinning(XZ) as pid, Profiler(_opts(unwind_cache_dir=str(cache))) as agent:
        agent.start()
        assert agent.unwind is not None
        starttime = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        for _walk in range(3):
            agent.unwind.prepare([(pid, starttime)])
            assert agent.unwind.wait_idle(120)
        assert agent.unwind.stats.prepared == 1 and agent.unwind.stats.built >= 3
        assert (cache / f"{build_id(Path('/usr/bin/xz'))}.unw").exists()
        agent.unwind.prepare([(pid, starttime + 1)])  # another process under the same pid
        assert agent.unwind.wait_idle(120)
        assert agent.unwind.stats.prepared == 2


def test_rows_are_written_through_a_mapping_of_the_array_entry_for_entry() -> None:
    """unwind_rows is mmapable: Map.update_array copies into it (12-byte rows at the kernel's
    16-byte stride, a window at a time), and each row reads back as written, its neighbours
    untouched."""
    from bistouri.unwind.ehframe import ROW

    with Profiler(_opts()) as agent:
        rows = agent._require().maps["unwind_rows"]
        n = (3 << 20) // 16 + 5  # past three 1 MiB windows
        values = b"".join(ROW.pack(i, -i, i % 7, i % 5, i % 3) for i in range(n))
        rows.update_array(1, ROW.pack(1, 2, 3, 4, 5) * 2, ROW.size)
        rows.update_array(3, values, ROW.size)  # not at a page boundary
        for i in [*range(0, n, 4099), n - 1]:
            assert rows.lookup(struct.pack("<I", 3 + i)) == values[i * ROW.size : (i + 1) * ROW.size]
        assert rows.lookup(struct.pack("<I", 2)) == ROW.pack(1, 2, 3, 4, 5)
        assert rows.lookup(struct.pack("<I", 3 + n)) == bytes(ROW.size)


def test_each_table_is_published_as_soon_as_it_is_loaded_libc_and_the_executable_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large binary's table takes seconds to build: the process's mappings are published
    after each new table, not once all are in; libc's and the executable's come first."""
    from bistouri.unwind.tables import UnwindTables

    published: list[tuple[list[bytes], bool]] = []
    write_proc = UnwindTables._write_proc

    def spy(self, pid, entries, source):  # type: ignore[no-untyped-def]
        published.append(([e[-1] for e in entries], source is not None))
        write_proc(self, pid, entries, source)

    monkeypatch.setattr(UnwindTables, "_write_proc", spy)
    with _spinning(PY) as pid, Profiler(_opts()) as agent:
        agent.start()
        agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        assert agent.unwind is not None and agent.unwind.wait_idle(120)
        files = agent.unwind.stats.built
    assert files >= 3
    *partial, (final, whole) = published
    assert whole and not any(done for _, done in partial)
    assert [len(keys) for keys, _ in partial] == list(range(1, files + 1))
    libc = build_id(Path("/lib/x86_64-linux-gnu/libc.so.6"))
    assert {k.hex() for k in partial[1][0]} == {libc, build_id(Path(PY[0]))}
    assert set(final) == set(partial[-1][0])


def test_a_frame_pointer_files_callers_are_walked_without_a_search_to_the_entry(workloads: Path) -> None:
    """The burner (frame pointers) is published marked (BISTOURI_MAPPING_FP_CALLERS: its callers
    walked by frame pointer, no row search), Debian's libc not; its walks still reach the entry:
    main's return address into libc is searched, and _start's, whose RBP is 0, too (its END row)."""
    from bistouri.capture.events import StackSample
    from bistouri.unwind.tables import _FP_CALLERS, _MAPPING

    burner = str(workloads / "burner")
    opts = ProfilerOptions(
        freq_hz=199, offcpu=False, exec_discovery=False, unwind_cpu_share=1.0, unwind_nice=0
    )
    with _spinning([burner]) as pid, Profiler(opts) as agent:
        agent.start()
        agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        assert agent.unwind is not None and agent.unwind.wait_idle(120)
        maps = agent._require().maps
        proc = maps["unwind_procs"].lookup(struct.pack("<I", pid))
        assert proc is not None
        slot, count, _flags = _PROC.unpack(proc)
        marked = {}
        for i in range(count):
            start, _end, *_, shift = _MAPPING.unpack(
                maps["unwind_mappings"].lookup(struct.pack("<I", slot * abi.UNWIND_MAPPINGS + i))
            )
            marked[start] = bool(shift & _FP_CALLERS)
        files = {}
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            f = line.split()
            if "x" in f[1] and len(f) > 5:
                files[int(f[0].split("-")[0], 16)] = os.path.basename(f[5])
        assert {files[s]: m for s, m in marked.items() if files.get(s) in ("burner", "libc.so.6")} == {
            "burner": True,
            "libc.so.6": False,
        }, (marked, files)
        got: list[StackSample] = []

        def enough() -> bool:
            got.extend(e for e in agent.take(timeout=0.2) if isinstance(e, StackSample) and e.pid == pid)
            return len(got) >= 100

        assert wait_until(enough, 60)
    ends = [abi.WALK_ENDS.get(s.walk[2]) for s in got]
    assert ends.count("entry") >= 0.9 * len(got), ends


def test_a_process_without_a_python_record_is_marked_so_and_a_python_one_is_walked() -> None:
    """xz's unwind_procs entry says it has no python_procs record (BISTOURI_UNWIND_PROC_NO_PYTHON:
    its samples skip the Python walk's lookup); python3.11's does not, and its samples carry Python
    frames. A record written after the tables (an interpreter described again) clears the flag first."""
    from bistouri.capture.events import StackSample
    from bistouri.unwind.tables import _NO_PYTHON

    opts = ProfilerOptions(
        freq_hz=199, offcpu=False, exec_discovery=False, unwind_cpu_share=1.0, unwind_nice=0
    )
    with _spinning(XZ) as xz, _spinning(PY) as py, Profiler(opts) as agent:
        agent.start()
        for pid in (xz, py):
            agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        assert agent.unwind is not None and agent.unwind.wait_idle(120)
        procs = agent._require().maps["unwind_procs"]

        def flags(pid: int) -> int:
            raw = procs.lookup(struct.pack("<I", pid))
            assert raw is not None
            return _PROC.unpack(raw)[2]

        assert (flags(xz), flags(py)) == (_NO_PYTHON, 0)
        got: list[StackSample] = []

        def enough() -> bool:
            got.extend(e for e in agent.take(timeout=0.2) if isinstance(e, StackSample))
            return sum(s.pid == py for s in got) >= 20 and sum(s.pid == xz for s in got) >= 20

        assert wait_until(enough, 60)
        assert all(not s.python for s in got if s.pid == xz)
        assert sum(bool(s.python) for s in got if s.pid == py) >= 0.9 * sum(s.pid == py for s in got)
        agent.unwind.python_record(xz, True)  # as the profiler does before a record goes in
        assert flags(xz) == 0

"""bistouri/cpython without another process: line tables, the checksum, the BPF record's bounds, and this
very interpreter (the venv's CPython) described and named from its own memory.

The other interpreters of the host, as children: tests/integration/test_cpython.py. In BPF:
tests/bpf/test_python_frames.py.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types

import pytest

from bistouri.bpf import abi
from bistouri.cpython import discover, processes
from bistouri.cpython.layouts import LAYOUTS, checksum
from bistouri.cpython.linetable import LineTable, TableKind, kind_for
from bistouri.cpython.memory import MAX_READ, MemoryReadError, ProcessMemory
from bistouri.cpython.naming import FREED, UNKNOWN, CodeNamer
from bistouri.cpython.processes import PythonProcesses
from bistouri.cpython.splice import PyFrame, decode, splice

# ---- line tables, as CPython's codeobject.c reads them


def test_lnotab_adds_every_increment_up_to_the_offset():
    # 3.8: (+6 bytes, +1 line), (+0, +2): both at 6; (+10, -1 as 0xff) at 16.
    t = LineTable(TableKind.LNOTAB, bytes([6, 1, 0, 2, 10, 0xFF]), 10)
    assert [t.line(u) for u in (0, 2, 3, 7, 8, 100)] == [10, 10, 13, 13, 12, 12]
    assert t.line(None) == t.line(-1) == 10  # before the first instruction: the first line


def test_the_310_table_has_lineless_ranges_and_zero_lengths():
    # [0,4) +1 -> 11; zero-length +5 (running line 16, no range); [4,8) no line (-128); [8,10) +1 -> 17.
    t = LineTable(TableKind.LINETABLE_310, bytes([4, 1, 0, 5, 4, 0x80, 2, 1]), 10)
    assert [t.line(u) for u in (0, 1, 2, 3, 4, 5)] == [11, 11, None, None, 17, None]


def test_the_location_table_keeps_the_running_line_across_a_lineless_entry():
    # code 13 (no columns) +3 for 1 unit; code 15 (no line) 2 units; code 11 (+1) 1 unit; code 14 (long)
    # -2 for 1 unit, with its three varints; code 5 (short form, same line) 1 unit.
    table = bytes([0x80 | 13 << 3, 3 << 1])  # line += 3 (svarint 6)
    table += bytes([0x80 | 15 << 3 | 1])
    table += bytes([0x80 | 11 << 3, 0, 4])  # line += 1, then its two column bytes
    table += bytes([0x80 | 14 << 3, 2 << 1 | 1, 0, 1, 2])  # line -= 2 (svarint 5), then three varints
    table += bytes([0x80 | 5 << 3, 7])
    t = LineTable(TableKind.LOCATIONS, table, 100)
    assert [t.line(u) for u in range(7)] == [103, None, None, 104, 102, 102, None]


def test_a_truncated_or_garbage_table_never_raises():
    for kind in TableKind:
        for table in (b"", b"\x80", b"\xff" * 7, bytes(range(256)), b"\xf0\x7f\x7f\x7f"):
            LineTable(kind, table, 1).line(3)


def test_the_decoders_give_this_interpreters_own_lines_for_its_stdlib():
    addr2line = ctypes.pythonapi.PyCode_Addr2Line
    addr2line.argtypes = [ctypes.py_object, ctypes.c_int]
    addr2line.restype = ctypes.c_int

    def codes(co: types.CodeType):
        yield co
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                yield from codes(c)

    kind = kind_for(sys.version_info[:2])
    wrong = total = 0
    for mod in ("json/decoder.py", "argparse.py", "ast.py"):
        path = os.path.join(os.path.dirname(os.__file__), mod)
        with open(path, encoding="utf-8") as f:
            top = compile(f.read(), path, "exec")
        for co in codes(top):
            table = co.co_linetable if kind != TableKind.LNOTAB else co.co_lnotab
            t = LineTable(kind, table, co.co_firstlineno)
            for u in range(-1, len(co.co_code) // 2 + 1):
                want = addr2line(co, u * 2)
                total += 1
                wrong += t.line(u) != (None if want == -1 else want)
    assert total > 10_000 and wrong == 0


# ---- the checksum and the BPF record


def test_the_checksum_is_the_one_bpf_computes():
    # tests/bpf/test_python_frames.py checks that BPF's py_checksum agrees on real code objects; this
    # pins the formula, so a change of it is a change of both sides.
    fields = (0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3000, 42, 0x1234_5678_9ABC_DEF0)
    assert checksum(*fields) == 0x8C30_4056
    assert checksum(0, 0, 0, 0, 0) == 1  # never 0: 0 says "not read"


@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_every_layouts_record_fits_the_walks_reads(version):
    interp = discover.Interpreter(
        pid=1,
        version=(*version, 0),
        layout=LAYOUTS[version],
        path="",
        build_id=b"",
        bias=0,
        runtime=0,
        tss_key=0,
        tstate_slot=0x318,
        eval_ranges=(),
        code_type=0,
        str_type=0,
        bytes_type=0,
    )
    rec = discover.record(interp)
    lay = LAYOUTS[version]
    assert 8 <= rec.frame_size <= 128 and rec.code_window_size <= 128
    for field in ("frame_previous", "frame_code", "frame_instr"):
        assert getattr(rec, field) + 8 <= rec.frame_size
    assert rec.frame_entry < rec.frame_size
    for field in ("code_firstlineno", "code_filename", "code_name", "code_linetable"):
        assert getattr(rec, field) + (4 if field == "code_firstlineno" else 8) <= rec.code_window_size
    assert rec.code_window + rec.code_filename == lay.code_filename
    assert rec.entry_kind == lay.entry_kind and rec.instr_kind == lay.instr_kind


# ---- this interpreter, from its own memory


@pytest.fixture(scope="module")
def me() -> discover.Interpreter:
    interp = discover.describe(os.getpid())
    if isinstance(interp, discover.Unsupported):
        pytest.skip(f"this interpreter is not one bistouri walks: {interp}")
    return interp


def _sample():
    return 1


def _name(co: types.CodeType) -> str:
    """What bistouri names a code object: its qualified name from 3.11 (co_qualname), before it its name."""
    return co.co_qualname if sys.version_info >= (3, 11) else co.co_name


def test_this_interpreter_is_described(me):
    # Before 3.11 the version may come from the library's name alone, without the micro (0).
    want = sys.version_info[:3]
    assert me.version == want or (sys.version_info < (3, 11) and me.version == (*want[:2], 0))
    assert me.tstate_slot > 0 and me.eval_ranges and me.code_type and me.str_type


def test_a_function_is_named_from_memory(me):
    with CodeNamer(me) as namer:
        co = _sample.__code__
        named = namer.name(id(co), namer.checksum(id(co)))
        want = (_name(co), co.co_filename, co.co_firstlineno)
        assert (named.name, named.filename, named.firstlineno) == want
        assert namer.name(id(named), 0) is UNKNOWN  # not a code object (its type is not PyCode_Type)


def test_a_freed_and_reused_address_is_never_named_after_the_new_code(me):
    """Functions created and dropped in a loop: CPython's allocator gives a freed code object's address to
    the next one. A sample of the old one (its checksum) is named after it while the namer keeps it, else
    FREED; never after the new one."""
    reused = 0
    seen: dict[int, tuple[str, int]] = {}
    with CodeNamer(me) as namer:
        for i in range(3000):
            co = compile(f"def f_{i}():\n    return {i}\n", f"<gen {i}>", "exec").co_consts[0]
            addr, have = id(co), namer.checksum(id(co))
            assert namer.name(addr, have).name == f"f_{i}"
            if addr in seen:
                old_name, old_sum = seen[addr]
                assert old_sum != have
                assert namer.name(addr, old_sum).name == old_name  # kept from when it lived
                with CodeNamer(me) as fresh:
                    assert fresh.name(addr, old_sum) is FREED
                reused += 1
            seen[addr] = (f"f_{i}", have)
            del co
    assert reused > 100


def test_reads_are_bounded_and_objects_checked(me):
    with ProcessMemory(os.getpid()) as mem:
        with pytest.raises(MemoryReadError):
            mem.read(id(me), MAX_READ + 1)
        with pytest.raises(MemoryReadError):
            mem.read(0, 8)
        with pytest.raises(MemoryReadError):
            mem.read(1 << 47, 8)
        # A bytes object that claims more than the bound, and a str that is not one.
        big = b"x" * 100
        with pytest.raises(MemoryReadError):
            mem.bytes_object(id(big), max_size=99)
        assert mem.bytes_object(id(big), max_size=100, type_addr=me.bytes_type) == big
        with pytest.raises(MemoryReadError):
            mem.str_object(id(big), ascii_data=48, data=72, type_addr=me.str_type)
        name = "nöm"
        lay = me.layout
        assert mem.str_object(id(name), ascii_data=lay.str_ascii_data, data=lay.str_data) == name


def test_a_process_without_python_says_why(tmp_path):
    assert discover.describe(1 << 30).reason == "unreadable"  # type: ignore[union-attr]
    proc = tmp_path / "42"
    proc.mkdir()
    (proc / "maps").write_bytes(b"00400000-00401000 r-xp 00000000 08:01 1234 /usr/bin/true\n")
    (proc / "exe").symlink_to("/usr/bin/true")
    found = discover.describe(42, proc_root=str(tmp_path))
    assert isinstance(found, discover.Unsupported) and found.reason in discover.REASONS


def test_the_record_is_the_abis():
    assert ctypes.sizeof(abi.PythonProc) == 64 and ctypes.sizeof(abi.PyFrame) == 16


# ---- mixed stacks


def _py(name: str, entry: bool) -> PyFrame:
    return PyFrame(hash(name) & 0xFFFF_FFF0, 0, 1, entry)


def test_each_eval_frame_is_replaced_by_the_python_frames_of_its_activation():
    # 3.11+: key* (its own activation: sorted() called it), then driver <- main <- <module>* (one
    # activation, calls inlined); libc called by key, sorted by driver.
    key, driver, main, module = _py("k", True), _py("d", False), _py("m", False), _py("M", True)
    native = ["libc", "EVAL", "sorted", "EVAL", "PyRun", "main"]
    out = splice(native, [key, driver, main, module], lambda f: f == "EVAL")
    assert out.frames == ["libc", key, "sorted", driver, main, module, "PyRun", "main"]
    assert out.leftover == 0


def test_python_frames_no_eval_frame_took_go_at_the_root_end():
    a, b = _py("a", True), _py("b", True)
    out = splice(["libc", "EVAL"], [a, b], lambda f: f == "EVAL")
    assert out.frames == ["libc", a, b] and out.leftover == 1
    # No Python frames (a thread without a thread state): the native stack as it was.
    assert splice(["EVAL", "x"], [], lambda f: f == "EVAL").frames == ["EVAL", "x"]


def test_raw_frames_decode_with_their_entry_bit_and_unknown_offset():
    raw = abi.PY_FRAME.pack(0x1000 | abi.PY_FRAME_ENTRY, abi.PY_NO_OFFSET, 7)
    raw += abi.PY_FRAME.pack(0x2000, 3, 9)
    assert decode(raw + b"\0" * 5) == [PyFrame(0x1000, None, 7, True), PyFrame(0x2000, 3, 9, False)]


def test_313s_own_debug_offsets_must_agree_with_the_layout():
    lay = LAYOUTS[(3, 13)]
    offsets = [0] * 41
    for i, field in discover._DEBUG_FIELDS_313.items():
        offsets[i] = getattr(lay, field)

    def head(cookie: bytes = b"xdebugpy", free_threaded: int = 0) -> bytes:
        return discover._DEBUG_313.pack(cookie, 0x030D00F0, free_threaded, *offsets)

    assert discover._check_debug_offsets(head(), lay) is None
    assert discover._check_debug_offsets(head(free_threaded=1), lay) == discover.Unsupported(
        "free_threaded", "a free-threaded build"
    )
    assert discover._check_debug_offsets(head(b"xxxxxxxx"), lay).reason == "layout_mismatch"  # type: ignore[union-attr]
    offsets[20] += 8  # tstate -> current_frame moved
    found = discover._check_debug_offsets(head(), lay)
    assert found is not None and found.reason == "layout_mismatch" and "tstate_frame" in found.detail


# ---- the capture's registry


def test_the_registry_describes_once_names_frames_and_counts_refusals(me):
    co = _sample.__code__
    with CodeNamer(me) as namer:
        have = namer.checksum(id(co))
    raw = abi.PY_FRAME.pack(id(co) | abi.PY_FRAME_ENTRY, 1, have) + abi.PY_FRAME.pack(id(co), 1, have ^ 1)
    procs = PythonProcesses()
    try:
        assert procs.add(os.getpid()) == me
        assert procs.add(os.getpid()) is procs.interpreter(os.getpid())  # described once
        first, freed = procs.name(os.getpid(), raw)
        assert (first.name, first.filename) == (_name(co), co.co_filename)
        assert first.line == co.co_firstlineno + 1  # `return 1`, one line under the def
        assert (freed.name, freed.line) == ("<freed code>", 0)
        with subprocess.Popen(["sleep", "30"]) as child:
            try:
                assert procs.add(child.pid).reason == "not_python"  # type: ignore[union-attr]
            finally:
                child.kill()
        assert procs.stats.walked == 1 and procs.stats.not_walked == dict.fromkeys(discover.REASONS, 0) | {
            "not_python": 1
        }
        procs.remove(os.getpid())
        assert procs.name(os.getpid(), raw) == ()
    finally:
        procs.close()


def test_each_sample_gets_its_named_frames_and_its_note(me, monkeypatch):
    """stack(): the frames named with their entry bit and the eval loop to splice them at; without frames,
    why (the walk's end); a refused process's reason; a process that is not CPython: nothing. A process
    described before is not described again while it is the same program."""
    co = _sample.__code__
    with CodeNamer(me) as namer:
        have = namer.checksum(id(co))
    raw = abi.PY_FRAME.pack(id(co) | abi.PY_FRAME_ENTRY, 1, have)
    described: list[int] = []
    refuse: dict[int, discover.Unsupported] = {}

    def describe(pid: int, proc_root: str = "/proc") -> discover.Interpreter | discover.Unsupported:
        described.append(pid)
        return refuse.get(pid) or discover.describe(pid, proc_root)

    monkeypatch.setattr(processes, "describe", describe)
    procs = PythonProcesses()
    try:
        me_pid = os.getpid()
        assert procs.stack(me_pid, b"", abi.PyStatus.NOT_PYTHON) is processes.NO_PYTHON  # not added
        procs.add(me_pid)
        got = procs.stack(me_pid, raw, abi.PyStatus.DONE)
        assert got.note == processes.NAMED and got.frames[0].entry and got.frames[0].name == _name(co)
        assert got.eval_loop is not None and got.eval_loop.ranges == me.eval_ranges
        assert got.eval_loop.holds(me.build_id, "", me.eval_ranges[0][0])
        assert procs.stack(me_pid, b"", abi.PyStatus.NO_THREAD).note == "no_thread_state"
        assert procs.stack(me_pid, b"", abi.PyStatus.DONE).note == "no_frame"
        with subprocess.Popen(["sleep", "30"]) as child, subprocess.Popen(["sleep", "30"]) as odd:
            try:
                assert procs.add(child.pid).reason == "not_python"  # type: ignore[union-attr]
                assert procs.add(child.pid).reason == "not_python"  # type: ignore[union-attr]
                assert procs.stack(child.pid, b"", abi.PyStatus.NOT_PYTHON) is processes.NO_PYTHON
                refuse[odd.pid] = discover.Unsupported("version_unknown", "3.99")
                procs.add(odd.pid)
                assert procs.stack(odd.pid, b"", abi.PyStatus.NOT_PYTHON).note == "version_unknown"
            finally:
                child.kill()
                odd.kill()
        assert described == [me_pid, child.pid, odd.pid]  # each described once
        procs.remove(me_pid)
        assert procs.stack(me_pid, raw, abi.PyStatus.DONE).note == processes.UNNAMED
        assert set(processes.NOTES) >= {"named", "no_thread_state", "version_unknown", "unnamed"}
    finally:
        procs.close()


def test_perf_trampolines_are_left_out_when_the_python_frames_are_there():
    a, b = _py("a", True), _py("b", True)
    native = ["EVAL", "py::a", "EVAL", "py::b", "main"]
    out = splice(native, [a, b], lambda f: f == "EVAL", lambda f: f.startswith("py::"))
    assert out.frames == [a, b, "main"]
    assert splice(native, [], lambda f: f == "EVAL", lambda f: f.startswith("py::")).frames == native


def test_a_prefix_read_stops_at_the_first_unmapped_page():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = 4096
    base = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(base + page - 100, 0x5A, 100)
    assert libc.munmap(base + page, page) == 0
    try:
        with ProcessMemory(os.getpid()) as mem:
            assert mem.read_prefix(base + page - 100, 300) == b"\x5a" * 100
            assert mem.read_prefix(base + page, 8) == b""
    finally:
        libc.munmap(base, page)


def test_a_process_refused_while_it_was_starting_is_described_again(tmp_path, monkeypatch):
    """Same program, refused: not_python is described again once a libpython is mapped (it was still in
    the dynamic loader), no_thread_key at most once a second (its runtime was not initialised), a version
    we do not walk never; each counted once."""
    proc = tmp_path / "42"
    proc.mkdir()
    (proc / "stat").write_text("42 (python3) R " + "1 " * 18 + "777 0\n")  # start time 777
    (proc / "exe").symlink_to("/usr/bin/true")
    (proc / "maps").write_text("00400000-00401000 r-xp 00000000 08:01 1234 /usr/bin/python3.12\n")
    answers = [
        discover.Unsupported("not_python", "no libpython"),
        discover.Unsupported("no_thread_key", "no thread yet"),
        discover.Unsupported("no_thread_key", "no thread yet"),
        discover.Unsupported("version_unknown", "3.99"),
    ]
    calls: list[int] = []

    def describe(pid: int, proc_root: str = "/proc") -> discover.Unsupported:
        calls.append(pid)
        return answers[len(calls) - 1]

    monkeypatch.setattr(processes, "describe", describe)
    now = [0.0]
    procs = PythonProcesses(str(tmp_path), clock=lambda: now[0])
    assert procs.add(42).reason == "not_python"  # type: ignore[union-attr]
    assert procs.add(42).reason == "not_python" and len(calls) == 1  # type: ignore[union-attr]
    assert not procs.retry_due(42)  # not CPython: its mappings say when to look again
    with (proc / "maps").open("a") as f:
        f.write("7f0000000000-7f0000001000 r-xp 00000000 08:01 99 /opt/lib/libpython3.12.so.1.0\n")
    assert procs.add(42).reason == "no_thread_key" and len(calls) == 2  # type: ignore[union-attr]
    now[0] += processes.RETRY_S / 2
    assert not procs.retry_due(42)  # its samples ask for another look once a second at most
    assert procs.add(42).reason == "no_thread_key" and len(calls) == 2  # type: ignore[union-attr]
    now[0] += processes.RETRY_S
    assert procs.retry_due(42)
    assert procs.add(42).reason == "no_thread_key" and len(calls) == 3  # type: ignore[union-attr]
    assert not procs.retry_due(42)
    now[0] += processes.RETRY_S
    assert procs.add(42).reason == "version_unknown" and len(calls) == 4  # type: ignore[union-attr]
    now[0] += 100 * processes.RETRY_S
    assert not procs.retry_due(42)  # a version we do not walk: never
    assert procs.add(42).reason == "version_unknown" and len(calls) == 4  # type: ignore[union-attr]
    counted = {k: v for k, v in procs.stats.not_walked.items() if v}
    assert counted == {"not_python": 1, "no_thread_key": 1, "version_unknown": 1}

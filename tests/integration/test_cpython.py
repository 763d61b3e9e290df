"""bistouri/cpython on the real interpreters: each supported CPython (pyenv's 3.8-3.13 with a shared
libpython, Debian's static 3.11) recognised, and its code objects named from its memory, with the line
of every instruction offset exactly the one CPython itself computes (`PyCode_Addr2Line`).

Unprivileged: the target is our child, whose memory its parent may read.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from bistouri.cpython import discover
from bistouri.cpython.layouts import LAYOUTS
from bistouri.cpython.memory import ProcessMemory
from bistouri.cpython.naming import FREED, UNKNOWN, CodeNamer
from testkit.helpers import CPYTHON_TARGET, CPYTHONS, cpython


@pytest.fixture(params=CPYTHONS)
def target(request) -> Iterator[tuple[str, subprocess.Popen[str], dict]]:
    exe = cpython(request.param)
    if exe is None:
        pytest.skip(f"CPython {request.param} is not installed")
    proc = subprocess.Popen(
        [str(exe), str(CPYTHON_TARGET)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        dump = json.loads(proc.stdout.readline())
        yield request.param, proc, dump
    finally:
        proc.kill()
        proc.wait()


def test_each_interpreter_is_described_and_its_code_named_with_cpythons_own_lines(target):
    which, proc, dump = target
    interp = discover.describe(proc.pid)
    assert isinstance(interp, discover.Interpreter), interp
    want = (3, 11) if which == "debian-3.11" else tuple(int(x) for x in which.split("."))
    assert interp.version[:2] == want
    assert interp.eval_ranges, "the eval loop's range (splicing) was not found"
    offsets = wrong = 0
    with CodeNamer(interp) as namer:
        for code in dump["codes"]:
            named = namer.name(code["id"], 0)
            assert (named.name, named.filename, named.firstlineno) == (
                code["name"],
                code["filename"],
                code["firstlineno"],
            )
            for unit, line in code["lines"]:
                offsets += 1
                wrong += named.line(unit) != line
    # Every offset of every code object, not 99.5 %: the decoders are CPython's own algorithms.
    assert wrong == 0, f"{wrong} of {offsets} offsets on another line than CPython's"
    assert offsets > 10_000


def test_a_code_object_is_named_only_with_the_checksum_it_had(target):
    _which, proc, dump = target
    interp = discover.describe(proc.pid)
    assert isinstance(interp, discover.Interpreter), interp
    hot = dump["hot"]
    with CodeNamer(interp) as namer:
        have = namer.checksum(hot)
        named = namer.name(hot, have)
        assert have and named.name == "hot_loop"
        reads = namer.reads
        assert namer.name(hot, have) is named and namer.reads == reads  # kept
        assert namer.name(hot, have ^ 1) is FREED  # another code object's checksum: never this name
        assert namer.name(8, 0) is UNKNOWN  # not an address of the process


@pytest.mark.root
def test_an_interpreter_in_another_mount_namespace_is_described(tmp_path):
    """A container's interpreter: its file is at a path only its own mount namespace has (a tmpfs there);
    the agent opens it through /proc/PID/map_files and reads the rest from /proc/PID/mem."""
    exe = cpython("debian-3.11") or cpython("3.11")
    if exe is None:
        pytest.skip("no CPython 3.11 to copy")
    where = tmp_path / "ns"
    where.mkdir()
    script = (
        f"mount -t tmpfs none {where} && cp {exe} {where}/python3 && "
        f"exec {where}/python3 -c 'import os, sys; print(os.getpid(), flush=True); sys.stdin.read()'"
    )
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        assert not (where / "python3").exists()  # not in our namespace
        found = discover.describe(pid)
        assert isinstance(found, discover.Interpreter), found
        assert found.path == f"{where}/python3" and found.version[:2] == (3, 11)
    finally:
        proc.kill()
        proc.wait()


_DATASTACK_PROBE = """
import ctypes, sys
datastack, tstate_frame, cframe_frame = map(int, sys.argv[1:])
get = ctypes.pythonapi.PyThreadState_Get
get.restype = ctypes.c_void_p
tstate = get()
chunk, top = (ctypes.c_uint64.from_address(tstate + datastack + i).value for i in (0, 8))
frame = ctypes.c_uint64.from_address(tstate + tstate_frame).value
if cframe_frame >= 0:
    frame = ctypes.c_uint64.from_address(frame + cframe_frame).value
print(chunk < frame < top)
"""


@pytest.mark.parametrize("which", CPYTHONS)
def test_the_frames_are_where_the_layout_says_the_data_stack_is(which):
    """3.11+: the walk reads the newest bytes of the thread's data stack at once (bpf/python.bpf.h); with
    wrong offsets it would read them apart again (never wrongly: any window is a copy of the memory)."""
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    minor = subprocess.run(
        [str(exe), "-c", "import sys; print(sys.version_info[1])"], capture_output=True, text=True
    )
    lay = LAYOUTS[3, int(minor.stdout)]
    if lay.tstate_datastack < 0:
        pytest.skip("frames are heap objects before 3.11")
    argv = [str(lay.tstate_datastack), str(lay.tstate_frame), str(lay.cframe_frame)]
    out = subprocess.run(
        [str(exe), "-c", _DATASTACK_PROBE, *argv], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"


_REUSE = """
import sys
for i in range(int(sys.argv[1])):
    co = compile("def f_%d():\\n    return %d\\n" % (i, i), "<gen %d>" % i, "exec").co_consts[0]
    print(id(co), flush=True)
    sys.stdin.readline()  # the parent has read it
    del co
"""


@pytest.mark.parametrize("which", CPYTHONS)
def test_a_freed_and_reused_address_is_never_named_after_the_new_code(which):
    """Functions made and dropped in a loop in each interpreter (its allocator gives a freed code object's
    address to the next): the checksum tells the old from the new, with co_version on 3.12+ and the
    name's hash before (tests/unit/test_cpython.py does the same in this process only)."""
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    proc = subprocess.Popen(
        [str(exe), "-c", _REUSE, "500"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        addr = int(proc.stdout.readline())
        interp = discover.describe(proc.pid)
        assert isinstance(interp, discover.Interpreter), interp
        seen: dict[int, tuple[str, int]] = {}
        reused = 0
        with CodeNamer(interp) as namer:
            for i in range(500):
                if i:
                    addr = int(proc.stdout.readline())
                have = namer.checksum(addr)
                assert namer.name(addr, have).name == f"f_{i}"
                if addr in seen:
                    old_name, old_sum = seen[addr]
                    assert old_sum != have, f"{which}: f_{i} has {old_name}'s checksum"
                    with CodeNamer(interp) as fresh:
                        assert fresh.name(addr, old_sum) is FREED
                    reused += 1
                seen[addr] = (f"f_{i}", have)
                proc.stdin.write("\n")
                proc.stdin.flush()
        assert reused > 100
    finally:
        proc.kill()
        proc.wait()


_MAKE = """
import sys
names = {}
for line in sys.stdin:
    for i in range(int(line)):
        exec("def g(): pass", names)  # two code objects: the module's and g's
    fs = [(lambda: 1) for _ in range(20)]  # functions, no code object
    print("made", flush=True)
"""


@pytest.mark.parametrize("which", CPYTHONS)
def test_the_count_of_code_objects_made_is_where_the_record_says(which):
    """BPF keeps a code object's checksum between samples while this count stays the same, so it must be
    the count: it moves by exactly the code objects made (2 per exec here) and not with functions made
    from existing code. None before 3.12."""
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    proc = subprocess.Popen([str(exe), "-c", _MAKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("1\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "made"
        interp = discover.describe(proc.pid)
        assert isinstance(interp, discover.Interpreter), interp
        if interp.layout.version < (3, 12):
            assert interp.code_counter == 0 and discover.record(interp).code_counter == 0
            return
        assert interp.code_counter, f"{which}: no count of code objects found"
        with ProcessMemory(proc.pid) as mem:

            def count() -> int:
                at = interp.code_counter
                if interp.counter_in_interp:
                    at += mem.u64(interp.runtime + interp.layout.runtime_interpreters_head)
                return mem.u32(at)

            for made in (0, 5, 17):
                before = count()
                proc.stdin.write(f"{made}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "made"
                assert count() - before == 2 * made, (
                    f"{which}: {made} execs moved the count by {count() - before}"
                )
    finally:
        proc.kill()
        proc.wait()

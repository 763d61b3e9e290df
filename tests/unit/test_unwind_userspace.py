"""The BPF walk's step (bpf/unwind_step.h) compiled for user space and fed recorded cases.

No root, no kernel: tests/fixtures/unwind/walk_host.c includes the object's own step
and replaces only what in BPF is a map (the stack read, the rule search). Two kinds of
case: stacks synthesized with known frames (every rule kind, every way a walk ends),
and stacks recorded once from Debian's python3.11 and xz (tests/fixtures/unwind/record_case.py:
registers, the stack window, gdb's backtrace as the truth), replayed against the rows our
table builder makes from the same binaries (skipped where those are another build).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bistouri.bpf.abi import CfaKind, Counter, RbpKind
from bistouri.elf import ElfFile
from bistouri.unwind.ehframe import ROW
from bistouri.unwind.tables import _bias, compile_file
from tests.conftest import ROOT

CASES = ROOT / "tests" / "fixtures" / "unwind"
MAX_DEPTH = 127  # BISTOURI_MAX_DEPTH


class Regs(ctypes.Structure):
    _fields_ = [("ip", ctypes.c_uint64), ("sp", ctypes.c_uint64), ("bp", ctypes.c_uint64)]


class Rule(ctypes.Structure):  # struct unwind_rule
    _fields_ = [
        ("bias", ctypes.c_uint64),
        ("cfa_off", ctypes.c_int32),
        ("rbp_off", ctypes.c_int32),
        ("cfa_kind", ctypes.c_uint32),
        ("rbp_kind", ctypes.c_uint32),
    ]


class Walk(ctypes.Structure):  # struct walk of walk_host.c
    _fields_ = [
        ("regs", Regs),
        ("by_table", ctypes.c_uint32),
        ("by_fp", ctypes.c_uint32),
        ("stop", ctypes.c_uint32),
        ("exact", ctypes.c_bool),
        ("stack", ctypes.c_char_p),
        ("base", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
    ]


class Mapping(ctypes.Structure):  # struct host_mapping of walk_host.c
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("bias", ctypes.c_uint64),
        ("rows", ctypes.c_char_p),
        ("count", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("a C compiler is needed to build the walk for user space")
    lib = tmp_path_factory.mktemp("walk") / "walk_host.so"
    subprocess.run(
        [cc, "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{ROOT / 'bpf'}",
         str(CASES / "walk_host.c"), "-o", str(lib)],
        check=True,
    )  # fmt: skip
    dll = ctypes.CDLL(str(lib))
    dll.host_step.argtypes = [ctypes.POINTER(Walk), ctypes.POINTER(Rule)]
    dll.host_step.restype = ctypes.c_long
    dll.host_walk.argtypes = [
        ctypes.POINTER(Walk),
        ctypes.POINTER(Mapping),
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_uint32,
    ]
    dll.host_walk.restype = ctypes.c_uint32
    return dll


@dataclass
class Walked:
    ips: list[int]
    stop: int
    by_table: int
    by_fp: int


@dataclass
class Table:
    """One mapping's rows, as unwind_mappings and unwind_rows describe it."""

    start: int
    end: int
    bias: int
    rows: bytes  # ROW each, sorted by pc


def _walk(
    host: ctypes.CDLL, regs: tuple[int, int, int], stack: bytes, base: int, tables: list[Table]
) -> Walked:
    w = Walk(regs=Regs(*regs), exact=True, stack=stack, base=base, size=len(stack))
    maps = (Mapping * max(len(tables), 1))(
        *(Mapping(t.start, t.end, t.bias, t.rows, len(t.rows) // ROW.size, 0) for t in tables)
    )
    ips = (ctypes.c_uint64 * MAX_DEPTH)()
    n = host.host_walk(ctypes.byref(w), maps, len(tables), ips, MAX_DEPTH)
    return Walked(list(ips[:n]), w.stop, w.by_table, w.by_fp)


def _rows(*rows: tuple[int, CfaKind, int, RbpKind, int]) -> bytes:
    return b"".join(
        ROW.pack(pc, cfa_off, rbp_off, kind, rbp_kind) for pc, kind, cfa_off, rbp_kind, rbp_off in rows
    )


class Stack:
    """A synthesized stack window: words written at user addresses."""

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.data = bytearray(size)

    def put(self, addr: int, value: int) -> None:
        struct.pack_into("<Q", self.data, addr - self.base, value)


# One synthesized file mapped at START, its table pcs = ip - START: a function of each rule kind.
START = 0x400000
FN_RSP, FN_RBP, FN_PLT, FN_SIGNAL, FN_NO_TABLE, FN_END = (0x1000 + 0x100 * i for i in range(6))
ROWS = _rows(
    (FN_RSP, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0),  # one push: CFA = RSP + 16
    (FN_RBP, CfaKind.RBP, 16, RbpKind.AT_CFA, -16),  # push %rbp; mov %rsp,%rbp
    (FN_PLT, CfaKind.PLT, 11, RbpKind.UNCHANGED, 0),  # binutils' .plt expression, threshold 11
    (FN_SIGNAL, CfaKind.SIGNAL, 0, RbpKind.UNCHANGED, 0),  # __restore_rt
    (FN_NO_TABLE, CfaKind.NONE, 0, RbpKind.UNCHANGED, 0),  # JIT code, a file not loaded: the frame pointer
    (FN_END, CfaKind.END, 0, RbpKind.UNCHANGED, 0),  # _start: the return address is undefined
    (FN_END + 0x100, CfaKind.NONE, 0, RbpKind.UNCHANGED, 0),
)
TABLE = Table(START, START + 0x10000, START, ROWS)
BASE = 0x7FFD_0000_0000


def _every_kind() -> tuple[tuple[int, int, int], Stack, list[int]]:
    """Registers, stack and expected IPs of a walk through each rule kind in turn."""
    s = Stack(BASE, 4096)
    sp0 = BASE + 0x100
    ips = [START + FN_RSP + 0x10, START + FN_RBP + 0x10, START + FN_PLT + 8]
    # RSP + 16: the return address at CFA - 8.
    s.put(sp0 + 8, ips[1])
    # RBP-based: CFA = RBP + 16, the caller's RBP at CFA - 16, the return address at CFA - 8.
    bp1 = sp0 + 0x40
    s.put(bp1, bp1 + 0x200)
    s.put(bp1 + 8, ips[2])
    # .plt, before the push (ip & 15 = 8 < 11): CFA = RSP + 8.
    sp2 = bp1 + 16
    ips.append(START + FN_SIGNAL + 0x10)
    s.put(sp2, ips[3])
    # The signal trampoline: RSP points at the ucontext, whose mcontext holds the
    # interrupted rip (168), rsp (160) and rbp (120).
    uc = sp2 + 8
    interrupted_sp, interrupted_bp = uc + 0x300, uc + 0x340
    ips.append(START + FN_NO_TABLE + 0x20)  # the interrupted instruction itself (exact)
    s.put(uc + 168, ips[4])
    s.put(uc + 160, interrupted_sp)
    s.put(uc + 120, interrupted_bp)
    # No table: the frame pointer chain.
    ips.append(START + FN_END + 0x10)
    s.put(interrupted_bp, 0)
    s.put(interrupted_bp + 8, ips[5])
    return (ips[0], sp0, bp1), s, ips  # RBP is the RBP-based function's, kept by the first


def test_a_walk_through_every_rule_kind_finds_each_frame(host):
    regs, stack, expected = _every_kind()
    got = _walk(host, regs, bytes(stack.data), stack.base, [TABLE])
    assert [hex(ip) for ip in got.ips] == [hex(ip) for ip in expected]
    assert got.stop == Counter.WALK_END
    # RSP, RBP, PLT, SIGNAL and END by table; the frame without one by its frame pointer.
    assert (got.by_table, got.by_fp) == (5, 1)


def test_without_tables_the_walk_follows_frame_pointers(host):
    s = Stack(BASE, 4096)
    bp = BASE + 0x80
    chain = [0x7F00_0000_1000 + i for i in range(4)]
    for ra in chain[1:]:
        s.put(bp, bp + 0x40)  # the caller's RBP
        s.put(bp + 8, ra)
        bp += 0x40
    s.put(bp, 0)
    s.put(bp + 8, 0)  # the outermost frame: a zero return address ends the walk
    got = _walk(host, (chain[0], BASE + 0x10, BASE + 0x80), bytes(s.data), s.base, [])
    assert got.ips == chain
    assert got.stop == Counter.WALK_END
    assert (got.by_table, got.by_fp) == (0, len(chain))


def _step(host, rule: Rule, regs: tuple[int, int, int], stack: Stack) -> tuple[int, Walk]:
    w = Walk(regs=Regs(*regs), stack=bytes(stack.data), base=stack.base, size=len(stack.data))
    return host.host_step(ctypes.byref(w), ctypes.byref(rule)), w


@pytest.mark.parametrize(("offset", "pushed"), [(0, 0), (3, 0), (4, 8), (9, 8), (10, 0)])
def test_a_perf_trampoline_copy_is_unwound_by_its_offset(host, offset, pushed):
    """sub $8,%rsp (4 bytes); call *%rcx (2); add $8,%rsp (4); ret: 8 more on the stack in [4, 10)."""
    s = Stack(BASE, 256)
    sp = BASE + 0x40
    s.put(sp + pushed, 0x7F00_0000_2000)
    rule = Rule(bias=START, cfa_off=16, rbp_off=4 | 10 << 8, cfa_kind=CfaKind.TRAMPOLINE)
    ended, w = _step(host, rule, (START + 5 * 16 + offset, sp, 0), s)
    assert not ended
    assert (w.regs.ip, w.regs.sp) == (0x7F00_0000_2000, sp + 8 + pushed)


@pytest.mark.parametrize(
    ("why", "rule", "regs", "stop"),
    [
        ("no frame pointer", Rule(cfa_kind=CfaKind.NONE), (START, BASE + 8, 0), Counter.WALK_NO_FP),
        (
            "CFA not above SP",
            Rule(cfa_kind=CfaKind.RSP, cfa_off=0),
            (START, BASE + 8, 0),
            Counter.WALK_BAD_FRAME,
        ),
        (
            "return address outside the window",
            Rule(cfa_kind=CfaKind.RSP, cfa_off=16),
            (START, BASE + 4096, 0),
            Counter.WALK_READ_FAILED,
        ),
        (
            "signal frame outside the window",
            Rule(cfa_kind=CfaKind.SIGNAL),
            (START, BASE + 4000, 0),
            Counter.WALK_READ_FAILED,
        ),
        (
            "a kernel return address",
            Rule(cfa_kind=CfaKind.RSP, cfa_off=16),
            (START, BASE + 16, 0),
            Counter.WALK_BAD_FRAME,
        ),
    ],
)
def test_a_walk_ends_with_its_reason(host, why, rule, regs, stop):
    s = Stack(BASE, 4096)
    s.put(BASE + 24, 0xFFFF_FFFF_8100_0000)  # read as the return address in the last case
    ended, w = _step(host, rule, regs, s)
    assert ended, why
    assert w.stop == stop, why


def test_a_deep_recursion_ends_at_the_maximum_depth(host):
    """A function calling itself, 16 bytes of stack a frame: the walk stops at BISTOURI_MAX_DEPTH IPs."""
    s = Stack(BASE, 8192)
    ip = START + FN_RSP + 0x10
    for sp in range(BASE, BASE + 8192 - 16, 16):
        s.put(sp + 8, ip)
    got = _walk(host, (ip, BASE, 0), bytes(s.data), s.base, [TABLE])
    assert got.ips == [ip] * MAX_DEPTH
    assert got.stop == Counter.WALK_DEPTH
    assert got.by_table == MAX_DEPTH


# --- a stack recorded from a real process ------------------------------------------


def _recorded(name: str) -> tuple[dict, bytes]:
    case = json.loads((CASES / f"{name}.json").read_text())
    return case, (CASES / f"{name}.stack").read_bytes()


def _tables_of(case: dict) -> list[Table]:
    """The rows of the mappings the truth's frames are in, built now from the same files."""
    frames = case["gdb_frames"]
    tables = []
    for m in case["mappings"]:
        if not any(m["start"] <= pc < m["end"] for pc in frames):
            continue
        path = Path(m["path"])
        if not path.exists():
            pytest.skip(f"{path} is not installed")
        with ElfFile(str(path)) as elf:
            build_id = elf.build_id
        if build_id is None or build_id.hex() != m["build_id"]:
            pytest.skip(f"{path} is not the build the case was recorded with ({m['build_id']})")
        table = compile_file(str(path))
        bias = _bias(table.segments, m["start"], m["pgoff"])
        assert bias is not None, m
        tables.append(Table(m["start"], m["end"], bias, table.rows))
    return tables


@pytest.mark.parametrize(
    "name",
    [
        # Debian's python3.11 asleep in time.sleep: clock_nanosleep in libc, the interpreter's C frames.
        "python311",
        # Debian's xz -9e stopped wherever it was while compressing: 9 frames in liblzma, then xz, libc.
        "xz_1",
        "xz_2",
    ],
)
def test_a_recorded_stack_unwinds_as_gdb_does(host, name):
    """Files built without frame pointers: every frame by .eh_frame rows, down to _start."""
    case, stack = _recorded(name)
    regs = case["regs"]
    got = _walk(host, (regs["rip"], regs["rsp"], regs["rbp"]), stack, case["stack_base"], _tables_of(case))
    assert [hex(ip) for ip in got.ips] == [hex(pc) for pc in case["gdb_frames"]]
    assert got.stop == Counter.WALK_END  # _start's row says the return address is undefined
    assert got.by_fp == 0
    assert got.by_table == len(got.ips)


def test_a_recorded_stack_without_its_tables_stops_at_the_first_frame(host):
    """No rows (the tables not loaded yet) and no frame pointers: RBP is not a frame pointer
    in Debian's builds, so the walk stops early, which is why the tables exist."""
    case, stack = _recorded("python311")
    regs = case["regs"]
    got = _walk(host, (regs["rip"], regs["rsp"], regs["rbp"]), stack, case["stack_base"], [])
    assert len(got.ips) < len(case["gdb_frames"])
    assert got.ips[0] == regs["rip"]

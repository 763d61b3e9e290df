"""aarch64 unwind rows and the aarch64 walk, on Debian 12's own arm64 xz, liblzma and libc.

The rows (bistouri/unwind/cfa.py with aarch64's registers: sp, x29, x30) are checked FDE by FDE
against `readelf --debug-dump=frames-interp` of the same files, as test_ehframe.py does for
x86-64's. The walk's step (bpf/unwind_step.h built with __TARGET_ARCH_arm64, as the arm64 object
is) is then fed stacks laid out as those rows say, through real functions of liblzma: a leaf
whose return address is still in x30, frames that saved x29 and x30 side by side, the
frame record where no row covers, and a row after it (placed from x29: the SP that step gives
is a lower bound). The files come from tests/fixtures/arm64/fetch-debs.sh
(`make fixtures`).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bistouri.bpf.abi import RA_SHIFT, CfaKind, Counter, RaKind, RbpKind
from bistouri.elf import ElfFile
from bistouri.unwind.ehframe import ROW, Row, build_table, file_fdes, unpack_rows
from tests.conftest import ROOT

ARM64_ROOT = ROOT / "tests" / "fixtures" / "build" / "arm64" / "root"
LIBS = ARM64_ROOT / "lib" / "aarch64-linux-gnu"
BINARIES = [LIBS / "libc.so.6", LIBS / "liblzma.so.5", ARM64_ROOT / "usr" / "bin" / "xz"]

# (pc, CFA register, CFA offset, x29 rule, x29 offset, return address rule, its offset)
Rule = tuple[int, str, int, str, int, str, int]
_OTHER = ("other", 0, "other", 0, "other", 0)

_FDE_LINE = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_OTHER_ENTRY = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ (CIE|ZERO)")


def _need(path: Path) -> str:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make fixtures` (tests/fixtures/arm64/fetch-debs.sh)")
    return os.path.realpath(path)


def _readelf(path: str) -> dict[int, list[Rule]]:
    """FDE start -> its rows as readelf evaluates them, normalised to what a row can say."""
    out = subprocess.run(
        ["readelf", "--debug-dump=frames-interp", "-W", path], capture_output=True, text=True
    ).stdout
    fdes: dict[int, list[Rule]] = {}
    rows: list[Rule] | None = None
    cols: list[str] = []
    for line in out.splitlines():
        m = _FDE_LINE.match(line)
        if m:
            rows = fdes.setdefault(int(m.group(1), 16), [])
            cols = []
            continue
        if not line.strip() or _OTHER_ENTRY.match(line):
            rows = None
            continue
        if rows is None:
            continue
        parts = line.split()
        if parts[:1] == ["LOC"]:
            cols = parts
        elif cols and parts and re.fullmatch(r"[0-9a-f]{8,}", parts[0]):
            rows.append(_their_rule(int(parts[0], 16), dict(zip(cols, parts))))
    return fdes


def _saved(cell: str) -> tuple[str, int]:
    if cell in ("u", "s"):  # readelf's "u": never set, so the register still holds it
        return ("same", 0)
    if cell.startswith("c") and re.fullmatch(r"c[+-]\d+", cell):
        return ("cfa", int(cell[1:]))
    return ("other", 0)


def _their_rule(pc: int, cells: dict[str, str]) -> Rule:
    cfa = cells["CFA"]
    x29 = _saved(cells.get("x29", "u"))
    ra = _saved(cells.get("ra", "u"))
    m = re.fullmatch(r"(sp|x29)\+(\d+)", cfa)
    if m is None:
        return (pc, *_OTHER)
    kind, off = m.group(1), int(m.group(2))
    if ra[0] == "same":
        return (pc, kind, off, *x29, "lr", 0)
    # Saved: beside x29 (stp x29, x30) or alone; any other pairing is what a row cannot say.
    if ra[0] == "cfa" and (x29[0] == "same" or (x29[0] == "cfa" and ra[1] == x29[1] + 8)):
        return (pc, kind, off, *x29, "cfa", ra[1])
    return (pc, *_OTHER)


def _our_rule(row: Row) -> Rule:
    if row.cfa_kind not in (CfaKind.RSP, CfaKind.RBP):
        return (row.pc, *_OTHER)
    kind = "sp" if row.cfa_kind == CfaKind.RSP else "x29"
    x29 = {RbpKind.UNCHANGED: ("same", 0), RbpKind.AT_CFA: ("cfa", row.rbp_off)}.get(
        row.rbp_kind, ("other", 0)
    )
    if row.ra_kind == RaKind.LR:
        return (row.pc, kind, row.cfa_off, *x29, "lr", 0)
    if row.ra_kind == RaKind.AT_OFF:
        return (row.pc, kind, row.cfa_off, "same", 0, "cfa", row.rbp_off)
    return (row.pc, kind, row.cfa_off, *x29, "cfa", row.rbp_off + 8)


def _merged(rules: list[Rule]) -> list[Rule]:
    out: list[Rule] = []
    for r in rules:
        if out and out[-1][0] == r[0]:
            out.pop()
        if out and out[-1][1:] == r[1:]:
            continue
        out.append(r)
    return out


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils not installed")
@pytest.mark.parametrize("binary", BINARIES, ids=lambda p: p.name)
def test_every_aarch64_fde_matches_readelf(binary: Path) -> None:
    path = _need(binary)
    theirs = _readelf(path)
    with ElfFile(path) as elf:
        assert elf.machine == 183  # EM_AARCH64
        ours = {f.start: f for f in file_fdes(elf)}
    assert len(theirs) > 100
    assert set(ours) == set(theirs)
    differing, outermost = [], 0
    for start, their_rows in theirs.items():
        rows = ours[start].rows
        if any(r.cfa_kind == CfaKind.END for r in rows):
            outermost += 1  # DW_CFA_undefined x30 (_start): readelf prints "u" as for "never set"
            continue
        if their_rows and _merged(their_rows) != _merged([_our_rule(r) for r in rows]):
            differing.append(hex(start))
    assert differing == []
    assert outermost <= 1


def test_aarch64_rows_say_where_the_return_address_is() -> None:
    """Nearly every row of liblzma is one the walk follows (no OTHER), and both places of the
    return address occur: x30 in leaves and before prologues, the stack after them."""
    rows = unpack_rows(build_table(_need(LIBS / "liblzma.so.5")))
    kinds = {(r.cfa_kind, r.ra_kind) for r in rows}
    assert (CfaKind.RSP, RaKind.LR) in kinds
    assert (CfaKind.RSP, RaKind.CFA) in kinds
    assert sum(r.cfa_kind == CfaKind.OTHER for r in rows) == 0


# --- the step, built as the arm64 object builds it -------------------------------------------


class Regs(ctypes.Structure):  # struct unwind_regs under __TARGET_ARCH_arm64
    _fields_ = [(name, ctypes.c_uint64) for name in ("ip", "sp", "bp", "lr")]


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
        ("sp_floor", ctypes.c_bool),
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
    lib = tmp_path_factory.mktemp("walk") / "walk_host_arm64.so"
    subprocess.run(
        [cc, "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-D__TARGET_ARCH_arm64",
         f"-I{ROOT / 'bpf'}", str(ROOT / "tests" / "fixtures" / "unwind" / "walk_host.c"), "-o", str(lib)],
        check=True,
    )  # fmt: skip
    dll = ctypes.CDLL(str(lib))
    dll.host_walk.argtypes = [
        ctypes.POINTER(Walk),
        ctypes.POINTER(Mapping),
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_uint32,
    ]
    dll.host_walk.restype = ctypes.c_uint32
    dll.host_step.argtypes = [ctypes.POINTER(Walk), ctypes.c_void_p]  # struct unwind_rule *
    dll.host_step.restype = ctypes.c_long
    return dll


LOAD = 0xFFFF_9000_0000  # where liblzma is mapped: above x86-64's user space, as arm64 maps it
STACK_TOP = 0xFFFF_F000_0000


def _row_at(rows: list[Row], pc: int) -> Row:
    at = max(i for i, r in enumerate(rows) if r.pc <= pc)
    return rows[at]


def _frames(rows: list[Row], want: tuple[RaKind, ...]) -> list[int]:
    """PCs of liblzma (one per function) whose rows put the return address as `want` says, in
    order: a leaf first (in x30), then callers that saved it."""
    out: list[int] = []
    for kind in want:
        for i, r in enumerate(rows[:-1]):
            roomy = rows[i + 1].pc > r.pc + 4 and r.pc + 4 not in out
            framed = kind != RaKind.LR or r.cfa_off == 0  # a leaf: nothing pushed, CFA = sp
            if r.cfa_kind == CfaKind.RSP and r.ra_kind == kind and roomy and framed:
                out.append(r.pc + 4)
                break
    assert len(out) == len(want)
    return out


@dataclass
class Case:
    """A stack laid out as real rows say: the registers of its first frame, the stack window from
    `base`, the mappings with tables (start, end, bias, rows), and what a walk must give."""

    regs: Regs
    stack: bytes
    base: int
    tables: list[tuple[int, int, int, bytes]]
    ips: list[int]
    by_table: int
    by_fp: int


def host_walk(host: ctypes.CDLL, case: Case) -> tuple[list[int], Walk]:
    """The BPF walk's reading of a case (walk_host.c's host_walk over the object's step)."""
    w = Walk(regs=case.regs, exact=True, stack=case.stack, base=case.base, size=len(case.stack))
    maps = (Mapping * len(case.tables))(
        *(Mapping(start, end, bias, rows, len(rows) // ROW.size, 0) for start, end, bias, rows in case.tables)
    )
    ips = (ctypes.c_uint64 * 16)()
    n = host.host_walk(ctypes.byref(w), maps, len(case.tables), ips, 16)
    return list(ips[:n]), w


def liblzma_chain() -> Case:
    """Three functions of liblzma laid out as their rows say (a leaf whose return address is in
    x30, two callers that saved x29 and x30, one return address signed), then a frame record."""
    table = build_table(_need(LIBS / "liblzma.so.5"))
    rows = unpack_rows(table)
    leaf, mid, outer = _frames(rows, (RaKind.LR, RaKind.CFA, RaKind.CFA))
    unmapped = 0x4000_1234  # no table: the frame pointer's frame record takes the walk on
    stack = bytearray(4096)
    base = STACK_TOP - len(stack)

    def put(addr: int, value: int) -> None:
        struct.pack_into("<Q", stack, addr - base, value)

    sp = base + 256
    pac = 0x002A_0000_0000_0000  # a pointer-authentication signature in the top bits
    chain = [(mid, outer), (outer, unmapped)]
    frame_record = base + 2048
    put(frame_record, 0)  # the last frame record: x29 0 ends the walk
    put(frame_record + 8, 0)
    for pc, ret in chain:
        r = _row_at(rows, pc)
        assert r.rbp_kind == RbpKind.AT_CFA
        cfa = sp + r.cfa_off
        put(cfa + r.rbp_off, frame_record)  # the caller's x29
        put(cfa + r.rbp_off + 8, (LOAD + ret) | pac if ret != unmapped else unmapped)
        sp = cfa
    leaf_row = _row_at(rows, leaf)
    assert leaf_row.ra_kind == RaKind.LR and leaf_row.cfa_off == 0
    regs = Regs(ip=LOAD + leaf, sp=base + 256, bp=frame_record, lr=LOAD + mid)
    size = max(r.pc for r in rows) + 0x1000
    return Case(
        regs,
        bytes(stack),
        base,
        [(LOAD, LOAD + size, LOAD, table)],
        [LOAD + leaf, LOAD + mid, LOAD + outer, unmapped],
        3,
        1,
    )


def lzma_code_under_xz() -> Case:
    """lzma_code (liblzma mapped, its table not in yet) called by xz at xz+0x53dc: the frame
    record leaves lzma_code with an SP 32 too low (its x29 is 48 below its CFA), and xz's row
    (CFA sp + 128, x29/x30 saved as a pair) must place its frame from x29."""
    xz_table = build_table(_need(ARM64_ROOT / "usr" / "bin" / "xz"))
    xz_rows = unpack_rows(xz_table)
    xz, lzma = 0xAAAA_0000_0000, LOAD  # liblzma: mapped, no table yet
    leaf = 0x4154  # lzma_code past its prologue: sub sp, sp, #96; stp x29, x30, [sp, #48]; add x29, sp, #48
    call = 0x53DC  # after xz's `bl lzma_code@plt`
    outer = _frames(xz_rows, (RaKind.CFA,))[0]  # any xz call site whose caller saved x29 and x30
    stack = bytearray(4096)
    base = STACK_TOP - len(stack)
    for at in range(0, len(stack), 8):  # stack garbage: a wrong read is a bogus frame, not an end
        struct.pack_into("<Q", stack, at, xz + 0x1000 + at)

    def put(addr: int, value: int) -> None:
        struct.pack_into("<Q", stack, addr - base, value)

    sp = base + 256
    lzma_cfa = sp + 96
    lzma_fp = lzma_cfa - 48
    r = _row_at(xz_rows, call - 1)
    assert (r.cfa_kind, r.cfa_off, r.rbp_kind, r.rbp_off, r.ra_kind) == (
        CfaKind.RSP, 128, RbpKind.AT_CFA, -128, RaKind.CFA
    )  # fmt: skip
    xz_cfa = lzma_cfa + r.cfa_off  # its SP at the call is lzma_code's CFA
    xz_fp = xz_cfa + r.rbp_off  # stp x29, x30, [sp, #-128]!; mov x29, sp
    put(lzma_fp, xz_fp)
    put(lzma_fp + 8, xz + call)
    o = _row_at(xz_rows, outer - 1)
    outer_cfa = xz_cfa + o.cfa_off
    put(xz_fp, outer_cfa + o.rbp_off)
    put(xz_fp + 8, xz + outer)
    put(outer_cfa + o.rbp_off, 0)  # the outermost frame: no caller
    put(outer_cfa + o.rbp_off + 8, 0)
    regs = Regs(ip=lzma + leaf, sp=sp, bp=lzma_fp, lr=lzma + 0x40F4)  # x30: the last call's
    size = max(r.pc for r in xz_rows) + 0x1000
    return Case(
        regs, bytes(stack), base, [(xz, xz + size, xz, xz_table)], [lzma + leaf, xz + call, xz + outer], 2, 1
    )


def test_the_aarch64_walk_follows_real_rows_through_x30_and_saved_frames(host: ctypes.CDLL) -> None:
    """liblzma_chain: the walk gives every PC back, the leaf's caller from x30, the others from
    the stack, signature bits of a signed return address masked off."""
    case = liblzma_chain()
    ips, w = host_walk(host, case)
    assert ips == case.ips
    assert (w.by_table, w.by_fp) == (case.by_table, case.by_fp) == (3, 1)
    assert w.stop == Counter.WALK_END


def test_a_row_after_a_frame_record_is_placed_by_its_own_record(host: ctypes.CDLL) -> None:
    """What broke 7 % of `record`'s arm64 xz stacks: liblzma's table not yet loaded (the
    executable's and libc's are built first), lzma_code left by its frame record, whose x29 is
    48 below its CFA, so the SP that step gives is 32 too low; xz's caller at xz+0x53dc
    (CFA sp + 128) then read its return address from inside lzma_code's frame: one bogus
    frame. The row's x29/x30 pair places the frame from x29 instead, and the walk goes on."""
    case = lzma_code_under_xz()
    ips, w = host_walk(host, case)
    assert [hex(ip) for ip in ips] == [hex(ip) for ip in case.ips]
    assert (w.by_table, w.by_fp) == (case.by_table, case.by_fp) == (2, 1)
    assert w.stop == Counter.WALK_END


def test_ra_kind_leaves_x86_rows_alone() -> None:
    """x86-64's rows never carry return-address bits: their rbp_kind byte is as before."""
    table = build_table("/usr/bin/xz")
    assert {rbp_kind >> RA_SHIFT for *_, rbp_kind in ROW.iter_unpack(table)} == {RaKind.CFA}

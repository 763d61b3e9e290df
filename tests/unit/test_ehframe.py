"""The unwind-table compiler against binutils' own evaluation of the same CFI.

`readelf --debug-dump=frames-interp` evaluates every FDE into rows; ours must
give the same CFA rule and RBP rule at every PC, for every FDE of real Debian
binaries (libc, liblzma, xz, python3.11, postgres).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from bistouri.compat import pairwise
from bistouri.elf import ElfFile
from bistouri.unwind.ehframe import (
    ROW,
    CfaKind,
    RbpKind,
    Row,
    UnwindTableError,
    build_table,
    compile_rows,
    file_fdes,
    parse_fdes,
    unpack_rows,
)

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
BINARIES = [
    LIBC,
    "/lib/x86_64-linux-gnu/liblzma.so.5",
    "/usr/bin/xz",
    "/usr/bin/python3.11",
    "/usr/lib/postgresql/15/bin/postgres",
]

Rule = tuple[int, str, int, str, int]

_FDE_LINE = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_OTHER_ENTRY = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ (CIE|ZERO)")


def _readelf(path: str) -> dict[int, list[Rule]]:
    """FDE start -> its rows as readelf evaluates them (normalised like ours)."""
    out = subprocess.run(
        ["readelf", "--debug-dump=frames-interp", "-W", path], capture_output=True, text=True
    ).stdout  # exits 1 on libc over a warning about .debug_* it cannot find; the frames are all printed
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
            rows = None  # a blank line ends an FDE's rows
            continue
        if rows is None:
            continue
        parts = re.sub(r" \((\w+)\)", r"(\1)", line).split()
        if parts[:1] == ["LOC"]:
            cols = parts
        elif cols and parts and re.fullmatch(r"[0-9a-f]{8,}", parts[0]):
            rows.append(_their_rule(int(parts[0], 16), dict(zip(cols, parts))))
    return fdes


def _their_rule(pc: int, cells: dict[str, str]) -> Rule:
    cfa, rbp = cells["CFA"], cells.get("rbp", "u")
    if cells.get("ra", "c-8") != "c-8":
        return (pc, "other", 0, "other", 0)
    kind, off = "other", 0
    if cfa.startswith(("rsp+", "rbp+")):
        kind, off = cfa[:3], int(cfa[4:])
    if rbp in ("u", "s"):
        return (pc, kind, off, "same", 0)
    if rbp.startswith("c"):
        return (pc, kind, off, "cfa", int(rbp[1:]))
    return (pc, kind, off, "other", 0)


def _our_rule(row: Row) -> Rule:
    if row.cfa_kind in (CfaKind.SIGNAL, CfaKind.END):  # readelf: no c-8 return address
        return (row.pc, "other", 0, "other", 0)
    kind = {CfaKind.RSP: "rsp", CfaKind.RBP: "rbp"}.get(row.cfa_kind, "other")
    off = row.cfa_off if kind != "other" else 0
    if row.rbp_kind == RbpKind.UNCHANGED:
        return (row.pc, kind, off, "same", 0)
    if row.rbp_kind == RbpKind.AT_CFA:
        return (row.pc, kind, off, "cfa", row.rbp_off)
    return (row.pc, kind, off, "other", 0)


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
@pytest.mark.parametrize("path", BINARIES)
def test_every_fde_matches_readelf(path: str) -> None:
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: run `make deps` (xz-utils, python3.11, postgresql)")
    theirs = _readelf(path)
    with ElfFile(path) as elf:
        ours = {f.start: f for f in file_fdes(elf)}
    assert len(theirs) > 100
    assert set(ours) == set(theirs)
    differing = []
    for start, their_rows in theirs.items():
        if not their_rows:
            continue  # readelf prints no rows for an FDE without instructions: the CIE's rules
        if _merged(their_rows) != _merged([_our_rule(r) for r in ours[start].rows]):
            differing.append(hex(start))
    assert differing == []


def _signal_fde_starts(path: str) -> list[int]:
    """Starts of the FDEs whose CIE has the 'S' augmentation (signal trampolines), per readelf."""
    out = subprocess.run(
        ["readelf", "--debug-dump=frames", "-W", path], capture_output=True, text=True
    ).stdout
    signal_cies = re.findall(
        r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE\n.*\n  Augmentation: +\"z\w*S\w*\"", out, re.M
    )
    return [
        int(m.group(2), 16)
        for m in re.finditer(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)", out, re.M)
        if m.group(1) in signal_cies
    ]


def test_libc_plt_and_signal_trampoline_are_marked() -> None:
    with ElfFile(LIBC) as elf:
        rows = compile_rows(file_fdes(elf))
    (restore_rt,) = _signal_fde_starts(LIBC)  # __restore_rt
    kinds = {r.cfa_kind for r in rows}
    assert CfaKind.PLT in kinds
    plt = [r for r in rows if r.cfa_kind == CfaKind.PLT]
    assert all(r.cfa_off in (10, 11) for r in plt)  # the PC-in-entry threshold of the expression
    covering = max((r for r in rows if r.pc <= restore_rt), key=lambda r: r.pc)
    assert covering.cfa_kind == CfaKind.SIGNAL


def test_table_is_sorted_gapless_and_round_trips() -> None:
    table = build_table(LIBC)
    assert len(table) % ROW.size == 0
    rows = unpack_rows(table)
    pcs = [r.pc for r in rows]
    assert pcs == sorted(set(pcs))
    # No two neighbours share a rule: runs are merged.
    assert all(a.rule() != b.rule() for a, b in pairwise(rows))
    assert rows[-1].cfa_kind == CfaKind.NONE  # past the last FDE: no table


# A hand-made .eh_frame: CIE "zR" (pcrel|sdata4), FDE with push rbp / mov rbp,rsp /
# remember_state / def_cfa rsp / restore_state, as GCC emits around an early return.
def _cie() -> bytes:
    body = b"\0\0\0\0" + b"\x01" + b"zR\0" + b"\x01" + b"\x78" + b"\x10" + b"\x01" + b"\x1b"
    body += bytes([0x0C, 7, 8, 0x90, 1])  # def_cfa rsp+8; offset ra at cfa-8
    body += b"\0" * (-(len(body) + 4) % 8)
    return len(body).to_bytes(4, "little") + body


def _fde(cie_at: int, at: int, pc: int, size: int, program: bytes) -> bytes:
    pc_field_at = at + 8
    body = (at + 4 - cie_at).to_bytes(4, "little")
    body += (pc - pc_field_at).to_bytes(4, "little", signed=True) + size.to_bytes(4, "little") + b"\0"
    body += program
    body += b"\0" * (-(len(body) + 4) % 8)
    return len(body).to_bytes(4, "little") + body


def test_remember_restore_state_and_pcrel_encoding() -> None:
    cie = _cie()
    program = bytes(
        [
            0x41, 0x0E, 16, 0x86, 2,  # +1: cfa rsp+16, rbp at cfa-16
            0x43, 0x0D, 6,  # +3: cfa rbp+16
            0x45, 0x0A, 0x0C, 7, 8,  # +5: remember; cfa rsp+8 (the early ret)
            0x41, 0x0B,  # +1: restore: rbp+16 again
        ]
    )  # fmt: skip
    data = cie + _fde(0, len(cie), 0x1000, 0x20, program) + b"\0\0\0\0"
    (fde,) = parse_fdes(data, 0)
    assert (fde.start, fde.end) == (0x1000, 0x1020)
    assert fde.rows == [
        Row(0x1000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0),
        Row(0x1001, CfaKind.RSP, 16, RbpKind.AT_CFA, -16),
        Row(0x1004, CfaKind.RBP, 16, RbpKind.AT_CFA, -16),
        Row(0x1009, CfaKind.RSP, 8, RbpKind.AT_CFA, -16),
        Row(0x100A, CfaKind.RBP, 16, RbpKind.AT_CFA, -16),
    ]


def test_fdes_that_share_a_program_get_its_rows_at_their_start_cut_at_their_end() -> None:
    """A program is run once per CIE (ehframe._Programs) and its rows moved to every FDE that has
    it: each FDE gets the rows a run from its own start gives, none at or past its end."""
    cie = _cie()
    program = bytes([0x41, 0x0E, 16, 0x48, 0x0E, 24, 0x44, 0x0E, 8])  # +1: 16, +8: 24, +4: 8
    data = bytearray(cie)
    for pc, size in ((0x1000, 0x20), (0x2000, 0x9), (0x3000, 0x1)):
        data += _fde(0, len(data), pc, size, program)
    fdes = parse_fdes(bytes(data + b"\0\0\0\0"), 0)
    assert [f.rows for f in fdes] == [
        [
            Row(0x1000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0),
            Row(0x1001, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0),
            Row(0x1009, CfaKind.RSP, 24, RbpKind.UNCHANGED, 0),
            Row(0x100D, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0),
        ],
        [
            Row(0x2000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0),
            Row(0x2001, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0),
        ],
        [Row(0x3000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0)],
    ]


def test_a_program_that_sets_the_pc_keeps_its_own_pcs() -> None:
    """DW_CFA_set_loc names an absolute PC (sdata4 here): such a program's rows are not moved to
    the start of another FDE that has the same program, as the other programs' are."""
    cie = _cie()
    program = bytes([0x41, 0x0E, 16, 0x01]) + (0x1010).to_bytes(4, "little") + bytes([0x0E, 24])
    data = bytearray(cie)
    for pc in (0x1000, 0x2000):
        data += _fde(0, len(data), pc, 0x20, program)
    fdes = parse_fdes(bytes(data + b"\0\0\0\0"), 0)
    assert [[(r.pc, r.cfa_off) for r in f.rows] for f in fdes] == [
        [(0x1000, 8), (0x1001, 16), (0x1010, 24)],
        [(0x2000, 8), (0x2001, 16), (0x1010, 24)],
    ]


def test_malformed_cfi_is_a_clear_error(tmp_path: os.PathLike[str]) -> None:
    bad = os.path.join(tmp_path, "bad.so")
    with open(LIBC, "rb") as f:
        data = bytearray(f.read())
    with ElfFile(LIBC) as elf:
        sec = elf.section(".eh_frame")
    assert sec is not None
    data[sec.offset + 0x18 : sec.offset + 0x1C] = (0x7FFFFFF0).to_bytes(4, "little")  # first FDE's length
    with open(bad, "wb") as f:
        f.write(data)
    with pytest.raises(UnwindTableError, match="malformed call frame information"):
        build_table(bad)


def test_an_fdes_augmentation_data_is_skipped_whole() -> None:
    """A "zLR" CIE's FDEs carry an LSDA pointer before their program: the program starts after
    it (the walk skipped its length byte but started one byte early, on the pointer's last byte,
    which happened to be a nop or a rule for a register no row holds in every file tried)."""
    body = b"\0\0\0\0" + b"\x01" + b"zLR\0" + b"\x01" + b"\x78" + b"\x10" + b"\x02" + b"\x1b" + b"\x1b"
    body += bytes([0x0C, 7, 8, 0x90, 1])
    body += b"\0" * (-(len(body) + 4) % 8)
    cie = len(body).to_bytes(4, "little") + body
    at = len(cie)
    # An LSDA pointer ending in 0x0D (def_cfa_register): run, it would take the program's first
    # byte for a register number. The program proper: advance 1, cfa rsp+16.
    lsda = bytes([4]) + bytes([0x00, 0x00, 0x00, 0x0D])
    fde = (at + 4).to_bytes(4, "little") + (0x1000 - (at + 8)).to_bytes(4, "little", signed=True)
    fde += (0x20).to_bytes(4, "little") + lsda + bytes([0x41, 0x0E, 16])
    fde += b"\0" * (-(len(fde) + 4) % 8)
    data = cie + len(fde).to_bytes(4, "little") + fde + b"\0\0\0\0"
    (parsed,) = parse_fdes(data, 0)
    assert parsed.rows == [
        Row(0x1000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0),
        Row(0x1001, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0),
    ]

"""Unwind tables from `.eh_frame` / `.debug_frame`: what the BPF walk reads.

Distribution builds omit frame pointers, so the BPF program cannot follow an
RBP chain through libc, libpython or liblzma. Every such file still carries
call frame information (CFI) in `.eh_frame`. This module evaluates the CFI of
every FDE ahead of time into a table sorted by PC: for each address range, how
to find the CFA (canonical frame address) from RSP or RBP, and where the
caller's RBP was saved. On x86-64 the return address is at CFA - 8; a file
whose CFI says otherwise gets rows the walk treats as "no table here".
An aarch64 file (by its ELF machine) gets the same rows with sp and x29 in
place of RSP and RBP, and where the return address is (x30, or saved) in
the rbp_kind byte's upper bits (`RaKind`, cfa.py `_aarch64_rule`).

Stdlib only (the agent's core has no compiled dependency); the ELF sections
come from `bistouri.elf`, which is pure Python too. This module finds the CIEs and
FDEs; `cfa.py` runs their programs. A distinct short FDE program is run once per
CIE and its rows moved to every FDE that has it (`_Programs`: cc1plus's 49 000 FDEs
have 20 000 programs), and the FDEs' rows are joined into one table (`_compile`).

Row kinds (`CfaKind`) mirror `enum bistouri_cfa_kind` in bpf/bistouri.h.

The CFI comes from files the watched processes map, so it may be hostile: a 10 MB
crafted `.eh_frame` once took the agent to 477 MiB and the OOM killer, because rows
were bounded only once the whole table was built. Parsing is bounded as it goes
(`CfiLimits`: rows, entries, instructions, saved states, section bytes) and rows are
kept packed (`ROW`, 12 bytes each) from the start; a file past a bound is refused
with a reason (`UnwindTableError.reason`, counted by the unwind builder).
"""

from __future__ import annotations

import array
import bisect
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..bpf.abi import RA_SHIFT, RBP_KIND_MASK, CfaKind, RaKind, RbpKind
from ..compat import SLOTS
from ..elf import ElfFile, ElfFormatError, Section
from ..errors import BistouriError
from .cfa import (
    ARCH_OF_MACHINE,
    NO_END,
    ROW,
    X86_64,
    Arch,
    Budget,
    Buffer,
    CfiBoundError,
    CfiLimits,
    Cie,
    Reader,
    State,
    run_program,
)

_PCREL_SDATA4 = 0x1B  # DW_EH_PE_pcrel | DW_EH_PE_sdata4: the FDE pointers of gcc's and clang's .eh_frame
_SDATA4_PAIR = struct.Struct("<ii")  # an FDE's PC begin and range in that encoding
_ADDRESS_MASK = 0xFFFF_FFFF_FFFF_FFFF

# Programs up to this long are evaluated once per CIE (_Programs), what those evaluations may hold.
_MEMO_PROGRAM_BYTES = 256
_MEMO_MAX_BYTES = 16 << 20


class UnwindTableError(BistouriError):
    """A file's call frame information is malformed beyond what can be skipped, or past a bound
    of `CfiLimits` (`reason` names which: the metric label)."""

    def __init__(self, path: str, why: str, reason: str = "malformed") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot build an unwind table for {path}: {why}")


# Why a file's table was refused beyond "malformed" (UnwindTableError.reason).
BOUND_REASONS = (
    "too_many_rows",
    "too_many_entries",
    "program_too_long",
    "too_many_states",
    "section_too_large",
)


@dataclass(frozen=True, **SLOTS)
class Row:
    """From `pc` on (up to the next row), how to unwind a frame."""

    pc: int
    cfa_kind: CfaKind
    cfa_off: int
    rbp_kind: RbpKind
    rbp_off: int
    ra_kind: RaKind = RaKind.CFA  # aarch64's; always CFA (at CFA - 8) on x86-64

    def rule(self) -> tuple[int, int, int, int]:
        return (self.cfa_kind, self.cfa_off, self.rbp_kind, self.rbp_off)


@dataclass(frozen=True, **SLOTS)
class Fde:
    """One FDE evaluated: its PC range and its rows (the first at `start`), packed."""

    start: int
    end: int
    packed: bytes  # ROW each: PCs rising from `start`, all below `end`, no rule twice in a row

    @property
    def rows(self) -> list[Row]:
        return unpack_rows(self.packed)


class _Packer:
    """FDEs' rows packed into ROW records, one struct.pack call an FDE."""

    __slots__ = ("structs",)

    def __init__(self) -> None:
        self.structs: dict[int, struct.Struct] = {}  # rows -> "<IQ" that many times (ROW's layout)

    def pack(self, start: int, pcs: Sequence[int], rules: Sequence[int]) -> bytes:
        """ROW records of (start + pc, rule) each."""
        n = len(pcs)
        st = self.structs.get(n)
        if st is None:
            st = self.structs[n] = struct.Struct("<" + "IQ" * n)
        flat: list[int] = [0] * (2 * n)
        flat[0::2] = [start + pc for pc in pcs] if start else pcs
        flat[1::2] = rules
        return st.pack(*flat)


def _parse_cie(r: Reader, view: memoryview, end: int, debug_frame: bool, arch: Arch) -> Cie:
    version = r.u8()
    aug = r.cstr()
    address_size = 8
    if debug_frame and version >= 4:
        address_size = r.u8()
        r.u8()  # segment selector size
    if aug.startswith(b"eh"):
        r.pos += 8
    code_align = r.uleb()
    data_align = r.sleb()
    ra_reg = r.u8() if version == 1 else r.uleb()
    fde_enc = 0x00
    lsda_enc = 0xFF
    signal = False
    has_z = aug.startswith(b"z")
    if has_z:
        aug_len = r.uleb()
        aug_end = r.pos + aug_len
        for ch in aug[1:]:
            if ch == ord("R"):
                fde_enc = r.u8()
            elif ch == ord("L"):
                lsda_enc = r.u8()
            elif ch == ord("P"):
                penc = r.u8()
                r.encoded(penc & 0x7F)  # personality routine: not needed
            elif ch == ord("S"):
                signal = True
            elif ch in (ord("B"), ord("G")):  # AArch64 key / MTE: no data
                pass
            else:
                break  # unknown letter: the length lets us skip the rest
        r.pos = aug_end
    elif aug not in (b"", b"eh"):
        raise ValueError(f"CIE augmentation {aug!r} without 'z'")
    instructions = view[r.pos : end]
    return Cie(
        code_align, data_align, ra_reg, fde_enc, lsda_enc, signal, has_z, instructions, address_size, arch
    )


def parse_fdes(
    data: bytes,
    address: int,
    *,
    debug_frame: bool = False,
    limits: CfiLimits | None = None,
    arch: Arch = X86_64,
) -> list[Fde]:
    """Every FDE of one `.eh_frame` (loaded at `address`) or `.debug_frame` section, evaluated."""
    return _parse(data, address, debug_frame, Budget(limits or CfiLimits()), arch)


def _parse(data: bytes, address: int, debug_frame: bool, budget: Budget, arch: Arch = X86_64) -> list[Fde]:
    limits = budget.limits
    if len(data) > limits.max_section_bytes:
        raise CfiBoundError("section_too_large", limits.max_section_bytes)
    # An honest section runs at most one instruction per byte (entries do not overlap); a CIE
    # "parsed where it lies" lets a hostile one run the same bytes again and again.
    budget.ops = len(data) + limits.max_ops
    cies: dict[int, Cie] = {}
    initial: dict[int, State] = {}
    programs = _Programs(budget)
    out: list[Fde] = []
    pos = 0
    size = len(data)
    view = memoryview(data)  # programs are run from slices of it: no copies
    while pos + 4 <= size:
        length = struct.unpack_from("<I", data, pos)[0]
        hdr = 4
        if length == 0:
            if debug_frame:
                pos += 4
                continue
            break  # .eh_frame terminator
        if length == 0xFFFF_FFFF:
            length = struct.unpack_from("<Q", data, pos + 4)[0]
            hdr = 12
        start = pos
        body = pos + hdr
        end = body + length
        if end > size:
            raise ValueError(f"entry at 0x{pos:x} runs past the section end")
        budget.entry()
        wide = hdr == 12
        cie_id = struct.unpack_from("<Q" if wide else "<I", data, body)[0]
        idsize = 8 if wide else 4
        r = Reader(data, body + idsize, address)
        is_cie = (cie_id == (0xFFFF_FFFF_FFFF_FFFF if wide else 0xFFFF_FFFF)) if debug_frame else cie_id == 0
        if is_cie:
            cie = _parse_cie(r, view, end, debug_frame, arch)
            cies[start] = cie
            initial[start] = run_program(cie, cie.instructions, 0, None, budget).state
        else:
            cie_at = cie_id if debug_frame else body - cie_id
            cie_or_none = cies.get(cie_at)
            if cie_or_none is None:
                # A CIE after its FDE is legal though rare: parse it where it lies.
                budget.entry()
                cr_len = struct.unpack_from("<I", data, cie_at)[0]
                cr = Reader(data, cie_at + 4 + idsize, address)
                cie_or_none = _parse_cie(cr, view, cie_at + 4 + cr_len, debug_frame, arch)
                cies[cie_at] = cie_or_none
                initial[cie_at] = run_program(cie_or_none, cie_or_none.instructions, 0, None, budget).state
            cie = cie_or_none
            if debug_frame:
                pc_begin = r.unpack("<Q", 8)
                pc_range = r.unpack("<Q", 8)
            elif cie.fde_encoding == _PCREL_SDATA4:  # gcc's and clang's: read inline, as r.encoded would
                at = r.pos
                begin, pc_range = _SDATA4_PAIR.unpack_from(data, at)
                pc_begin = (address + at + begin) & _ADDRESS_MASK
                pc_range &= _ADDRESS_MASK
                r.pos = at + 8
            else:
                pc_begin = r.encoded(cie.fde_encoding)
                pc_range = r.encoded(cie.fde_encoding & 0x0F)
            if cie.has_z:
                aug_len = r.uleb()  # augmentation data (LSDA pointer): skipped, after its length
                r.pos += aug_len
            if pc_range:
                out.append(programs.fde(cie, cie_at, initial[cie_at], view[r.pos : end], pc_begin, pc_range))
        pos = end
    return out


class _Programs:
    """FDEs evaluated, each distinct short program once per CIE (`_MEMO_PROGRAM_BYTES`).

    Most FDEs of a large binary run a program another one has (cc1plus: 49 000 FDEs, 20 000
    programs): its rows are kept relative to the FDE's start and moved to each FDE's, cut at its
    end (rows only ever advance, so the rows before the end are those a run from that start gives).
    Bounded in bytes (`_MEMO_MAX_BYTES`): a hostile file of distinct programs is only run
    uncached; rows are kept as arrays (12 bytes each, not two int objects). Every FDE's rows count
    against the budget, cached or not."""

    __slots__ = ("budget", "bytes", "memo", "packer", "rules_of")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.packer = _Packer()
        self.memo: dict[tuple[int, bytes], tuple[array.array[int], array.array[int]]] = {}
        self.bytes = 0
        self.rules_of: dict[tuple[object, ...], int] = {}

    def fde(self, cie: Cie, cie_at: int, initial: State, program: Buffer, start: int, size: int) -> Fde:
        rows = None
        if len(program) <= _MEMO_PROGRAM_BYTES:
            key = (cie_at, bytes(program))
            rows = self.memo.get(key)
            if rows is None and self.bytes < _MEMO_MAX_BYTES:
                ev = run_program(cie, key[1], 0, initial, self.budget, NO_END, self.rules_of)
                if ev.relative and (not ev.pcs or ev.pcs[-1] <= 0xFFFF_FFFF):  # no set_loc in it
                    rows = self.memo[key] = (array.array("I", ev.pcs), array.array("Q", ev.rules))
                    self.bytes += len(key[1]) + 12 * len(ev.pcs) + 250  # and the entry's objects
        pcs: Sequence[int]
        bits: Sequence[int]
        if rows is None:
            ev = run_program(cie, program, start, initial, self.budget, start + size, self.rules_of)
            pcs, bits, base = ev.pcs, ev.rules, 0
        else:
            pcs, bits = rows
            if pcs and pcs[-1] >= size:
                cut = bisect.bisect_left(pcs, size)
                pcs, bits = pcs[:cut], bits[:cut]
            if pcs and start + pcs[-1] > 0xFFFF_FFFF:
                raise ValueError(f"PC 0x{start + pcs[-1]:x} does not fit the 32-bit rows")
            base = start
        budget = self.budget
        budget.rows -= len(pcs)
        if budget.rows < 0:
            raise CfiBoundError("too_many_rows", budget.limits.max_rows)
        return Fde(start, start + size, self.packer.pack(base, pcs, bits))


def file_fdes(elf: ElfFile, limits: CfiLimits | None = None, debug_frame: bool = True) -> list[Fde]:
    """FDEs of `.eh_frame`, plus (`debug_frame`) those of `.debug_frame` covering PCs `.eh_frame`
    leaves out. Both sections share one budget of `limits`. The registers are the ELF machine's
    (`cfa.ARCH_OF_MACHINE`: aarch64's, else x86-64's)."""
    budget = Budget(limits or CfiLimits())
    arch = ARCH_OF_MACHINE.get(elf.machine, X86_64)
    fdes: list[Fde] = []
    sec = elf.section(".eh_frame")
    try:
        if sec is not None and sec.size:
            fdes = _parse(_section(elf, sec, budget.limits), sec.addr, False, budget, arch)
        dbg = elf.section(".debug_frame") if debug_frame else None
        if dbg is not None and dbg.size and dbg.type != 8:
            covered = sorted((f.start, f.end) for f in fdes)
            starts = [s for s, _ in covered]
            for f in _parse(_section(elf, dbg, budget.limits), 0, True, budget, arch):
                i = bisect.bisect_right(starts, f.start) - 1
                if i >= 0 and covered[i][1] > f.start:
                    continue
                fdes.append(f)
    except CfiBoundError as e:
        raise UnwindTableError(elf.path, str(e), e.reason) from e
    except (ValueError, IndexError, struct.error) as e:
        raise UnwindTableError(elf.path, f"malformed call frame information ({e})") from e
    return fdes


def _section(elf: ElfFile, sec: Section, limits: CfiLimits) -> bytes:
    # Checked before reading: a compressed .debug_frame inflates to what its header says.
    if sec.size > limits.max_section_bytes:
        raise CfiBoundError("section_too_large", limits.max_section_bytes)
    return elf.section_data(sec)


def _compile(fdes: list[Fde]) -> bytearray:
    """One table sorted by PC, packed: each FDE's rows, a NONE row where no FDE covers, runs merged."""
    out = bytearray()
    last: tuple[int, int, int, int, int] | None = None  # pc, cfa_off, rbp_off, kind, rbp_kind
    size = ROW.size
    for f in sorted(fdes, key=lambda f: f.start):
        if last is not None and last[0] >= f.start and last[3] == CfaKind.NONE:
            del out[-size:]  # the previous FDE's end marker: this one starts there
            last = ROW.unpack_from(out, len(out) - size) if out else None
        marker = (f.end, 0, 0, CfaKind.NONE, RbpKind.UNCHANGED)
        rows = f.packed
        for i, row in enumerate(itertools.chain(ROW.iter_unpack(rows), (marker,))):
            if i == 1 and last is not None and last[0] < row[0]:
                # An FDE's own rows rise in PC with no rule twice in a row, and its end is past
                # them, the marker's rule (NONE) none of them: past its first row, all go in as
                # they are (the rest of this loop would keep every one).
                if f.end > 0xFFFF_FFFF:
                    raise ValueError(f"PC 0x{f.end:x} does not fit the 32-bit rows")
                out += rows[size:]
                out += ROW.pack(*marker)
                last = marker
                break
            if last is not None and last[0] == row[0]:
                del out[-size:]
                last = ROW.unpack_from(out, len(out) - size) if out else None
            if last is not None and last[1:] == row[1:]:
                continue
            if row[0] > 0xFFFF_FFFF:
                raise ValueError(f"PC 0x{row[0]:x} does not fit the 32-bit rows")
            out += ROW.pack(*row)
            last = row
    return out


def compile_rows(fdes: list[Fde]) -> list[Row]:
    """One table sorted by PC: each FDE's rows, a NONE row where no FDE covers, runs merged."""
    return unpack_rows(bytes(_compile(fdes)))


def build_table(path: str, limits: CfiLimits | None = None) -> bytes:
    """The packed rows (`ROW` each) of the file at `path`; b"" when it has no call frame information."""
    try:
        with ElfFile(path) as elf:
            fdes = _go_fdes(elf, limits or CfiLimits())
            if fdes is None:
                fdes = file_fdes(elf, limits)
        return bytes(_compile(fdes))
    except ElfFormatError as e:
        raise UnwindTableError(path, str(e)) from e
    except ValueError as e:
        raise UnwindTableError(path, str(e)) from e


def _go_fdes(elf: ElfFile, limits: CfiLimits) -> list[Fde] | None:
    """A Go binary's FDEs from its pclntab (goframes.py), with the `.eh_frame` ones of its C code
    (cgo) outside them; None when the file is not Go. Go's own `.debug_frame` is not read: the
    pclntab says the same, and more (the outermost frames). amd64's frame layout only: another
    machine's Go binary gets its `.eh_frame`/`.debug_frame` rows."""
    if elf.machine in ARCH_OF_MACHINE:
        return None
    # Here, not at import: only a table being built reads it, and record's runs on tables from the
    # cache take no Go reader (goframes and gopclntab, ~1.3 ms).
    from .goframes import go_functions

    try:
        funcs = go_functions(elf, limits.max_rows)
    except ValueError as e:
        raise UnwindTableError(elf.path, f"Go stack table: {e}", "too_many_rows") from e
    if funcs is None:
        return None
    fdes = [Fde(start, end, b"".join(ROW.pack(*r) for r in rows)) for start, end, rows in funcs]
    if elf.section(".eh_frame") is not None:
        starts = [f.start for f in fdes]
        for f in file_fdes(elf, limits, debug_frame=False):
            i = bisect.bisect_right(starts, f.start) - 1
            if (i < 0 or fdes[i].end <= f.start) and (i + 1 >= len(fdes) or f.end <= fdes[i + 1].start):
                fdes.append(f)
    return fdes


def unpack_rows(table: bytes) -> list[Row]:
    return [
        Row(
            pc,
            CfaKind(kind),
            cfa_off,
            RbpKind(rbp_kind & RBP_KIND_MASK),
            rbp_off,
            RaKind(rbp_kind >> RA_SHIFT),
        )
        for pc, cfa_off, rbp_off, kind, rbp_kind in ROW.iter_unpack(table)
    ]


# The frame-pointer rule: CFA = RBP + 16, the caller's RBP saved at CFA - 16 (push %rbp; mov %rsp,%rbp).
_FP_RULE = (CfaKind.RBP, 16, RbpKind.AT_CFA, -16)
_PROLOGUE_BYTES = 32  # push %rbp to mov %rsp,%rbp: gcc schedules a few instructions between
_PLT_HEADER_BYTES = 16  # the linker's .plt0 (push, jmp): RSP rows just before the entries' PLT row


def callers_by_frame_pointer(table: bytes) -> bool:
    """Whether, in this x86-64 table, every row that can hold a return address is the frame-pointer
    rule or one the walk already takes by frame pointer (NONE, OTHER), so that a caller's frame in
    the file is walked by frame pointer without a row search, with the same result (the BPF walk,
    bpf/unwind.bpf.h `frame_rule_how`). A return address is the end of a call instruction, and the
    rows no call can end in are:

    - CFA = RSP + 8 (a function's entry, or past its epilogue): the psABI has RSP 16-byte aligned
      at a call, so there the CFA is RSP + 16n, never RSP + 8;
    - the FP prologue, CFA = RSP + 16 with RBP saved (after `push %rbp`), when the frame-pointer
      rule follows it within `_PROLOGUE_BYTES`: compilers set the frame pointer before any call
      (a callee's frame chain would skip the function otherwise: what -fno-omit-frame-pointer is
      for); a frameless function keeping RBP as a saved register (`push %rbp; ... call`) has no
      frame-pointer row after it, and unmarks the file;
    - PLT rows and the linker's .plt0 rows before them (entries and header jump, never call);
    - END rows (`_start`, `clone`): they hold calls, but the psABI marks the outermost frame with
      RBP = 0, and the walk searches a frame whose RBP is 0 (the frame pointer cannot be right).

    Anything else (a frameless function's body: CFA = RSP + 16n with calls in it, a SIGNAL row,
    whose return address is `__restore_rt` a signal handler returns to) leaves the file unmarked:
    its callers' rows are searched as before. A leaf's PC, or one after a signal frame, is where the
    thread was, not a return address, and is always searched."""
    n = len(table) // ROW.size

    def row(i: int) -> tuple[int, int, int, int, int]:
        return ROW.unpack_from(table, i * ROW.size)

    for i, (pc, cfa_off, rbp_off, kind, rbp_kind) in enumerate(ROW.iter_unpack(table)):
        if kind in (CfaKind.NONE, CfaKind.OTHER, CfaKind.PLT, CfaKind.END):
            continue
        if (kind, cfa_off, rbp_kind, rbp_off) == _FP_RULE:
            continue
        if rbp_kind >> RA_SHIFT or kind != CfaKind.RSP:
            return False  # aarch64's rows, a SIGNAL row, another RBP offset
        if cfa_off == 8:
            continue
        after = row(i + 1) if i + 1 < n else None
        if (
            after is not None
            and cfa_off == 16
            and (rbp_kind, rbp_off) == (RbpKind.AT_CFA, -16)
            and after[0] - pc <= _PROLOGUE_BYTES
            and (after[3], after[1], after[4], after[2]) == _FP_RULE
        ):
            continue  # up to mov %rsp,%rbp
        plt = next((r for r in map(row, range(i + 1, min(i + 3, n))) if r[3] != CfaKind.RSP), None)
        if plt is not None and plt[3] == CfaKind.PLT and plt[0] - pc <= _PLT_HEADER_BYTES:
            continue  # .plt0
        return False
    return True

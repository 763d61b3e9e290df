"""Unwind tables from `.eh_frame` / `.debug_frame`: what the BPF walk reads.

Distribution builds omit frame pointers, so the BPF program cannot follow an
RBP chain through libc, libpython or liblzma. Every such file still carries
call frame information (CFI) in `.eh_frame`. This module evaluates the CFI of
every FDE ahead of time into a table sorted by PC: for each address range, how
to find the CFA (canonical frame address) from RSP or RBP, and where the
caller's RBP was saved. On x86-64 the return address is at CFA - 8; a file
whose CFI says otherwise gets rows the walk treats as "no table here".

Stdlib only (the agent's core has no compiled dependency); the ELF sections
come from `bistouri.elf`, which is pure Python too.

Row kinds (`CfaKind`) mirror `enum bistouri_cfa_kind` in bpf/bistouri.h.

The CFI comes from files the watched processes map, so it may be hostile: a 10 MB
crafted `.eh_frame` once took the agent to 477 MiB and the OOM killer, because rows
were bounded only once the whole table was built. Parsing is bounded as it goes
(`CfiLimits`: rows, entries, instructions, saved states, section bytes) and rows are
kept packed (`ROW`, 12 bytes each) from the start; a file past a bound is refused
with a reason (`UnwindTableError.reason`, counted by the unwind builder).
"""

from __future__ import annotations

import bisect
import itertools
import struct
from dataclasses import dataclass

from ..bpf.abi import CfaKind, RbpKind
from ..elf import ElfFile, ElfFormatError, Section
from ..errors import BistouriError

# x86-64 DWARF register numbers.
REG_RBP = 6
REG_RSP = 7
REG_RA = 16


# One row as the BPF program reads it (struct bistouri_unwind_row).
ROW = struct.Struct("<IihBB")

# The two CFA expressions of .plt entries (binutils): RSP + 8 + ((RIP & 15) >= N) << 3.
_PLT_EXPR_HEAD = bytes([0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A])
_PLT_EXPR_TAIL = bytes([0x2A, 0x33, 0x24, 0x22])
_DW_OP_LIT0 = 0x30

_MAX_OFFSET = (1 << 31) - 1

Buffer = bytes | memoryview  # programs and expressions: slices of the section, not copies


class UnwindTableError(BistouriError):
    """A file's call frame information is malformed beyond what can be skipped, or past a bound
    of `CfiLimits` (`reason` names which: the metric label)."""

    def __init__(self, path: str, why: str, reason: str = "malformed") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot build an unwind table for {path}: {why}")


class CfiBoundError(ValueError):
    """Parsing stopped at a bound of `CfiLimits`."""

    def __init__(self, reason: str, bound: int) -> None:
        super().__init__(f"{reason.replace('_', ' ')} (bound {bound})")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CfiLimits:
    """What parsing one file may cost. The defaults hold every file of a Debian system (libc has
    28 000 rows, python3.11 65 000) and keep the worst case to tens of MiB."""

    max_rows: int = 1 << 20  # the whole file's rows: what the BPF array holds (unwind_rows)
    max_entries: int = 1 << 17  # CIEs and FDEs
    max_ops: int = 1 << 16  # instructions of one CIE's or FDE's program
    max_states: int = 64  # remember_state depth
    max_section_bytes: int = 64 << 20  # .eh_frame or .debug_frame


# Why a file's table was refused beyond "malformed" (UnwindTableError.reason).
BOUND_REASONS = (
    "too_many_rows",
    "too_many_entries",
    "program_too_long",
    "too_many_states",
    "section_too_large",
)


class _Budget:
    """What is left of a file's `CfiLimits` as parsing goes."""

    __slots__ = ("entries", "limits", "ops", "rows")

    def __init__(self, limits: CfiLimits) -> None:
        self.limits = limits
        self.rows = limits.max_rows
        self.entries = limits.max_entries
        self.ops = 0  # instructions left for the section being parsed (see _parse)

    def entry(self) -> None:
        self.entries -= 1
        if self.entries < 0:
            raise CfiBoundError("too_many_entries", self.limits.max_entries)


@dataclass(frozen=True, slots=True)
class Row:
    """From `pc` on (up to the next row), how to unwind a frame."""

    pc: int
    cfa_kind: CfaKind
    cfa_off: int
    rbp_kind: RbpKind
    rbp_off: int

    def rule(self) -> tuple[int, int, int, int]:
        return (self.cfa_kind, self.cfa_off, self.rbp_kind, self.rbp_off)


@dataclass(frozen=True, slots=True)
class Fde:
    """One FDE evaluated: its PC range and its rows (the first at `start`), packed."""

    start: int
    end: int
    packed: bytes  # ROW each, in PC order, runs merged

    @property
    def rows(self) -> list[Row]:
        return unpack_rows(self.packed)


@dataclass(slots=True)
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_encoding: int
    lsda_encoding: int
    signal: bool
    has_z: bool
    instructions: Buffer
    address_size: int


@dataclass(slots=True)
class _State:
    """The rule set as the CFA program runs: CFA (register, offset or expression) and RBP/RA rules."""

    cfa_reg: int = REG_RSP
    cfa_off: int = 8
    cfa_expr: Buffer | None = None
    rbp: tuple[str, int] = ("same", 0)  # ("same"|"offset"|"other", n)
    ra: tuple[str, int] = ("offset", -8)

    def copy(self) -> _State:
        return _State(self.cfa_reg, self.cfa_off, self.cfa_expr, self.rbp, self.ra)


class _Reader:
    __slots__ = ("base", "data", "pos")

    def __init__(self, data: Buffer, pos: int = 0, base: int = 0) -> None:
        self.data = data
        self.pos = pos
        self.base = base  # address of data[0] when loaded (for pcrel)

    def u8(self) -> int:
        v = self.data[self.pos]
        self.pos += 1
        return v

    def unpack(self, fmt: str, size: int) -> int:
        v: int = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return v

    def uleb(self) -> int:
        result = shift = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    def sleb(self) -> int:
        result = shift = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                if b & 0x40:
                    result -= 1 << shift
                return result

    def cstr(self) -> bytes:
        """A NUL-terminated string of at most 255 bytes (an augmentation)."""
        head = bytes(self.data[self.pos : self.pos + 256])
        s = head[: head.index(b"\0")]
        self.pos += len(s) + 1
        return s

    def encoded(self, enc: int, data_base: int = 0) -> int:
        """A pointer in DW_EH_PE encoding `enc` (application bits: pcrel, datarel; absptr otherwise)."""
        if enc == 0xFF:
            return 0
        at = self.base + self.pos
        fmt = enc & 0x0F
        if fmt == 0x00:
            v = self.unpack("<Q", 8)
        elif fmt == 0x01:
            v = self.uleb()
        elif fmt == 0x02:
            v = self.unpack("<H", 2)
        elif fmt == 0x03:
            v = self.unpack("<I", 4)
        elif fmt == 0x04:
            v = self.unpack("<Q", 8)
        elif fmt == 0x09:
            v = self.sleb()
        elif fmt == 0x0A:
            v = self.unpack("<h", 2)
        elif fmt == 0x0B:
            v = self.unpack("<i", 4)
        elif fmt == 0x0C:
            v = self.unpack("<q", 8)
        else:
            raise ValueError(f"pointer encoding 0x{enc:02x}")
        app = enc & 0x70
        if app == 0x10:
            v += at
        elif app == 0x30:
            v += data_base
        elif app not in (0x00,):
            raise ValueError(f"pointer application 0x{enc:02x}")
        return v & 0xFFFF_FFFF_FFFF_FFFF


def _encoded_size(enc: int) -> int:
    return {0x00: 8, 0x02: 2, 0x03: 4, 0x04: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}.get(enc & 0x0F, 8)


def _plt_threshold(expr: Buffer) -> int | None:
    """N of the .plt CFA expression RSP + 8 + (((RIP & 15) >= N) << 3), or None."""
    if len(expr) == 11 and expr[:6] == _PLT_EXPR_HEAD and expr[7:] == _PLT_EXPR_TAIL:
        lit = expr[6] - _DW_OP_LIT0
        if 0 <= lit < 32:
            return lit
    return None


# A rule as ROW packs it after the PC: CFA offset, RBP offset, CFA kind, RBP kind.
Rule = tuple[int, int, int, int]
_SIGNAL: Rule = (0, 0, CfaKind.SIGNAL, RbpKind.OTHER)
_END: Rule = (0, 0, CfaKind.END, RbpKind.UNCHANGED)
_OTHER: Rule = (0, 0, CfaKind.OTHER, RbpKind.OTHER)


def _rule_bits(rule: Rule) -> int:
    """A rule as the 8 bytes after the PC in ROW, read as one little-endian integer."""
    return int.from_bytes(ROW.pack(0, *rule)[4:], "little")


class _Packer:
    """FDEs' rows packed into ROW records, one struct.pack call an FDE."""

    __slots__ = ("structs",)

    def __init__(self) -> None:
        self.structs: dict[int, struct.Struct] = {}  # rows -> "<IQ" that many times (ROW's layout)

    def pack(self, start: int, pcs: list[int], rules: list[int]) -> bytes:
        """ROW records of (start + pc, rule) each."""
        n = len(pcs)
        st = self.structs.get(n)
        if st is None:
            st = self.structs[n] = struct.Struct("<" + "IQ" * n)
        flat: list[int] = [0] * (2 * n)
        flat[0::2] = [start + pc for pc in pcs] if start else pcs
        flat[1::2] = rules
        return st.pack(*flat)


# A rule as the CFA program leaves it: (kind, n) for RBP and the return address.
_SAME = ("same", 0)
_RA_AT_CFA_MINUS_8 = ("offset", -8)
_NO_END = 1 << 64  # rows wherever the program puts them (relative ones, cut per FDE)
_MEMO_PROGRAM_BYTES = 256  # FDE programs up to this long are evaluated once per file (_Programs)
_MEMO_MAX_BYTES = 16 << 20  # what those evaluations may hold, about
_RULES_CACHED = 4096  # distinct rule sets remembered per file (_run's rules_of)


def _rule(
    cfa_reg: int,
    cfa_off: int,
    cfa_expr: Buffer | None,
    rbp: tuple[str, int],
    ra: tuple[str, int],
    signal: bool,
) -> Rule:
    if signal:
        return _SIGNAL
    if ra[0] == "undefined":
        return _END
    if ra != _RA_AT_CFA_MINUS_8:
        return _OTHER
    if cfa_expr is not None:
        n = _plt_threshold(cfa_expr)
        kind, off = (CfaKind.PLT, n) if n is not None else (CfaKind.OTHER, 0)
    elif cfa_reg == REG_RSP and 0 <= cfa_off <= _MAX_OFFSET:
        kind, off = CfaKind.RSP, cfa_off
    elif cfa_reg == REG_RBP and 0 <= cfa_off <= _MAX_OFFSET:
        kind, off = CfaKind.RBP, cfa_off
    else:
        kind, off = CfaKind.OTHER, 0
    how, n = rbp
    if how == "same":
        return (off, 0, kind, RbpKind.UNCHANGED)
    if how == "offset" and -32768 <= n <= 32767:
        return (off, n, kind, RbpKind.AT_CFA)
    return (off, 0, kind, RbpKind.OTHER)


def _uleb(data: Buffer, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def _sleb(data: Buffer, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, pos


@dataclass(slots=True)
class _Evaluated:
    """What a CFA program run leaves: the rule set after it, and its rows (see _run)."""

    state: _State
    pcs: list[int]
    rules: list[int]  # as _rule_bits
    relative: bool  # no set_loc: the rows' PCs are the start's plus what the program advanced


def _run(
    cie: _Cie,
    program: Buffer,
    start: int,
    initial: _State | None,
    budget: _Budget,
    end: int = -1,
    rules_of: dict[tuple[object, ...], int] | None = None,
) -> _Evaluated:
    """Run a CFA program from `start`, a row at each advance while the PC is below `end` (none
    by default: the CIE's initial rules): the last row of a PC kept, runs of one rule merged.
    The rows' rules are in ROW's bytes after the PC (`_rule_bits`). `rules_of`: those already
    worked out, by rule set (a file has few distinct ones).

    One loop with the rule set in locals (the hottest code of a table build): a file's CFI has
    hundreds of thousands of instructions."""
    if initial is None:
        cfa_reg, cfa_off, cfa_expr, rbp, ra = REG_RSP, 8, None, _SAME, _RA_AT_CFA_MINUS_8
    else:
        cfa_reg, cfa_off, cfa_expr, rbp, ra = (
            initial.cfa_reg,
            initial.cfa_off,
            initial.cfa_expr,
            initial.rbp,
            initial.ra,
        )
    limits = budget.limits
    ops = min(limits.max_ops, budget.ops)
    budget_ops = budget.ops
    stack: list[tuple[int, int, Buffer | None, tuple[str, int], tuple[str, int]]] = []
    pcs: list[int] = []
    rules: list[int] = []
    last_pc = -1
    last_rule = -1
    rule = -1  # of the current rule set, once computed; -1 after any change
    relative = True
    if rules_of is None:
        rules_of = {}
    code_align, data_align, ra_reg, signal = cie.code_align, cie.data_align, cie.ra_reg, cie.signal
    loc = start
    pos = 0
    n = len(program)
    data = program
    while True:
        advance = -1
        if pos < n:
            ops -= 1
            if ops < 0:
                budget.ops = budget_ops - (min(limits.max_ops, budget_ops) - ops)
                raise CfiBoundError("program_too_long", limits.max_ops)
            op = data[pos]
            pos += 1
            hi = op & 0xC0
            if hi == 0x40:
                advance = op & 0x3F
            elif hi == 0x80:
                v = data[pos]
                if v < 0x80:
                    pos += 1
                else:
                    v, pos = _uleb(data, pos)
                reg = op & 0x3F
                if reg == REG_RBP:
                    rbp = ("offset", v * data_align)
                elif reg == ra_reg:
                    ra = ("offset", v * data_align)
                rule = -1
                continue
            elif hi == 0xC0:
                if initial is not None:
                    reg = op & 0x3F
                    if reg == REG_RBP:
                        rbp = initial.rbp
                    elif reg == ra_reg:
                        ra = initial.ra
                    rule = -1
                continue
            elif op == 0x0E:  # def_cfa_offset
                cfa_off = data[pos]
                if cfa_off < 0x80:
                    pos += 1
                else:
                    cfa_off, pos = _uleb(data, pos)
                rule = -1
                continue
            elif op == 0x00:
                continue
            elif op == 0x02:
                advance = data[pos]
                pos += 1
            elif op == 0x0A:
                if len(stack) >= limits.max_states:
                    raise CfiBoundError("too_many_states", limits.max_states)
                stack.append((cfa_reg, cfa_off, cfa_expr, rbp, ra))
                continue
            elif op == 0x0B:
                if stack:  # the whole row comes back, CFA rules too (DWARF 5 6.4.2.4)
                    cfa_reg, cfa_off, cfa_expr, rbp, ra = stack.pop()
                    rule = -1
                continue
            elif op == 0x0C:
                cfa_reg, pos = _uleb(data, pos)
                cfa_off, pos = _uleb(data, pos)
                cfa_expr = None
                rule = -1
                continue
            elif op == 0x0D:
                cfa_reg, pos = _uleb(data, pos)
                cfa_expr = None
                rule = -1
                continue
            else:
                pos, advance, new_loc, state = _rare_op(
                    cie, data, pos, op, (cfa_reg, cfa_off, cfa_expr, rbp, ra), initial, limits
                )
                cfa_reg, cfa_off, cfa_expr, rbp, ra = state
                rule = -1
                if new_loc is None:
                    if advance < 0:
                        continue
                else:  # set_loc: a row at the old PC, then the new one
                    relative = False
                    advance = -2
        # A row at loc (an advance, a set_loc, or the end of the program), then the PC moves.
        if loc < end:
            if rule < 0:
                rule_set = (cfa_reg, cfa_off, cfa_expr, rbp, ra, signal)
                rule = rules_of.get(rule_set, -1)
                if rule < 0:
                    rule = _rule_bits(_rule(cfa_reg, cfa_off, cfa_expr, rbp, ra, signal))
                    if len(rules_of) < _RULES_CACHED:
                        rules_of[rule_set] = rule
            if loc == last_pc:
                pcs.pop()
                rules.pop()
                last_rule = rules[-1] if rules else -1
                last_pc = -1
            if rule != last_rule:
                if end != _NO_END and not 0 <= loc <= 0xFFFF_FFFF:
                    raise ValueError(f"PC 0x{loc:x} does not fit the 32-bit rows")
                pcs.append(loc)
                rules.append(rule)
                last_pc, last_rule = loc, rule
        if advance >= 0:
            loc += advance * code_align
        elif advance == -2:
            loc = new_loc  # type: ignore[assignment]
        else:
            break
    budget.ops = budget_ops - (min(limits.max_ops, budget_ops) - ops)
    return _Evaluated(_State(cfa_reg, cfa_off, cfa_expr, rbp, ra), pcs, rules, relative)


_RuleSet = tuple[int, int, "Buffer | None", tuple[str, int], tuple[str, int]]


def _rare_op(
    cie: _Cie, data: Buffer, pos: int, op: int, state: _RuleSet, initial: _State | None, limits: CfiLimits
) -> tuple[int, int, int | None, _RuleSet]:
    """The instructions _run's loop leaves out: (position after, advance or -1, set_loc's new PC
    or None, the rule set after)."""
    cfa_reg, cfa_off, cfa_expr, rbp, ra = state
    advance = -1
    new_loc = None

    def set_reg(reg: int, rule: tuple[str, int]) -> None:
        nonlocal rbp, ra
        if reg == REG_RBP:
            rbp = rule
        elif reg == cie.ra_reg:
            ra = rule

    if op == 0x01:  # set_loc
        r = _Reader(data, pos)
        new_loc = r.encoded(cie.fde_encoding & 0x0F) if cie.has_z else r.unpack("<Q", 8)
        pos = r.pos
    elif op == 0x03:
        advance = struct.unpack_from("<H", data, pos)[0]
        pos += 2
    elif op == 0x04:
        advance = struct.unpack_from("<I", data, pos)[0]
        pos += 4
    elif op == 0x05:
        reg, pos = _uleb(data, pos)
        v, pos = _uleb(data, pos)
        set_reg(reg, ("offset", v * cie.data_align))
    elif op == 0x06:
        reg, pos = _uleb(data, pos)
        if initial is not None:
            if reg == REG_RBP:
                rbp = initial.rbp
            elif reg == cie.ra_reg:
                ra = initial.ra
    elif op == 0x07:
        reg, pos = _uleb(data, pos)
        set_reg(reg, ("undefined", 0))
    elif op == 0x08:
        reg, pos = _uleb(data, pos)
        set_reg(reg, _SAME)
    elif op == 0x09:
        reg, pos = _uleb(data, pos)
        _, pos = _uleb(data, pos)
        set_reg(reg, ("other", 0))
    elif op == 0x0F:
        size, pos = _uleb(data, pos)
        cfa_expr = bytes(data[pos : pos + size])  # hashable: _run looks rules up by state
        pos += size
    elif op == 0x10 or op == 0x16:  # expression, val_expression
        reg, pos = _uleb(data, pos)
        size, pos = _uleb(data, pos)
        pos += size
        set_reg(reg, ("other", 0))
    elif op == 0x11:
        reg, pos = _uleb(data, pos)
        v, pos = _sleb(data, pos)
        set_reg(reg, ("offset", v * cie.data_align))
    elif op == 0x12:
        cfa_reg, pos = _uleb(data, pos)
        v, pos = _sleb(data, pos)
        cfa_off = v * cie.data_align
        cfa_expr = None
    elif op == 0x13:
        v, pos = _sleb(data, pos)
        cfa_off = v * cie.data_align
    elif op == 0x14 or op == 0x15:  # val_offset(_sf): a value, not a save slot
        reg, pos = _uleb(data, pos)
        _, pos = _uleb(data, pos) if op == 0x14 else _sleb(data, pos)
        set_reg(reg, ("other", 0))
    elif op == 0x2E:  # GNU_args_size
        _, pos = _uleb(data, pos)
    elif op == 0x2F:  # GNU_negative_offset_extended
        reg, pos = _uleb(data, pos)
        v, pos = _uleb(data, pos)
        set_reg(reg, ("offset", -v * cie.data_align))
    else:
        raise ValueError(f"unknown DW_CFA opcode 0x{op:02x}")
    return pos, advance, new_loc, (cfa_reg, cfa_off, cfa_expr, rbp, ra)


def _parse_cie(r: _Reader, view: memoryview, end: int, debug_frame: bool) -> _Cie:
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
    return _Cie(
        code_align, data_align, ra_reg, fde_enc, lsda_enc, signal, has_z, view[r.pos : end], address_size
    )


def parse_fdes(
    data: bytes, address: int, *, debug_frame: bool = False, limits: CfiLimits | None = None
) -> list[Fde]:
    """Every FDE of one `.eh_frame` (loaded at `address`) or `.debug_frame` section, evaluated."""
    return _parse(data, address, debug_frame, _Budget(limits or CfiLimits()))


def _parse(data: bytes, address: int, debug_frame: bool, budget: _Budget) -> list[Fde]:
    limits = budget.limits
    if len(data) > limits.max_section_bytes:
        raise CfiBoundError("section_too_large", limits.max_section_bytes)
    # An honest section runs at most one instruction per byte (entries do not overlap); a CIE
    # "parsed where it lies" lets a hostile one run the same bytes again and again.
    budget.ops = len(data) + limits.max_ops
    cies: dict[int, _Cie] = {}
    initial: dict[int, _State] = {}
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
        r = _Reader(data, body + idsize, address)
        is_cie = (cie_id == (0xFFFF_FFFF_FFFF_FFFF if wide else 0xFFFF_FFFF)) if debug_frame else cie_id == 0
        if is_cie:
            cie = _parse_cie(r, view, end, debug_frame)
            cies[start] = cie
            initial[start] = _run(cie, cie.instructions, 0, None, budget).state
        else:
            cie_at = cie_id if debug_frame else body - cie_id
            cie_or_none = cies.get(cie_at)
            if cie_or_none is None:
                # A CIE after its FDE is legal though rare: parse it where it lies.
                budget.entry()
                cr_len = struct.unpack_from("<I", data, cie_at)[0]
                cr = _Reader(data, cie_at + 4 + idsize, address)
                cie_or_none = _parse_cie(cr, view, cie_at + 4 + cr_len, debug_frame)
                cies[cie_at] = cie_or_none
                initial[cie_at] = _run(cie_or_none, cie_or_none.instructions, 0, None, budget).state
            cie = cie_or_none
            if debug_frame:
                pc_begin = r.unpack("<Q", 8)
                pc_range = r.unpack("<Q", 8)
            else:
                pc_begin = r.encoded(cie.fde_encoding)
                pc_range = r.encoded(cie.fde_encoding & 0x0F)
            if cie.has_z:
                r.pos += r.uleb()  # augmentation data (LSDA pointer)
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
    uncached. Every FDE's rows count against the budget, cached or not."""

    __slots__ = ("budget", "bytes", "memo", "packer", "rules_of")

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        self.packer = _Packer()
        self.memo: dict[tuple[int, bytes], tuple[list[int], list[int]]] = {}
        self.bytes = 0
        self.rules_of: dict[tuple[object, ...], int] = {}

    def fde(self, cie: _Cie, cie_at: int, initial: _State, program: Buffer, start: int, size: int) -> Fde:
        rows = None
        if len(program) <= _MEMO_PROGRAM_BYTES:
            key = (cie_at, bytes(program))
            rows = self.memo.get(key)
            if rows is None and self.bytes < _MEMO_MAX_BYTES:
                ev = _run(cie, key[1], 0, initial, self.budget, _NO_END, self.rules_of)
                if ev.relative:  # no set_loc in it
                    rows = self.memo[key] = (ev.pcs, ev.rules)
                    self.bytes += len(key[1]) + 16 * len(ev.pcs) + 100
        if rows is None:
            ev = _run(cie, program, start, initial, self.budget, start + size, self.rules_of)
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


def file_fdes(elf: ElfFile, limits: CfiLimits | None = None) -> list[Fde]:
    """FDEs of `.eh_frame`, plus those of `.debug_frame` covering PCs `.eh_frame` leaves out.
    Both sections share one budget of `limits`."""
    budget = _Budget(limits or CfiLimits())
    fdes: list[Fde] = []
    sec = elf.section(".eh_frame")
    try:
        if sec is not None and sec.size:
            fdes = _parse(_section(elf, sec, budget.limits), sec.addr, False, budget)
        dbg = elf.section(".debug_frame")
        if dbg is not None and dbg.size and dbg.type != 8:
            covered = sorted((f.start, f.end) for f in fdes)
            starts = [s for s, _ in covered]
            for f in _parse(_section(elf, dbg, budget.limits), 0, True, budget):
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
            fdes = file_fdes(elf, limits)
        return bytes(_compile(fdes))
    except ElfFormatError as e:
        raise UnwindTableError(path, str(e)) from e
    except ValueError as e:
        raise UnwindTableError(path, str(e)) from e


def unpack_rows(table: bytes) -> list[Row]:
    return [
        Row(pc, CfaKind(kind), cfa_off, RbpKind(rbp_kind), rbp_off)
        for pc, cfa_off, rbp_off, kind, rbp_kind in ROW.iter_unpack(table)
    ]

"""The BPF user-stack walk, in Python, over a raw copy of a stack (abi.RawStack).

A sample taken before its process's tables were in comes as the registers and the top of
its user stack (bpf/stack.bpf.h emit_raw_stack); once the tables are in, this walks it with
the same rows the BPF walk reads (`MappedRules`: unwind_procs -> unwind_mappings ->
unwind_rows, as unwind.bpf.h searches them) and the same step (`step`, a line-by-line
reading of bpf/unwind_step.h, whose constants are in bpf/unwind_rule.h). What the rows
mean is in ehframe.py (CfaKind, RbpKind).

An aarch64 copy (`AARCH64`: this machine's, as the object the loader picks) is walked by
`step_aarch64`, the __TARGET_ARCH_arm64 branch of the same step: sp, x29 and x30 for RSP, RBP
and the return address, the row's `RaKind` in the upper bits of its rbp_kind.

A word outside the copy ends the walk (Counter.WALK_READ_FAILED, `Walked.left_copy`): the
process has gone on since, its stack is not there to read.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..bpf import abi
from ..bpf.abi import RA_SHIFT, RBP_KIND_MASK, CfaKind, Counter, RaKind, RbpKind
from ..bpf.handles import Map
from ..compat import SLOTS

# bpf/unwind_rule.h, each number explained there.
USER_TOP = 0x7FFF_FFFF_FFFF
_U64 = (1 << 64) - 1
UCONTEXT_RBP_OFF = 120
UCONTEXT_RSP_OFF = 160
UCONTEXT_RIP_OFF = 168
FP_CFA_OFF = 16
FP_SAVED_RBP_OFF = -16
CFA_RA_OFF = -8
PLT_ENTRY_MASK = 15
CFA_PUSHED = 8
# ... and its __TARGET_ARCH_arm64 half.
A64_USER_TOP = 0xFFFF_FFFF_FFFF
A64_RA_ADDRESS_MASK = A64_USER_TOP  # pointer authentication's signature bits off
_A64_MCONTEXT = 128 + 176
A64_UCONTEXT_RBP_OFF = _A64_MCONTEXT + 240  # x29
A64_UCONTEXT_LR_OFF = _A64_MCONTEXT + 248  # x30
A64_UCONTEXT_RSP_OFF = _A64_MCONTEXT + 256
A64_UCONTEXT_RIP_OFF = _A64_MCONTEXT + 264
RA_AFTER_FP = 8  # stp x29, x30: x30 is saved 8 above x29

# The copies this machine's object sends (bistouri/bpf/loader.py OBJECT_NAMES picks it so).
AARCH64 = os.uname().machine in ("aarch64", "arm64")

_WORD = struct.Struct("<Q")


class Rule(NamedTuple):
    """struct unwind_rule: a row with its mapping's bias; cfa_kind NONE: no table covers the PC."""

    cfa_kind: int = CfaKind.NONE
    cfa_off: int = 0
    rbp_kind: int = RbpKind.UNCHANGED
    rbp_off: int = 0
    bias: int = 0


NO_RULE = Rule()

# (ip, exact) -> the rule of that PC (NO_RULE if none); exact: ip is where the thread was, not a
# return address (which is looked up one byte back, on its call).
RuleOf = Callable[[int, bool], Rule]


@dataclass(**SLOTS)
class Walked:
    """A raw stack copy walked in user space: its addresses and how each frame was found."""

    ips: list[int] = field(default_factory=list)
    by_table: int = 0
    by_fp: int = 0
    stop: int = 0  # a Counter.WALK_* of why it ended
    left_copy: bool = False  # it ended at a word outside the copy


class _Regs:
    """struct unwind_regs and the walk's exact and sp_floor (aarch64: lr, sp_floor)."""

    __slots__ = ("bp", "exact", "ip", "lr", "sp", "sp_floor")

    def __init__(self, ip: int, sp: int, bp: int, lr: int = 0) -> None:
        self.ip, self.sp, self.bp, self.lr, self.exact, self.sp_floor = ip, sp, bp, lr, True, False


class _Stack:
    """Words of the copy: the stack from `base` on."""

    __slots__ = ("base", "data", "left")

    def __init__(self, data: bytes, base: int) -> None:
        self.data, self.base, self.left = data, base, False

    def read(self, addr: int) -> int | None:
        at = addr - self.base
        if at < 0 or at + 8 > len(self.data):
            self.left = True
            return None
        return int(_WORD.unpack_from(self.data, at)[0])


def step(r: _Regs, rule: Rule, stack: _Stack, w: Walked) -> bool:
    """unwind_step(): the caller's registers into `r`; True if the walk ends here (w.stop says why)."""
    ip, sp, bp = r.ip, r.sp, r.bp
    kind, rbp_kind, cfa_off, rbp_off = rule.cfa_kind, rule.rbp_kind, rule.cfa_off, rule.rbp_off
    r.exact = False
    if kind == CfaKind.RSP:
        cfa = sp + cfa_off
    elif kind == CfaKind.RBP:
        cfa = bp + cfa_off
    elif kind == CfaKind.PLT:
        cfa = sp + 8 + (CFA_PUSHED if (ip & PLT_ENTRY_MASK) >= (cfa_off & _U64) else 0)
    elif kind == CfaKind.TRAMPOLINE:
        at = ((ip - rule.bias) & _U64) % cfa_off if cfa_off > 0 else 0
        cfa = sp + 8 + (CFA_PUSHED if (rbp_off & 0xFF) <= at < ((rbp_off >> 8) & 0xFF) else 0)
        rbp_kind = RbpKind.UNCHANGED
    elif kind == CfaKind.SIGNAL:
        ra = stack.read(sp + UCONTEXT_RIP_OFF)
        new_sp = stack.read(sp + UCONTEXT_RSP_OFF) if ra is not None else None
        new_bp = stack.read(sp + UCONTEXT_RBP_OFF) if new_sp is not None else None
        if ra is None or new_sp is None or new_bp is None:
            w.stop = Counter.WALK_READ_FAILED
            return True
        w.by_table += 1
        r.ip, r.sp, r.bp, r.exact = ra, new_sp, new_bp, True  # the interrupted instruction itself
        if not ra:
            w.stop = Counter.WALK_END
            return True
        return False
    elif kind == CfaKind.END:
        w.by_table += 1
        w.stop = Counter.WALK_END
        return True
    else:  # no table here: the frame pointer
        if not bp:
            w.stop = Counter.WALK_NO_FP
            return True
        cfa = bp + FP_CFA_OFF
        rbp_kind, rbp_off, kind = RbpKind.AT_CFA, FP_SAVED_RBP_OFF, CfaKind.NONE
    cfa &= _U64  # u64 arithmetic, as in C: a negative offset past 0 wraps above USER_TOP
    if cfa <= sp or cfa > USER_TOP:
        w.stop = Counter.WALK_BAD_FRAME
        return True
    return _to_caller(r, w, stack, stack.read(cfa + CFA_RA_OFF), cfa, kind, rbp_kind, rbp_off, USER_TOP)


def step_aarch64(r: _Regs, rule: Rule, stack: _Stack, w: Walked) -> bool:
    """unwind_step() as the arm64 object has it (__TARGET_ARCH_arm64); True if the walk ends here."""
    sp, bp = r.sp, r.bp
    kind, cfa_off, rbp_off = rule.cfa_kind, rule.cfa_off, rule.rbp_off
    ra_kind, rbp_kind = rule.rbp_kind >> RA_SHIFT, rule.rbp_kind & RBP_KIND_MASK
    # After a frame record's step SP is a lower bound: only a row saving the x29/x30 pair places
    # its frame (from x29); any other SP row, the frame record again.
    if r.sp_floor and kind == CfaKind.RSP and (rbp_kind != RbpKind.AT_CFA or ra_kind != RaKind.CFA):
        kind = CfaKind.NONE
    r.exact = False
    if kind == CfaKind.RSP:
        cfa = bp - rbp_off if r.sp_floor else sp + cfa_off
    elif kind == CfaKind.RBP:
        cfa = bp + cfa_off
    elif kind == CfaKind.SIGNAL:
        ra = stack.read(sp + A64_UCONTEXT_RIP_OFF)
        new_sp = stack.read(sp + A64_UCONTEXT_RSP_OFF) if ra is not None else None
        new_bp = stack.read(sp + A64_UCONTEXT_RBP_OFF) if new_sp is not None else None
        lr = stack.read(sp + A64_UCONTEXT_LR_OFF) if new_bp is not None else None
        if ra is None or new_sp is None or new_bp is None or lr is None:
            w.stop = Counter.WALK_READ_FAILED
            return True
        w.by_table += 1
        r.ip, r.sp, r.bp, r.lr, r.exact, r.sp_floor = ra, new_sp, new_bp, lr, True, False
        if not ra:
            w.stop = Counter.WALK_END
            return True
        return False
    elif kind == CfaKind.END:
        w.by_table += 1
        w.stop = Counter.WALK_END
        return True
    else:  # no table here (PLT and TRAMPOLINE rows are x86-64's): the frame record
        if not bp:
            w.stop = Counter.WALK_NO_FP
            return True
        cfa = bp + FP_CFA_OFF
        rbp_kind, rbp_off, kind, ra_kind = RbpKind.AT_CFA, FP_SAVED_RBP_OFF, CfaKind.NONE, RaKind.CFA
    cfa &= _U64
    # A leaf's CFA may be its SP itself: only below it is wrong.
    if cfa < sp or cfa > A64_USER_TOP:
        w.stop = Counter.WALK_BAD_FRAME
        return True
    ra = (
        r.lr
        if ra_kind == RaKind.LR
        else stack.read((cfa + rbp_off + (0 if ra_kind == RaKind.AT_OFF else RA_AFTER_FP)) & _U64)
    )
    if ra is not None:
        ra &= A64_RA_ADDRESS_MASK
    r.lr = 0  # the caller's x30 is gone: the call overwrote it
    r.sp_floor = kind == CfaKind.NONE
    return _to_caller(r, w, stack, ra, cfa, kind, rbp_kind, rbp_off, A64_USER_TOP)


def _to_caller(
    r: _Regs,
    w: Walked,
    stack: _Stack,
    ra: int | None,
    cfa: int,
    kind: int,
    rbp_kind: int,
    rbp_off: int,
    top: int,
) -> bool:
    """Both steps' end: the caller's registers from the frame found (its CFA, its return address
    read, its saved frame pointer where the row says); True if the walk ends here."""
    if ra is None:
        w.stop = Counter.WALK_READ_FAILED
        return True
    if rbp_kind == RbpKind.AT_CFA:
        saved = stack.read((cfa + rbp_off) & _U64)
        if saved is None:
            w.stop = Counter.WALK_READ_FAILED
            return True
        r.bp = saved
    if kind == CfaKind.NONE:
        w.by_fp += 1
    else:
        w.by_table += 1
    r.ip, r.sp = ra, cfa
    if not ra or ra > top:
        w.stop = Counter.WALK_BAD_FRAME if ra else Counter.WALK_END
        return True
    return False


def walk(
    ip: int,
    sp: int,
    bp: int,
    stack: bytes,
    base: int,
    rule_of: RuleOf,
    max_depth: int = abi.MAX_DEPTH,
    lr: int = 0,
    aarch64: bool = AARCH64,
) -> Walked:
    """walk_user(): the user stack from these registers (aarch64: pc, sp, x29 and x30), over
    `stack` (the copy, from `base`)."""
    w = Walked()
    if not ip or ip > (A64_USER_TOP if aarch64 else USER_TOP):
        return w
    r = _Regs(ip, sp, bp, lr)
    words = _Stack(stack, base)
    one = step_aarch64 if aarch64 else step
    while True:
        if len(w.ips) >= max_depth:
            w.stop = Counter.WALK_DEPTH
            break
        w.ips.append(r.ip)
        if one(r, rule_of(r.ip, r.exact), words, w):
            break
    w.left_copy = words.left and w.stop == Counter.WALK_READ_FAILED
    return w


_PID = struct.Struct("<I")
_INDEX = struct.Struct("<I")
_PROC = struct.Struct("<III")  # slot, count, flags
_MAPPING = struct.Struct("<QQQIIIIII")  # abi.UnwindMapping
_ROW = struct.Struct("<IihBB")  # abi.UnwindRow (ehframe.ROW)


class MappedRules:
    """The rules of one process's PCs as the BPF walk finds them now: its mappings from
    unwind_procs and unwind_mappings, rows from unwind_rows through each mapping's bucket
    index (find_mapping, find_row in bpf/unwind.bpf.h). Map lookups, each rule kept: the
    samples of a process share most of their PCs. Built per batch of samples (the tables
    change as files are loaded and evicted)."""

    def __init__(self, maps: Mapping[str, Map], pid: int) -> None:
        self._rows = maps["unwind_rows"]
        self._row_cache: dict[int, tuple[int, int, int, int, int] | None] = {}
        self._rules: dict[tuple[int, bool], Rule] = {}
        self.mappings: list[tuple[int, int, int, int, int, int, int, int, int]] = []
        proc = maps["unwind_procs"].lookup(_PID.pack(pid))
        if proc is None:
            return
        slot, count, _flags = _PROC.unpack(proc)
        table = maps["unwind_mappings"]
        for i in range(min(count, abi.UNWIND_MAPPINGS)):
            raw = table.lookup(_INDEX.pack(slot * abi.UNWIND_MAPPINGS + i))
            if raw is not None:
                self.mappings.append(_MAPPING.unpack(raw))
        self.mappings.sort()
        self._starts = [m[0] for m in self.mappings]

    def __call__(self, ip: int, exact: bool) -> Rule:
        got = self._rules.get((ip, exact))
        if got is None:
            got = self._rules[(ip, exact)] = self._find(ip, exact)
        return got

    def _row(self, index: int) -> tuple[int, int, int, int, int] | None:
        if index not in self._row_cache:
            raw = self._rows.lookup(_INDEX.pack(index))
            self._row_cache[index] = _ROW.unpack_from(raw) if raw is not None else None
        return self._row_cache[index]

    def _find(self, ip: int, exact: bool) -> Rule:
        i = bisect.bisect_right(self._starts, ip) - 1
        if i < 0 or ip >= self.mappings[i][1]:
            return NO_RULE
        _start, _end, bias, first, count, buckets, bucket_count, bucket_base, shift = self.mappings[i]
        if not count:
            return NO_RULE
        pc = (ip - bias - (0 if exact else 1)) & 0xFFFF_FFFF
        lo, hi = first, first + count
        bucket = (pc >> (shift & 31)) - bucket_base
        if pc >> (shift & 31) >= bucket_base and bucket < bucket_count:
            at = self._row(buckets + bucket)
            nxt = self._row(buckets + bucket + 1)
            if at is not None:
                lo = at[0]
            if nxt is not None:
                hi = nxt[0] + 1
        while lo + 1 < hi:  # the last row at or before pc among [lo, hi)
            mid = lo + (hi - lo) // 2
            row = self._row(mid)
            if row is None:
                return NO_RULE
            if row[0] <= pc:
                lo = mid
            else:
                hi = mid
        row = self._row(lo)
        if row is None or row[0] > pc:
            return NO_RULE
        _pc, cfa_off, rbp_off, cfa_kind, rbp_kind = row
        return Rule(cfa_kind, cfa_off, rbp_kind, rbp_off, bias)

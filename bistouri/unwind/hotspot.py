"""Unwind rows of a HotSpot JVM's compiled code, from its perf map and the code's own prologues.

JIT code has no CFI, and C2 uses RBP as a register unless the JVM runs with
`-XX:+PreserveFramePointer`: a frame-pointer walk stops at the first compiled frame. But a
compiled frame has a fixed size once its prologue ran, and HotSpot's x86-64 prologues take few
forms (MacroAssembler::verified_entry, C1's build_frame), after an inline-cache check and a stack
bang: `push %rbp; sub $N,%rsp` (CFA = RSP + N + 16), a bare `push %rbp` (N = 0), or, for code
that bangs no stack, `sub $N,%rsp; mov %rbp,N-8(%rsp)` (CFA = RSP + N + 8): C2's runtime stubs
(`_new_array_Java`, `_complete_monitor_locking_Java`, ...) through which compiled code calls the
JVM's allocation and locking slow paths, so a sample in libjvm walks back into Java. The return
address is at CFA - 8 and the caller's RBP at CFA - 16, what the walk's table rows already express.

For each perf-map entry of a code-cache mapping, the first bytes of its code (read from
/proc/PID/mem) give the prologue; the epilogues (`add $N,%rsp; pop %rbp; ...; ret`, the same N)
are found in its code and get their own rows, so a sample that hit one is walked right too.
Entries with no such prologue (the interpreter, adapters, stubs that `push %rbp; mov %rsp,%rbp`)
get no rows: they keep RBP as a frame pointer, and the walk crosses them by it as before. Code
compiled after the perf map was written has no rows either until the map is asked for again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..bpf.abi import CfaKind, RbpKind
from ..compat import SLOTS
from .ehframe import ROW

PROLOGUE_WINDOW = 96  # bytes of an entry looked at for its prologue (IC check, nops, stack bang before it)
SAVED_RBP_OFF = -16  # the caller's RBP, from the CFA (pushed right below the return address)

# Pushed RBP then `sub $imm8|$imm32,%rsp`; the subtraction that spills RBP below the new RSP
# (stubs: no stack bang, frame made first); a stack bang then a lone push (a 16-byte frame).
_PUSH_SUB8 = re.compile(rb"\x55\x48\x83\xec(.)", re.DOTALL)
_PUSH_SUB32 = re.compile(rb"\x55\x48\x81\xec(....)", re.DOTALL)
_SUB_SPILL = re.compile(
    rb"\x48(?:\x83\xec(.)|\x81\xec(....))\x48\x89(?:\x6c\x24(.)|\xac\x24(....)|\x2c\x24)", re.DOTALL
)
_BANG_PUSH = re.compile(rb"\x89\x84\x24....\x55", re.DOTALL)
# `mov %rsp,%rbp` (both encodings) after the push: a frame pointer kept (-XX:+PreserveFramePointer,
# stubs), which the walk follows without rows.
_MOV_RSP_RBP = (b"\x48\x8b\xec", b"\x48\x89\xe5")

# A rule as ROW packs it after the PC: CFA offset, RBP offset, CFA kind, RBP kind.
Rule = tuple[int, int, int, int]
_NONE: Rule = (0, 0, CfaKind.NONE, RbpKind.UNCHANGED)
_ENTRY: Rule = (8, 0, CfaKind.RSP, RbpKind.UNCHANGED)  # the call's return address at RSP
_PUSHED: Rule = (16, SAVED_RBP_OFF, CfaKind.RSP, RbpKind.AT_CFA)


@dataclass(frozen=True, **SLOTS)
class Prologue:
    """A JIT-compiled method's prologue: where RBP is saved and the frame made."""

    push_end: int  # offset after which the caller's RBP is saved (after the push or the spill)
    frame_at: int  # offset at which CFA = RSP + frame (after the `sub`)
    frame: int  # CFA - RSP once the frame is made
    pushed: bool  # RBP pushed before the `sub` (else spilled after it)


def find_prologue(code: bytes) -> Prologue | None:
    """The frame-making instructions in the first bytes of a compiled method, the earliest form found."""
    head = code[:PROLOGUE_WINDOW]
    found: list[tuple[int, Prologue]] = []
    if m := _PUSH_SUB8.search(head):
        n = m.group(1)[0]
        if n < 0x80 and n % 8 == 0:  # imm8 is sign-extended: a frame shrinks by nothing
            found.append((m.start(), Prologue(m.start() + 1, m.end(), n + 16, True)))
    if m := _PUSH_SUB32.search(head):
        n = int.from_bytes(m.group(1), "little")
        if n < 1 << 20 and n % 8 == 0:
            found.append((m.start(), Prologue(m.start() + 1, m.end(), n + 16, True)))
    if m := _SUB_SPILL.search(head):
        n = int.from_bytes(m.group(1) or m.group(2), "little")
        at = int.from_bytes(m.group(3) or m.group(4) or b"", "little")  # mov %rbp,(%rsp): 0
        if n < 1 << 20 and n % 8 == 0 and at == n - 8 and (m.group(2) or n < 0x80):
            sub_end = m.start() + (4 if m.group(1) else 7)
            found.append((m.start(), Prologue(m.end(), sub_end, n + 8, False)))
    if (
        (m := _BANG_PUSH.search(head))
        and not any(at == m.end() - 1 for at, _ in found)
        and head[m.end() : m.end() + 3] not in _MOV_RSP_RBP
    ):
        found.append((m.end() - 1, Prologue(m.end(), m.end(), 16, True)))
    return min(found, key=lambda f: f[0])[1] if found else None


def _epilogues(code: bytes, frame: int, start: int) -> list[tuple[int, int, int]]:
    """(after the `add`, after the `pop`, after the `ret`) of each `add $frame-16,%rsp; pop %rbp`
    in code[start:], with the first `ret` within 32 bytes after it (the safepoint poll between)."""
    n = frame - 16
    if n <= 0:
        return []  # a lone `pop %rbp` byte is found anywhere
    add = (b"\x48\x83\xc4" + bytes((n,)) if n < 0x80 else b"\x48\x81\xc4" + n.to_bytes(4, "little")) + b"\x5d"
    out = []
    at = code.find(add, start)
    while at >= 0:
        popped = at + len(add)
        ret = code.find(b"\xc3", popped, popped + 32)
        if ret >= 0:
            out.append((popped - 1, popped, ret + 1))
        at = code.find(add, popped)
    return out


@dataclass(**SLOTS)
class JitLimits:
    """Bounds on the work of building a JIT mapping's unwind rows."""

    max_entries: int = 1 << 17  # perf-map entries looked at per mapping
    max_rows: int = 1 << 18
    max_code_bytes: int = 64 << 10  # of one entry, scanned for epilogues
    max_read_bytes: int = 64 << 20  # of all entries, per table built


@dataclass(**SLOTS)
class JitStats:
    """What building a JIT mapping's rows found, and whether a bound cut it short."""

    entries: int = 0  # perf-map entries in the mapping
    framed: int = 0  # ... with a prologue found: rows for them
    unreadable: int = 0  # ... whose code could not be read
    over_bound: bool = False  # a limit was reached: the rest walked by frame pointer


def jit_rows(
    start: int,
    end: int,
    entries: Sequence[tuple[int, int, str]],
    read: Callable[[int, int], bytes],
    limits: JitLimits | None = None,
) -> tuple[bytes, JitStats]:
    """Rows (PCs from `start`) for the perf-map entries (start, end, name; sorted) of the code mapped
    at [start, end), their code read by `read(address, size)` (b"" if it cannot be)."""
    lim = limits or JitLimits()
    stats = JitStats()
    rows: list[tuple[int, Rule]] = []

    def row(pc: int, rule: Rule) -> None:
        if rows and rows[-1][0] == pc:
            rows.pop()
        if not rows or rows[-1][1] != rule:
            rows.append((pc, rule))

    budget = lim.max_read_bytes
    covered = start  # end of the last entry with rows
    for lo, hi, _name in entries:
        if lo < covered or hi > end or hi <= lo:
            continue  # outside the mapping, or overlapping one already done
        stats.entries += 1
        if stats.entries > lim.max_entries or budget <= 0:
            stats.over_bound = True
            break
        size = min(hi - lo, lim.max_code_bytes)
        budget -= size
        code = read(lo, size)
        if not code:
            stats.unreadable += 1
            continue
        p = find_prologue(code)
        if p is None:
            continue
        body: Rule = (p.frame, SAVED_RBP_OFF, CfaKind.RSP, RbpKind.AT_CFA)
        mine: list[tuple[int, Rule]] = [(0, _ENTRY)]  # offsets in the entry
        if p.pushed:
            mine += [(p.push_end, _PUSHED), (p.frame_at, body)]
        else:
            mine += [(p.frame_at, (p.frame, 0, CfaKind.RSP, RbpKind.UNCHANGED)), (p.push_end, body)]
        for added, popped, returned in _epilogues(code, p.frame, p.frame_at):
            mine += [(added, _PUSHED), (popped, _ENTRY), (returned, body)]
        if len(rows) + len(mine) + 2 > lim.max_rows:  # with the rows before and after it
            stats.over_bound = True
            break
        stats.framed += 1
        if lo > covered:
            row(covered - start, _NONE)
        for at, rule in mine:
            row(lo - start + at, rule)
        covered = hi
    if rows and covered < end:
        row(covered - start, _NONE)
    return b"".join(ROW.pack(pc, *rule) for pc, rule in rows), stats


__all__ = ["JitLimits", "JitStats", "Prologue", "find_prologue", "jit_rows"]

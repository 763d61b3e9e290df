"""The Python walk of arm64 raw stack copies (unwind/rawwalk.py step_aarch64) against the arm64
object's own step (bpf/unwind_step.h built with __TARGET_ARCH_arm64 in walk_host.c).

One step, for every rule kind, return-address place, x29 rule and sp_floor over stack words of
every sort: the same registers, counters and end. Then whole stacks laid out as Debian 12's arm64
liblzma, xz and libc rows say (tests/fixtures/arm64/fetch-debs.sh, `make fixtures`): from a leaf
of liblzma whose return address is still in x30, through xz's main and libc, to xz's _start, and
the cases of test_unwind_aarch64.py (the frame record, the row after it placed from x29): the
same frames as the BPF walk, also when sent as a raw record (abi.RawStack with x30).
"""

from __future__ import annotations

import ctypes
import random
import struct

import pytest

from bistouri.bpf import abi
from bistouri.bpf.abi import RA_SHIFT, CfaKind, Counter, RaKind, RbpKind
from bistouri.capture.rawstacks import hash_ips, walked_event
from bistouri.compat import pairwise, zip_strict
from bistouri.unwind.ehframe import Row, build_table, unpack_rows
from bistouri.unwind.rawwalk import Rule, Walked, _Regs, _Stack, step_aarch64, walk
from tests.unit.test_rawwalk import rules_of
from tests.unit.test_unwind_aarch64 import (
    ARM64_ROOT,
    LIBS,
    LOAD,
    STACK_TOP,
    Case,
    Regs,
    Walk,
    _need,
    host,  # noqa: F401 (the fixture: the step built as the arm64 object builds it)
    host_walk,
    liblzma_chain,
    lzma_code_under_xz,
)
from tests.unit.test_unwind_userspace import Rule as CRule
from tests.unit.test_unwind_userspace import Table

USER_TOP = 0xFFFF_FFFF_FFFF


def py_walk(case: Case) -> Walked:
    r = case.regs
    tables = [Table(*t) for t in case.tables]
    return walk(r.ip, r.sp, r.bp, case.stack, case.base, rules_of(tables), lr=r.lr, aarch64=True)


# --- one step ----------------------------------------------------------------------------------

_KINDS = [CfaKind.NONE, CfaKind.RSP, CfaKind.RBP, CfaKind.PLT, CfaKind.SIGNAL, CfaKind.OTHER, CfaKind.END]
_KINDS.append(CfaKind.TRAMPOLINE)
_OFFS = [0, 8, 16, 32, 48, 96, 128, -16, -48, -128, 600, 4096]


def _word(rng: random.Random, base: int, size: int) -> int:
    """A stack word of any sort: 0, an address of the window, a code address (signed or not),
    or one above user space."""
    return rng.choice(
        [
            0,
            base + rng.randrange(0, size, 8),
            LOAD + rng.randrange(0x1000, 0x40000, 4),
            (LOAD + rng.randrange(0x1000, 0x40000, 4)) | 0x002A_0000_0000_0000,
            0xFFFF_8000_1000_0000,
        ]
    )


def test_one_aarch64_step_is_the_bpf_step_for_every_rule_and_register(host) -> None:  # noqa: F811
    rng = random.Random(23)
    size = 2048
    base = STACK_TOP - size
    ended_by: dict[int, int] = {}
    for _ in range(4000):
        stack = bytearray(size)
        for at in range(0, size, 8):
            struct.pack_into("<Q", stack, at, _word(rng, base, size))
        kind = rng.choice(_KINDS)
        rbp_kind = rng.choice([RbpKind.UNCHANGED, RbpKind.AT_CFA, RbpKind.OTHER])
        ra_kind = rng.choice([RaKind.CFA, RaKind.LR, RaKind.AT_OFF])
        cfa_off, rbp_off = rng.choice(_OFFS), rng.choice(_OFFS)
        ip = LOAD + rng.randrange(0x1000, 0x40000, 4)
        sp = base + rng.randrange(0, size + 64, 16)  # past the window too: reads fail there
        bp = rng.choice([0, base + rng.randrange(0, size, 16), sp + rng.choice([0, 16, 48])])
        lr = rng.choice([0, LOAD + 0x2000, (LOAD + 0x2000) | 0x002A_0000_0000_0000])
        sp_floor = rng.random() < 0.4
        rule = CRule(
            bias=LOAD,
            cfa_off=cfa_off,
            rbp_off=rbp_off,
            cfa_kind=kind,
            rbp_kind=rbp_kind | ra_kind << RA_SHIFT,
        )
        w = Walk(
            regs=Regs(ip, sp, bp, lr), exact=True, stack=bytes(stack), base=base, size=size, sp_floor=sp_floor
        )
        c_ended = host.host_step(ctypes.byref(w), ctypes.byref(rule))
        r = _Regs(ip, sp, bp, lr)
        r.sp_floor = sp_floor
        py = Walked()
        py_ended = step_aarch64(
            r, Rule(kind, cfa_off, rule.rbp_kind, rbp_off, LOAD), _Stack(bytes(stack), base), py
        )
        where = (kind, rbp_kind, ra_kind, cfa_off, rbp_off, hex(sp - base), hex(bp), sp_floor)
        assert py_ended == bool(c_ended), where
        assert (py.stop, py.by_table, py.by_fp) == (w.stop, w.by_table, w.by_fp), where
        if not c_ended:
            regs = (r.ip, r.sp, r.bp, r.lr, r.exact, r.sp_floor)
            assert regs == (w.regs.ip, w.regs.sp, w.regs.bp, w.regs.lr, w.exact, w.sp_floor), where
        ended_by[w.stop if c_ended else -1] = ended_by.get(w.stop if c_ended else -1, 0) + 1
    # Every way a step ends, and going on, was compared.
    ends = {Counter.WALK_END, Counter.WALK_BAD_FRAME, Counter.WALK_READ_FAILED, Counter.WALK_NO_FP}
    assert ends | {-1} <= set(ended_by), ended_by


# --- whole stacks through real rows ------------------------------------------------------------

XZ, LIBC = 0xAAAA_0000_0000, 0xFFFF_A000_0000  # where xz and libc are mapped (liblzma at LOAD)
XZ_CALL_LZMA_CODE = 0x53DC  # after xz's `bl lzma_code@plt`
LIBC_START_MAIN = (0x27000, 0x278D8)  # __libc_start_call_main and __libc_start_main (Debian's 2.36)


def _call_sites(rows: list[Row], n: int, within: tuple[int, int] = (0, 1 << 32)) -> list[int]:
    """n return addresses (call + 4), spread over the file, whose rows saved x29 and x30 as a pair
    with the CFA from sp: the frames of a compiled caller past its prologue."""
    sites = [
        r.pc + 4
        for r, nxt in pairwise(rows)
        if within[0] <= r.pc < within[1]
        and (r.cfa_kind, r.rbp_kind, r.ra_kind) == (CfaKind.RSP, RbpKind.AT_CFA, RaKind.CFA)
        and nxt.pc > r.pc + 4
        and 16 <= r.cfa_off <= 512
    ]
    assert len(sites) >= n
    return [sites[i * len(sites) // n] for i in range(n)]


def _row_at(rows: list[Row], pc: int) -> Row:
    return [r for r in rows if r.pc <= pc][-1]


def xz_compressing() -> Case:
    """A sample of `xz -6` as the VM records it: a leaf of liblzma (its return address in x30),
    three liblzma callers, xz's call of lzma_code and one more xz frame, libc's start-up and
    xz's _start (the outermost row: DW_CFA_undefined x30). Laid out from the SP of the leaf."""
    lzma_t = build_table(_need(LIBS / "liblzma.so.5"))
    xz_t = build_table(_need(ARM64_ROOT / "usr" / "bin" / "xz"))
    libc_t = build_table(_need(LIBS / "libc.so.6"))
    lzma_rows, xz_rows, libc_rows = unpack_rows(lzma_t), unpack_rows(xz_t), unpack_rows(libc_t)
    leaf = next(  # a leaf past the middle of the file: nothing pushed, x30 holds its caller
        r.pc + 4
        for r, nxt in pairwise(lzma_rows[len(lzma_rows) // 2 :])
        if (r.cfa_kind, r.cfa_off, r.ra_kind) == (CfaKind.RSP, 0, RaKind.LR) and nxt.pc > r.pc + 8
    )
    start_row = next(r for r in xz_rows if r.cfa_kind == CfaKind.END)
    in_start = start_row.pc + 0x2C  # past `bl __libc_start_main`, still under the row
    assert _row_at(xz_rows, in_start - 1) == start_row
    frames = (
        [(LOAD, lzma_rows, pc) for pc in _call_sites(lzma_rows, 3)]
        + [(XZ, xz_rows, XZ_CALL_LZMA_CODE), (XZ, xz_rows, _call_sites(xz_rows, 1)[0])]
        + [(LIBC, libc_rows, pc) for pc in _call_sites(libc_rows, 2, LIBC_START_MAIN)]
        + [(XZ, xz_rows, in_start)]
    )
    size = abi.RAW_STACK_BYTES
    base = STACK_TOP - size
    stack = bytearray(size)
    for at in range(0, size, 8):  # garbage: a wrong read is a bogus frame, not an end
        struct.pack_into("<Q", stack, at, XZ + 0x1000 + at)

    def put(addr: int, value: int) -> None:
        struct.pack_into("<Q", stack, addr - base, value)

    # Each caller's frame record (x29 of that frame) and where its callee put it.
    sp, records, slots = base, [], []
    for _load, rows, pc in frames[:-1]:
        r = _row_at(rows, pc - 1)
        cfa = sp + r.cfa_off
        slots.append(cfa + r.rbp_off)  # stp x29, x30 of this frame: its caller's pair
        records.append(cfa + r.rbp_off)
        sp = cfa
    assert sp < STACK_TOP - 64
    for i, (slot, (load, _rows, pc)) in enumerate(zip_strict(slots, frames[1:])):
        put(slot, records[i + 1] if i + 1 < len(records) else 0)  # the caller's x29
        put(slot + 8, (load + pc) | (0x002A_0000_0000_0000 if i % 2 else 0))  # signed, or not
    ips = [LOAD + leaf] + [load + pc for load, _rows, pc in frames]
    tables = [
        (LOAD, LOAD + 0x40000, LOAD, lzma_t),
        (XZ, XZ + 0x20000, XZ, xz_t),
        (LIBC, LIBC + 0x200000, LIBC, libc_t),
    ]
    regs = Regs(ip=LOAD + leaf, sp=base, bp=records[0], lr=ips[1])  # x30: the leaf's caller
    return Case(regs, bytes(stack), base, tables, ips, len(ips), 0)


@pytest.mark.parametrize("make", [xz_compressing, liblzma_chain, lzma_code_under_xz])
def test_a_copy_walked_in_python_gives_the_bpf_walks_frames(host, make) -> None:  # noqa: F811
    case = make()
    c_ips, c = host_walk(host, case)
    py = py_walk(case)
    assert [hex(ip) for ip in py.ips] == [hex(ip) for ip in c_ips] == [hex(ip) for ip in case.ips]
    assert (py.stop, py.by_table, py.by_fp) == (c.stop, c.by_table, c.by_fp)
    assert (py.stop, py.by_table, py.by_fp) == (Counter.WALK_END, case.by_table, case.by_fp)


def test_an_arm64_raw_record_becomes_its_event_with_the_whole_stack() -> None:
    """As bpf/stack.bpf.h sends it on arm64: x30 beside pc, sp and x29, the copy from sp, the
    event as the BPF walk left it (one frame: no table of liblzma yet)."""
    case = xz_compressing()
    r = case.regs
    raw = abi.RawStack(ip=r.ip, sp=r.sp, bp=r.bp, lr=r.lr, stack_size=len(case.stack))
    raw.event.pid = raw.event.user_key.pid = 42
    raw.event.user_stack[0] = r.ip
    raw.event.user_stack_size = 8
    raw.event.user_walk_end = Counter.WALK_BAD_FRAME
    ctypes.memmove(ctypes.addressof(raw) + abi.RAW_BYTES_OFFSET, case.stack, len(case.stack))
    record = bytes(raw)
    event, w = walked_event(record, rules_of([Table(*t) for t in case.tables]), aarch64=True)
    ev = abi.StackEvent.from_buffer_copy(event)
    assert list(ev.user_stack[: ev.user_stack_size // 8]) == case.ips == w.ips
    assert ev.user_key.hash == hash_ips(case.ips)
    assert (ev.user_by_table, ev.user_by_fp, ev.user_walk_end) == (len(case.ips), 0, Counter.WALK_END)
    # Without x30 the leaf's caller is lost: the copy's lr is what the walk needs.
    assert abi.RAW_STACK_HEAD.unpack_from(record)[3] == r.lr

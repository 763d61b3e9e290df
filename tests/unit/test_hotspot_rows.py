"""Rows for a JVM's compiled code (unwind/hotspot.py), from the bytes HotSpot emits: the prologues and
epilogues below are copied from OpenJDK 17 and Temurin 25 code caches (Registers.mix, C2 and C1)."""

from __future__ import annotations

from bistouri.bpf.abi import CfaKind, RbpKind
from bistouri.unwind.ehframe import ROW
from bistouri.unwind.hotspot import JitLimits, Prologue, find_prologue, jit_rows

BANG = bytes.fromhex("898424 00c0feff")  # mov %eax,-0x14000(%rsp): the stack bang
# C2, verified entry first: bang; push %rbp; sub $0x50,%rsp
C2 = BANG + bytes.fromhex("55 4883ec50") + bytes.fromhex("4c8bc6 85d2")
# C2 with its inline-cache check first, then a 32-bit frame: call ...; nops; bang; push; sub $0xa0,%rsp
C2_IC = bytes.fromhex("e81b8fd017 666666 0f1f840000000000") + BANG + bytes.fromhex("55 4881eca0000000")
# A stub without a stack bang: sub $0x18,%rsp (imm32); mov %rbp,0x10(%rsp)
SPILL = bytes.fromhex("4881ec18000000 48896c2410")
# -XX:+PreserveFramePointer: bang; push %rbp; mov %rsp,%rbp; sub ...: the frame pointer does it
KEPT_FP = BANG + bytes.fromhex("55 488bec 4883ec50")
# C2's epilogue: add $0x50,%rsp; pop %rbp; the safepoint poll (cmp 0x340(%r15),%rsp; ja ...); ret
EPILOGUE = bytes.fromhex("4883c450 5d 493ba740030000 0f872e000000 c3")


def test_prologues_of_hotspot_compiled_code():
    assert find_prologue(C2) == Prologue(push_end=8, frame_at=12, frame=0x50 + 16, pushed=True)
    assert find_prologue(C2_IC) == Prologue(push_end=24, frame_at=31, frame=0xA0 + 16, pushed=True)
    assert find_prologue(SPILL) == Prologue(push_end=12, frame_at=7, frame=0x18 + 8, pushed=False)
    # The same with 8-bit immediates (a small frame: Object.<init> in OpenJDK 17).
    assert find_prologue(bytes.fromhex("4883ec18 48896c2410")) == Prologue(9, 4, 0x18 + 8, False)
    # C2's runtime stubs (_new_array_Java): sub $0x8,%rsp (imm32); mov %rbp,(%rsp)
    stub = bytes.fromhex("4881ec08000000 48892c24 4989a790020000")
    assert find_prologue(stub) == Prologue(11, 7, 16, False)
    # A 16-byte frame: nothing subtracted after the push.
    assert find_prologue(BANG + b"\x55\x4c\x8b\xc6") == Prologue(8, 8, 16, True)


def test_code_that_keeps_a_frame_pointer_or_has_no_prologue_gets_no_rows():
    assert find_prologue(KEPT_FP) is None
    assert (
        find_prologue(bytes.fromhex("8b5a2448c1e303488b5b104885db0f8403000000ff6340")) is None
    )  # linkToStatic
    assert find_prologue(bytes.fromhex("4883ec80 55")) is None  # sub of a negative imm8 is no frame


def _rules(rows: bytes) -> list[tuple[int, int, int, int, int]]:
    return [ROW.unpack_from(rows, i) for i in range(0, len(rows), ROW.size)]


def test_rows_of_a_method_follow_its_prologue_body_and_epilogue():
    body = bytes.fromhex("4c8bc6") * 8
    code = C2 + body + EPILOGUE + bytes.fromhex("b869000000 ebe6")  # code after the ret: the frame again
    base = 0x7F00_0000_0000
    entries = [(base + 0x40, base + 0x40 + len(code), "long Registers.mix(long[], int)")]
    rows, stats = jit_rows(base, base + 0x1000, entries, lambda at, n: code[at - base - 0x40 :][:n])
    assert (stats.entries, stats.framed) == (1, 1)
    add = len(C2) + len(body)
    framed = (0x60, -16, CfaKind.RSP, RbpKind.AT_CFA)
    assert _rules(rows) == [
        (0, 0, 0, CfaKind.NONE, RbpKind.UNCHANGED),  # before the method: frame pointer
        (0x40, 8, 0, CfaKind.RSP, RbpKind.UNCHANGED),  # the call's return address at RSP
        (0x40 + 8, 16, -16, CfaKind.RSP, RbpKind.AT_CFA),  # after the push
        (0x40 + 12, *framed),  # after the sub: the whole frame
        (0x40 + add + 4, 16, -16, CfaKind.RSP, RbpKind.AT_CFA),  # after the add
        (0x40 + add + 5, 8, 0, CfaKind.RSP, RbpKind.UNCHANGED),  # after the pop
        (0x40 + add + len(EPILOGUE), *framed),  # after the ret
        (0x40 + len(code), 0, 0, CfaKind.NONE, RbpKind.UNCHANGED),
    ]


def test_entries_outside_the_mapping_unreadable_or_past_the_bounds_get_no_rows():
    base = 0x1000
    code = {base: C2, base + 0x100: C2, base + 0x200: C2}
    entries = [(a, a + len(C2), "m") for a in sorted(code)] + [(base + 0x2000, base + 0x2100, "elsewhere")]
    rows, stats = jit_rows(base, base + 0x1000, entries, lambda at, n: code.get(at, b"")[:n])
    assert (stats.entries, stats.framed, stats.over_bound) == (3, 3, False)
    rows, stats = jit_rows(base, base + 0x1000, entries, lambda at, n: b"")
    assert (rows, stats.unreadable) == (b"", 3)
    rows, stats = jit_rows(base, base + 0x1000, entries, lambda at, n: code[at][:n], JitLimits(max_entries=2))
    assert (stats.framed, stats.over_bound) == (2, True)
    assert _rules(rows)[-1][0] == 0x100 + len(C2)  # frame pointer past the last method with rows
    rows, stats = jit_rows(base, base + 0x1000, entries, lambda at, n: code[at][:n], JitLimits(max_rows=6))
    assert stats.over_bound and len(rows) // ROW.size <= 6

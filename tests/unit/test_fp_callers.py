"""Which files' callers the BPF walk takes by frame pointer without a row search
(`ehframe.callers_by_frame_pointer`, set on the mapping by tables.py): real binaries built with and
without frame pointers, and the rows that must leave a file unmarked."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bistouri.unwind.ehframe import ROW, CfaKind, RbpKind, build_table, callers_by_frame_pointer

# Calls in every shape a frame-pointer build compiles (a leaf, a loop, a pointer call, a
# noreturn path, a tail position), and main calling out of the file (printf, through the PLT).
SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
static volatile int sink;
__attribute__((noinline)) static int leaf(int x) { return x * 3 + sink; }
__attribute__((noinline)) static int loop(int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += leaf(i);
    return s;
}
__attribute__((noinline)) static int by_pointer(int (*f)(int), int x) { if (x < 0) abort(); return f(x) + 1; }
__attribute__((noinline)) int tail(int x) { return loop(x); }
int main(int argc, char **argv) { printf("%d\n", by_pointer(tail, argc) + loop(argc)); return 0; }
"""

DEBIAN = ["/usr/bin/xz", "/usr/bin/python3.11", "/lib/x86_64-linux-gnu/libc.so.6"]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "build" / "workloads"

pytestmark = pytest.mark.skipif(
    subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() != "x86_64",
    reason="x86-64 rows",
)


def _build(tmp_path: Path, compiler: str, *flags: str) -> str:
    src = tmp_path / "calls.c"
    src.write_text(SOURCE)
    out = tmp_path / f"calls-{compiler}{''.join(flags)}"
    subprocess.run([compiler, *flags, "-o", str(out), str(src)], check=True)
    return str(out)


@pytest.mark.parametrize("opt", ["-O0", "-O1", "-O2", "-O3"])
def test_a_frame_pointer_build_is_marked(tmp_path: Path, opt: str) -> None:
    assert callers_by_frame_pointer(build_table(_build(tmp_path, "gcc", opt, "-fno-omit-frame-pointer")))
    assert callers_by_frame_pointer(
        build_table(
            _build(tmp_path, "gcc", opt, "-fno-omit-frame-pointer", "-fcf-protection", "-fPIC", "-shared")
        )
    )


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed")
def test_a_clang_frame_pointer_build_is_marked(tmp_path: Path) -> None:
    assert callers_by_frame_pointer(build_table(_build(tmp_path, "clang", "-O2", "-fno-omit-frame-pointer")))


def test_the_frame_pointer_fixtures_are_marked_the_frameless_ones_not() -> None:
    for name in ("burner", "libhot.so", "convoy"):
        assert callers_by_frame_pointer(build_table(str(FIXTURES / name))), name
    for name in ("nofp_signal", "nofp_throw"):
        assert not callers_by_frame_pointer(build_table(str(FIXTURES / name))), name


@pytest.mark.parametrize("opt", ["-O1", "-O2"])
def test_a_frameless_build_is_not_marked(tmp_path: Path, opt: str) -> None:
    assert not callers_by_frame_pointer(build_table(_build(tmp_path, "gcc", opt, "-fomit-frame-pointer")))


@pytest.mark.parametrize("path", DEBIAN)
def test_debians_binaries_are_not_marked(path: str) -> None:
    if not Path(path).exists():
        pytest.skip(f"{path} not installed")
    assert not callers_by_frame_pointer(build_table(path))


def _table(*rows: tuple[int, CfaKind, int, RbpKind, int]) -> bytes:
    return b"".join(
        ROW.pack(pc, cfa_off, rbp_off, kind, rbp_kind) for pc, kind, cfa_off, rbp_kind, rbp_off in rows
    )


ENTRY = (0x1000, CfaKind.RSP, 8, RbpKind.UNCHANGED, 0)
PUSHED = (0x1001, CfaKind.RSP, 16, RbpKind.AT_CFA, -16)  # push %rbp
FRAME = (0x1004, CfaKind.RBP, 16, RbpKind.AT_CFA, -16)  # mov %rsp,%rbp
RETURN = (0x1040, CfaKind.RSP, 8, RbpKind.AT_CFA, -16)  # after leave: gcc keeps the RBP rule
GAP = (0x1041, CfaKind.NONE, 0, RbpKind.UNCHANGED, 0)


def test_the_rows_no_return_address_can_be_in() -> None:
    assert callers_by_frame_pointer(_table(ENTRY, PUSHED, FRAME, RETURN, GAP))
    end = (0x1041, CfaKind.END, 0, RbpKind.UNCHANGED, 0)  # _start: RBP = 0 there (searched)
    assert callers_by_frame_pointer(_table(ENTRY, PUSHED, FRAME, RETURN, end, (0x1060, *GAP[1:])))
    plt0 = [(0x1041, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0), (0x1047, CfaKind.RSP, 24, RbpKind.UNCHANGED, 0)]
    plt = (0x1050, CfaKind.PLT, 11, RbpKind.UNCHANGED, 0)
    assert callers_by_frame_pointer(_table(ENTRY, PUSHED, FRAME, RETURN, *plt0, plt, (0x1090, *GAP[1:])))


def test_rows_a_call_can_end_in_unmark_the_file() -> None:
    """A frameless function's body; `push %rbp` kept as a saved register before a call (its row is
    longer than a `mov`, or no frame follows); another RBP offset; a signal trampoline, whose
    return address a handler returns to."""
    body = (0x1001, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0)
    assert not callers_by_frame_pointer(_table(ENTRY, body, RETURN, GAP))
    long_push = (0x1030, CfaKind.RBP, 16, RbpKind.AT_CFA, -16)  # more than a prologue before it
    assert not callers_by_frame_pointer(_table(ENTRY, PUSHED, long_push, RETURN, GAP))
    assert not callers_by_frame_pointer(_table(ENTRY, PUSHED, RETURN, GAP))
    assert not callers_by_frame_pointer(
        _table(ENTRY, PUSHED, (0x1004, CfaKind.RBP, 32, RbpKind.AT_CFA, -16), GAP)
    )
    signal = (0x1041, CfaKind.SIGNAL, 0, RbpKind.UNCHANGED, 0)
    assert not callers_by_frame_pointer(_table(ENTRY, PUSHED, FRAME, RETURN, signal, (0x1050, *GAP[1:])))
    far_plt0 = [
        (0x1041, CfaKind.RSP, 16, RbpKind.UNCHANGED, 0),
        (0x1080, CfaKind.PLT, 11, RbpKind.UNCHANGED, 0),
    ]
    assert not callers_by_frame_pointer(_table(ENTRY, PUSHED, FRAME, RETURN, *far_plt0, (0x10C0, *GAP[1:])))

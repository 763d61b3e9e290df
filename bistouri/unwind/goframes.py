"""Unwind rows of Go code, from the binary's own stack-pointer table (`.gopclntab`'s pcsp).

A Go binary built by Go's linker has no `.eh_frame` (its `.debug_frame`, when kept, is compressed,
and `-ldflags=-w` drops it), and the frame pointer alone misses the caller of every function that
keeps no frame (a leaf with no locals: `main.hotLoop` came out as called by `main.outer`, its
caller's caller). The pcsp table gives, for each PC, how far SP is below the function's entry SP:
CFA = RSP + delta + 8, the return address below it, and from the prologue on the caller's RBP
saved at CFA - 16 (Go's frame layout on amd64). What Go's own traceback does, with two exceptions
it makes too: functions marked TOPFRAME (runtime.goexit, mstart, rt0_go) end the walk, so a
goroutine's stack ends at runtime.goexit instead of walking on into whatever the stack holds
above it; functions that write SP (stack switches: systemstack, mcall, morestack) get no rows, and
the walk crosses them by frame pointer, as before.
"""

from __future__ import annotations

from ..bpf.abi import CfaKind, RbpKind
from ..elf import ElfFile
from ..gopclntab import FLAG_SPWRITE, FLAG_TOPFRAME, read_pclntab

RA_SIZE = 8  # the return address a call pushed: the CFA is 8 above the entry SP
SAVED_RBP_OFF = -16  # where a Go frame keeps its caller's RBP, from the CFA

# (start, end, rows as (pc, cfa_off, rbp_off, kind, rbp_kind)) of one function.
GoRows = tuple[int, int, list[tuple[int, int, int, int, int]]]


def go_functions(elf: ElfFile, max_rows: int) -> list[GoRows] | None:
    """The rows of every Go function of `elf`, or None when it has no pclntab this reader knows.
    ValueError past `max_rows` (the caller's budget)."""
    tab = read_pclntab(elf)
    if tab is None:
        return None
    out: list[GoRows] = []
    left = max_rows
    for start, end, flags, spans in tab.frame_rules():
        if flags & FLAG_TOPFRAME:
            rows = [(start, 0, 0, int(CfaKind.END), int(RbpKind.UNCHANGED))]
        elif flags & FLAG_SPWRITE or not spans:
            continue
        else:
            rows = []
            for pc, delta in spans:
                if delta < 0 or delta > 1 << 30:
                    rows = []  # a table this walk cannot trust: the frame pointer
                    break
                saved = delta > 0  # after the prologue's SUBQ; a frameless function never saves it
                rows.append(
                    (
                        pc,
                        delta + RA_SIZE,
                        SAVED_RBP_OFF if saved else 0,
                        int(CfaKind.RSP),
                        int(RbpKind.AT_CFA if saved else RbpKind.UNCHANGED),
                    )
                )
            if not rows:
                continue
        left -= len(rows) + 1
        if left < 0:
            raise ValueError("too_many_rows")
        out.append((start, end, rows))
    return out

"""The CFI parser is bounded while it parses: hostile `.eh_frame` sections are refused by reason,
at a bounded cost, and honest files are untouched (see test_ehframe.py for those)."""

from __future__ import annotations

import tracemalloc

import pytest

from bistouri.unwind.ehframe import (
    BOUND_REASONS,
    CfiBoundError,
    CfiLimits,
    UnwindTableError,
    build_table,
    parse_fdes,
)
from testkit.hostile_cfi import EH_FRAME_ADDR, cie, elf_with_eh_frame, fde, row_bomb


def _one_fde(program: bytes) -> bytes:
    head = cie()
    return head + fde(0, len(head), 0x1000, 0x100000, program) + b"\0\0\0\0"


@pytest.mark.parametrize(
    ("data", "limits", "reason"),
    [
        (row_bomb(1 << 16), CfiLimits(max_rows=1000), "too_many_rows"),
        (row_bomb(1 << 16, rows_per_fde=10), CfiLimits(max_entries=100), "too_many_entries"),
        (_one_fde(bytes([0x41, 0x0E, 16]) * 100), CfiLimits(max_ops=50), "program_too_long"),
        (_one_fde(bytes([0x0A]) * 50), CfiLimits(max_states=10), "too_many_states"),
        (row_bomb(1 << 16), CfiLimits(max_section_bytes=1 << 15), "section_too_large"),
    ],
)
def test_each_bound_stops_parsing_with_its_reason(data, limits, reason):
    assert reason in BOUND_REASONS
    with pytest.raises(CfiBoundError) as e:
        parse_fdes(data, 0, limits=limits)
    assert e.value.reason == reason
    parse_fdes(data, 0)  # within the default bounds: parsed


def test_a_cie_parsed_again_and_again_is_bounded_by_the_section_s_bytes():
    """FDEs pointing each at a different offset of one region that reads as a 64 KiB CIE
    wherever it is entered every 16 bytes (a length, then zeros: nops, and 0xff: restore): a CIE
    "parsed where it lies" is cached by offset only, so each ran the region again. Never more
    instructions than the section has bytes."""
    region = (b"\xff\xff\0\0" + b"\0" * 12) * 8192
    head = cie()
    # The region as the real CIE's initial instructions (run once there): the main walk skips it.
    body = head[4:] + region
    blob = bytearray(len(body).to_bytes(4, "little") + body)
    first = len(head)
    for cie_at in range(first, first + 65536, 16):
        at = len(blob)
        entry = (at + 4 - cie_at).to_bytes(4, "little") + b"\0" * 16  # pc 0, range 0
        blob += len(entry).to_bytes(4, "little") + entry
    data = bytes(blob + b"\0\0\0\0")
    with pytest.raises(CfiBoundError) as e:
        parse_fdes(data, 0)
    assert e.value.reason == "program_too_long"


def test_a_10_mb_row_bomb_costs_little_memory_and_is_refused(tmp_path):
    path = tmp_path / "bomb.so"
    path.write_bytes(elf_with_eh_frame(row_bomb(10 << 20, address=EH_FRAME_ADDR)))
    tracemalloc.start()
    try:
        with pytest.raises(UnwindTableError) as e:
            build_table(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.reason == "too_many_rows"
    # The section (10 MiB, read once) and 1 Mi rows of 12 bytes; it was 477 MiB of Row objects.
    assert peak < 40 << 20, peak >> 20


def test_rows_within_the_bounds_are_what_they_were(tmp_path):
    """A table just under the row bound is built whole: the bound refuses, it never truncates."""
    data = row_bomb(1 << 15, rows_per_fde=1000, address=EH_FRAME_ADDR)
    path = tmp_path / "ok.so"
    path.write_bytes(elf_with_eh_frame(data))
    n = len(parse_fdes(data, EH_FRAME_ADDR))
    table = build_table(str(path))
    assert n > 5 and len(table) // 12 > 1000 * n // 2


def test_the_cache_of_programs_is_bounded_and_changes_no_row(monkeypatch):
    """Distinct short programs are each run once and cached (ehframe._Programs) up to a bound in
    bytes; past it they are run uncached, with the same rows."""
    from bistouri.unwind import ehframe

    head = cie()
    data = bytearray(head)
    for i in range(2000):  # 700 distinct programs: CFA offsets 16 + 8 * (i % 14), 16, then i % 50 on
        program = bytes([0x41, 0x0E, 16 + 8 * (i % 14), 0x42, 0x0E, 16, 0x40 + i % 50])
        data += fde(0, len(data), 0x10000 + 0x100 * i, 0x80, program)
    section = bytes(data + b"\0\0\0\0")
    whole = parse_fdes(section, 0)
    held = []
    fde_of = ehframe._Programs.fde

    def watched(self, *args):
        held.append(self.bytes)
        return fde_of(self, *args)

    monkeypatch.setattr(ehframe, "_MEMO_MAX_BYTES", 10_000)
    monkeypatch.setattr(ehframe._Programs, "fde", watched)
    assert parse_fdes(section, 0) == whole
    assert max(held) < 10_000 + 1_000  # one entry past the bound at most

"""record's line tables file (record/linefile.py): a unit's line rows kept between runs."""

from __future__ import annotations

from array import array

import pytest

from bistouri.record import symfile
from bistouri.record.linefile import encode_lines, encode_section, read_lines, read_section
from bistouri.record.symfile import CorruptFile
from bistouri.symbolizer.dwarflines import LineTable


def table() -> LineTable:
    seqs = [(0x1000, 0x1010, 0, 3), (0x2000, 0x2008, 3, 5)]
    t = LineTable(
        4,
        ["inc", "/abs"],
        [("p.c", 0), ("leaf.h", 1), ("x.h", 2)],
        seqs,
        [s[1] for s in seqs],
        array("Q", [0x1000, 0x1008, 0x1010, 0x2000, 0x2008]),
        array("I", [1, 2, 1, 3, 3]),
        array("i", [10, 2, 11, 7, 8]),
    )
    t.program_bytes = 77
    return t


def test_a_table_reads_back_as_it_was_made() -> None:
    want = table()
    got = read_lines(symfile.joined(encode_lines(want)))
    assert (got.version, got.dirs, got.files, got.seqs, got.seq_highs) == (
        want.version,
        want.dirs,
        want.files,
        want.seqs,
        want.seq_highs,
    )
    assert list(got.addrs) == list(want.addrs) and list(got.lines) == list(want.lines)
    assert list(got.files_of) == list(want.files_of) and got.program_bytes == 77
    for a in (0xFFF, 0x1000, 0x1007, 0x1008, 0x100F, 0x1010, 0x2004, 0x2008):
        assert got.row(a) == want.row(a)
    for i in range(5):
        assert got.path(i, "/comp") == want.path(i, "/comp")


def test_any_damaged_byte_refuses_the_file() -> None:
    data = symfile.joined(encode_lines(table()))
    padding = range(symfile._HEADER_BYTES - 4, symfile._HEADER_BYTES)  # after the header's checksum
    for i in (i for i in range(len(data)) if i not in padding):
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises(CorruptFile):
            read_lines(bytes(bad))
    with pytest.raises(CorruptFile):
        read_lines(data[:-1])
    with pytest.raises(CorruptFile):
        read_lines(symfile.joined(symfile.encode_frames({}, True)))


def test_an_inflated_section_reads_back_checked_whole() -> None:
    body = bytes(range(256)) * 40
    data = symfile.joined(encode_section(memoryview(body)))
    assert bytes(read_section(data)) == body
    padding = range(symfile._HEADER_BYTES - 4, symfile._HEADER_BYTES)
    for i in (i for i in range(0, len(data), 7) if i not in padding):
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises(CorruptFile):
            read_section(bytes(bad))
    with pytest.raises(CorruptFile):
        read_section(data[:-1])
    with pytest.raises(CorruptFile):
        read_section(symfile.joined(encode_lines(table())))

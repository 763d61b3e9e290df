"""record's spans file (record/spanfile.py): DWARF answers by address range, read in place."""

from __future__ import annotations

import pytest

from bistouri.record import symfile
from bistouri.record.spanfile import SpanTable, encode_spans
from bistouri.record.symfile import CorruptFile
from bistouri.symbolizer.llvm import SourceFrame

INLINED = [SourceFrame("leaf", "/src/inc/leaf.h", 2), SourceFrame("outer", "/src/p.c", 4)]
SPANS = [
    (0x1000, 0x1004, [SourceFrame("outer", "/src/p.c", 3)]),
    (0x1004, 0x1010, INLINED),
    (0x1010, 0x1012, []),  # in a function, but no line and no subprogram: an answer too
    (0x2000, 0x2100, [SourceFrame("main", "/src/p.c", 9)]),
]


def table(spans: list, old: SpanTable | None = None) -> SpanTable:
    parts = encode_spans(spans, old)
    assert parts is not None
    return SpanTable(symfile.joined(parts))


def test_an_address_gets_the_frames_of_the_span_holding_it() -> None:
    t = table(SPANS)
    assert len(t) == 4
    assert t.get(0x1000) == SPANS[0][2] and t.get(0x1003) == SPANS[0][2]
    assert t.get(0x1004) == INLINED and t.get(0x100F) == INLINED
    assert t.get(0x1011) == []
    assert t.get(0x20FF) == SPANS[3][2]
    for outside in (0, 0xFFF, 0x1012, 0x1FFF, 0x2100, -1, 1 << 64):
        assert t.get(outside) is None
    assert list(t.items()) == SPANS


def test_a_merge_keeps_the_old_spans_and_adds_only_those_overlapping_none() -> None:
    old = table(SPANS[:2])
    new = [
        (0x1002, 0x1006, [SourceFrame("other", "/x.c", 1)]),  # overlaps: the old answers stay
        (0x1010, 0x1012, []),
        (0x3000, 0x3001, [SourceFrame("f", "/y.c", 5)]),
        (0x5, 0x5, []),  # empty: dropped
    ]
    t = table(new, old)
    assert [s[:2] for s in t.items()] == [
        (0x1000, 0x1004),
        (0x1004, 0x1010),
        (0x1010, 0x1012),
        (0x3000, 0x3001),
    ]
    assert t.get(0x1005) == INLINED
    assert encode_spans([(0x1000, 0x1001, [])], t) is None  # nothing new: no rewrite


def test_a_damaged_file_never_answers_wrong() -> None:
    data = bytearray(symfile.joined(encode_spans(SPANS)))
    clean = SpanTable(bytes(data))
    want = {a: clean.get(a) for a in range(0xFF0, 0x2110)}
    for i in range(0, len(data)):
        for flip in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= flip
            try:
                t = SpanTable(bytes(bad))
            except CorruptFile:
                continue
            for a in (0x1000, 0x1008, 0x1011, 0x2050, 0x1FFF):
                try:
                    got = t.get(a)
                except CorruptFile:
                    continue
                assert got is None or got == want[a], (i, flip, hex(a))


def test_a_file_of_another_kind_is_refused() -> None:
    frames = symfile.joined(symfile.encode_frames({}, True))
    with pytest.raises(CorruptFile):
        SpanTable(frames)
    with pytest.raises(CorruptFile):
        SpanTable(symfile.joined(encode_spans(SPANS))[:-1])

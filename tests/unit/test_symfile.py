"""The on-disk format of record's symbol cache (bistouri/record/symfile.py), pure: bytes in, bytes out.

The cache directory is the user's own, but its files are read as untrusted bytes: a damaged file must
give `CorruptFile` or a miss, never a wrong answer, another exception or a read outside the file."""

from __future__ import annotations

import pytest

from bistouri.record import symfile
from bistouri.record.symfile import CorruptFile, FrameTable, KallsymsTable
from bistouri.symbolizer.kallsyms import parse_kallsyms
from bistouri.symbolizer.model import KIND_KERNEL, Frame

KALLSYMS = b"""\
ffffffff81000000 T _text
ffffffff81000000 T startup_64
ffffffff81001000 T do_syscall_64
ffffffff81001000 t __pi_do_syscall_64
ffffffff81002000 T schedule
ffffffff81002800 T _etext
ffffffffc0000000 t ext4_sync_file\t[ext4]
ffffffffc0001000 t ext4_fsync\t[ext4]
"""
KERNEL_IPS = (0xFFFFFFFF80FFFFFF, 0xFFFFFFFF81000010, 0xFFFFFFFF81001234, 0xFFFFFFFF81002900)
MODULE_IPS = (0xFFFFFFFFC0000010, 0xFFFFFFFFC0001002, 0xFFFFFFFFC1000000)


def answers(n: int, base: int = 0x1000) -> dict[tuple[int, bool], tuple[Frame, ...]]:
    return {
        (base + i, i % 2 == 0): (
            Frame(f"outer_{i % 3}", "app", "a.c", i % 3),
            Frame(f"inner_{i}", "app", inlined=True),
        )
        for i in range(n)
    }


def table(new: dict, file_lines: bool = True, old: FrameTable | None = None, **kw) -> FrameTable:
    return FrameTable(symfile.joined(symfile.encode_frames(new, file_lines, old, **kw)))


def test_frames_round_trip() -> None:
    want = {
        **answers(50),
        (0, False): (Frame("zero"),),
        ((1 << 64) - 1, True): (Frame("top", kind=KIND_KERNEL),),
        (7, True): (Frame("ünïcode \udcff", "m", "f.c", 2**32 + 5),),  # a line over u32 is clamped
    }
    got = table(want)
    assert len(got) == len(want) and got.file_lines and got.generation == 1
    decoded = dict(got.items())
    assert decoded.pop((7, True)) == (Frame("ünïcode \udcff", "m", "f.c", 0xFFFFFFFF),)
    assert decoded == {k: v for k, v in want.items() if k != (7, True)}
    assert got.get((0x1000, False)) is None and (0x1000, True) in got and (0x1000, False) not in got
    assert got.get((-1, True)) is None and got.get((1 << 64, True)) is None
    # Frames equal in value are one object within a table (the assembler indexes them by id).
    assert got.get((0x1000, True))[0] is got.get((0x1003, False))[0]  # type: ignore[index]
    empty = table({}, False)
    assert len(empty) == 0 and not empty.file_lines and empty.get((1, True)) is None
    got.close()


def test_merge_keeps_what_was_there_and_new_answers_win() -> None:
    first = table(answers(10))
    second = table({(0x1000, True): (Frame("renamed"),), (0x9999, False): (Frame("late"),)}, True, first)
    assert second.generation == 2
    assert dict(second.items()) == {
        **answers(10),
        (0x1000, True): (Frame("renamed"),),
        (0x9999, False): (Frame("late"),),
    }
    # Made another way (names only after DWARF, or the reverse): what was there is not kept.
    other = table({(1, True): (Frame("names_only"),)}, False, second)
    assert dict(other.items()) == {(1, True): (Frame("names_only"),)} and other.generation == 1


def test_bounded_keeps_the_newest_answers() -> None:
    old = table(answers(10))
    newer = table(answers(5, base=0x5000), True, old, max_entries=8)
    assert len(newer) == 8
    assert set(answers(5, base=0x5000)) <= set(newer.keys())  # the 5 new ones, and 3 of the old
    assert len(set(answers(10)) & set(newer.keys())) == 3
    # The strings and frames of dropped answers are not carried on.
    one = symfile.joined(symfile.encode_frames({}, True, newer, max_entries=1))
    assert one.count(b"inner_") == 1 and one.count(b"outer_") == 1


def appended(old: FrameTable, new: dict, **kw) -> FrameTable:
    parts = symfile.append_frames(old, new, **kw)
    assert parts is not None
    return FrameTable(symfile.joined(parts))


def test_appending_answers_as_a_whole_rewrite_does() -> None:
    old = table(answers(40))
    # Between, before and after the old keys of both kinds; frames shared with old ones and new.
    new = {
        **answers(7, base=0x1000 + 40),
        (0x10, True): (Frame("before"),),
        (0x1000 + 5 * 2 + 1, True): (Frame("outer_1", "app", "a.c", 1),),  # between two old keys
        (1 << 63, False): (Frame("after", "app"), Frame("ünï \udcff", "m", "f.c", 3)),
    }
    assert not set(new) & set(old.keys())
    got = appended(old, new)
    whole = table(new, True, old)
    assert dict(got.items()) == dict(whole.items()) == {**answers(40), **new}
    assert got.generation == whole.generation == 2 and got.file_lines
    assert list(got.keys()) == list(whole.keys())  # sorted as a rewrite sorts them
    # Each entry keeps the generation that added it: the bound drops the oldest first.
    assert [got._stamps[i] for i in range(len(got))] == [whole._stamps[i] for i in range(len(whole))]
    again = appended(got, {(3, False): (Frame("third"),)})
    assert dict(again.items()) == {**answers(40), **new, (3, False): (Frame("third"),)}
    assert again.generation == 3


def test_appending_gives_way_to_a_whole_rewrite() -> None:
    old = table(answers(10))
    assert symfile.append_frames(old, {(0x1000, True): (Frame("renamed"),)}) is None  # already there
    assert symfile.append_frames(old, answers(3, base=0x9000), max_entries=12) is None  # over the bound
    assert symfile.append_frames(old, {}) is None


def test_an_appended_file_keeps_what_was_damaged_detectable() -> None:
    want = answers(6)
    good = symfile.joined(symfile.encode_frames(want, True))
    new = {(0x8000, True): (Frame("late"),)}
    for pos in range(symfile._HEADER_BYTES, len(good)):
        data = bytearray(good)
        data[pos] ^= 0x80
        try:
            old = FrameTable(bytes(data))
        except CorruptFile:
            continue
        parts = symfile.append_frames(old, new)
        if parts is None:
            continue
        t = FrameTable(symfile.joined(parts))
        for key, frames in {**want, **new}.items():
            try:
                got = t.get(key)
            except CorruptFile:
                continue
            assert got is None or got == frames, (pos, key, got)


def test_every_damaged_byte_gives_an_error_or_a_miss_never_a_wrong_answer() -> None:
    want = answers(6)
    good = symfile.joined(symfile.encode_frames(want, True))
    for pos in range(len(good)):
        for flip in (0x01, 0x80, 0xFF):
            data = bytearray(good)
            data[pos] ^= flip
            try:
                t = FrameTable(bytes(data))
            except CorruptFile:
                continue
            for key, frames in want.items():
                try:
                    got = t.get(key)
                except CorruptFile:
                    continue
                assert got is None or got == frames, (pos, flip, key, got)


def test_truncated_extended_or_foreign_files_are_refused_when_opened() -> None:
    good = symfile.joined(symfile.encode_frames(answers(3), True))
    for size in range(len(good)):
        with pytest.raises(CorruptFile):
            FrameTable(good[:size])
    with pytest.raises(CorruptFile):
        FrameTable(good + b"\0")
    with pytest.raises(CorruptFile):  # the format before this one
        FrameTable(b"BSYM" + good[4:])
    kallsyms = parse_kallsyms(KALLSYMS)
    with pytest.raises(CorruptFile):  # another kind
        FrameTable(symfile.joined(symfile.encode_kallsyms(kallsyms.rows(), kallsyms.text_addr)))


def test_counts_that_point_outside_the_file_are_refused() -> None:
    """A header with a good checksum and huge counts (a crafted file): refused, nothing allocated."""
    for counts in ([1, 1, 1 << 40, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, (1 << 64) - 1]):
        with pytest.raises(CorruptFile):
            FrameTable(symfile._header(symfile.KIND_FRAMES, counts))


def test_kallsyms_answers_like_the_parsed_index() -> None:
    parsed = parse_kallsyms(KALLSYMS)
    got = KallsymsTable(symfile.joined(symfile.encode_kallsyms(parsed.rows(), parsed.text_addr)))
    assert got.text_addr == parsed.text_addr == 0xFFFFFFFF81000000 and len(got) == len(list(parsed.rows()))
    for ip in (*KERNEL_IPS, *MODULE_IPS, 0, (1 << 64) - 1, -1, 1 << 64):
        assert got.lookup(ip) == (parsed.lookup(ip) if 0 <= ip < 1 << 64 else None), hex(ip)
    assert got.lookup(0xFFFFFFFFC0001002) == ("ext4_fsync", "ext4", 2)
    assert got.address_of("schedule") == 0xFFFFFFFF81002000 and got.address_of("sched") is None
    assert not got.damaged
    got.close()


def test_a_damaged_kernel_symbol_is_a_miss_never_a_wrong_name() -> None:
    parsed = parse_kallsyms(KALLSYMS)
    good = symfile.joined(symfile.encode_kallsyms(parsed.rows(), parsed.text_addr))
    ips = (*KERNEL_IPS, *MODULE_IPS)
    for pos in range(len(good)):
        data = bytearray(good)
        data[pos] ^= 0x41
        try:
            t = KallsymsTable(bytes(data))
        except CorruptFile:
            continue
        for ip in ips:
            got = t.lookup(ip)
            assert got is None or got == parsed.lookup(ip), (pos, hex(ip))
    for size in range(len(good)):
        with pytest.raises(CorruptFile):
            KallsymsTable(good[:size])


def test_a_binarys_symbols_answer_like_its_symbol_index() -> None:
    from bistouri.elf import ElfFile, offset_to_vaddr
    from tests.ui import data

    with ElfFile(data.WORKLOADS / "shares") as elf:
        index, segments = elf.symbol_index(), elf.segments
    rows = [(s.offset, s.filesz, s.vaddr) for s in segments]
    good = symfile.joined(symfile.encode_symbols(index.items(), rows, "shares"))
    got = symfile.SymbolTable(good)
    assert got.label == "shares" and len(got) == len(index) and got.segments == rows
    for off in range(0, 0x3100, 3):
        vaddr = offset_to_vaddr(segments, off)
        assert got.vaddr(off) == vaddr
        if vaddr is not None:
            assert got.lookup(vaddr) == index.lookup(vaddr), hex(off)
    for pos in range(len(good)):  # damaged: refused, or a miss, never a wrong name
        raw = bytearray(good)
        raw[pos] ^= 0x41
        try:
            t = symfile.SymbolTable(bytes(raw))
            for vaddr in (0x1130, 0x1140, 0x1190, 0x1200):
                assert t.lookup(vaddr) in (None, index.lookup(vaddr))
        except CorruptFile:
            continue


def test_a_binarys_symbols_keep_the_ranges_its_dwarf_describes() -> None:
    rows, segments = [(0x1000, 0x1100, "f"), (0x1100, 0x1200, "g")], [(0x1000, 0x1000, 0x1000)]
    plain = symfile.SymbolTable(symfile.joined(symfile.encode_symbols(rows, segments, "b")))
    assert plain.described == [] and not plain.has_dwarf(0x1000)
    good = symfile.joined(symfile.encode_symbols(rows, segments, "b", [(0x1010, 0x1020), (0x1180, 0x1190)]))
    got = symfile.SymbolTable(good)
    assert [a for a in (0x100F, 0x1010, 0x101F, 0x1020, 0x1185, 0x1190, 0x5000) if got.has_dwarf(a)] == [
        0x1010,
        0x101F,
        0x1185,
    ]
    for pos in range(len(good) - 32, len(good)):  # the ranges are checked with the segments
        raw = bytearray(good)
        raw[pos] ^= 0x41
        with pytest.raises(CorruptFile):
            symfile.SymbolTable(bytes(raw))

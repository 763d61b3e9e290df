"""The line tables file of record's symbol cache: one compile unit's `.debug_line` rows, run once.

A warm `record` run on pyenv's python meets ~10 new addresses a run in libpython (functions
sampled rarely, the eval loop's other instructions): the DWARF reader (symbolizer/dwarf.py) then
runs each one's unit's whole line program again, ~0.4 µs a row, 3 000-50 000 rows a unit: about
half of what those addresses cost. The rows it made are kept here, one file per unit
(`<build id>-<size>-<offset>.lines`: the DWARF file's build id and size, a debug file installed
later being another file, and the table's offset in `.debug_line`), and mapped as the reader's
`LineTable` arrays next time: bisected in place, nothing run.

The file shares symfile.py's header and its rules (native byte order, a header checksum, exactly
as long as its arrays). Arrays: the sequences (low, high, first row, end row: four u64 each,
in the reader's order), the rows' addresses (u64), file indexes (u32) and lines (i32), each
file's directory index (u32), and the directory and file names (a string table). A unit's rows
are answers for all its addresses at once, so the whole payload is checked on opening (crc32,
~0.1 ms for 25 000 rows): a damaged file is refused (`CorruptFile`) and its unit read again.
"""

from __future__ import annotations

import mmap
import zlib
from array import array

from ..compat import zip_strict
from ..symbolizer.dwarflines import LineTable
from .symfile import _HEADER_BYTES, CorruptFile, Parts, _Code, _counts, _header, _sections, _Strings

KIND_LINES = 5  # after symfile's kinds: one header format for every file of the cache


def encode_lines(table: LineTable) -> Parts:
    # The directories, then the files' names, by position (not interned: the reader indexes them).
    encoded = [
        s.encode("utf-8", "surrogateescape") for s in (*table.dirs, *(name for name, _ in table.files))
    ]
    offs = array("I", [0])
    for b in encoded:
        offs.append(offs[-1] + len(b))
    blob = b"".join(encoded)
    seqs = array("Q", [v for seq in table.seqs for v in seq])
    dir_of = array("I", [d for _, d in table.files])
    body: Parts = [
        seqs,
        table.addrs,  # the parser's arrays: u64, u32, i32
        table.files_of,
        table.lines,
        dir_of,
        offs,
        blob,
    ]
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    counts = [
        table.version,
        len(table.seqs),
        len(table.addrs),
        len(table.dirs),
        len(table.files),
        len(blob),
        crc,
        table.program_bytes,
    ]
    return [_header(KIND_LINES, counts), *body]


def read_lines(data: mmap.mmap | bytes) -> LineTable:
    """The table of a lines file; its arrays are views of `data` (kept mapped while they live)."""
    buf = memoryview(data)
    version, n_seqs, n_rows, n_dirs, n_files, blob_bytes, crc, program_bytes = _counts(buf, KIND_LINES)
    sizes: list[tuple[_Code, int]] = [
        ("Q", 4 * n_seqs),
        ("Q", n_rows),
        ("I", n_rows),
        ("i", n_rows),
        ("I", n_files),
        ("I", n_dirs + n_files + 1),
        ("B", blob_bytes),
    ]
    seqs, addrs, files_of, lines, dir_of, offs, blob = _sections(buf, sizes)
    if zlib.crc32(buf[_HEADER_BYTES:]) != crc:
        raise CorruptFile("line rows checksum")
    names = _Strings(offs, blob)
    dirs = [names[i] for i in range(n_dirs)]
    files = [(names[n_dirs + i], dir_of[i]) for i in range(n_files)]
    quads = [tuple(seqs[i : i + 4]) for i in range(0, len(seqs), 4)]
    if any(not (0 <= first <= end <= n_rows) for _, _, first, end in quads):
        raise CorruptFile("a sequence's rows")
    table_seqs = [(lo, hi, first, end) for lo, hi, first, end in quads]
    table = LineTable(version, dirs, files, table_seqs, [s[1] for s in table_seqs], addrs, files_of, lines)  # type: ignore[arg-type]
    table.program_bytes = program_bytes
    return table


# --- a compressed section, inflated ---------------------------------------------------------

KIND_SECTION = 7


def encode_section(data: memoryview) -> Parts:
    """An inflated section's bytes as they are (libc's debug file: `.debug_info` 5.8 MB, inflated
    in ~30 ms, read back and checked in a few)."""
    return [_header(KIND_SECTION, [len(data), zlib.crc32(data)]), data]


def read_section(data: mmap.mmap | bytes) -> memoryview:
    """The section's bytes, a view of `data` (kept mapped while it lives), checked whole: the
    reader's every answer is read from them. The check's pages are then let go: only those the
    reader touches after count in the run's memory (libc's `.debug_info`: 5.8 MB checked, a few
    units read)."""
    buf = memoryview(data)
    n, crc, *_ = _counts(buf, KIND_SECTION)
    (body,) = _sections(buf, [("B", n)])
    got = 0
    for start in range(0, n, _CHECK_STEP):
        got = zlib.crc32(body[start : start + _CHECK_STEP], got)
        if isinstance(data, mmap.mmap):  # a shared read-only map of the file: read again from the page cache
            done = len(buf) - n + min(start + _CHECK_STEP, n)
            data.madvise(mmap.MADV_DONTNEED, 0, done // mmap.PAGESIZE * mmap.PAGESIZE)
    if got != crc:
        raise CorruptFile("section checksum")
    if isinstance(data, mmap.mmap):
        data.madvise(mmap.MADV_DONTNEED)
    return body


_CHECK_STEP = 1 << 20  # a section is checked a megabyte at a time, each let go after


# --- a unit's outermost subroutines ------------------------------------------------------------

KIND_OUTER = 6


def encode_outer(outer: list[tuple[int, int, int, int]]) -> Parts:
    """A unit's outermost subroutines' (low, high, DIE offset, depth), sorted, as the reader's walk
    from the unit's first DIE recorded them (`symbolizer.dwarf.Outer`)."""
    columns = [array("Q", [o[k] for o in outer]) for k in range(3)]
    body: Parts = [*columns, array("I", [o[3] for o in outer])]
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    return [_header(KIND_OUTER, [len(outer), crc]), *body]


def read_outer(data: mmap.mmap | bytes) -> list[tuple[int, int, int, int]]:
    """Read whole (a few thousand entries at most) and checked."""
    buf = memoryview(data)
    n, crc, *_ = _counts(buf, KIND_OUTER)
    lows, highs, offsets, depths = _sections(buf, [("Q", n), ("Q", n), ("Q", n), ("I", n)])
    if zlib.crc32(buf[_HEADER_BYTES:]) != crc:
        raise CorruptFile("outermost subroutines checksum")
    return list(zip_strict(lows.tolist(), highs.tolist(), offsets.tolist(), depths.tolist()))

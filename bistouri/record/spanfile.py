"""The spans file of record's symbol cache: a binary's DWARF answers by address range.

`symbolizer.dwarf.DwarfFile.spans` gives, for each function a run sampled, the [start, end)
ranges over which the DWARF answer (function, file:line and inlined frames, as
`DwarfFile.frames` gives them) is the same. A later run's new address in one of those
functions is answered from here without opening the DWARF file: no compile unit read, no
compressed section inflated (record/dwarfpool.py asks this file first).

`<build id>-<size>.spans` (the size of the DWARF file read: a debug file installed later is
another file, with its own spans) shares symfile.py's header and its rules: native byte order,
read in place (mmap, bisect), every answer checked against its entry's checksum (start, end,
frame rows and their strings) before it is returned, `CorruptFile` when damaged. Arrays: span
starts and ends (u64, sorted, disjoint), a checksum each, the index of each span's first frame
row (n + 1), the frame rows (function and file string ids, line: three u32), the string table.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator

from ..symbolizer.llvm import SourceFrame
from .symfile import _U32, CorruptFile, Parts, _Code, _counts, _header, _sections, _StringBuilder, _Strings

KIND_SPANS = 4  # after symfile's kinds: one header format for every file of the cache
_SPAN = struct.Struct("=QQ")
_FRAME = struct.Struct("=I")  # a frame's line in an entry's checksum

Span = tuple[int, int, list[SourceFrame]]


def _span_crc(start: int, end: int, frames: Iterable[tuple[bytes, bytes, int]]) -> int:
    h = zlib.crc32(_SPAN.pack(start, end))
    for function, file, line in frames:
        for s in (function, file):
            h = zlib.crc32(s, zlib.crc32(_FRAME.pack(len(s)), h))
        h = zlib.crc32(_FRAME.pack(line), h)
    return h


class SpanTable:
    """One spans file, read in place. `get` raises `CorruptFile` when the span it reads is damaged."""

    __slots__ = ("_buf", "_crcs", "_ends", "_lists", "_map", "_rows", "_starts", "_strings")

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self._map = data
        self._buf = memoryview(data)
        n, n_rows, n_strings, blob, *_ = _counts(self._buf, KIND_SPANS)
        sizes: list[tuple[_Code, int]] = [
            ("Q", n),
            ("Q", n),
            ("I", n),
            ("I", n + 1),
            ("I", 3 * n_rows),
            ("I", n_strings + 1),
            ("B", blob),
        ]
        sections = _sections(self._buf, sizes)
        self._starts, self._ends, self._crcs, self._lists, self._rows, offs, strs = sections
        self._strings = _Strings(offs, strs)

    def close(self) -> None:
        for v in (self._starts, self._ends, self._crcs, self._lists, self._rows):
            v.release()
        self._strings.release()
        self._buf.release()
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __enter__(self) -> SpanTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._starts)

    def get(self, addr: int) -> list[SourceFrame] | None:
        """The frames of the span holding `addr`, None when no span does."""
        if not 0 <= addr < 1 << 64:
            return None
        i = bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._ends[i]:
            return None
        return self._span(i)[2]

    def _span(self, i: int) -> Span:
        start, end = self._lists[i], self._lists[i + 1]
        if not start <= end <= len(self._rows) // 3:
            raise CorruptFile(f"span {i}'s frames at {start}-{end}")
        raw = []
        for r in range(start, end):
            fn, file, line = self._rows[3 * r : 3 * r + 3]
            raw.append((self._strings.raw(fn), self._strings.raw(file), line, fn, file))
        lo, hi = self._starts[i], self._ends[i]
        if _span_crc(lo, hi, ((f, p, line) for f, p, line, _, _ in raw)) != self._crcs[i]:
            raise CorruptFile(f"span {i}'s checksum")
        s = self._strings
        return lo, hi, [SourceFrame(s[fn], s[file], line) for _, _, line, fn, file in raw]

    def items(self) -> Iterator[Span]:
        """Every span (to merge a file with new ones, and for tests): reads it whole."""
        for i in range(len(self)):
            yield self._span(i)


def encode_spans(new: Iterable[Span], old: SpanTable | None = None, max_spans: int = 1 << 31) -> Parts | None:
    """A spans file of what `old` holds and `new`'s spans that overlap none of them, up to
    `max_spans`; None when `new` adds nothing. Raises `CorruptFile` when `old` is damaged."""
    kept = list(old.items()) if old is not None else []
    starts = [s for s, _, _ in kept]
    ends = [e for _, e, _ in kept]
    added = 0
    for lo, hi, frames in sorted(new, key=lambda s: s[0]):
        if len(kept) >= max_spans:
            break
        if not 0 <= lo < hi < 1 << 64:
            continue
        i = bisect_right(starts, lo)
        if (i > 0 and ends[i - 1] > lo) or (i < len(starts) and starts[i] < hi):
            continue  # overlaps a span kept (the same function, met again): the first stays
        starts.insert(i, lo)
        ends.insert(i, hi)
        kept.insert(i, (lo, hi, frames))
        added += 1
    if not added:
        return None
    strings = _StringBuilder()
    crcs, lists, rows = array("I"), array("I", [0]), array("I")
    for lo, hi, frames in kept:
        for f in frames:
            rows.extend((strings.add(f.function), strings.add(f.file), min(max(f.line, 0), _U32)))
        mine = range(3 * lists[-1], len(rows), 3)
        crcs.append(
            _span_crc(
                lo, hi, ((strings.encoded[rows[k]], strings.encoded[rows[k + 1]], rows[k + 2]) for k in mine)
            )
        )
        lists.append(len(rows) // 3)
    offs, blob = strings.arrays()
    counts = [len(kept), len(rows) // 3, len(strings), len(blob)]
    return [_header(KIND_SPANS, counts), array("Q", starts), array("Q", ends), crcs, lists, rows, offs, blob]

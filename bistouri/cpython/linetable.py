"""Instruction offset -> source line, with each version's line table, as CPython computes it.

CPython's own answer is `PyCode_Addr2Line` (what tracebacks and `frame.f_lineno` use; `co_lines()` gives
the same ranges on 3.10+). The three formats, written from CPython's `Objects/lnotab_notes.txt` and
`Objects/locations.md` and the functions that read them (`codeobject.c`):

- 3.8, 3.9 `co_lnotab`: pairs (byte increment u8, line increment s8) from `co_firstlineno`; the line of an
  offset adds the line increments of every pair whose running address is <= it.
- 3.10 `co_linetable` (PEP 626): pairs (byte length u8, line delta s8), each one range; delta -128 is a
  range with no line (the running line unchanged); a range of length 0 changes only the running line.
- 3.11+ location table: entries of a first byte (bit 7 set, code = bits 3-6, length = bits 0-2 + 1 code
  units) and code-specific bytes; codes 10-12 add 0-2 to the line, 13 and 14 a signed varint, 15 is a range
  with no line, 0-9 keep the line.

A table becomes a `LineTable` once (bounded: its bytes were read with a bound), then each offset is a
bisect. Offsets are in code units (2 bytes), what the BPF walk sends; no line is None.
"""

from __future__ import annotations

import bisect
from enum import IntEnum


class TableKind(IntEnum):
    LNOTAB = 0  # 3.8, 3.9
    LINETABLE_310 = 1  # 3.10
    LOCATIONS = 2  # 3.11+


def kind_for(version: tuple[int, int]) -> TableKind:
    if version < (3, 10):
        return TableKind.LNOTAB
    if version < (3, 11):
        return TableKind.LINETABLE_310
    return TableKind.LOCATIONS


class LineTable:
    """The lines of one code object: `line(offset)` for an instruction offset in code units."""

    __slots__ = ("_lines", "_starts", "firstlineno")

    def __init__(self, kind: TableKind, table: bytes, firstlineno: int) -> None:
        self.firstlineno = firstlineno
        # Ranges as parallel lists: from byte offset _starts[i] to _starts[i + 1], line _lines[i]
        # (None: no line); past the last start, the last line (lnotab) or None (the others).
        if kind == TableKind.LNOTAB:
            self._starts, self._lines = _lnotab(table, firstlineno)
        elif kind == TableKind.LINETABLE_310:
            self._starts, self._lines = _linetable_310(table, firstlineno)
        else:
            self._starts, self._lines = _locations(table, firstlineno)

    def line(self, offset: int | None) -> int | None:
        """The line of the instruction `offset` code units from the first; None when CPython has no
        line for it. An unknown offset (None) or one before the first instruction is the first line,
        as `PyCode_Addr2Line` of a negative offset."""
        if offset is None or offset < 0:
            return self.firstlineno
        i = bisect.bisect_right(self._starts, offset * 2) - 1
        return self._lines[i] if i >= 0 else None

    def ranges(self) -> list[tuple[int, int | None]]:
        """(start byte offset, line) of each range, for tests and dumps."""
        return list(zip(self._starts, self._lines))


def _lnotab(table: bytes, firstlineno: int) -> tuple[list[int], list[int | None]]:
    starts: list[int] = [0]
    lines: list[int | None] = [firstlineno]
    addr, line = 0, firstlineno
    for i in range(0, len(table) - 1, 2):
        addr += table[i]
        delta = table[i + 1]
        line += delta - 256 if delta >= 128 else delta
        if addr == starts[-1]:
            lines[-1] = line
        else:
            starts.append(addr)
            lines.append(line)
    return starts, lines


def _linetable_310(table: bytes, firstlineno: int) -> tuple[list[int], list[int | None]]:
    starts: list[int] = []
    lines: list[int | None] = []
    end, computed = 0, firstlineno
    for i in range(0, len(table) - 1, 2):
        length, delta = table[i], table[i + 1]
        start, end = end, end + length
        line: int | None
        if delta == 128:  # -128: no line, the running line unchanged
            line = None
        else:
            computed += delta - 256 if delta > 128 else delta
            line = computed
        if length:
            starts.append(start)
            lines.append(line)
    starts.append(end)  # past the table: no line
    lines.append(None)
    return starts, lines


def _locations(table: bytes, firstlineno: int) -> tuple[list[int], list[int | None]]:
    starts: list[int] = []
    lines: list[int | None] = []
    end, computed = 0, firstlineno
    i, n = 0, len(table)
    while i < n:
        first = table[i]
        code = (first >> 3) & 15
        length = ((first & 7) + 1) * 2
        if code in (13, 14):
            computed += _svarint(table, i + 1)
        elif 10 <= code <= 12:
            computed += code - 10
        starts.append(end)
        lines.append(None if code == 15 else computed)
        end += length
        i += 1
        while i < n and not table[i] & 0x80:  # the entry's other bytes
            i += 1
    starts.append(end)
    lines.append(None)
    return starts, lines


def _svarint(table: bytes, i: int) -> int:
    """The signed varint at `i`: 6-bit chunks, bit 6 continues, bit 0 of the value is the sign. A
    truncated one reads as far as the table goes."""
    value, shift = 0, 0
    while i < len(table):
        b = table[i]
        value |= (b & 63) << shift
        i += 1
        if not b & 64 or shift > 60:
            break
        shift += 6
    return -(value >> 1) if value & 1 else value >> 1

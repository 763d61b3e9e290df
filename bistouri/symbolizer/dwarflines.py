"""One compile unit's line table (`.debug_line`, versions 2-5): its rows, and a row's file as llvm names it.

The program is run once for all the addresses asked about in the unit; its rows are kept in
arrays (16 bytes a row), its sequences ordered by their end as llvm orders them, so that an
address finds its row as llvm-symbolizer's lookupAddress does (the last row at or before it in
the first sequence that ends after it). Bytes are untrusted (dwarfform.py): the rows are bounded
by the program's length, which the caller bounds.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from ..compat import SLOTS
from .dwarfform import (
    F_BLOCK,
    F_IMPLICIT_CONST,
    F_LINE_STRP,
    F_SEC_OFFSET,
    F_STRING,
    F_STRP,
    F_STRX,
    F_UDATA,
    FIXED,
    Malformed,
    Unsupported,
    cstr,
    join_path,
    sleb,
    uint,
    uleb,
)

# A string of the line table's header by its form and value (.debug_line_str, .debug_str, strx).
Strings = Callable[[int, int], str]


@dataclass(**SLOTS)
class LineTable:
    """A unit's DWARF line table: directories, files and the rows of its sequences."""

    version: int
    dirs: list[str]
    files: list[tuple[str, int]]  # (name, directory index)
    # Sequences sorted by their end: (low, high, first row, end row) into the row arrays.
    seqs: list[tuple[int, int, int, int]]
    seq_highs: list[int]
    addrs: array[int]
    files_of: array[int]
    lines: array[int]
    paths: dict[int, str] = field(default_factory=dict)
    program_bytes: int = 0  # the length of the program that made the rows (what the budget bounds)

    def row(self, addr: int) -> tuple[int, int] | None:
        """(file index, line) of the row holding `addr` (llvm's lookupAddress)."""
        i = bisect_right(self.seq_highs, addr)
        if i == len(self.seqs):
            return None
        low, high, first, last = self.seqs[i]
        if not low <= addr < high:
            return None
        # The last row at or before addr among first..last-2 (the end_sequence row excluded).
        j = bisect_right(self.addrs, addr, first + 1, last - 1) - 1
        return self.files_of[j], self.lines[j]

    def path(self, index: int, comp_dir: str) -> str:
        got = self.paths.get(index)
        if got is None:
            got = self.paths[index] = self._path(index, comp_dir)
        return got

    def _path(self, index: int, comp_dir: str) -> str:
        """llvm's getFileNameByIndex with AbsoluteFilePath ("" when the index names no file)."""
        if self.version >= 5:
            if not 0 <= index < len(self.files):
                return ""
            name, d = self.files[index]
        else:
            if not 1 <= index <= len(self.files):
                return ""
            name, d = self.files[index - 1]
        if name.startswith("/"):
            return name
        include = ""
        if self.version >= 5:
            if d < len(self.dirs):
                include = self.dirs[d]
        elif 0 < d <= len(self.dirs):
            include = self.dirs[d - 1]
        comp = ""
        # As llvm 19 (14 also prepended it to DWARF 5's directory 0, the unit's own).
        if (self.version < 5 or d != 0) and comp_dir and not include.startswith("/"):
            comp = comp_dir
        return join_path(comp, include, name)


def parse(b: memoryview, off: int, strings: Strings, max_rows: int) -> LineTable:
    """The line table at `off` in .debug_line; Unsupported past `max_rows` rows."""
    (length,) = struct.unpack_from("<I", b, off)
    offset_size, pos = 4, off + 4
    if length == 0xFFFFFFFF:
        (length,) = struct.unpack_from("<Q", b, off + 4)
        offset_size, pos = 8, off + 12
    end = pos + length
    if end > len(b):
        raise Malformed("line table past the end of .debug_line")
    (version,) = struct.unpack_from("<H", b, pos)
    pos += 2
    if not 2 <= version <= 5:
        raise Unsupported(f"line table version {version}")
    if version >= 5:
        if b[pos] != 8:
            raise Unsupported("line table address size")
        pos += 2
    header_length = uint(b, pos, offset_size)
    pos += offset_size
    program = pos + header_length
    min_inst = b[pos]
    pos += 1
    if version >= 4:
        if b[pos] > 1:
            raise Unsupported("VLIW line table")
        pos += 1
    line_base = struct.unpack_from("<b", b, pos + 1)[0]  # after default_is_stmt, which llvm's lookup ignores
    line_range, opcode_base = b[pos + 2], b[pos + 3]
    pos += 4
    if line_range == 0 or opcode_base == 0:
        raise Malformed("line table header")
    std_lengths = bytes(b[pos : pos + opcode_base - 1])
    pos += opcode_base - 1
    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    if version >= 5:
        for entries in (dirs, files):
            n_formats = b[pos]
            pos += 1
            formats = []
            for _ in range(n_formats):
                kind, pos = uleb(b, pos)
                form, pos = uleb(b, pos)
                formats.append((kind, form))
            count, pos = uleb(b, pos)
            if count > 1 << 20:
                raise Malformed("too many line table entries")
            for _ in range(count):
                name, index = "", 0
                for kind, form in formats:
                    val, pos = _value(b, form, pos, offset_size)
                    if kind == 1:  # DW_LNCT_path
                        name = cstr(b, val)[0] if form == F_STRING else strings(form, val)
                    elif kind == 2:  # DW_LNCT_directory_index
                        index = val
                if entries is dirs:
                    dirs.append(name)
                else:
                    files.append((name, index))
    else:
        while b[pos]:
            name, pos = cstr(b, pos)
            dirs.append(name)
        pos += 1
        while b[pos]:
            name, pos = cstr(b, pos)
            index, pos = uleb(b, pos)
            _, pos = uleb(b, pos)  # modification time
            _, pos = uleb(b, pos)  # length
            files.append((name, index))
    # Every row takes at least a byte of program: bounding the bytes bounds the rows.
    if end - program > max_rows:
        raise Unsupported("over the line row budget")
    seqs, addrs, files_of, lines = _run(
        bytes(b[program:end]), min_inst, line_base, line_range, opcode_base, std_lengths
    )
    table = LineTable(version, dirs, files, seqs, [s[1] for s in seqs], addrs, files_of, lines)
    table.program_bytes = end - program
    return table


def _value(b: memoryview, form: int, pos: int, offset_size: int) -> tuple[int, int]:
    """(value, position after it) of one field of a DWARF 5 directory or file entry."""
    size = FIXED.get(form)
    if size is not None and form != F_IMPLICIT_CONST:
        return (uint(b, pos, size) if size <= 8 else 0), pos + size
    if form in (F_STRP, F_LINE_STRP, F_SEC_OFFSET):
        return uint(b, pos, offset_size), pos + offset_size
    if form in (F_UDATA, F_STRX):
        return uleb(b, pos)
    if form == F_STRING:
        _, after = cstr(b, pos)
        return pos, after
    if form == F_BLOCK:
        n, pos = uleb(b, pos)
        return 0, pos + n
    raise Unsupported(f"line table form 0x{form:x}")


def _run(
    prog: bytes, min_inst: int, line_base: int, line_range: int, opcode_base: int, std_lengths: bytes
) -> tuple[list[tuple[int, int, int, int]], array[int], array[int], array[int]]:
    """The sequences and rows (address, file, line) of a line program."""
    addrs, files_of, lines = array("Q"), array("I"), array("i")
    add_addr, add_file, add_line = addrs.append, files_of.append, lines.append
    seqs: list[tuple[int, int, int, int]] = []
    addr, file, line = 0, 1, 1
    seq_first = 0
    const_add = (255 - opcode_base) // line_range * min_inst
    # Each special opcode's address and line advance, looked up rather than computed.
    step = [0] * 256
    lstep = [0] * 256
    for op in range(opcode_base, 256):
        step[op] = (op - opcode_base) // line_range * min_inst
        lstep[op] = line_base + (op - opcode_base) % line_range
    pos, end = 0, len(prog)
    # Out of range values (a damaged program) raise OverflowError in the appends.
    while pos < end:
        op = prog[pos]
        pos += 1
        if op >= opcode_base:
            addr += step[op]
            line += lstep[op]
            add_addr(addr)
            add_file(file)
            add_line(line)
        elif op == 0:  # extended
            n, pos = uleb(prog, pos)
            if n == 0:
                continue
            sub, body = prog[pos], pos + 1
            pos += n
            if sub == 1:  # end_sequence
                add_addr(addr)
                add_file(file)
                add_line(line)
                low = addrs[seq_first]
                if low < addr and len(addrs) - seq_first >= 2 and low != (1 << 64) - 1:
                    seqs.append((low, addr, seq_first, len(addrs)))
                seq_first = len(addrs)
                addr, file, line = 0, 1, 1
            elif sub == 2:  # set_address
                addr = int.from_bytes(prog[body : body + min(n - 1, 8)], "little")
        elif op == 1:  # copy
            add_addr(addr)
            add_file(file)
            add_line(line)
        elif op == 2:  # advance_pc
            n, pos = uleb(prog, pos)
            addr += n * min_inst
        elif op == 3:  # advance_line
            n, pos = sleb(prog, pos)
            line += n
        elif op == 4:  # set_file
            file, pos = uleb(prog, pos)
        elif op == 8:  # const_add_pc
            addr += const_add
        elif op == 9:  # fixed_advance_pc
            addr += int.from_bytes(prog[pos : pos + 2], "little")
            pos += 2
        else:  # set_column and the rest: skip their operands
            for _ in range(std_lengths[op - 1] if op - 1 < len(std_lengths) else 0):
                _, pos = uleb(prog, pos)
    # The rows of a sequence are in the order written; llvm orders sequences by their end.
    seqs.sort(key=lambda s: s[1])
    del addrs[seq_first:], files_of[seq_first:], lines[seq_first:]  # an unterminated last sequence
    return seqs, addrs, files_of, lines

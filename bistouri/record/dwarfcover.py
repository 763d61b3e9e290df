"""The code a binary's DWARF describes, from `.debug_aranges`: what llvm-symbolizer can add to a name.

node ships a little DWARF (~110 ranges of a few C files) beside ~60 MB of code without it. An
address outside every compile unit gets from llvm-symbolizer what the symbol table says, no
file:line, and starting it costs ~75 MB and ~1 s for node. With the ranges cached beside the
binary's symbols (symfile's symbols file), `record` names such addresses itself.

Only a complete answer is given: every compile unit of `.debug_info` (type units aside) must have
its set in `.debug_aranges` (an optional section, which some producers write for some units only),
and neither section may be compressed; otherwise None, and the resolver keeps every address.
"""

from __future__ import annotations

import struct

from ..elf import SHF_COMPRESSED, ElfFile, ElfFormatError

_TYPE_UNITS = (0x02, 0x06)  # DW_UT_type, DW_UT_split_type (DWARF 5): no code
MAX_RANGES = 1 << 16  # more than any binary here has (node: ~110); past it, no answer


def covered_ranges(path: str) -> list[tuple[int, int]] | None:
    """The merged [start, end) virtual address ranges of the compile units of the ELF file at
    `path` (its debug file), or None when they cannot be told exactly."""
    try:
        with ElfFile(path) as elf:
            info, aranges = elf.section(".debug_info"), elf.section(".debug_aranges")
            if info is None or aranges is None or (info.flags | aranges.flags) & SHF_COMPRESSED:
                return None
            units = _compile_units(elf.section_data(info))
            sets = _aranges(elf.section_data(aranges))
    except (ElfFormatError, OSError, struct.error, ValueError):
        return None
    if units is None or sets is None or not units <= sets[0]:
        return None
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(sets[1]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _unit_length(data: bytes, pos: int) -> tuple[int, int, int]:
    """(length, offset size, position after the length field) of the unit at `pos`."""
    (length,) = struct.unpack_from("<I", data, pos)
    if length == 0xFFFFFFFF:
        (length,) = struct.unpack_from("<Q", data, pos + 4)
        return length, 8, pos + 12
    if length >= 0xFFFFFFF0:
        raise ValueError("reserved unit length")
    return length, 4, pos + 4


def _compile_units(data: bytes) -> set[int] | None:
    """The offsets of the units of `.debug_info` that may describe code."""
    out: set[int] = set()
    pos = 0
    while pos < len(data):
        length, _, body = _unit_length(data, pos)
        (version,) = struct.unpack_from("<H", data, body)
        if version >= 5 and data[body + 2] in _TYPE_UNITS:
            pass
        elif 2 <= version <= 5:
            out.add(pos)
        else:
            return None
        pos = body + length
        if len(out) > MAX_RANGES:
            return None
    return out


def _aranges(data: bytes) -> tuple[set[int], list[tuple[int, int]]] | None:
    """(the `.debug_info` offsets of the units with a set, their address ranges)."""
    units: set[int] = set()
    ranges: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        length, offset_size, body = _unit_length(data, pos)
        end = body + length
        (version,) = struct.unpack_from("<H", data, body)
        (unit,) = struct.unpack_from("<I" if offset_size == 4 else "<Q", data, body + 2)
        address_size, segment_size = data[body + 2 + offset_size], data[body + 3 + offset_size]
        if version != 2 or address_size != 8 or segment_size != 0 or end > len(data):
            return None
        units.add(unit)
        at = body + 4 + offset_size
        at += -(at - pos) % 16  # the tuples are aligned to their size from the set's start
        while at + 16 <= end:
            lo, size = struct.unpack_from("<QQ", data, at)
            at += 16
            if lo == 0 and size == 0:
                break
            if size:
                ranges.append((lo, lo + size))
                if len(ranges) > MAX_RANGES:
                    return None
        pos = end
    return units, ranges

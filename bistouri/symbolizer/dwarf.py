"""File:line and inlined frames from DWARF 4 and 5, read in place for the compile units asked about.

llvm-symbolizer answers one address of a binary by indexing all of its DWARF: on pyenv's libpython
(14 MB of `.debug_info`) a run costs ~70 MB and ~1 s, for a few dozen sampled addresses. This reader
answers the same questions (docs/symbolization.md, "DWARF in process") touching only what they need:

- the compile unit of an address from `.debug_aranges`, and for a unit it omits from the unit's
  own ranges (its first DIE), as llvm finds it;
- its line from that unit's `.debug_line` program, run once for all the unit's addresses;
- its inlined frames from that unit's DIEs, descending only into the subprograms, inlined
  subroutines and lexical blocks whose ranges hold one of the addresses (`DW_AT_sibling`, or the
  attributes' sizes, skip the rest).

The answers are llvm-symbolizer's (`--inlines`, linkage names, absolute file names), frame for frame:
the innermost frame's line from the line table, each outer frame's from the call site of the
frame inside it (`DW_AT_call_file`, `DW_AT_call_line`); tests/integration/test_dwarf_llvm.py compares
the two on real binaries.

The file is the watched process's, or an upload: every read is an index into the mapped file,
checked (a bad offset raises, the unit gets no answer); loops advance or stop; work is bounded per
file (DIEs, line rows, range entries, reference hops); a compressed section is inflated up to a
bound. What it does not read it says (`Unsupported`, None for an address): split DWARF, DWARF
before 4, dwz's supplementary files, zstd; its caller asks llvm-symbolizer for those
(record/dwarfpool.py). The encodings are dwarfform.py's, the line tables dwarflines.py's.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import struct
import zlib
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..compat import SLOTS, bisect_left_key, zip_strict
from ..elf import ELFCOMPRESS_ZLIB, SHF_COMPRESSED, SHT_NOBITS, ElfFile, ElfFormatError
from . import dwarflines
from .dwarfform import (
    AT_ABSTRACT_ORIGIN,
    AT_ADDR_BASE,
    AT_CALL_FILE,
    AT_CALL_LINE,
    AT_COMP_DIR,
    AT_DWO_NAME,
    AT_GNU_DWO_NAME,
    AT_HIGH_PC,
    AT_LINKAGE_NAME,
    AT_LOW_PC,
    AT_MIPS_LINKAGE_NAME,
    AT_NAME,
    AT_RANGES,
    AT_RNGLISTS_BASE,
    AT_SIBLING,
    AT_SPECIFICATION,
    AT_STMT_LIST,
    AT_STR_OFFSETS_BASE,
    F_ADDR,
    F_ADDRX,
    F_ADDRX1,
    F_ADDRX2,
    F_ADDRX3,
    F_ADDRX4,
    F_BLOCK,
    F_BLOCK1,
    F_BLOCK2,
    F_BLOCK4,
    F_DATA16,
    F_EXPRLOC,
    F_IMPLICIT_CONST,
    F_INDIRECT,
    F_LINE_STRP,
    F_REF_ADDR,
    F_RNGLISTX,
    F_SDATA,
    F_STRING,
    F_STRP,
    F_STRX,
    F_STRX1,
    F_STRX2,
    F_STRX3,
    F_STRX4,
    FIXED,
    LEB,
    OFFSET_SIZED,
    REFS_IN_UNIT,
    SKELETON_TAGS,
    TAG_INLINED,
    TAG_LEXICAL_BLOCK,
    TAG_NAMESPACE,
    TAG_SUBPROGRAM,
    UNIT_TAGS,
    UNREADABLE,
    WANTED,
    Abbrevs,
    Malformed,
    Unsupported,
    cstr,
    sleb,
    uint,
    uleb,
)
from .dwarflines import LineTable
from .llvm import SourceFrame

MAX_INFLATED_BYTES = 256 << 20  # one compressed section, inflated
MAX_UNITS = 1 << 20
MAX_DIES = 4_000_000  # DIEs read per file and run: a few units of a large C++ binary
MAX_ROWS = 2_000_000  # line rows per file and run (16 bytes each)
MAX_DEPTH = 256  # DIE nesting
MAX_RANGES = 1 << 16  # entries of one range list
MAX_HOPS = 16  # DW_AT_abstract_origin / DW_AT_specification followed for a name
_OVERLAPS = 16  # unit ranges looked at before an address

_SECTIONS = (
    ".debug_info",
    ".debug_abbrev",
    ".debug_aranges",
    ".debug_line",
    ".debug_str",
    ".debug_line_str",
    ".debug_str_offsets",
    ".debug_addr",
    ".debug_ranges",
    ".debug_rnglists",
)


Frames = list[SourceFrame]


Outer = list[tuple[int, int, int, int]]  # a unit's outermost subroutines: (low, high, DIE offset, depth)


class UnitStore(Protocol):
    """What the reader made of a unit, kept between runs (`record`'s cache: record/linefile.py):
    its line table (by offset in `.debug_line`: not run again) and the ranges of its outermost
    subroutines (by unit offset: an address's chain is walked from its function, not from the
    unit's first DIE); and the file's compressed sections once inflated (by name: libc's debug
    file, ~30 ms of inflating for `.debug_info` alone at every run that meets a new libc address)."""

    def get(self, offset: int) -> LineTable | None: ...

    def put(self, offset: int, table: LineTable) -> None: ...

    def outer(self, unit: int) -> Outer | None: ...

    def put_outer(self, unit: int, outer: Outer) -> None: ...

    def section(self, name: str) -> memoryview | None: ...

    def put_section(self, name: str, data: memoryview) -> None: ...


@dataclass(**SLOTS)
class _Unit:
    """A compilation unit of .debug_info: its header and what its unit DIE says."""

    offset: int  # of its header in .debug_info
    end: int
    version: int
    addr_size: int
    offset_size: int
    abbrev_offset: int
    first_die: int
    ranges: list[tuple[int, int]] = field(default_factory=list)
    comp_dir: str = ""
    stmt_list: int | None = None
    str_offsets_base: int = 8
    addr_base: int = 8
    rnglists_base: int = 0
    low_pc: int = 0
    split: bool = False  # a skeleton: the DIEs are in a .dwo file
    abbrevs: Abbrevs | None = None
    read: bool = False  # its unit DIE's attributes


@dataclass(**SLOTS)
class _Die:
    """A DIE read from .debug_info: its tag and attributes."""

    offset: int
    tag: int
    children: bool
    attrs: dict[int, tuple[int, int]]  # attribute -> (form, value)
    end: int  # after its attributes


class DwarfFile:
    """One ELF file's DWARF, mapped read-only. Not thread-safe. Raises `Unsupported` on opening
    when the file has nothing this reader reads."""

    def __init__(self, path: str, lines: UnitStore | None = None) -> None:
        self.path = path
        self.line_store = lines
        self._views: dict[str, memoryview] = {}
        self._mm: mmap.mmap | None = None
        self._inflated: list[mmap.mmap] = []  # sections inflated into anonymous maps
        # Compressed sections not inflated yet: each is at its first use (a run whose units' line
        # rows are kept never inflates `.debug_line`: libc's debug file, ~7 ms and 1.3 MB).
        self._packed: dict[str, memoryview] = {}
        self._packed_at: dict[str, int] = {}  # their offsets in the file
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block us
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < 64:
                raise Unsupported("not a regular file, or too small for an ELF file")
            self._mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            self._open_sections()
        except BaseException:
            self.close()
            raise
        self._units: list[_Unit] | None = None
        self._complete = True  # every unit that may describe code was read
        self._unit_starts: list[int] = []
        self._ranges: list[tuple[int, int, int]] = []  # units' (start, end, number), by start
        self._lo: list[int] = []  # their starts, bisected
        self._abbrevs: dict[tuple[int, int, int], Abbrevs] = {}
        self._lines: dict[int, LineTable] = {}
        self._names: dict[int, str] = {}  # a subroutine DIE's name, by offset
        self.dies = 0
        self.rows = 0
        self._outer: Outer | None = None  # while a walk records the outermost subroutines

    def _open_sections(self) -> None:
        assert self._mm is not None
        try:
            elf = ElfFile(data=self._mm)  # type: ignore[arg-type]  # reads as bytes do
        except ElfFormatError as e:
            raise Unsupported(str(e)) from e
        try:
            if elf.endian != "<":
                raise Unsupported("big-endian")
            whole = memoryview(self._mm)
            try:
                for sec in elf.sections:
                    if sec.name.startswith(".zdebug_"):
                        raise Unsupported(f"{sec.name}: GNU compressed section")
                    if sec.name not in _SECTIONS or sec.type == SHT_NOBITS:
                        continue
                    if sec.offset + sec.size > len(whole):
                        raise Unsupported(f"{sec.name} past the end of the file")
                    view = whole[sec.offset : sec.offset + sec.size]
                    if sec.flags & SHF_COMPRESSED:
                        self._packed[sec.name] = view
                        self._packed_at[sec.name] = sec.offset
                    else:
                        self._views[sec.name] = view
            finally:
                whole.release()
        finally:
            elf.close()
        for name in (".debug_info", ".debug_abbrev", ".debug_line"):
            if name not in self._views and name not in self._packed:
                raise Unsupported(f"no {name}")
        self.empty = memoryview(b"")
        self.info = self._sec(".debug_info")

    def _sec(self, name: str) -> memoryview:
        """A section's bytes (empty when the file has none), inflated at its first use; raises
        `Unsupported` at every use when it cannot be (a unit that needs it is llvm's)."""
        view = self._views.get(name)
        if view is None:
            packed = self._packed.get(name)
            if packed is None:
                return self.empty
            store = self.line_store
            view = store.section(name) if store is not None else None
            if view is not None and len(view) != _inflated_size(packed, name):
                view.release()  # not this section's (its header says another size)
                view = None
            if view is None and store is not None:
                # Kept, then read from the kept file, whose pages count only as the reader touches
                # them, not from an anonymous map (libc's seven sections: 8.5 MB held at once).
                inflated = _inflate(packed, name)
                with memoryview(inflated) as whole:
                    store.put_section(name, whole)
                inflated.close()
                view = store.section(name)
                if view is not None and len(view) != _inflated_size(packed, name):
                    view.release()
                    view = None
            if view is None:  # no store, or the section could not be kept
                inflated = _inflate(packed, name)
                self._inflated.append(inflated)
                view = memoryview(inflated)
            del self._packed[name]
            self._let_go(self._packed_at[name], len(packed))
            packed.release()
            self._views[name] = view
        return view

    def _let_go(self, offset: int, size: int) -> None:
        """Drop the mapped file's pages of [offset, offset + size) from this process's memory
        (read again from the page cache if touched): a section's compressed bytes once inflated."""
        assert self._mm is not None
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if start < end:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        for v in (*self._views.values(), *self._packed.values()):
            v.release()
        self._views.clear()
        self._packed.clear()
        for m in self._inflated:
            m.close()
        self._inflated.clear()
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> DwarfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- units -------------------------------------------------------------------------

    def _index_units(self) -> None:
        """Every unit's header and its first DIE's ranges: which unit holds an address."""
        units: list[_Unit] = []
        info = self.info
        pos = 0
        while pos + 11 <= len(info):
            (length,) = struct.unpack_from("<I", info, pos)
            offset_size, body = 4, pos + 4
            if length == 0xFFFFFFFF:
                (length,) = struct.unpack_from("<Q", info, pos + 4)
                offset_size, body = 8, pos + 12
            elif length >= 0xFFFFFFF0:
                raise Unsupported("reserved unit length")
            end = body + length
            if end > len(info) or length < 2:
                raise Unsupported("unit past the end of .debug_info")
            (version,) = struct.unpack_from("<H", info, body)
            unit = None
            if version in (2, 3, 4):
                abbrev = uint(info, body + 2, offset_size)
                addr_size = info[body + 2 + offset_size]
                unit = _Unit(pos, end, version, addr_size, offset_size, abbrev, body + 3 + offset_size)
            elif version == 5:
                unit_type, addr_size = info[body + 2], info[body + 3]
                abbrev = uint(info, body + 4, offset_size)
                first = body + 4 + offset_size
                if unit_type in (0x01, 0x03):  # compile, partial
                    unit = _Unit(pos, end, version, addr_size, offset_size, abbrev, first)
                elif unit_type in (0x04, 0x05):  # skeleton, split compile: the DIEs are elsewhere
                    unit = _Unit(pos, end, version, addr_size, offset_size, abbrev, first + 8, split=True)
                # type units (0x02, 0x06) describe no code
            if unit is not None:
                units.append(unit)
                if len(units) > MAX_UNITS:
                    raise Unsupported("too many units")
            pos = end
        self._units = units
        self._unit_starts = [u.offset for u in units]
        # As llvm: the units' ranges from .debug_aranges, from the unit DIE for a unit it omits.
        try:
            listed = self._aranges()
        except (Malformed, IndexError, struct.error):
            listed = {}
        ranges: list[tuple[int, int, int]] = []
        for i, u in enumerate(units):
            got = listed.get(u.offset)
            if got is None:
                try:
                    self._read_unit_die(u)
                except (Malformed, Unsupported, IndexError, struct.error):
                    self._complete = False  # its addresses are llvm-symbolizer's
                    continue
                got = u.ranges
            ranges.extend((lo, hi, i) for lo, hi in got if lo < hi)
        ranges.sort()
        self._ranges = ranges
        self._lo = [r[0] for r in ranges]

    def _aranges(self) -> dict[int, list[tuple[int, int]]]:
        """The address ranges of each unit (by .debug_info offset) that .debug_aranges lists."""
        b = self._sec(".debug_aranges")
        out: dict[int, list[tuple[int, int]]] = {}
        pos = 0
        entries = 0
        while pos + 12 <= len(b):
            length = uint(b, pos, 4)
            offset_size, body = 4, pos + 4
            if length == 0xFFFFFFFF:
                length, offset_size, body = uint(b, pos + 4, 8), 8, pos + 12
            end = body + length
            if end > len(b) or length < 4 + offset_size:
                raise Malformed("address range set past the end of .debug_aranges")
            version, unit = uint(b, body, 2), uint(b, body + 2, offset_size)
            addr_size, seg_size = b[body + 2 + offset_size], b[body + 3 + offset_size]
            if version != 2 or addr_size != 8 or seg_size != 0:
                raise Malformed("address range set of another kind")
            at = body + 4 + offset_size
            at += -(at - pos) % 16  # the pairs are aligned to their size from the set's start
            got = out.setdefault(unit, [])
            while at + 16 <= end:
                lo, size = uint(b, at, 8), uint(b, at + 8, 8)
                at += 16
                if lo == 0 and size == 0:
                    break
                got.append((lo, lo + size))
                entries += 1
                if entries > MAX_UNITS:
                    raise Malformed("too many address ranges")
            pos = end
        return out

    def _prepare(self, u: _Unit) -> _Unit:
        """`u` with its unit DIE's attributes read (bases, directory, line table, ranges)."""
        if not u.read:
            self._read_unit_die(u)
        return u

    def _read_unit_die(self, u: _Unit) -> None:
        if u.version < 4 or u.addr_size != 8:
            raise Unsupported(f"DWARF {u.version}, {u.addr_size}-byte addresses")
        die = self._die(u, u.first_die)
        if die is None or die.tag not in UNIT_TAGS + SKELETON_TAGS:
            raise Malformed("a unit without a unit DIE")
        a = die.attrs
        if die.tag in SKELETON_TAGS or AT_DWO_NAME in a or AT_GNU_DWO_NAME in a:
            u.split = True
        # The bases first: the other attributes' values are read through them.
        if AT_STR_OFFSETS_BASE in a:
            u.str_offsets_base = a[AT_STR_OFFSETS_BASE][1]
        if AT_ADDR_BASE in a:
            u.addr_base = a[AT_ADDR_BASE][1]
        if AT_RNGLISTS_BASE in a:
            u.rnglists_base = a[AT_RNGLISTS_BASE][1]
        if AT_LOW_PC in a:
            u.low_pc = self._address(u, *a[AT_LOW_PC])
        if AT_COMP_DIR in a:
            u.comp_dir = self._string(u, *a[AT_COMP_DIR])
        if AT_STMT_LIST in a:
            u.stmt_list = a[AT_STMT_LIST][1]
        u.ranges = self._die_ranges(u, a)
        u.read = True

    def _unit_at(self, info_offset: int) -> _Unit:
        """The unit whose header or DIEs hold `info_offset` (a DW_FORM_ref_addr)."""
        assert self._units is not None
        i = bisect_right(self._unit_starts, info_offset) - 1
        if i < 0 or info_offset >= self._units[i].end:
            raise Malformed("reference outside every unit")
        return self._prepare(self._units[i])

    # --- DIEs --------------------------------------------------------------------------

    def _abbrev_table(self, u: _Unit) -> Abbrevs:
        if u.abbrevs is None:
            key = (u.abbrev_offset, u.offset_size, u.addr_size)
            table = self._abbrevs.get(key)
            if table is None:
                table = self._abbrevs[key] = Abbrevs(self._sec(".debug_abbrev"), *key)
            u.abbrevs = table
        return u.abbrevs

    def _die(self, u: _Unit, pos: int) -> _Die | None:
        """The DIE at `pos` with the attributes this reader uses (None: a null entry)."""
        self.dies += 1
        if self.dies > MAX_DIES:
            raise Unsupported("over the DIE budget")
        code, at = uleb(self.info, pos)
        if code == 0:
            return None
        ab = self._abbrev_table(u).get(code)
        if ab is None:
            raise Malformed(f"abbreviation {code} not in its table")
        attrs: dict[int, tuple[int, int]] = {}
        for attr, form, const in ab.attrs:
            real, val, at = self._value(u, form, at, const)
            if attr in WANTED and attr not in attrs:
                attrs[attr] = (real, val)
        if at > u.end:
            raise Malformed("DIE past its unit")
        return _Die(pos, ab.tag, ab.children, attrs, at)

    def _value(self, u: _Unit, form: int, pos: int, const: int = 0) -> tuple[int, int, int]:
        """(form, value, position after it) of one attribute: the form named by a DW_FORM_indirect;
        a string is its offset, a block 0."""
        b = self.info
        size = FIXED.get(form)
        if size is not None:
            if form == F_IMPLICIT_CONST:
                return form, const, pos
            if form == F_DATA16:
                return form, 0, pos + 16
            return form, (uint(b, pos, size) if size else 1), pos + size
        if form in OFFSET_SIZED:
            return form, uint(b, pos, u.offset_size), pos + u.offset_size
        if form == F_ADDR:
            return form, uint(b, pos, u.addr_size), pos + u.addr_size
        if form == F_SDATA:
            return (form, *sleb(b, pos))
        if form in LEB:
            return (form, *uleb(b, pos))
        if form == F_STRING:
            end = pos
            while b[end]:
                end += 1
            return form, pos, end + 1
        if form in (F_BLOCK, F_EXPRLOC):
            n, pos = uleb(b, pos)
            return form, 0, pos + n
        if form in (F_BLOCK1, F_BLOCK2, F_BLOCK4):
            size = {F_BLOCK1: 1, F_BLOCK2: 2, F_BLOCK4: 4}[form]
            return form, 0, pos + size + uint(b, pos, size)
        if form == F_INDIRECT:
            real, pos = uleb(b, pos)
            if real in (F_INDIRECT, F_IMPLICIT_CONST):
                raise Malformed("indirect form")
            return self._value(u, real, pos)
        raise Unsupported(f"form 0x{form:x}")

    def _skip_children(self, u: _Unit, pos: int, depth: int) -> int:
        """The position after the children starting at `pos` (after their null entry)."""
        if depth > MAX_DEPTH:
            raise Malformed("DIEs nested too deep")
        b = self.info
        table = self._abbrev_table(u)
        while True:
            self.dies += 1
            if self.dies > MAX_DIES:
                raise Unsupported("over the DIE budget")
            code, at = uleb(b, pos)
            if code == 0:
                return at
            ab = table.get(code)
            if ab is None:
                raise Malformed(f"abbreviation {code} not in its table")
            sibling = 0
            if ab.fixed >= 0:
                if ab.children and ab.attrs and ab.attrs[0][0] == AT_SIBLING:
                    sibling = self._ref(u, *self._value(u, ab.attrs[0][1], at)[:2])
                at += ab.fixed
            else:
                for attr, form, const in ab.attrs:
                    real, val, at = self._value(u, form, at, const)
                    if attr == AT_SIBLING:
                        sibling = self._ref(u, real, val)
            if at > u.end:
                raise Malformed("DIE past its unit")
            if ab.children:
                at = sibling if at < sibling < u.end else self._skip_children(u, at, depth + 1)
            pos = at

    def _ref(self, u: _Unit, form: int, val: int) -> int:
        """The .debug_info offset a reference attribute names (-1: none this reader follows)."""
        if form in REFS_IN_UNIT:
            return u.offset + val
        if form == F_REF_ADDR:
            return val
        return -1

    # --- values ------------------------------------------------------------------------

    def _string(self, u: _Unit, form: int, val: int) -> str:
        if form == F_STRING:
            return cstr(self.info, val)[0]
        if form == F_STRP:
            return cstr(self._sec(".debug_str"), val)[0]
        if form == F_LINE_STRP:
            return cstr(self._sec(".debug_line_str"), val)[0]
        if form in (F_STRX, F_STRX1, F_STRX2, F_STRX3, F_STRX4):
            off = uint(
                self._sec(".debug_str_offsets"), u.str_offsets_base + val * u.offset_size, u.offset_size
            )
            return cstr(self._sec(".debug_str"), off)[0]
        if form in UNREADABLE:
            raise Unsupported(f"string form 0x{form:x}")
        raise Malformed(f"string of form 0x{form:x}")

    def _address(self, u: _Unit, form: int, val: int) -> int:
        if form == F_ADDR:
            return val
        if form in (F_ADDRX, F_ADDRX1, F_ADDRX2, F_ADDRX3, F_ADDRX4):
            return uint(self._sec(".debug_addr"), u.addr_base + val * u.addr_size, u.addr_size)
        if form in UNREADABLE:
            raise Unsupported(f"address form 0x{form:x}")
        raise Malformed(f"address of form 0x{form:x}")

    def _die_ranges(self, u: _Unit, a: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
        """The [low, high) ranges of a DIE (llvm's getAddressRanges): low/high pc, else its range list."""
        if AT_LOW_PC in a and AT_HIGH_PC in a:
            low = self._address(u, *a[AT_LOW_PC])
            form, high = a[AT_HIGH_PC]
            if form not in (F_ADDR, F_ADDRX, F_ADDRX1, F_ADDRX2, F_ADDRX3, F_ADDRX4):
                return [(low, low + high)]
            return [(low, self._address(u, form, high))]
        if AT_RANGES not in a:
            return []
        form, val = a[AT_RANGES]
        if u.version >= 5:
            rl = self._sec(".debug_rnglists")
            if form == F_RNGLISTX:
                off = u.rnglists_base + uint(rl, u.rnglists_base + val * u.offset_size, u.offset_size)
            else:
                off = val
            return self._rnglist(u, rl, off)
        return self._ranges_v4(u, val)

    def _ranges_v4(self, u: _Unit, off: int) -> list[tuple[int, int]]:
        b = self._sec(".debug_ranges")
        base = u.low_pc
        out: list[tuple[int, int]] = []
        for _ in range(MAX_RANGES):
            lo, hi = uint(b, off, 8), uint(b, off + 8, 8)
            off += 16
            if lo == 0 and hi == 0:
                return out
            if lo == 0xFFFFFFFFFFFFFFFF:
                base = hi
            else:
                out.append((base + lo, base + hi))
        raise Malformed("range list too long")

    def _rnglist(self, u: _Unit, b: memoryview, off: int) -> list[tuple[int, int]]:
        base = u.low_pc
        out: list[tuple[int, int]] = []

        def addrx(i: int) -> int:
            return uint(self._sec(".debug_addr"), u.addr_base + i * u.addr_size, u.addr_size)

        for _ in range(MAX_RANGES):
            kind = b[off]
            off += 1
            if kind == 0:  # end_of_list
                return out
            if kind == 1:  # base_addressx
                i, off = uleb(b, off)
                base = addrx(i)
            elif kind in (2, 3):  # startx_endx, startx_length
                i, off = uleb(b, off)
                n, off = uleb(b, off)
                lo = addrx(i)
                out.append((lo, addrx(n) if kind == 2 else lo + n))
            elif kind == 4:  # offset_pair
                lo, off = uleb(b, off)
                hi, off = uleb(b, off)
                out.append((base + lo, base + hi))
            elif kind == 5:  # base_address
                base = uint(b, off, 8)
                off += 8
            elif kind == 6:  # start_end
                out.append((uint(b, off, 8), uint(b, off + 8, 8)))
                off += 16
            elif kind == 7:  # start_length
                lo = uint(b, off, 8)
                n, off = uleb(b, off + 8)
                out.append((lo, lo + n))
            else:
                raise Malformed(f"range list entry {kind}")
        raise Malformed("range list too long")

    def _name(self, u: _Unit, die: _Die) -> str:
        """llvm's getSubroutineName(LinkageName): a linkage name, else the name, from the DIE or
        those its DW_AT_abstract_origin and DW_AT_specification name (last pushed, first read)."""
        name = self._names.get(die.offset)
        if name is None:
            name = self._names[die.offset] = self._find_name(u, die)
        return name

    def _find_name(self, u: _Unit, die: _Die) -> str:
        for wanted in ((AT_MIPS_LINKAGE_NAME, AT_LINKAGE_NAME), (AT_NAME,)):
            todo: list[tuple[_Unit, _Die]] = [(u, die)]
            seen = {die.offset}
            hops = 0
            while todo and hops <= MAX_HOPS:
                hops += 1
                du, d = todo.pop()
                got = next((d.attrs[k] for k in wanted if k in d.attrs), None)
                if got is not None:
                    return self._string(du, *got)
                for attr in (AT_ABSTRACT_ORIGIN, AT_SPECIFICATION):
                    if attr not in d.attrs:
                        continue
                    off = self._ref(du, *d.attrs[attr])
                    if off < 0 or off in seen:
                        continue
                    seen.add(off)
                    ou = du if du.offset <= off < du.end else self._unit_at(off)
                    target = self._die(ou, off)
                    if target is not None:
                        todo.append((ou, target))
        return ""

    # --- inlined chains ----------------------------------------------------------------

    def _chains(self, u: _Unit, addrs: list[int]) -> list[list[_Die]]:
        """For each address, the subroutine DIEs holding it, outermost first (llvm's
        getInlinedChainForAddress, reversed): the last in DIE order at the deepest level wins."""
        store = self.line_store
        outer = store.outer(u.offset) if store is not None else None
        if outer is not None:
            got = self._chains_from(u, addrs, outer)
            if got is not None:
                return got
        best: list[list[_Die]] = [[] for _ in addrs]
        top = self._die(u, u.first_die)
        if top is not None and top.children:
            by_address = sorted(range(len(addrs)), key=addrs.__getitem__)
            record = store is not None and outer is None
            self._outer = [] if record else None
            try:
                self._walk(u, top.end, by_address, addrs, [], best, 0)
                if record and self._outer is not None and store is not None:
                    store.put_outer(u.offset, sorted(self._outer))
            finally:
                self._outer = None
        return best

    def _chains_from(self, u: _Unit, addrs: list[int], outer: Outer) -> list[list[_Die]] | None:
        """`_chains` walking from each address's outermost subroutine, as the walk from the unit's
        first DIE reaches it (`outer`: every outermost one, as that walk recorded them); None when
        an address is held by two of them (the later would win: the whole walk tells)."""
        lows = [o[0] for o in outer]
        reach = list(itertools.accumulate((o[1] for o in outer), max))  # the highest end so far
        by_die: dict[tuple[int, int], list[int]] = {}
        for k, a in enumerate(addrs):
            holders = set()
            i = bisect_right(lows, a) - 1
            while i >= 0 and reach[i] > a:
                lo, hi, off, depth = outer[i]
                if lo <= a < hi:
                    holders.add((off, depth))
                i -= 1
            if len(holders) > 1:
                return None
            if holders:
                by_die.setdefault(holders.pop(), []).append(k)
        best: list[list[_Die]] = [[] for _ in addrs]
        for (off, depth), held in by_die.items():
            die = self._die(u, off)
            if die is None or die.tag not in (TAG_SUBPROGRAM, TAG_INLINED):
                raise Malformed("an outermost subroutine that is not one")
            for k in held:
                best[k] = [die]
            if die.children:
                self._walk(u, die.end, sorted(held, key=addrs.__getitem__), addrs, [die], best, depth + 1)
        return best

    def _walk(
        self,
        u: _Unit,
        pos: int,
        live: list[int],
        addrs: list[int],
        stack: list[_Die],
        best: list[list[_Die]],
        depth: int,
    ) -> int:
        """Read the sibling DIEs from `pos` to their null entry; return the position after it."""
        if depth > MAX_DEPTH:
            raise Malformed("DIEs nested too deep")
        table = self._abbrev_table(u)
        b = self.info
        while True:
            code, _ = uleb(b, pos)
            if code == 0:
                return pos + 1
            ab = table.get(code)
            if ab is None:
                raise Malformed(f"abbreviation {code} not in its table")
            tag = ab.tag
            if tag not in (TAG_SUBPROGRAM, TAG_INLINED, TAG_LEXICAL_BLOCK, TAG_NAMESPACE) or not ab.children:
                if tag in (TAG_SUBPROGRAM, TAG_INLINED):  # a leaf subroutine may still hold an address
                    die = self._die(u, pos)
                    assert die is not None
                    self._hold(u, die, live, addrs, stack, best, depth)
                    pos = die.end
                else:
                    pos = self._skip_one(u, pos, depth)
                continue
            die = self._die(u, pos)
            assert die is not None
            inside = live
            if tag in (TAG_SUBPROGRAM, TAG_INLINED):
                inside = self._hold(u, die, live, addrs, stack, best, depth)
                below = [*stack, die]
            else:
                below = stack
                if tag == TAG_LEXICAL_BLOCK:
                    r = self._die_ranges(u, die.attrs)
                    if r:
                        inside = _within(live, addrs, r)
                        if not stack and self._outer is not None:
                            self._outer = None  # a block outside every function: not recorded
            sibling = -1
            if AT_SIBLING in die.attrs:
                sibling = self._ref(u, *die.attrs[AT_SIBLING])
            if inside:
                pos = self._walk(u, die.end, inside, addrs, below, best, depth + 1)
            elif die.end < sibling < u.end:
                pos = sibling
            else:
                pos = self._skip_children(u, die.end, depth + 1)

    def _skip_one(self, u: _Unit, pos: int, depth: int) -> int:
        """The position after the DIE at `pos` and its children."""
        code, at = uleb(self.info, pos)
        ab = self._abbrev_table(u).get(code)
        if ab is None:
            raise Malformed(f"abbreviation {code} not in its table")
        if not ab.children and ab.fixed >= 0:
            self.dies += 1
            return at + ab.fixed
        die = self._die(u, pos)
        assert die is not None
        if not die.children:
            return die.end
        if AT_SIBLING in die.attrs:
            sibling = self._ref(u, *die.attrs[AT_SIBLING])
            if die.end < sibling < u.end:
                return sibling
        return self._skip_children(u, die.end, depth + 1)

    def _hold(
        self,
        u: _Unit,
        die: _Die,
        live: list[int],
        addrs: list[int],
        stack: list[_Die],
        best: list[list[_Die]],
        depth: int,
    ) -> list[int]:
        """The live addresses `die` (a subroutine) holds, each made its deepest holder so far."""
        ranges = [(lo, hi) for lo, hi in self._die_ranges(u, die.attrs) if lo < hi]
        if not ranges:
            return []
        if not stack and self._outer is not None:
            self._outer.extend((lo, hi, die.offset, depth) for lo, hi in ranges)
        inside = _within(live, addrs, ranges)
        for i in inside:
            best[i] = [*stack, die]
        return inside

    # --- lines -------------------------------------------------------------------------

    def _line_table(self, u: _Unit) -> LineTable:
        assert u.stmt_list is not None
        table = self._lines.get(u.stmt_list)
        if table is None:
            store = self.line_store
            table = store.get(u.stmt_list) if store is not None else None
            if table is not None and table.program_bytes > MAX_ROWS - self.rows:
                raise Unsupported("over the line row budget")  # as parsing it would have
            if table is None:
                strings = lambda form, val: self._string(u, form, val)  # noqa: E731
                table = dwarflines.parse(self._sec(".debug_line"), u.stmt_list, strings, MAX_ROWS - self.rows)
                if store is not None:
                    store.put(u.stmt_list, table)
            self.rows += len(table.addrs)
            self._lines[u.stmt_list] = table
        return table

    # --- answers -----------------------------------------------------------------------

    def described(self) -> list[tuple[int, int]] | None:
        """The merged ranges of every unit, None when a unit could not be read."""
        try:
            if self._units is None:
                self._index_units()
        except (Malformed, IndexError, struct.error):
            return None
        if not self._complete or len(self._ranges) > MAX_RANGES:
            return None
        merged: list[tuple[int, int]] = []
        for lo, hi, _ in self._ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return merged

    def frames(self, addrs: Sequence[int]) -> list[Frames | None]:
        """Frames (innermost first, as llvm-symbolizer's) of each virtual address: [] where no unit
        describes it, None where this reader cannot tell (ask llvm-symbolizer)."""
        if self._units is None:
            try:
                self._index_units()
            except (Malformed, IndexError, struct.error):
                return [None] * len(addrs)
        # Where no unit that could be read holds an address, one that could not might: ask llvm.
        out: list[Frames | None] = [[] if self._complete else None for _ in addrs]
        by_unit: dict[int, list[int]] = {}
        for k, a in enumerate(addrs):
            # Units' ranges may overlap (rarely): the nearest starts before `a` are looked at.
            i = bisect_right(self._lo, a) - 1
            for lo, hi, unit in self._ranges[max(0, i - _OVERLAPS) : i + 1][::-1]:
                if lo <= a < hi:
                    by_unit.setdefault(unit, []).append(k)
                    break
        assert self._units is not None
        for n, wanted in by_unit.items():
            u = self._units[n]
            try:
                if self._prepare(u).split:
                    raise Unsupported("split DWARF")
                got = self._unit_frames(u, [addrs[k] for k in wanted])
            except (Unsupported, Malformed, IndexError, struct.error, KeyError, ValueError, OverflowError):
                got = [None] * len(wanted)  # llvm-symbolizer's, if it can
            for k, g in zip_strict(wanted, got):
                out[k] = g
        return out

    def _unit_frames(self, u: _Unit, addrs: list[int]) -> list[Frames | None]:
        table = self._line_table(u) if u.stmt_list is not None else None
        chains = self._chains(u, addrs)
        out: list[Frames | None] = []
        for a, chain in zip_strict(addrs, chains):
            # Innermost first, up to and with the first subprogram (lexical blocks are not frames).
            inner: list[_Die] = []
            for die in reversed(chain):
                inner.append(die)
                if die.tag == TAG_SUBPROGRAM:
                    break
            row = table.row(a) if table is not None else None
            if not inner:
                if row is None or table is None:
                    out.append([])
                else:
                    out.append([SourceFrame("", table.path(row[0], u.comp_dir), row[1])])
                continue
            frames = []
            call_file, call_line = 0, 0
            for i, die in enumerate(inner):
                name = self._name(u, die)
                if i == 0:
                    file, line = (
                        ("", 0) if row is None or table is None else (table.path(row[0], u.comp_dir), row[1])
                    )
                else:
                    file = table.path(call_file, u.comp_dir) if table is not None else ""
                    line = call_line
                call_file = _const(die.attrs, AT_CALL_FILE, -1)  # -1: names no file
                call_line = _const(die.attrs, AT_CALL_LINE, 0)
                frames.append(SourceFrame(name, file, line))
            out.append(frames)
        return out


def _within(live: list[int], addrs: list[int], ranges: list[tuple[int, int]]) -> list[int]:
    """The indexes in `live` (sorted by address) of the addresses in one of `ranges`, in order."""
    key = addrs.__getitem__
    if len(ranges) == 1:
        lo, hi = ranges[0]
        return live[bisect_left_key(live, lo, key) : bisect_left_key(live, hi, key)]
    picked = {
        j for lo, hi in ranges for j in range(bisect_left_key(live, lo, key), bisect_left_key(live, hi, key))
    }
    return [live[j] for j in sorted(picked)]


def _const(attrs: dict[int, tuple[int, int]], attr: int, default: int) -> int:
    """A constant attribute's value (a block's is 0)."""
    got = attrs.get(attr)
    return default if got is None else got[1]


def _inflated_size(data: memoryview, name: str) -> int:
    """What an SHF_COMPRESSED section's header says it inflates to; raises `Unsupported` when it
    cannot be inflated here."""
    if len(data) < 24:
        raise Unsupported(f"{name}: compressed header")
    ch_type, _res, size = struct.unpack_from("<IIQ", data)
    if ch_type != ELFCOMPRESS_ZLIB:
        raise Unsupported(f"{name}: compression {ch_type}")
    if not 0 < size <= MAX_INFLATED_BYTES:
        raise Unsupported(f"{name}: {size} bytes inflated, out of bounds")
    return int(size)


def _inflate(data: memoryview, name: str) -> mmap.mmap:
    """An SHF_COMPRESSED section's bytes, up to MAX_INFLATED_BYTES, in an anonymous map: unmapped
    when the file is closed, its memory is the system's again (freed heap memory of that size
    stays with the process, and would add to the peak of what record does next)."""
    size = _inflated_size(data, name)
    out = mmap.mmap(-1, size)
    d = zlib.decompressobj()
    pos = 0
    try:
        for start in range(24, len(data), 1 << 20):
            todo: bytes | memoryview = data[start : start + (1 << 20)]
            while todo:
                # A megabyte at a time; one byte more than the claim: then the claim was false.
                chunk = d.decompress(todo, min(1 << 20, size - pos + 1))
                if pos + len(chunk) > size:
                    raise Unsupported(f"{name}: inflates past its {size} bytes")
                out[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
                todo = d.unconsumed_tail
                if d.eof:
                    break
            if d.eof:
                break
    except zlib.error as e:
        out.close()
        raise Unsupported(f"{name}: {e}") from e
    except Unsupported:
        out.close()
        raise
    if pos != size:
        out.close()
        raise Unsupported(f"{name}: inflates to {pos} bytes, not {size}")
    return out


def covered_ranges(path: str) -> list[tuple[int, int]] | None:
    """The merged [start, end) virtual address ranges the compile units of the ELF file at `path`
    describe, as llvm finds a unit (.debug_aranges, else the unit DIE's ranges); None when they
    cannot all be told. Outside them llvm-symbolizer adds nothing to the symbol table's name."""
    try:
        with DwarfFile(path) as f:
            return f.described()
    except (Unsupported, OSError, ValueError):
        return None


def symbolize(path: str, addrs: Sequence[int], lines: UnitStore | None = None) -> list[Frames | None]:
    """Frames of each address of the ELF file at `path`; all None when the file cannot be read here.
    `lines`: line tables kept from earlier runs, and where to keep those read now."""
    try:
        with DwarfFile(path, lines) as f:
            return f.frames(addrs)
    except (Unsupported, OSError, ValueError):
        return [None] * len(addrs)

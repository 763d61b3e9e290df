"""File:line and inlined frames from DWARF 4 and 5, read in place for the compile units asked about.

llvm-symbolizer answers one address of a binary by indexing all of its DWARF: on pyenv's libpython
(14 MB of `.debug_info`) a run costs ~70 MB and ~1 s, for a few dozen sampled addresses. This reader
answers the same questions (docs/symbolization.md, "DWARF in process") touching only what they need:

- the compile unit of an address from the unit headers and each unit's own ranges (its first DIE);
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
bound. What it does not read it says (`Unsupported`): split DWARF, DWARF before 4, dwz's
supplementary files, zstd; its caller asks llvm-symbolizer for those (record/symbolize.py).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..elf import ELFCOMPRESS_ZLIB, SHF_COMPRESSED, SHT_NOBITS, ElfFile, ElfFormatError
from .llvm import SourceFrame

MAX_INFLATED_BYTES = 256 << 20  # one compressed section, inflated
MAX_UNITS = 1 << 20
MAX_DIES = 4_000_000  # DIEs read per file and run: a few units of a large C++ binary
MAX_ROWS = 2_000_000  # line rows per file and run (16 bytes each)
MAX_DEPTH = 256  # DIE nesting
MAX_RANGES = 1 << 16  # entries of one range list
MAX_HOPS = 16  # DW_AT_abstract_origin / DW_AT_specification followed for a name
_OVERLAPS = 16  # unit ranges looked at before an address

# Tags
_SUBPROGRAM = 0x2E
_INLINED = 0x1D
_LEXICAL_BLOCK = 0x0B
_NAMESPACE = 0x39
_UNIT_TAGS = (0x11, 0x3C)  # compile, partial unit
_SKELETON_TAGS = (0x4A,)
# Attributes
AT_SIBLING, AT_NAME, AT_STMT_LIST, AT_LOW_PC, AT_HIGH_PC = 0x01, 0x03, 0x10, 0x11, 0x12
AT_COMP_DIR, AT_ABSTRACT_ORIGIN, AT_SPECIFICATION, AT_RANGES = 0x1B, 0x31, 0x47, 0x55
AT_CALL_FILE, AT_CALL_LINE, AT_LINKAGE_NAME, AT_MIPS_LINKAGE_NAME = 0x58, 0x59, 0x6E, 0x2007
AT_STR_OFFSETS_BASE, AT_ADDR_BASE, AT_RNGLISTS_BASE = 0x72, 0x73, 0x74
AT_DWO_NAME, AT_GNU_DWO_NAME = 0x76, 0x2130
_WANTED = frozenset(
    (
        AT_SIBLING,
        AT_NAME,
        AT_STMT_LIST,
        AT_LOW_PC,
        AT_HIGH_PC,
        AT_COMP_DIR,
        AT_ABSTRACT_ORIGIN,
        AT_SPECIFICATION,
        AT_RANGES,
        AT_CALL_FILE,
        AT_CALL_LINE,
        AT_LINKAGE_NAME,
        AT_MIPS_LINKAGE_NAME,
        AT_STR_OFFSETS_BASE,
        AT_ADDR_BASE,
        AT_RNGLISTS_BASE,
        AT_DWO_NAME,
        AT_GNU_DWO_NAME,
    )
)
# Forms
F_ADDR, F_BLOCK2, F_BLOCK4, F_DATA2, F_DATA4, F_DATA8, F_STRING, F_BLOCK = (
    0x01,
    0x03,
    0x04,
    0x05,
    0x06,
    0x07,
    0x08,
    0x09,
)
F_BLOCK1, F_DATA1, F_FLAG, F_SDATA, F_STRP, F_UDATA, F_REF_ADDR = 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10
F_REF1, F_REF2, F_REF4, F_REF8, F_REF_UDATA, F_INDIRECT, F_SEC_OFFSET = (
    0x11,
    0x12,
    0x13,
    0x14,
    0x15,
    0x16,
    0x17,
)
F_EXPRLOC, F_FLAG_PRESENT, F_STRX, F_ADDRX, F_REF_SUP4, F_STRP_SUP, F_DATA16 = (
    0x18,
    0x19,
    0x1A,
    0x1B,
    0x1C,
    0x1D,
    0x1E,
)
F_LINE_STRP, F_REF_SIG8, F_IMPLICIT_CONST, F_LOCLISTX, F_RNGLISTX, F_REF_SUP8 = (
    0x1F,
    0x20,
    0x21,
    0x22,
    0x23,
    0x24,
)
F_STRX1, F_STRX2, F_STRX3, F_STRX4, F_ADDRX1, F_ADDRX2, F_ADDRX3, F_ADDRX4 = range(0x25, 0x2D)
F_GNU_ADDR_INDEX, F_GNU_STR_INDEX, F_GNU_REF_ALT, F_GNU_STRP_ALT = 0x1F01, 0x1F02, 0x1F20, 0x1F21
_FIXED = {
    F_DATA1: 1, F_REF1: 1, F_FLAG: 1, F_STRX1: 1, F_ADDRX1: 1,
    F_DATA2: 2, F_REF2: 2, F_STRX2: 2, F_ADDRX2: 2,
    F_STRX3: 3, F_ADDRX3: 3,
    F_DATA4: 4, F_REF4: 4, F_STRX4: 4, F_ADDRX4: 4, F_REF_SUP4: 4,
    F_DATA8: 8, F_REF8: 8, F_REF_SIG8: 8, F_REF_SUP8: 8,
    F_DATA16: 16, F_FLAG_PRESENT: 0, F_IMPLICIT_CONST: 0,
}  # fmt: skip
_OFFSET_SIZED = (F_STRP, F_LINE_STRP, F_SEC_OFFSET, F_REF_ADDR, F_STRP_SUP, F_GNU_REF_ALT, F_GNU_STRP_ALT)
_LEB = (
    F_SDATA,
    F_UDATA,
    F_REF_UDATA,
    F_STRX,
    F_ADDRX,
    F_LOCLISTX,
    F_RNGLISTX,
    F_GNU_ADDR_INDEX,
    F_GNU_STR_INDEX,
)
_REFS_IN_UNIT = (F_REF1, F_REF2, F_REF4, F_REF8, F_REF_UDATA)
_UNREADABLE = (
    F_GNU_ADDR_INDEX,
    F_GNU_STR_INDEX,
    F_GNU_REF_ALT,
    F_GNU_STRP_ALT,
    F_STRP_SUP,
    F_REF_SUP4,
    F_REF_SUP8,
)
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


class Unsupported(Exception):
    """DWARF this reader does not read (llvm-symbolizer may), or over one of its bounds."""


class _Bad(Exception):
    """Malformed DWARF met while answering: the unit at hand gets no answer from here."""


Frames = list[SourceFrame]


@dataclass(slots=True)
class _Abbrev:
    tag: int
    children: bool
    attrs: list[tuple[int, int, int]]  # (attribute, form, implicit constant)
    fixed: int  # total size when every form is fixed-size and the DIE is only skipped, else -1


@dataclass(slots=True)
class _Unit:
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
    abbrevs: _Abbrevs | None = None
    read: bool = False  # its unit DIE's attributes


@dataclass(slots=True)
class _Die:
    offset: int
    tag: int
    children: bool
    attrs: dict[int, tuple[int, int]]  # attribute -> (form, value)
    end: int  # after its attributes


class _Abbrevs:
    """One abbreviation table, read as far as the codes asked for: GCC gives each unit its own, and
    indexing a unit needs only its first DIE's."""

    __slots__ = ("_b", "_pos", "addr_size", "done", "offset_size", "table")

    def __init__(self, b: memoryview, offset: int, offset_size: int, addr_size: int) -> None:
        self._b = b
        self._pos = offset
        self.offset_size = offset_size
        self.addr_size = addr_size
        self.table: dict[int, _Abbrev] = {}
        self.done = False

    def get(self, code: int) -> _Abbrev | None:
        ab = self.table.get(code)
        while ab is None and not self.done:
            if self._next() == code:
                ab = self.table[code]
        return ab

    def _next(self) -> int:
        """Read one more abbreviation; its code (0 at the table's end)."""
        b = self._b
        code, pos = _uleb(b, self._pos)
        if code == 0:
            self.done = True
            return 0
        tag, pos = _uleb(b, pos)
        children = b[pos] != 0
        pos += 1
        attrs: list[tuple[int, int, int]] = []
        fixed = 0
        while True:
            attr, pos = _uleb(b, pos)
            form, pos = _uleb(b, pos)
            if attr == 0 and form == 0:
                break
            const = 0
            if form == F_IMPLICIT_CONST:
                const, pos = _sleb(b, pos)
            attrs.append((attr, form, const))
            size = _FIXED.get(form)
            if size is None and form in _OFFSET_SIZED:
                size = self.offset_size
            elif size is None and form == F_ADDR:
                size = self.addr_size
            fixed = fixed + size if size is not None and fixed >= 0 else -1
            if len(attrs) > 512:
                raise _Bad("too many attributes")
        self._pos = pos
        if code not in self.table:  # the first of a duplicated code, as llvm keeps
            self.table[code] = _Abbrev(tag, children, attrs, fixed)
        if len(self.table) > 1 << 20:
            raise _Bad("too many abbreviations")
        return code


@dataclass(slots=True)
class _LineTable:
    version: int
    dirs: list[str]
    files: list[tuple[str, int]]  # (name, directory index)
    # Sequences sorted by their end: (low, high, first row, end row) into the row arrays.
    seqs: list[tuple[int, int, int, int]]
    seq_highs: list[int]
    addrs: array[int]
    files_of: array[int]
    lines: array[int]


def _uleb(b: bytes | memoryview, pos: int) -> tuple[int, int]:
    byte = b[pos]
    if byte < 0x80:
        return byte, pos + 1
    val, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = b[pos]
        val |= (byte & 0x7F) << shift
        if byte < 0x80:
            return val, pos + 1
        shift += 7
        if shift > 70:
            raise _Bad("LEB128 too long")


def _sleb(b: bytes | memoryview, pos: int) -> tuple[int, int]:
    val, shift = 0, 0
    while True:
        byte = b[pos]
        pos += 1
        val |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return (val - (1 << shift) if byte & 0x40 else val), pos
        if shift > 70:
            raise _Bad("LEB128 too long")


def _uint(b: memoryview, pos: int, size: int) -> int:
    if pos < 0 or pos + size > len(b):
        raise _Bad("read past the end of a section")
    return int.from_bytes(b[pos : pos + size], "little")


def _cstr(b: memoryview, pos: int) -> tuple[str, int]:
    """The NUL-terminated string at `pos` and the position after it."""
    if not 0 <= pos < len(b):
        raise _Bad("string past the end of a section")
    end = bytes(b[pos : pos + 4096]).find(b"\0")
    if end < 0:
        raise _Bad("unterminated string")
    return bytes(b[pos : pos + end]).decode("utf-8", "surrogateescape"), pos + end + 1


def _join(*parts: str) -> str:
    """llvm's sys::path::append: one '/' between non-empty parts, none added after a trailing one."""
    out = ""
    for p in parts:
        if not p:
            continue
        if out and out.endswith("/"):
            out += p.lstrip("/")
        elif out and not p.startswith("/"):
            out += "/" + p
        else:
            out += p
    return out


class DwarfFile:
    """One ELF file's DWARF, mapped read-only. Not thread-safe. Raises `Unsupported` on opening
    when the file has nothing this reader reads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._views: dict[str, memoryview] = {}
        self._mm: mmap.mmap | None = None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < 64:
                raise Unsupported("too small for an ELF file")
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
        self._lo: list[int] = []  # unit ranges sorted by start: (start, end, unit number)
        self._ranges: list[tuple[int, int, int]] = []
        self._abbrevs: dict[tuple[int, int, int], _Abbrevs] = {}
        self._lines: dict[int, _LineTable] = {}
        self._names: dict[int, str] = {}  # a subroutine DIE's name, by offset
        self._paths: dict[tuple[int, int], str] = {}  # a file's path, by (line table, index)
        self.dies = 0
        self.rows = 0

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
                        try:
                            self._views[sec.name] = memoryview(_inflate(view, sec.name))
                        finally:
                            view.release()
                    else:
                        self._views[sec.name] = view
            finally:
                whole.release()
        finally:
            elf.close()
        for name in (".debug_info", ".debug_abbrev", ".debug_line"):
            if name not in self._views:
                raise Unsupported(f"no {name}")
        self.info = self._views[".debug_info"]
        self.empty = memoryview(b"")

    def _sec(self, name: str) -> memoryview:
        return self._views.get(name, self.empty)

    def close(self) -> None:
        for v in self._views.values():
            v.release()
        self._views.clear()
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
                abbrev = _uint(info, body + 2, offset_size)
                addr_size = info[body + 2 + offset_size]
                unit = _Unit(pos, end, version, addr_size, offset_size, abbrev, body + 3 + offset_size)
            elif version == 5:
                unit_type, addr_size = info[body + 2], info[body + 3]
                abbrev = _uint(info, body + 4, offset_size)
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
        except (_Bad, IndexError, struct.error):
            listed = {}
        ranges: list[tuple[int, int, int]] = []
        for i, u in enumerate(units):
            got = listed.get(u.offset)
            if got is None:
                try:
                    self._read_unit_die(u)
                except (_Bad, Unsupported, IndexError, struct.error):
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
            length = _uint(b, pos, 4)
            offset_size, body = 4, pos + 4
            if length == 0xFFFFFFFF:
                length, offset_size, body = _uint(b, pos + 4, 8), 8, pos + 12
            end = body + length
            if end > len(b) or length < 4 + offset_size:
                raise _Bad("address range set past the end of .debug_aranges")
            version, unit = _uint(b, body, 2), _uint(b, body + 2, offset_size)
            addr_size, seg_size = b[body + 2 + offset_size], b[body + 3 + offset_size]
            if version != 2 or addr_size != 8 or seg_size != 0:
                raise _Bad("address range set of another kind")
            at = body + 4 + offset_size
            at += -(at - pos) % 16  # the pairs are aligned to their size from the set's start
            got = out.setdefault(unit, [])
            while at + 16 <= end:
                lo, size = _uint(b, at, 8), _uint(b, at + 8, 8)
                at += 16
                if lo == 0 and size == 0:
                    break
                got.append((lo, lo + size))
                entries += 1
                if entries > MAX_UNITS:
                    raise _Bad("too many address ranges")
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
        if die is None or die.tag not in _UNIT_TAGS + _SKELETON_TAGS:
            raise _Bad("a unit without a unit DIE")
        a = die.attrs
        if die.tag in _SKELETON_TAGS or AT_DWO_NAME in a or AT_GNU_DWO_NAME in a:
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
            raise _Bad("reference outside every unit")
        return self._prepare(self._units[i])

    # --- DIEs --------------------------------------------------------------------------

    def _abbrev_table(self, u: _Unit) -> _Abbrevs:
        if u.abbrevs is None:
            key = (u.abbrev_offset, u.offset_size, u.addr_size)
            table = self._abbrevs.get(key)
            if table is None:
                table = self._abbrevs[key] = _Abbrevs(self._sec(".debug_abbrev"), *key)
            u.abbrevs = table
        return u.abbrevs

    def _die(self, u: _Unit, pos: int) -> _Die | None:
        """The DIE at `pos` with the attributes this reader uses (None: a null entry)."""
        self.dies += 1
        if self.dies > MAX_DIES:
            raise Unsupported("over the DIE budget")
        code, at = _uleb(self.info, pos)
        if code == 0:
            return None
        ab = self._abbrev_table(u).get(code)
        if ab is None:
            raise _Bad(f"abbreviation {code} not in its table")
        attrs: dict[int, tuple[int, int]] = {}
        for attr, form, const in ab.attrs:
            real, val, at = self._value(u, form, at, const)
            if attr in _WANTED and attr not in attrs:
                attrs[attr] = (real, val)
        if at > u.end:
            raise _Bad("DIE past its unit")
        return _Die(pos, ab.tag, ab.children, attrs, at)

    def _value(self, u: _Unit, form: int, pos: int, const: int = 0) -> tuple[int, int, int]:
        """(form, value, position after it) of one attribute: the form named by a DW_FORM_indirect;
        a string is its offset, a block 0."""
        b = self.info
        size = _FIXED.get(form)
        if size is not None:
            if form == F_IMPLICIT_CONST:
                return form, const, pos
            if form == F_DATA16:
                return form, 0, pos + 16
            return form, (_uint(b, pos, size) if size else 1), pos + size
        if form in _OFFSET_SIZED:
            return form, _uint(b, pos, u.offset_size), pos + u.offset_size
        if form == F_ADDR:
            return form, _uint(b, pos, u.addr_size), pos + u.addr_size
        if form == F_SDATA:
            return (form, *_sleb(b, pos))
        if form in _LEB:
            return (form, *_uleb(b, pos))
        if form == F_STRING:
            end = pos
            while b[end]:
                end += 1
            return form, pos, end + 1
        if form in (F_BLOCK, F_EXPRLOC):
            n, pos = _uleb(b, pos)
            return form, 0, pos + n
        if form in (F_BLOCK1, F_BLOCK2, F_BLOCK4):
            size = {F_BLOCK1: 1, F_BLOCK2: 2, F_BLOCK4: 4}[form]
            return form, 0, pos + size + _uint(b, pos, size)
        if form == F_INDIRECT:
            real, pos = _uleb(b, pos)
            if real in (F_INDIRECT, F_IMPLICIT_CONST):
                raise _Bad("indirect form")
            return self._value(u, real, pos)
        raise Unsupported(f"form 0x{form:x}")

    def _skip_children(self, u: _Unit, pos: int, depth: int) -> int:
        """The position after the children starting at `pos` (after their null entry)."""
        if depth > MAX_DEPTH:
            raise _Bad("DIEs nested too deep")
        b = self.info
        table = self._abbrev_table(u)
        while True:
            self.dies += 1
            if self.dies > MAX_DIES:
                raise Unsupported("over the DIE budget")
            code, at = _uleb(b, pos)
            if code == 0:
                return at
            ab = table.get(code)
            if ab is None:
                raise _Bad(f"abbreviation {code} not in its table")
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
                raise _Bad("DIE past its unit")
            if ab.children:
                at = sibling if at < sibling < u.end else self._skip_children(u, at, depth + 1)
            pos = at

    def _ref(self, u: _Unit, form: int, val: int) -> int:
        """The .debug_info offset a reference attribute names (-1: none this reader follows)."""
        if form in _REFS_IN_UNIT:
            return u.offset + val
        if form == F_REF_ADDR:
            return val
        return -1

    # --- values ------------------------------------------------------------------------

    def _string(self, u: _Unit, form: int, val: int) -> str:
        if form == F_STRING:
            return _cstr(self.info, val)[0]
        if form == F_STRP:
            return _cstr(self._sec(".debug_str"), val)[0]
        if form == F_LINE_STRP:
            return _cstr(self._sec(".debug_line_str"), val)[0]
        if form in (F_STRX, F_STRX1, F_STRX2, F_STRX3, F_STRX4):
            off = _uint(
                self._sec(".debug_str_offsets"), u.str_offsets_base + val * u.offset_size, u.offset_size
            )
            return _cstr(self._sec(".debug_str"), off)[0]
        if form in _UNREADABLE:
            raise Unsupported(f"string form 0x{form:x}")
        raise _Bad(f"string of form 0x{form:x}")

    def _address(self, u: _Unit, form: int, val: int) -> int:
        if form == F_ADDR:
            return val
        if form in (F_ADDRX, F_ADDRX1, F_ADDRX2, F_ADDRX3, F_ADDRX4):
            return _uint(self._sec(".debug_addr"), u.addr_base + val * u.addr_size, u.addr_size)
        if form in _UNREADABLE:
            raise Unsupported(f"address form 0x{form:x}")
        raise _Bad(f"address of form 0x{form:x}")

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
                off = u.rnglists_base + _uint(rl, u.rnglists_base + val * u.offset_size, u.offset_size)
            else:
                off = val
            return self._rnglist(u, rl, off)
        return self._ranges_v4(u, val)

    def _ranges_v4(self, u: _Unit, off: int) -> list[tuple[int, int]]:
        b = self._sec(".debug_ranges")
        base = u.low_pc
        out: list[tuple[int, int]] = []
        for _ in range(MAX_RANGES):
            lo, hi = _uint(b, off, 8), _uint(b, off + 8, 8)
            off += 16
            if lo == 0 and hi == 0:
                return out
            if lo == 0xFFFFFFFFFFFFFFFF:
                base = hi
            else:
                out.append((base + lo, base + hi))
        raise _Bad("range list too long")

    def _rnglist(self, u: _Unit, b: memoryview, off: int) -> list[tuple[int, int]]:
        base = u.low_pc
        out: list[tuple[int, int]] = []

        def addrx(i: int) -> int:
            return _uint(self._sec(".debug_addr"), u.addr_base + i * u.addr_size, u.addr_size)

        for _ in range(MAX_RANGES):
            kind = b[off]
            off += 1
            if kind == 0:  # end_of_list
                return out
            if kind == 1:  # base_addressx
                i, off = _uleb(b, off)
                base = addrx(i)
            elif kind in (2, 3):  # startx_endx, startx_length
                i, off = _uleb(b, off)
                n, off = _uleb(b, off)
                lo = addrx(i)
                out.append((lo, addrx(n) if kind == 2 else lo + n))
            elif kind == 4:  # offset_pair
                lo, off = _uleb(b, off)
                hi, off = _uleb(b, off)
                out.append((base + lo, base + hi))
            elif kind == 5:  # base_address
                base = _uint(b, off, 8)
                off += 8
            elif kind == 6:  # start_end
                out.append((_uint(b, off, 8), _uint(b, off + 8, 8)))
                off += 16
            elif kind == 7:  # start_length
                lo = _uint(b, off, 8)
                n, off = _uleb(b, off + 8)
                out.append((lo, lo + n))
            else:
                raise _Bad(f"range list entry {kind}")
        raise _Bad("range list too long")

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
        best: list[list[_Die]] = [[] for _ in addrs]
        top = self._die(u, u.first_die)
        if top is not None and top.children:
            by_address = sorted(range(len(addrs)), key=addrs.__getitem__)
            self._walk(u, top.end, by_address, addrs, [], best, 0)
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
            raise _Bad("DIEs nested too deep")
        table = self._abbrev_table(u)
        b = self.info
        while True:
            code, _ = _uleb(b, pos)
            if code == 0:
                return pos + 1
            ab = table.get(code)
            if ab is None:
                raise _Bad(f"abbreviation {code} not in its table")
            tag = ab.tag
            if tag not in (_SUBPROGRAM, _INLINED, _LEXICAL_BLOCK, _NAMESPACE) or not ab.children:
                if tag in (_SUBPROGRAM, _INLINED):  # a leaf subroutine may still hold an address
                    die = self._die(u, pos)
                    assert die is not None
                    self._hold(u, die, live, addrs, stack, best)
                    pos = die.end
                else:
                    pos = self._skip_one(u, pos, depth)
                continue
            die = self._die(u, pos)
            assert die is not None
            inside = live
            if tag in (_SUBPROGRAM, _INLINED):
                inside = self._hold(u, die, live, addrs, stack, best)
                below = [*stack, die]
            else:
                below = stack
                if tag == _LEXICAL_BLOCK:
                    r = self._die_ranges(u, die.attrs)
                    if r:
                        inside = _within(live, addrs, r)
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
        code, at = _uleb(self.info, pos)
        ab = self._abbrev_table(u).get(code)
        if ab is None:
            raise _Bad(f"abbreviation {code} not in its table")
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
    ) -> list[int]:
        """The live addresses `die` (a subroutine) holds, each made its deepest holder so far."""
        ranges = [(lo, hi) for lo, hi in self._die_ranges(u, die.attrs) if lo < hi]
        if not ranges:
            return []
        inside = _within(live, addrs, ranges)
        for i in inside:
            best[i] = [*stack, die]
        return inside

    # --- lines -------------------------------------------------------------------------

    def _line_table(self, u: _Unit) -> _LineTable:
        if u.stmt_list is None:
            raise _Bad("no line table")
        table = self._lines.get(u.stmt_list)
        if table is None:
            table = self._lines[u.stmt_list] = self._parse_lines(u, u.stmt_list)
        return table

    def _parse_lines(self, u: _Unit, off: int) -> _LineTable:
        b = self._sec(".debug_line")
        (length,) = struct.unpack_from("<I", b, off)
        offset_size, pos = 4, off + 4
        if length == 0xFFFFFFFF:
            (length,) = struct.unpack_from("<Q", b, off + 4)
            offset_size, pos = 8, off + 12
        end = pos + length
        if end > len(b):
            raise _Bad("line table past the end of .debug_line")
        (version,) = struct.unpack_from("<H", b, pos)
        pos += 2
        if not 2 <= version <= 5:
            raise Unsupported(f"line table version {version}")
        if version >= 5:
            if b[pos] != 8:
                raise Unsupported("line table address size")
            pos += 2
        header_length = _uint(b, pos, offset_size)
        pos += offset_size
        program = pos + header_length
        min_inst = b[pos]
        pos += 1
        if version >= 4:
            if b[pos] > 1:
                raise Unsupported("VLIW line table")
            pos += 1
        default_stmt = b[pos] != 0
        line_base = struct.unpack_from("<b", b, pos + 1)[0]
        line_range, opcode_base = b[pos + 2], b[pos + 3]
        pos += 4
        if line_range == 0 or opcode_base == 0:
            raise _Bad("line table header")
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
                    kind, pos = _uleb(b, pos)
                    form, pos = _uleb(b, pos)
                    formats.append((kind, form))
                count, pos = _uleb(b, pos)
                if count > 1 << 20:
                    raise _Bad("too many line table entries")
                for _ in range(count):
                    name, index = "", 0
                    for kind, form in formats:
                        val, pos = self._line_value(u, b, form, pos, offset_size)
                        if kind == 1:  # DW_LNCT_path
                            name = self._line_string(u, form, val, b)
                        elif kind == 2:  # DW_LNCT_directory_index
                            index = val
                    if entries is dirs:
                        dirs.append(name)
                    else:
                        files.append((name, index))
        else:
            while b[pos]:
                name, pos = _cstr(b, pos)
                dirs.append(name)
            pos += 1
            while b[pos]:
                name, pos = _cstr(b, pos)
                index, pos = _uleb(b, pos)
                _, pos = _uleb(b, pos)
                _, pos = _uleb(b, pos)
                files.append((name, index))
        return self._run_program(version, dirs, files, b, program, end, min_inst, default_stmt, line_base,
                                 line_range, opcode_base, std_lengths)  # fmt: skip

    def _line_value(self, u: _Unit, b: memoryview, form: int, pos: int, offset_size: int) -> tuple[int, int]:
        size = _FIXED.get(form)
        if size is not None and form != F_IMPLICIT_CONST:
            return (_uint(b, pos, size) if size <= 8 else 0), pos + size
        if form in (F_STRP, F_LINE_STRP, F_SEC_OFFSET):
            return _uint(b, pos, offset_size), pos + offset_size
        if form in (F_UDATA, F_STRX):
            return _uleb(b, pos)
        if form == F_STRING:
            _, after = _cstr(b, pos)
            return pos, after
        if form == F_BLOCK:
            n, pos = _uleb(b, pos)
            return 0, pos + n
        raise Unsupported(f"line table form 0x{form:x}")

    def _line_string(self, u: _Unit, form: int, val: int, b: memoryview) -> str:
        if form == F_STRING:
            return _cstr(b, val)[0]
        return self._string(u, form, val)

    def _run_program(
        self,
        version: int,
        dirs: list[str],
        files: list[tuple[str, int]],
        b: memoryview,
        pos: int,
        end: int,
        min_inst: int,
        default_stmt: bool,
        line_base: int,
        line_range: int,
        opcode_base: int,
        std_lengths: bytes,
    ) -> _LineTable:
        # Every row takes at least a byte of program: bounding the bytes bounds the rows.
        if end - pos > MAX_ROWS - self.rows:
            raise Unsupported("over the line row budget")
        prog = bytes(b[pos:end])
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
                n, pos = _uleb(prog, pos)
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
                n, pos = _uleb(prog, pos)
                addr += n * min_inst
            elif op == 3:  # advance_line
                n, pos = _sleb(prog, pos)
                line += n
            elif op == 4:  # set_file
                file, pos = _uleb(prog, pos)
            elif op == 8:  # const_add_pc
                addr += const_add
            elif op == 9:  # fixed_advance_pc
                addr += int.from_bytes(prog[pos : pos + 2], "little")
                pos += 2
            else:  # set_column and the rest: skip their operands
                for _ in range(std_lengths[op - 1] if op - 1 < len(std_lengths) else 0):
                    _, pos = _uleb(prog, pos)
        rows = len(addrs)
        self.rows += rows
        # The rows of a sequence are in the order written; llvm orders sequences by their end.
        seqs.sort(key=lambda s: s[1])
        del addrs[seq_first:], files_of[seq_first:], lines[seq_first:]  # an unterminated last sequence
        return _LineTable(version, dirs, files, seqs, [s[1] for s in seqs], addrs, files_of, lines)

    def _file_name(self, u: _Unit, t: _LineTable, index: int) -> str:
        key = (u.stmt_list or 0, index)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = self._path(u, t, index)
        return path

    def _path(self, u: _Unit, t: _LineTable, index: int) -> str:
        """llvm's getFileNameByIndex with AbsoluteFilePath ("" when the index names no file)."""
        if t.version >= 5:
            if not 0 <= index < len(t.files):
                return ""
            name, d = t.files[index]
        else:
            if not 1 <= index <= len(t.files):
                return ""
            name, d = t.files[index - 1]
        if name.startswith("/"):
            return name
        include = ""
        if t.version >= 5:
            if d < len(t.dirs):
                include = t.dirs[d]
        elif 0 < d <= len(t.dirs):
            include = t.dirs[d - 1]
        comp = ""
        # As llvm 19 (14 also prepended it to DWARF 5's directory 0, the unit's own).
        if (t.version < 5 or d != 0) and u.comp_dir and not include.startswith("/"):
            comp = u.comp_dir
        return _join(comp, include, name)

    def _line_of(self, t: _LineTable, addr: int) -> tuple[int, int] | None:
        """(file index, line) of the row holding `addr` (llvm's lookupAddress)."""
        i = bisect_right(t.seq_highs, addr)
        if i == len(t.seqs):
            return None
        low, high, first, last = t.seqs[i]
        if not low <= addr < high:
            return None
        # The last row at or before addr among first..last-2 (the end_sequence row excluded).
        j = bisect_right(t.addrs, addr, first + 1, last - 1) - 1
        return t.files_of[j], t.lines[j]

    # --- answers -----------------------------------------------------------------------

    def described(self) -> list[tuple[int, int]] | None:
        """The merged ranges of every unit, None when a unit could not be read."""
        try:
            if self._units is None:
                self._index_units()
        except (_Bad, IndexError, struct.error):
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
            except (_Bad, IndexError, struct.error):
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
            except (_Bad, IndexError, struct.error, KeyError, ValueError, OverflowError):
                got = [None] * len(wanted)
            except Unsupported:
                got = [None] * len(wanted)
            for k, g in zip(wanted, got, strict=True):
                out[k] = g
        return out

    def _unit_frames(self, u: _Unit, addrs: list[int]) -> list[Frames | None]:
        table = self._line_table(u) if u.stmt_list is not None else None
        chains = self._chains(u, addrs)
        out: list[Frames | None] = []
        for a, chain in zip(addrs, chains, strict=True):
            # Innermost first, up to and with the first subprogram (lexical blocks are not frames).
            inner: list[_Die] = []
            for die in reversed(chain):
                inner.append(die)
                if die.tag == _SUBPROGRAM:
                    break
            row = self._line_of(table, a) if table is not None else None
            if not inner:
                if row is None or table is None:
                    out.append([])
                else:
                    out.append([SourceFrame("", self._file_name(u, table, row[0]), row[1])])
                continue
            frames = []
            call_file, call_line = 0, 0
            for i, die in enumerate(inner):
                name = self._name(u, die)
                if i == 0:
                    file, line = (
                        ("", 0)
                        if row is None or table is None
                        else (self._file_name(u, table, row[0]), row[1])
                    )
                else:
                    file = self._file_name(u, table, call_file) if table is not None else ""
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
        return live[bisect_left(live, lo, key=key) : bisect_left(live, hi, key=key)]
    key = addrs.__getitem__
    picked = {
        j for lo, hi in ranges for j in range(bisect_left(live, lo, key=key), bisect_left(live, hi, key=key))
    }
    return [live[j] for j in sorted(picked)]


def _const(attrs: dict[int, tuple[int, int]], attr: int, default: int) -> int:
    """A constant attribute's value (a block's is 0)."""
    got = attrs.get(attr)
    return default if got is None else got[1]


def _inflate(data: memoryview, name: str) -> bytes:
    """An SHF_COMPRESSED section's bytes, up to MAX_INFLATED_BYTES."""
    if len(data) < 24:
        raise Unsupported(f"{name}: compressed header")
    ch_type, _res, size = struct.unpack_from("<IIQ", data)
    if ch_type != ELFCOMPRESS_ZLIB:
        raise Unsupported(f"{name}: compression {ch_type}")
    if size > MAX_INFLATED_BYTES:
        raise Unsupported(f"{name}: {size} bytes inflated, over the bound")
    d = zlib.decompressobj()
    try:
        out = d.decompress(data[24:], size)
    except zlib.error as e:
        raise Unsupported(f"{name}: {e}") from e
    if len(out) != size:
        raise Unsupported(f"{name}: inflates to {len(out)} bytes, not {size}")
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


def symbolize(path: str, addrs: Sequence[int]) -> list[Frames | None]:
    """Frames of each address of the ELF file at `path`; all None when the file cannot be read here."""
    try:
        with DwarfFile(path) as f:
            return f.frames(addrs)
    except (Unsupported, OSError, ValueError):
        return [None] * len(addrs)

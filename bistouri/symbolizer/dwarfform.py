"""DWARF's encodings, as symbolizer/dwarf.py and dwarflines.py read them: the tags, attributes and
forms used, LEB128 and fixed-size values, strings, abbreviation tables.

Every reader here takes untrusted bytes: a read past the end raises `Malformed` (or IndexError,
which its callers take for the same), a LEB128 longer than 70 bits too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compat import SLOTS

# Tags
TAG_SUBPROGRAM = 0x2E
TAG_INLINED = 0x1D
TAG_LEXICAL_BLOCK = 0x0B
TAG_NAMESPACE = 0x39
UNIT_TAGS = (0x11, 0x3C)  # compile, partial unit
SKELETON_TAGS = (0x4A,)
# Attributes
AT_SIBLING, AT_NAME, AT_STMT_LIST, AT_LOW_PC, AT_HIGH_PC = 0x01, 0x03, 0x10, 0x11, 0x12
AT_COMP_DIR, AT_ABSTRACT_ORIGIN, AT_SPECIFICATION, AT_RANGES = 0x1B, 0x31, 0x47, 0x55
AT_CALL_FILE, AT_CALL_LINE, AT_LINKAGE_NAME, AT_MIPS_LINKAGE_NAME = 0x58, 0x59, 0x6E, 0x2007
AT_STR_OFFSETS_BASE, AT_ADDR_BASE, AT_RNGLISTS_BASE = 0x72, 0x73, 0x74
AT_DWO_NAME, AT_GNU_DWO_NAME = 0x76, 0x2130
WANTED = frozenset(
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
FIXED = {
    F_DATA1: 1, F_REF1: 1, F_FLAG: 1, F_STRX1: 1, F_ADDRX1: 1,
    F_DATA2: 2, F_REF2: 2, F_STRX2: 2, F_ADDRX2: 2,
    F_STRX3: 3, F_ADDRX3: 3,
    F_DATA4: 4, F_REF4: 4, F_STRX4: 4, F_ADDRX4: 4, F_REF_SUP4: 4,
    F_DATA8: 8, F_REF8: 8, F_REF_SIG8: 8, F_REF_SUP8: 8,
    F_DATA16: 16, F_FLAG_PRESENT: 0, F_IMPLICIT_CONST: 0,
}  # fmt: skip
OFFSET_SIZED = (F_STRP, F_LINE_STRP, F_SEC_OFFSET, F_REF_ADDR, F_STRP_SUP, F_GNU_REF_ALT, F_GNU_STRP_ALT)
LEB = (
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
REFS_IN_UNIT = (F_REF1, F_REF2, F_REF4, F_REF8, F_REF_UDATA)
UNREADABLE = (
    F_GNU_ADDR_INDEX,
    F_GNU_STR_INDEX,
    F_GNU_REF_ALT,
    F_GNU_STRP_ALT,
    F_STRP_SUP,
    F_REF_SUP4,
    F_REF_SUP8,
)


class Unsupported(Exception):
    """DWARF this reader does not read (llvm-symbolizer may), or over one of its bounds."""


class Malformed(Exception):
    """Malformed DWARF met while answering: the unit at hand gets no answer from here."""


@dataclass(**SLOTS)
class Abbrev:
    """A DWARF abbreviation: a DIE's tag and its attributes' forms."""

    tag: int
    children: bool
    attrs: list[tuple[int, int, int]]  # (attribute, form, implicit constant)
    fixed: int  # total size when every form is fixed-size and the DIE is only skipped, else -1


class Abbrevs:
    """One abbreviation table, read as far as the codes asked for: GCC gives each unit its own, and
    indexing a unit needs only its first DIE's."""

    __slots__ = ("_b", "_pos", "addr_size", "done", "offset_size", "table")

    def __init__(self, b: memoryview, offset: int, offset_size: int, addr_size: int) -> None:
        self._b = b
        self._pos = offset
        self.offset_size = offset_size
        self.addr_size = addr_size
        self.table: dict[int, Abbrev] = {}
        self.done = False

    def get(self, code: int) -> Abbrev | None:
        ab = self.table.get(code)
        while ab is None and not self.done:
            if self._next() == code:
                ab = self.table[code]
        return ab

    def _next(self) -> int:
        """Read one more abbreviation; its code (0 at the table's end)."""
        b = self._b
        code, pos = uleb(b, self._pos)
        if code == 0:
            self.done = True
            return 0
        tag, pos = uleb(b, pos)
        children = b[pos] != 0
        pos += 1
        attrs: list[tuple[int, int, int]] = []
        fixed = 0
        while True:
            attr, pos = uleb(b, pos)
            form, pos = uleb(b, pos)
            if attr == 0 and form == 0:
                break
            const = 0
            if form == F_IMPLICIT_CONST:
                const, pos = sleb(b, pos)
            attrs.append((attr, form, const))
            size = FIXED.get(form)
            if size is None and form in OFFSET_SIZED:
                size = self.offset_size
            elif size is None and form == F_ADDR:
                size = self.addr_size
            fixed = fixed + size if size is not None and fixed >= 0 else -1
            if len(attrs) > 512:
                raise Malformed("too many attributes")
        self._pos = pos
        if code not in self.table:  # the first of a duplicated code, as llvm keeps
            self.table[code] = Abbrev(tag, children, attrs, fixed)
        if len(self.table) > 1 << 20:
            raise Malformed("too many abbreviations")
        return code


def uleb(b: bytes | memoryview, pos: int) -> tuple[int, int]:
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
            raise Malformed("LEB128 too long")


def sleb(b: bytes | memoryview, pos: int) -> tuple[int, int]:
    val, shift = 0, 0
    while True:
        byte = b[pos]
        pos += 1
        val |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return (val - (1 << shift) if byte & 0x40 else val), pos
        if shift > 70:
            raise Malformed("LEB128 too long")


def uint(b: memoryview, pos: int, size: int) -> int:
    if pos < 0 or pos + size > len(b):
        raise Malformed("read past the end of a section")
    return int.from_bytes(b[pos : pos + size], "little")


def cstr(b: memoryview, pos: int) -> tuple[str, int]:
    """The NUL-terminated string at `pos` and the position after it."""
    if not 0 <= pos < len(b):
        raise Malformed("string past the end of a section")
    end = bytes(b[pos : pos + 4096]).find(b"\0")
    if end < 0:
        raise Malformed("unterminated string")
    return bytes(b[pos : pos + end]).decode("utf-8", "surrogateescape"), pos + end + 1


def join_path(*parts: str) -> str:
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

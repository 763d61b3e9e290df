"""A small pure-Python ELF64 reader: what symbolization needs and nothing more.

It reads the GNU build id, the PT_LOAD segments (to turn the file offsets the
agent sends into virtual addresses) and an index of function symbols. Files are
mmap'd, read and closed: a `SymbolIndex` copies the names it keeps, so it
outlives the `ElfFile` it came from and holds no file descriptor.

Files come from uploads and from any process the agent watches, so every read is
bounded in work and memory whatever the headers say (docs/symbolization.md): each
note byte is read at most once and the walk stops at the build id, the symbols
kept per file are capped and stored in arrays (about 20 bytes and the name each),
and MiniDebugInfo is decompressed up to a limit, checked while it inflates.

DWARF is not parsed here; llvm-symbolizer does that (see llvm.py).
"""

from __future__ import annotations

import bisect
import lzma
import mmap
import os
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .compat import SLOTS
from .errors import BistouriError

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
ELFDATA2MSB = 2

ET_EXEC = 2
ET_DYN = 3

PT_LOAD = 1
PT_NOTE = 4
PF_X = 1

SHT_SYMTAB = 2
SHT_DYNAMIC = 6
SHT_NOTE = 7
SHT_NOBITS = 8
SHT_DYNSYM = 11
SHF_EXECINSTR = 0x4

SHN_UNDEF = 0
SHN_LORESERVE = 0xFF00

STT_NOTYPE = 0
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL = 0
STB_GLOBAL = 1
STB_WEAK = 2

NT_GNU_BUILD_ID = 3
NT_GO_BUILD_ID = 4  # name "Go": the Go linker's build id, a string (`.note.go.buildid`)
DT_NULL = 0
DT_SONAME = 14

# Function symbols name code addresses. Size-0 NOTYPE labels (`_etext`,
# `__kprobes_text_start`, asm local labels) are left out: they would swallow
# the padding that follows them.

MAX_GNU_DEBUGDATA = 32 << 20  # decompressed MiniDebugInfo; Fedora's largest are a few MB
MAX_NOTE_BYTES = 1 << 20  # note bytes walked per file, all areas together; a build id is in the first few
MAX_NOTES = 256  # notes walked per file
MAX_SYMBOLS = 1_000_000  # function symbols kept per file (libxul has ~300 000)
MAX_SYMBOL_ENTRIES = 4_000_000  # symbol table entries scanned per table
MAX_NAME_BYTES = 1024  # a longer symbol name is cut: C++ templates can reach megabytes
MAX_SECTION_NAMES = 1 << 20  # bytes of .shstrtab read (a large binary's is ~1 KB)
MAX_SECTION_NAME = 256  # bytes of one section name
SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1
ELFCOMPRESS_ZSTD = 2
# The most a compressed DWARF section may claim to inflate to, per compressed byte. zlib's deflate
# cannot exceed 1032; zstd can, but real debug info compresses 3-10 times.
MAX_COMPRESSION_RATIO = 1100
MAX_DWARF_SECTION_BYTES = 2 << 30  # a vmlinux's .debug_info is ~700 MB
HOST_DEBUG_DIR = "/usr/lib/debug"  # where distributions install debug files (perf, gdb look there)
# A Go binary without a GNU build id is known by an id of its own (docs/wire-format.md, "Go binaries"):
# this prefix, then 20 bytes of SHA-256 of its Go build id (else of its .gopclntab), 24 bytes in all. No
# GNU linker makes an id of that length (8, 16 or 20 bytes) nor one that says "GoID" by choice.
GO_ID_PREFIX = b"GoID"
GO_ID_LEN = 24
MAX_GO_BUILD_ID = 1024  # a Go build id is 4 base64 hashes and 3 slashes, ~83 bytes
MAX_GO_HASHED = 64 << 20  # bytes of .gopclntab hashed when there is no Go build id


class ElfFormatError(BistouriError):
    """A file is not an ELF64 object this reader understands, or is truncated."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        super().__init__(f"cannot read ELF file {path}: {why}")


@dataclass(frozen=True, **SLOTS)
class Segment:
    """One PT_LOAD program header."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int
    align: int


@dataclass(frozen=True, **SLOTS)
class Section:
    """An ELF section header."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    align: int
    entsize: int


class SymbolIndex:
    """Function symbols sorted by address, looked up with bisect.

    `lookup(vaddr)` returns `(name, offset_in_function)` or None when the
    address falls outside every function (alignment padding, PLT stubs, data).
    Kept in arrays and one name blob: about 20 bytes and the name per symbol.
    """

    __slots__ = ("_ends", "_name_offs", "_names", "_starts", "source")

    def __init__(
        self, starts: array[int], ends: array[int], name_offs: array[int], names: bytes, source: str
    ) -> None:
        self._starts = starts
        self._ends = ends
        self._name_offs = name_offs  # len(starts) + 1 offsets into `names`: symbol i is [i, i + 1)
        self._names = names
        self.source = source  # ".symtab", ".dynsym", ... for diagnostics

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        """The memory it holds, about."""
        arrays = (self._starts, self._ends, self._name_offs)
        return sum(a.itemsize * len(a) for a in arrays) + len(self._names) + 200

    def _name(self, i: int) -> str:
        return self._names[self._name_offs[i] : self._name_offs[i + 1]].decode("utf-8", "replace")

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        if vaddr < self._ends[i]:
            return self._name(i), vaddr - self._starts[i]
        # A function can enclose a smaller symbol that starts inside it.
        if i > 0 and self._starts[i - 1] <= vaddr < self._ends[i - 1]:
            return self._name(i - 1), vaddr - self._starts[i - 1]
        return None

    def items(self) -> Iterator[tuple[int, int, str]]:
        """(start, end, name) of every symbol, in address order."""
        for i in range(len(self._starts)):
            yield self._starts[i], self._ends[i], self._name(i)

    @classmethod
    def empty(cls) -> SymbolIndex:
        return cls(array("Q"), array("Q"), array("I", [0]), b"", "none")


class _Candidates:
    """Function symbols as read from one or more tables, before sorting: arrays, one name blob.

    Row i sorts by one int key: address, then best alias first (sized, then global, weak, local)."""

    __slots__ = ("keys", "name_offs", "names", "sec_ends", "sizes", "truncated")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.sizes = array("Q")
        self.sec_ends = array("Q")
        self.name_offs = array("I")
        self.names = bytearray()
        self.truncated = False  # a bound was hit: some symbols are missing

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, value: int, pref: int, size: int, sec_end: int, name: bytes) -> None:
        # 3 bits of preference (0-6), then 20 bits of row number (MAX_SYMBOLS < 2**20).
        self.keys.append((value << 3 | (7 - pref)) << 20 | len(self.keys))
        self.sizes.append(size)
        self.sec_ends.append(sec_end)
        self.name_offs.append(len(self.names))
        self.names += name


_BIND_RANK = {STB_GLOBAL: 2, STB_WEAK: 1}


def build_index(cands: _Candidates, source: str) -> SymbolIndex:
    """Sort, de-duplicate aliases and give size-0 functions the gap up to the next symbol."""
    cands.keys.sort()
    starts = array("Q")
    ends = array("Q")
    offs = array("I")
    names = bytearray()
    unsized: list[tuple[int, int]] = []
    last = -1
    row_mask = (1 << 20) - 1
    n_names = len(cands.names)
    for key in cands.keys:
        value = key >> 23
        if value == last:
            continue
        last = value
        row = key & row_mask
        size = cands.sizes[row]
        if not size:
            unsized.append((len(starts), cands.sec_ends[row]))  # asm without .size: fixed up below
        starts.append(value)
        ends.append(value + size)
        begin = cands.name_offs[row]
        stop = cands.name_offs[row + 1] if row + 1 < len(cands.name_offs) else n_names
        offs.append(len(names))
        names += cands.names[begin:stop]
    offs.append(len(names))
    cands.keys.clear()
    n = len(starts)
    for i, sec_end in unsized:
        nxt = starts[i + 1] if i + 1 < n else sec_end
        ends[i] = min(nxt, sec_end) if sec_end > starts[i] else nxt
    return SymbolIndex(starts, ends, offs, bytes(names), source)


class ElfFile:
    """An ELF64 file opened read-only. Use as a context manager, or call close()."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, data: bytes | None = None) -> None:
        self._closed = True
        self._mm: mmap.mmap | None = None
        self.path = os.fspath(path) if path is not None else "<memory>"
        if data is None:
            if path is None:
                raise ValueError("ElfFile needs a path or data")
            try:
                with open(self.path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < 64:
                        raise ElfFormatError(self.path, f"file is {size} bytes, too small for an ELF header")
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise ElfFormatError(self.path, e.strerror or str(e)) from e
            self._buf: bytes | mmap.mmap = self._mm
        else:
            self._buf = data
        self._closed = False
        self.size = len(self._buf)
        # Which bounds this file hit (symbols, gnu_debugdata, dwarf, ...): the resolver counts them.
        self.bounds_hit: set[str] = set()
        self._parse_headers()
        self._build_id: bytes | None = None
        self._go_build_id: bytes | None = None
        self._build_id_read = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- headers -------------------------------------------------------------

    def _fail(self, why: str) -> ElfFormatError:
        return ElfFormatError(self.path, why)

    def _slice(self, off: int, size: int) -> bytes:
        if off < 0 or size < 0 or off + size > self.size:
            raise self._fail(f"range 0x{off:x}+0x{size:x} is past the end of the file (0x{self.size:x})")
        return self._buf[off : off + size]

    def _parse_headers(self) -> None:
        ident = self._buf[:16]
        if ident[:4] != ELF_MAGIC:
            raise self._fail("no ELF magic")
        if ident[4] != ELFCLASS64:
            raise self._fail("only 64-bit ELF is supported")
        if ident[5] not in (ELFDATA2LSB, ELFDATA2MSB):
            raise self._fail(f"unknown data encoding {ident[5]}")
        self.endian = "<" if ident[5] == ELFDATA2LSB else ">"
        e = self.endian
        (
            self.type,
            self.machine,
            _version,
            self.entry,
            phoff,
            shoff,
            _flags,
            _ehsize,
            phentsize,
            phnum,
            shentsize,
            shnum,
            shstrndx,
        ) = struct.unpack_from(e + "HHIQQQIHHHHHH", self._buf, 16)
        self.segments: list[Segment] = []
        self._notes_ph: list[tuple[int, int, int]] = []
        if phnum and phentsize >= 56:
            for i in range(phnum):
                p_type, p_flags, p_off, p_vaddr, _pa, p_filesz, p_memsz, p_align = struct.unpack(
                    e + "IIQQQQQQ", self._slice(phoff + i * phentsize, 56)
                )
                if p_type == PT_LOAD:
                    self.segments.append(Segment(p_vaddr, p_off, p_filesz, p_memsz, p_flags, p_align))
                elif p_type == PT_NOTE and p_filesz:
                    self._notes_ph.append((p_off, p_filesz, p_align))
        self.sections: list[Section] = []
        if shoff and shnum and shentsize >= 64:
            raw = [
                struct.unpack(e + "IIQQQQIIQQ", self._slice(shoff + i * shentsize, 64)) for i in range(shnum)
            ]
            names = b""
            if 0 < shstrndx < shnum and raw[shstrndx][1] != SHT_NOBITS:
                # Section names are short: a string table of a gigabyte without NULs, searched once per
                # header, would cost 65 535 scans of it.
                size = raw[shstrndx][5]
                if size > MAX_SECTION_NAMES:
                    size = MAX_SECTION_NAMES
                    self.bounds_hit.add("section_names")
                names = self._slice(raw[shstrndx][4], size)
            for sh_name, sh_type, sh_flags, sh_addr, sh_off, sh_size, sh_link, _info, sh_align, sh_ent in raw:
                end = names.find(b"\0", sh_name, sh_name + MAX_SECTION_NAME)
                stop = end if end >= 0 else min(len(names), sh_name + MAX_SECTION_NAME)
                name = names[sh_name:stop].decode("ascii", "replace")
                self.sections.append(
                    Section(name, sh_type, sh_flags, sh_addr, sh_off, sh_size, sh_link, sh_align, sh_ent)
                )

    def section(self, name: str) -> Section | None:
        for s in self.sections:
            if s.name == name:
                return s
        return None

    def section_data(self, sec: Section) -> bytes:
        if sec.type == SHT_NOBITS:
            return b""
        return self._slice(sec.offset, sec.size)

    # --- identity ------------------------------------------------------------

    def _iter_notes(self) -> Iterator[tuple[bytes, int, bytes]]:
        """(name, type, desc) of the notes, each byte read at most once and within MAX_NOTE_* in all.

        `.note.gnu.build-id` comes first; sections that overlap one already walked are skipped (a
        crafted file repeated one area 65 535 times, 12 bytes a step, for 33 s of CPU)."""
        areas = [
            (s.name != ".note.gnu.build-id", s.offset, s.size, 8 if s.align == 8 else 4)
            for s in self.sections
            if s.type == SHT_NOTE
        ]
        if not areas:
            areas = [(True, off, size, 8 if align == 8 else 4) for off, size, align in self._notes_ph]
        areas.sort()
        walked: list[tuple[int, int]] = []
        budget = MAX_NOTE_BYTES
        notes = 0
        for _rank, off, size, align in areas:
            size = min(size, budget)
            if notes >= MAX_NOTES or size < 12:
                continue
            if any(off < w_end and w_off < off + size for w_off, w_end in walked):
                continue
            notes += 1  # an area counts as a note, so that many empty ones are bounded too
            walked.append((off, off + size))
            budget -= size
            data = self._slice(off, size)
            pos = 0
            while pos + 12 <= len(data) and notes < MAX_NOTES:
                namesz, descsz, ntype = struct.unpack_from(self.endian + "III", data, pos)
                pos += 12
                name = data[pos : pos + namesz]
                pos += (namesz + align - 1) & ~(align - 1)
                desc = data[pos : pos + descsz]
                pos += (descsz + align - 1) & ~(align - 1)
                notes += 1
                yield name.rstrip(b"\0"), ntype, desc

    def _read_ids(self) -> None:
        """One walk of the notes for both ids; it stops at the GNU build id, which wins."""
        if self._build_id_read:
            return
        self._build_id_read = True
        for name, ntype, desc in self._iter_notes():
            if name == b"GNU" and ntype == NT_GNU_BUILD_ID and desc:
                self._build_id = bytes(desc)
                break
            if name == b"Go" and ntype == NT_GO_BUILD_ID and desc and self._go_build_id is None:
                self._go_build_id = bytes(desc[:MAX_GO_BUILD_ID])

    @property
    def build_id(self) -> bytes | None:
        """The GNU build id (NT_GNU_BUILD_ID note), or None when the file has none."""
        self._read_ids()
        return self._build_id

    @property
    def go_build_id(self) -> bytes | None:
        """The Go linker's build id (`actionID/.../contentID`), or None (GNU build id present, or not Go)."""
        self._read_ids()
        return self._go_build_id if self._build_id is None else None

    @property
    def file_id(self) -> bytes | None:
        """What the agent, uploads and the symbolizer key this file by (the wire's "build id"): the GNU
        build id, else for a Go binary an id derived from its Go build id (else from its pclntab)."""
        self._read_ids()
        if self._build_id is not None:
            return self._build_id
        if self._go_build_id is not None:
            return go_file_id(b"buildid\0" + self._go_build_id)
        sec = self.section(".gopclntab") or self.section(".data.rel.ro.gopclntab")  # (PIE)
        if sec is None or sec.type == SHT_NOBITS or sec.size < 16:
            return None
        # Built with -buildid= : the function table is the program. Bounded: a length and a prefix.
        size = min(sec.size, MAX_GO_HASHED)
        return go_file_id(b"pclntab\0" + sec.size.to_bytes(8, "little") + self._slice(sec.offset, size))

    @property
    def debuglink(self) -> str | None:
        """File name in `.gnu_debuglink` (a stripped binary pointing at its debug file)."""
        sec = self.section(".gnu_debuglink")
        if sec is None or sec.type == SHT_NOBITS:
            return None
        data = self._slice(sec.offset, min(sec.size, 4096))  # a file name and a CRC
        end = data.find(b"\0")
        return data[: end if end >= 0 else None].decode("utf-8", "replace") or None

    @property
    def soname(self) -> str | None:
        """DT_SONAME of a shared library (`libc.so.6`), or None."""
        for sec in self.sections:
            if sec.type != SHT_DYNAMIC or not 0 < sec.link < len(self.sections):
                continue
            strtab = self.section_data(self.sections[sec.link])
            data = self.section_data(sec)
            for tag, val in struct.iter_unpack(self.endian + "qQ", data[: len(data) // 16 * 16]):
                if tag == DT_NULL:
                    break
                if tag == DT_SONAME and val < len(strtab):
                    end = strtab.find(b"\0", val)
                    return strtab[val : end if end >= 0 else None].decode("utf-8", "replace") or None
        return None

    @property
    def has_dwarf(self) -> bool:
        """True when the file carries line tables llvm-symbolizer may read (file:line).

        False, with "dwarf" in `bounds_hit`, when a compressed debug section claims more than its
        compressed size can hold or than any real file has: llvm-symbolizer would allocate it
        (a 2.7 KB section took one to 5.5 GB)."""
        if not any(
            s.name in (".debug_line", ".zdebug_line") and s.type != SHT_NOBITS and s.size > 0
            for s in self.sections
        ):
            return False
        total = 0
        for s in self.sections:
            if not s.name.startswith((".debug_", ".zdebug_")) or s.type == SHT_NOBITS:
                continue
            claimed = self._inflated_size(s)
            total += claimed
            if claimed > max(s.size, 1024) * MAX_COMPRESSION_RATIO or total > MAX_DWARF_SECTION_BYTES:
                self.bounds_hit.add("dwarf")
                return False
        return True

    def _inflated_size(self, sec: Section) -> int:
        """The size a debug section claims once decompressed (its own size when not compressed)."""
        try:
            if sec.flags & SHF_COMPRESSED:
                # Elf64_Chdr: type u32, reserved u32, size u64, align u64.
                ch_type, _res, ch_size = struct.unpack(self.endian + "IIQ", self._slice(sec.offset, 16))
                return int(ch_size) if ch_type in (ELFCOMPRESS_ZLIB, ELFCOMPRESS_ZSTD) else 0
            if sec.name.startswith(".zdebug_"):
                head = self._slice(sec.offset, 12)  # "ZLIB" and a big-endian u64 size
                return int.from_bytes(head[4:12], "big") if head[:4] == b"ZLIB" else 0
        except ElfFormatError:
            return 1 << 62  # a header past the end of the file: never handed to llvm
        return sec.size

    # --- addresses -----------------------------------------------------------

    @property
    def loads_have_offsets(self) -> bool:
        """False for split debug files, whose code segments have p_filesz == 0.

        objcopy --only-keep-debug keeps p_vaddr and p_memsz but zeroes p_filesz
        and p_offset, so such a file cannot translate offsets exactly: use the
        executable's headers when it can be found.
        """
        return any(s.filesz > 0 for s in self.segments if s.flags & PF_X) or not any(
            s.flags & PF_X for s in self.segments
        )

    def offset_to_vaddr(self, offset: int) -> int | None:
        return offset_to_vaddr(self.segments, offset)

    def approx_segments(self) -> list[Segment]:
        """Segments with offsets rebuilt for a split debug file.

        GNU ld lays segments out with p_vaddr - p_offset equal to the first
        segment's difference for the text segment; lld does not. This is a guess,
        used only when the executable cannot be found.
        """
        if self.loads_have_offsets or not self.segments:
            return list(self.segments)
        first = self.segments[0]
        bias = first.vaddr - first.offset
        return [Segment(s.vaddr, s.vaddr - bias, s.memsz, s.memsz, s.flags, s.align) for s in self.segments]

    # --- symbols -------------------------------------------------------------

    def _add_symbols(self, sec: Section, strsec: Section, cands: _Candidates) -> None:
        """Function symbols of one table into `cands`, read in place: no copy of the table or its strings."""
        exec_end: dict[int, int] = {}
        for i, s in enumerate(self.sections):
            if s.flags & SHF_EXECINSTR:
                exec_end[i] = s.addr + s.size
        n = sec.size // 24
        if n > MAX_SYMBOL_ENTRIES:
            n = MAX_SYMBOL_ENTRIES
            self.bounds_hit.add("symbols")
        if not n:
            return
        if sec.offset + n * 24 > self.size:
            raise self._fail(f"symbol table 0x{sec.offset:x}+0x{n * 24:x} is past the end of the file")
        str_lo = strsec.offset
        str_hi = min(strsec.offset + strsec.size, self.size)
        buf = self._buf
        find = buf.find
        get_end = exec_end.get
        rank = _BIND_RANK.get
        add = cands.add
        view = memoryview(buf)[sec.offset : sec.offset + n * 24]
        try:
            # Elf64_Sym: name u32, info u8, other u8, shndx u16, value u64, size u64.
            for name_off, info, _other, shndx, value, size in struct.iter_unpack(
                self.endian + "IBBHQQ", view
            ):
                typ = info & 0xF
                if typ != STT_FUNC and typ != STT_GNU_IFUNC and (typ != STT_NOTYPE or not size):
                    continue
                sec_end = get_end(shndx)
                if sec_end is None or not value:
                    continue
                if len(cands) >= MAX_SYMBOLS:
                    cands.truncated = True
                    self.bounds_hit.add("symbols")
                    break
                start = str_lo + name_off
                stop = min(str_hi, start + MAX_NAME_BYTES)
                if start < stop:
                    end = find(b"\0", start, stop)
                    end = end if end >= 0 else stop
                    # A debug file's .symtab keeps symbol versions (`__libc_start_main@@GLIBC_2.34`):
                    # named as the binary's .dynsym names them, with or without the debug file.
                    at = find(b"@", start, end)
                    name = buf[start : at if at > start else end]
                else:
                    name = b""
                add(value, (4 if size else 0) + rank(info >> 4, 0), size, sec_end, name)
        finally:
            view.release()

    def _table(self, sec_type: int) -> tuple[Section, Section] | None:
        """The first symbol table of this type with a string table, as (symbols, strings)."""
        for s in self.sections:
            if s.type == sec_type and s.size and 0 < s.link < len(self.sections):
                strsec = self.sections[s.link]
                if strsec.type == SHT_NOBITS:
                    continue
                return s, strsec
        return None

    def symbol_index(self) -> SymbolIndex:
        """Function symbols: `.symtab` if present, else `.dynsym` merged with MiniDebugInfo."""
        tab = self._table(SHT_SYMTAB)
        if tab is not None:
            cands = _Candidates()
            self._add_symbols(*tab, cands)
            if len(cands):
                return build_index(cands, ".symtab")
        cands = _Candidates()
        sources = []
        dyn = self._table(SHT_DYNSYM)
        if dyn is not None:
            self._add_symbols(*dyn, cands)
            sources.append(".dynsym")
        mini = self._mini_debuginfo()
        if mini is not None:
            with mini:
                tab = mini._table(SHT_SYMTAB)
                if tab is not None:
                    # The mini file's section headers mirror ours (as NOBITS), so indexes match.
                    mini._add_symbols(*tab, cands)
                    sources.append(".gnu_debugdata")
                self.bounds_hit |= mini.bounds_hit
        if not len(cands):
            return SymbolIndex.empty()
        return build_index(cands, "+".join(sources))

    def _mini_debuginfo(self) -> ElfFile | None:
        """The xz-compressed ELF in `.gnu_debugdata` (Fedora's MiniDebugInfo), if any.

        Inflated at most MAX_GNU_DEBUGDATA bytes, a bound the decompressor keeps as it goes: a
        larger one is left out whole (a 4 MB upload once inflated to 256 MiB)."""
        sec = self.section(".gnu_debugdata")
        if sec is None or sec.type == SHT_NOBITS or not sec.size:
            return None
        if sec.size > MAX_GNU_DEBUGDATA:
            self.bounds_hit.add("gnu_debugdata")
            return None
        try:
            dec = lzma.LZMADecompressor()
            data = dec.decompress(self.section_data(sec), max_length=MAX_GNU_DEBUGDATA)
            if not dec.eof:
                self.bounds_hit.add("gnu_debugdata")
                return None
            return ElfFile(self.path + "!.gnu_debugdata", data=data)
        except (lzma.LZMAError, ElfFormatError):
            return None

    def find_symbol(self, name: str) -> int | None:
        """Address of a symbol of any type by exact name (a linear scan; for rare uses like `_text`)."""
        found = self.find_symbols([name])
        return found[name][0] if name in found else None

    def find_symbols(self, names: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(address, size) of the defined symbols of any type among `names`, `.symtab` first, then
        `.dynsym` for those it lacks.

        The names are looked for in the string table first, and only the entries named at one of
        their offsets are parsed: parsing all of them was ~6 ms of each description of pyenv's
        libpython (8 names among 15 000 symbols; ~2.5 ms now)."""
        want = {n.encode(): n for n in names}
        found: dict[str, tuple[int, int]] = {}
        for sec_type in (SHT_SYMTAB, SHT_DYNSYM):
            tab = self._table(sec_type)
            if tab is None or len(found) == len(want):
                continue
            sec, strsec = tab
            strtab = self.section_data(strsec)
            # Each offset where a wanted name stands whole: a linker may share its bytes with the
            # tail of a longer name, so one name can stand at several.
            named_at: dict[int, str] = {}
            for raw, name in want.items():
                at = -1 if name in found else strtab.find(raw + b"\0")
                while at >= 0:
                    named_at[at] = name
                    at = strtab.find(raw + b"\0", at + 1)
            if not named_at:
                continue
            data = self.section_data(sec)
            words = array("I", data[: len(data) // 24 * 24])
            if (self.endian == "<") != (sys.byteorder == "little"):
                words.byteswap()
            for i, name_off in enumerate(words[::6]):  # st_name, each 24-byte entry's first word
                wanted = named_at.get(name_off)
                if wanted is None or wanted in found:
                    continue
                _, _info, _other, shndx, value, size = struct.unpack_from(
                    self.endian + "IBBHQQ", data, i * 24
                )
                if shndx != SHN_UNDEF:
                    found[wanted] = (int(value), int(size))
        return found


def offset_to_vaddr(segments: Iterable[Segment], offset: int) -> int | None:
    """Translate a file offset into a virtual address through the PT_LOAD segments."""
    for s in segments:
        if s.offset <= offset < s.offset + s.filesz:
            return offset - s.offset + s.vaddr
    return None


def go_file_id(what: bytes) -> bytes:
    """The id of a Go binary without a GNU build id, from what identifies it (see GO_ID_PREFIX)."""
    import hashlib  # here: it maps libcrypto (~3.4 MB of RSS), which `record`'s capture needs not

    return GO_ID_PREFIX + hashlib.sha256(what).digest()[: GO_ID_LEN - len(GO_ID_PREFIX)]


def is_go_file_id(build_id: bytes) -> bool:
    return len(build_id) == GO_ID_LEN and build_id.startswith(GO_ID_PREFIX)


def read_build_id(path: str | os.PathLike[str]) -> bytes | None:
    """The id of an ELF file as the wire knows it (`ElfFile.file_id`: the GNU build id, else a Go
    binary's own), or None if it is not ELF64 or has neither."""
    try:
        with ElfFile(path) as f:
            return f.file_id
    except ElfFormatError:
        return None

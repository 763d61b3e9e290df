"""The on-disk format of record's symbol cache (record/symcache.py): read in place, by address.

A warm `record` run names a few hundred addresses; it must not decode a whole binary's
cached answers to do so. Each file is a header, sorted fixed-width arrays and string
tables, mapped with mmap and searched with bisect: a lookup touches a few pages, not the
file. Measured against SQLite (a table with primary key (address, leaf), `WITHOUT
ROWID`) for 1 000 lookups among 200 000 entries on this 2-vCPU machine: 2-20 ms against
26-97 ms; one pread per bisect step instead of mmap: 26-92 ms.

Two kinds of file share the header:

- frames (`<build id>.frames`, `k-<boot key>.frames`): the answers for (address, leaf?)
  keys: the keys as sorted u64 (call sites, then leaves), per key the write generation
  that added it (a file over its bound keeps the newest answers), a checksum and its frame
  ids; the distinct frames (six u32: name, module, file, line, kind, inlined; strings by
  id) and the string table;
- kallsyms (`k-<boot key>.kallsyms`): the kernel's text symbols of one boot, sorted by
  address: start, end, checksum, name and module of each;
- symbols (`<build id>.symbols`): the function symbols of a binary, as the resolver read
  them (start, end, checksum, name), with its PT_LOAD segments, its display name and the
  address ranges its DWARF describes (none for a binary without DWARF;
  `symbolizer.dwarf.covered_ranges`), so that its new addresses outside them are named
  without the resolver.

Files are this host's: arrays are in native byte order (a mark in the header refuses
another). Opening a file checks the header (its checksum) and that the file is exactly as
long as its arrays: a truncated or foreign file is refused. The rest is read only where
a lookup goes, and the contents are untrusted bytes: every index read from them is
checked before use, and every answer is checked against the checksum of its entry (key,
frame rows and strings; a symbol's start, end, name and module) before it is returned.
A damaged file raises `CorruptFile`, never answers wrong or reads outside itself (a
damaged key only makes its address a miss). A file is replaced whole (rename), never
rewritten in place, so a reader's mapping stays valid while another run writes.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

from ..compat import zip_strict

if TYPE_CHECKING:
    from typing_extensions import TypeAlias  # typing's from 3.10

    from ..symbolizer.model import Frame

MAGIC = b"BSY2"
KIND_FRAMES = 1
KIND_KALLSYMS = 2
KIND_SYMBOLS = 3
_BOM = 0x0102  # reads 0x0201 in the other byte order
_HEAD = struct.Struct("=4sHH8Q")  # magic, byte-order mark, kind, eight counts (meaning per kind)
_HEADER_BYTES = _HEAD.size + 8  # then the crc32 of those bytes, and 4 bytes of padding
_FILE_LINES = 1  # frames header flag: answers made with DWARF (file:line, inlines)
_KEY = struct.Struct("=QB")  # an entry's (address, leaf) in its checksum
_ROW = struct.Struct("=6I")  # a frame row in an entry's checksum
_SYM = struct.Struct("=QQH")  # a symbol's start, end, module in its checksum
_U32 = 0xFFFFFFFF

Frames = tuple["Frame", ...]
FrameKey = tuple[int, bool]
_Code = Literal["Q", "I", "i", "H", "B"]
_WIDTH = {"Q": 8, "I": 4, "i": 4, "H": 2, "B": 1}
# A file as the buffers to write one after the other (not joined: a kallsyms file is ~6 MB).
Parts: TypeAlias = "list[bytes | bytearray | array[int] | memoryview]"


class CorruptFile(ValueError):
    """The bytes are not a file this module wrote, or were damaged since."""


def joined(parts: Parts) -> bytes:
    return b"".join(parts)


def size_of(parts: Parts) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def map_file(fd: int) -> mmap.mmap | bytes:
    """The file of `fd`, mapped read-only (an empty file maps as empty bytes)."""
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    except ValueError:  # empty
        return b""


def _header(kind: int, counts: list[int]) -> bytes:
    head = _HEAD.pack(MAGIC, _BOM, kind, *counts, *[0] * (8 - len(counts)))
    return head + struct.pack("=I4x", zlib.crc32(head))


def _counts(buf: memoryview, kind: int) -> tuple[int, ...]:
    if len(buf) < _HEADER_BYTES:
        raise CorruptFile("shorter than a header")
    magic, bom, got_kind, *counts = _HEAD.unpack_from(buf)
    if magic != MAGIC or bom != _BOM or got_kind != kind:
        raise CorruptFile("not a symbol cache file of this kind and version")
    if struct.unpack_from("=I", buf, _HEAD.size)[0] != zlib.crc32(buf[: _HEAD.size]):
        raise CorruptFile("header checksum")
    return tuple(counts)


def _sections(buf: memoryview, sizes: Iterable[tuple[_Code, int]]) -> list[memoryview]:
    """The arrays that follow the header, each cast to its type, from (typecode, count) in
    order; the file must be exactly as long as they are."""
    out = []
    pos = _HEADER_BYTES
    for code, count in sizes:
        end = pos + _WIDTH[code] * count
        if not 0 <= count < 1 << 32 or end > len(buf):
            raise CorruptFile("truncated")
        out.append(buf[pos:end].cast(code))
        pos = end
    if pos != len(buf):
        raise CorruptFile(f"{len(buf) - pos} bytes too many")
    return out


class _Strings:
    """A string table read in place: offsets (n+1 u32) into a blob."""

    __slots__ = ("blob", "decoded", "offs")

    def __init__(self, offs: memoryview, blob: memoryview) -> None:
        self.offs = offs
        self.blob = blob
        self.decoded: dict[int, str] = {}

    def __len__(self) -> int:
        return max(0, len(self.offs) - 1)

    def raw(self, i: int) -> bytes:
        if not 0 <= i < len(self.offs) - 1:
            raise CorruptFile(f"string {i} of {len(self)}")
        start, end = self.offs[i], self.offs[i + 1]
        if not start <= end <= len(self.blob):
            raise CorruptFile(f"string {i} at {start}-{end}")
        return bytes(self.blob[start:end])

    def __getitem__(self, i: int) -> str:
        s = self.decoded.get(i)
        if s is None:
            s = self.decoded[i] = self.raw(i).decode("utf-8", "surrogateescape")
        return s

    def release(self) -> None:
        self.offs.release()
        self.blob.release()


class _StringBuilder:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.encoded: list[bytes] = []

    def __len__(self) -> int:
        return len(self.encoded)

    def add(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.encoded)
            self.encoded.append(s.encode("utf-8", "surrogateescape"))
        return i

    def arrays(self) -> tuple[array[int], bytes]:
        offs = array("I", [0])
        size = 0
        for b in self.encoded:
            size += len(b)
            offs.append(size)
        return offs, b"".join(self.encoded)


def _entry_crc(addr: int, leaf: bool, rows: Iterable[tuple[int, ...]], strings: Iterable[bytes]) -> int:
    h = zlib.crc32(_KEY.pack(addr, leaf))
    for row in rows:
        h = zlib.crc32(_ROW.pack(*row), h)
    for s in strings:
        h = zlib.crc32(s, zlib.crc32(struct.pack("=I", len(s)), h))
    return h


# --- frames -------------------------------------------------------------------------------


class FrameTable:
    """One frames file, read in place. `get` raises `CorruptFile` when the entry it reads is damaged."""

    __slots__ = (
        "_buf",
        "_call",
        "_crcs",
        "_frames",
        "_ids",
        "_leaf",
        "_lists",
        "_made",
        "_map",
        "_stamps",
        "_strings",
        "file_lines",
        "generation",
    )

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self._map = data
        self._buf = memoryview(data)
        flags, gen, n_call, n_leaf, n_ids, n_frames, n_strings, blob = _counts(self._buf, KIND_FRAMES)
        n = n_call + n_leaf
        sizes: list[tuple[_Code, int]] = [
            ("Q", n_call),
            ("Q", n_leaf),
            ("I", n),  # generation of each entry
            ("I", n),  # checksum of each entry
            ("I", n + 1),  # entry i's frame ids are ids[lists[i]:lists[i + 1]]
            ("I", n_ids),
            ("I", 6 * n_frames),
            ("I", n_strings + 1),
            ("B", blob),
        ]
        (
            self._call,
            self._leaf,
            self._stamps,
            self._crcs,
            self._lists,
            self._ids,
            self._frames,
            offs,
            strs,
        ) = _sections(self._buf, sizes)
        self._strings = _Strings(offs, strs)
        self._made: dict[int, Frame] = {}
        self.file_lines = bool(flags & _FILE_LINES)
        self.generation = gen

    def close(self) -> None:
        """Unmap the file (the table is unusable after)."""
        for v in (self._call, self._leaf, self._stamps, self._crcs, self._lists, self._ids, self._frames):
            v.release()
        self._strings.release()
        self._buf.release()
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __enter__(self) -> FrameTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._call) + len(self._leaf)

    def _index(self, key: FrameKey) -> int:
        """The entry number of `key`, -1 if absent."""
        addr, leaf = key
        if not 0 <= addr < 1 << 64:
            return -1
        keys = self._leaf if leaf else self._call
        i = bisect_left(keys, addr)
        if i < len(keys) and keys[i] == addr:
            return i + len(self._call) if leaf else i
        return -1

    def __contains__(self, key: FrameKey) -> bool:
        return self._index(key) >= 0

    def get(self, key: FrameKey) -> Frames | None:
        i = self._index(key)
        if i < 0:
            return None
        fids, rows = self._checked(i, key)
        return tuple(self._frame(fid, row) for fid, row in zip_strict(fids, rows))

    def _checked(self, i: int, key: FrameKey) -> tuple[list[int], list[tuple[int, ...]]]:
        """Entry `i`'s frame ids and rows, once its checksum matches."""
        start, end = self._lists[i], self._lists[i + 1]
        if not start <= end <= len(self._ids):
            raise CorruptFile(f"entry {i}'s frames at {start}-{end}")
        fids = list(self._ids[start:end])
        rows: list[tuple[int, ...]] = []
        for fid in fids:
            row = tuple(self._frames[6 * fid : 6 * fid + 6])
            if len(row) != 6:
                raise CorruptFile(f"frame {fid} of {len(self._frames) // 6}")
            rows.append(row)
        strings = (self._strings.raw(r[k]) for r in rows for k in (0, 1, 2, 4))
        if _entry_crc(key[0], key[1], rows, strings) != self._crcs[i]:
            raise CorruptFile(f"entry {i}'s checksum")
        return fids, rows

    def _frame(self, fid: int, row: tuple[int, ...]) -> Frame:
        f = self._made.get(fid)
        if f is None:
            from ..symbolizer.model import Frame

            s = self._strings
            f = self._made[fid] = Frame(s[row[0]], s[row[1]], s[row[2]], row[3], s[row[4]], bool(row[5]))
        return f

    def keys(self) -> Iterator[FrameKey]:
        yield from ((int(a), False) for a in self._call)
        yield from ((int(a), True) for a in self._leaf)

    def items(self) -> Iterator[tuple[FrameKey, Frames]]:
        """Every entry (to copy a file, and for tests): reads it whole."""
        for key in self.keys():
            got = self.get(key)
            if got is not None:
                yield key, got


def encode_frames(
    new: dict[FrameKey, Frames], file_lines: bool, old: FrameTable | None = None, max_entries: int = 1 << 31
) -> Parts:
    """A frames file of `new` and, unless `new` answers the same key, what `old` holds (when it was
    made the same way: with or without DWARF). Over `max_entries`, the oldest answers go first.
    Raises `CorruptFile` when `old` is damaged."""
    strings = _StringBuilder()
    rows: dict[tuple[int, ...], int] = {}  # a frame's six u32 -> its id

    def frame_id(name: str, module: str, file: str, line: int, kind: str, inlined: bool) -> int:
        ids = (strings.add(name), strings.add(module), strings.add(file))
        row = (*ids, min(max(line, 0), _U32), strings.add(kind), int(inlined))
        i = rows.get(row)
        if i is None:
            i = rows[row] = len(rows)
        return i

    gen = 1
    # key -> (generation, its entry number in `old` or its frames in `new`); what stays is chosen
    # before anything is interned, so that dropped answers leave no string behind.
    chosen: dict[FrameKey, tuple[int, int | Frames]] = {}
    if old is not None and old.file_lines == file_lines:
        gen = min(old.generation + 1, _U32)
        for i, key in enumerate(old.keys()):
            if key not in new:
                chosen[key] = (old._stamps[i], i)
    for key, frames in new.items():
        if 0 <= key[0] < 1 << 64:
            chosen[key] = (gen, frames)
    if len(chosen) > max_entries:
        # Newest first; among equals, the order they came in (what `old` held first, then `new`).
        newest = sorted(chosen, key=lambda k: chosen[k][0], reverse=True)[:max_entries]
        chosen = {k: chosen[k] for k in newest}
    entries: dict[FrameKey, tuple[int, list[int]]] = {}  # key -> (generation, frame ids)
    renumbered: dict[int, int] = {}  # an old frame id -> its id here (entries share frames)
    for key, (stamp, what) in chosen.items():
        if isinstance(what, int):
            assert old is not None
            old_ids, old_rows = old._checked(what, key)
            s = old._strings
            here = []
            for fid, r in zip_strict(old_ids, old_rows):
                got = renumbered.get(fid)
                if got is None:
                    got = renumbered[fid] = frame_id(s[r[0]], s[r[1]], s[r[2]], r[3], s[r[4]], bool(r[5]))
                here.append(got)
            entries[key] = (stamp, here)
        else:
            entries[key] = (
                stamp,
                [frame_id(f.name, f.module, f.file, f.line, f.kind, f.inlined) for f in what],
            )
    call = array("Q", sorted(a for a, leaf in entries if not leaf))
    leaf = array("Q", sorted(a for a, is_leaf in entries if is_leaf))
    stamps, crcs, lists, ids = array("I"), array("I"), array("I", [0]), array("I")
    by_id = list(rows)
    for keys, is_leaf in ((call, False), (leaf, True)):
        for a in keys:
            stamp, fids = entries[(a, is_leaf)]
            stamps.append(stamp)
            entry_rows = [by_id[f] for f in fids]
            text = (strings.encoded[r[k]] for r in entry_rows for k in (0, 1, 2, 4))
            crcs.append(_entry_crc(a, is_leaf, entry_rows, text))
            ids.extend(fids)
            lists.append(len(ids))
    table = array("I")
    for row in by_id:
        table.extend(row)
    offs, blob = strings.arrays()
    counts = [int(file_lines), gen, len(call), len(leaf), len(ids), len(by_id), len(strings), len(blob)]
    return [_header(KIND_FRAMES, counts), call, leaf, stamps, crcs, lists, ids, table, offs, blob]


def append_frames(old: FrameTable, new: dict[FrameKey, Frames], max_entries: int = 1 << 31) -> Parts | None:
    """`old`'s file with `new`'s keys added, its own entries copied as they are: what a warm run adds
    (a few dozen new addresses) costs in proportion to them, not to the file (`encode_frames` checks
    and re-interns every entry it keeps: ~0.2 s for 6 000). Old strings, frame rows, ids and
    checksums are copied unread (each read still checks its entry's checksum); new frames get new rows
    and strings after them (an equal old one is not looked for: a later full rewrite shares them).
    None when it cannot be done that way: a new key is already there, or the bound would be passed
    (then `encode_frames`, which drops the oldest). `new` is made as `old` was (with or without DWARF)."""
    keys = [k for k in new if 0 <= k[0] < 1 << 64]
    if not keys or len(old) + len(keys) > max_entries or any(k in old for k in keys):
        return None
    gen = min(old.generation + 1, _U32)
    n_strings, n_frames = len(old._strings), len(old._frames) // 6
    strings = _StringBuilder()
    rows: dict[tuple[int, ...], int] = {}  # a new frame's six u32 (string ids after the old ones) -> id

    def frame_id(f: Frame) -> tuple[int, tuple[int, ...]]:
        ids = [n_strings + strings.add(x) for x in (f.name, f.module, f.file)]
        row = (*ids, min(max(f.line, 0), _U32), n_strings + strings.add(f.kind), int(f.inlined))
        i = rows.get(row)
        if i is None:
            i = rows[row] = n_frames + len(rows)
        return i, row

    added: dict[FrameKey, tuple[int, list[int]]] = {}  # key -> (checksum, frame ids)
    for key in keys:
        got = [frame_id(f) for f in new[key]]
        text = (strings.encoded[r[k] - n_strings] for _, r in got for k in (0, 1, 2, 4))
        added[key] = (_entry_crc(key[0], key[1], [r for _, r in got], text), [i for i, _ in got])
    n_call = len(old._call)
    out_keys: list[array[int]] = []
    stamps, crcs, lists, ids = array("I"), array("I"), array("I", [0]), array("I")
    try:
        for leaf, old_keys, base in ((False, old._call, 0), (True, old._leaf, n_call)):
            merged = array("Q")
            pos = 0  # entries of old_keys copied so far
            for addr in sorted(a for a, is_leaf in added if is_leaf == leaf):
                at = bisect_left(old_keys, addr)
                _copy_entries(old, base + pos, base + at, merged, old_keys[pos:at], stamps, crcs, lists, ids)
                crc, fids = added[(addr, leaf)]
                merged.append(addr)
                stamps.append(gen)
                crcs.append(crc)
                ids.extend(fids)
                lists.append(len(ids))
                pos = at
            end = len(old_keys)
            _copy_entries(old, base + pos, base + end, merged, old_keys[pos:end], stamps, crcs, lists, ids)
            out_keys.append(merged)
    except (OverflowError, ValueError, IndexError):  # damaged offsets: a full rewrite finds which
        return None
    table, offs = array("I"), array("I")
    table.frombytes(old._frames.cast("B"))
    for row in rows:
        table.extend(row)
    offs.frombytes(old._strings.offs.cast("B"))
    old_blob = len(old._strings.blob)
    new_offs, new_blob = strings.arrays()
    offs.extend(old_blob + o for o in new_offs[1:])
    counts = [
        int(old.file_lines), gen, len(out_keys[0]), len(out_keys[1]), len(ids), len(table) // 6,
        len(offs) - 1, old_blob + len(new_blob),
    ]  # fmt: skip
    return [
        _header(KIND_FRAMES, counts), *out_keys, stamps, crcs, lists, ids, table, offs,
        bytes(old._strings.blob), new_blob,
    ]  # fmt: skip


def _copy_entries(
    old: FrameTable,
    start: int,
    end: int,
    merged: array[int],
    keys: memoryview,
    stamps: array[int],
    crcs: array[int],
    lists: array[int],
    ids: array[int],
) -> None:
    """`old`'s entries start..end (their keys: `keys`) appended as they are, their frame ids moved
    to where `ids` ends. Raises ValueError or OverflowError on offsets no file of ours has."""
    if start == end:
        return
    first, last = old._lists[start], old._lists[end]
    if not first <= last <= len(old._ids):
        raise ValueError(f"entries {start}-{end}'s frames at {first}-{last}")
    shift = len(ids) - first
    merged.frombytes(keys.cast("B"))  # frombytes takes bytes, not a typed view
    stamps.frombytes(old._stamps[start:end].cast("B"))
    crcs.frombytes(old._crcs[start:end].cast("B"))
    ids.frombytes(old._ids[first:last].cast("B"))
    lists.extend([x + shift for x in old._lists[start + 1 : end + 1]])


# --- kernel symbols ---------------------------------------------------------------------------


class KallsymsTable:
    """The kernel's text symbols of one boot, read in place; answers as `KallsymsIndex` does."""

    __slots__ = (
        "_addrs",
        "_buf",
        "_crcs",
        "_ends",
        "_map",
        "_mod",
        "_modules",
        "_names",
        "damaged",
        "text_addr",
    )

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self._map = data
        self._buf = memoryview(data)
        text_addr, n, n_modules, names_bytes, modules_bytes, *_ = _counts(self._buf, KIND_KALLSYMS)
        sizes: list[tuple[_Code, int]] = [
            ("Q", n),  # start
            ("Q", n),  # end (exclusive)
            ("I", n),  # checksum
            ("I", n + 1),  # name offsets
            ("H", n),  # module id
            ("B", 2 * n % 4),  # padding
            ("I", n_modules + 1),
            ("B", names_bytes),
            ("B", modules_bytes),
        ]
        self._addrs, self._ends, self._crcs, name_offs, self._mod, pad, mod_offs, names, modules = _sections(
            self._buf, sizes
        )
        pad.release()
        self._names = _Strings(name_offs, names)
        self._modules = _Strings(mod_offs, modules)
        self.text_addr = text_addr
        self.damaged = False

    def close(self) -> None:
        for v in (self._addrs, self._ends, self._crcs, self._mod):
            v.release()
        self._names.release()
        self._modules.release()
        self._buf.release()
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __len__(self) -> int:
        return len(self._addrs)

    def _symbol(self, i: int) -> tuple[int, int, str, str]:
        start, end, mod = self._addrs[i], self._ends[i], self._mod[i]
        name, module = self._names.raw(i), self._modules.raw(mod)
        if zlib.crc32(name + b"\0" + module, zlib.crc32(_SYM.pack(start, end, mod))) != self._crcs[i]:
            raise CorruptFile(f"symbol {i}'s checksum")
        return start, end, self._names[i], self._modules[mod]

    def lookup(self, ip: int) -> tuple[str, str, int] | None:
        """(name, module, offset) of a runtime address; module "" is vmlinux. None also when the
        symbol read is damaged (then `damaged` is set): the resolver takes this for its index."""
        if not 0 <= ip < 1 << 64:
            return None
        i = bisect_right(self._addrs, ip) - 1
        if i < 0 or ip >= self._ends[i]:
            return None
        try:
            start, _end, name, module = self._symbol(i)
        except CorruptFile:
            self.damaged = True
            return None
        return name, module, ip - start

    def address_of(self, name: str) -> int | None:
        want = name.encode()
        blob, offs = bytes(self._names.blob), self._names.offs  # a few MB, once: a rare question
        pos = blob.find(want)
        while pos >= 0:
            i = bisect_left(offs, pos)
            if i < len(self._addrs) and offs[i] == pos and offs[i + 1] == pos + len(want):
                return self._symbol(i)[0]
            pos = blob.find(want, pos + 1)
        return None


def encode_kallsyms(rows: Iterable[tuple[int, int, str, str]], text_addr: int) -> Parts:
    """A kallsyms file of (start, end, name, module) rows in address order."""
    addrs, ends, crcs, name_offs, mods = array("Q"), array("Q"), array("I"), array("I", [0]), array("H")
    names = bytearray()
    modules = _StringBuilder()
    modules.add("")
    for start, end, name, module in rows:
        mod = modules.add(module)
        raw = name.encode("utf-8", "surrogateescape")
        addrs.append(start)
        ends.append(end)
        crcs.append(zlib.crc32(raw + b"\0" + modules.encoded[mod], zlib.crc32(_SYM.pack(start, end, mod))))
        names += raw
        name_offs.append(len(names))
        mods.append(mod)
    mod_offs, mod_blob = modules.arrays()
    n = len(addrs)
    counts = [text_addr, n, len(modules), len(names), len(mod_blob)]
    pad = bytes(2 * n % 4)
    return [
        _header(KIND_KALLSYMS, counts),
        addrs,
        ends,
        crcs,
        name_offs,
        mods,
        pad,
        mod_offs,
        names,
        mod_blob,
    ]


# --- a binary's function symbols ----------------------------------------------------------------


class SymbolTable:
    """The function symbols of one binary, read in place: named as the resolver names the binary's
    addresses that no DWARF describes (`elf.SymbolIndex.lookup`, `elf.offset_to_vaddr`), and given
    to the resolver in place of the binary's symbol table for those DWARF describes (the same
    `lookup`). Lookups raise `CorruptFile` when the symbol they read is damaged."""

    source = "cache"  # as SymbolIndex.source: where the names came from

    __slots__ = ("_buf", "_crcs", "_ends", "_map", "_names", "_starts", "described", "label", "segments")

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self._map = data
        self._buf = memoryview(data)
        n, n_segments, names_bytes, label_bytes, meta_crc, n_described, *_ = _counts(self._buf, KIND_SYMBOLS)
        sizes: list[tuple[_Code, int]] = [
            ("Q", n),  # start (virtual address)
            ("Q", n),  # end (exclusive)
            ("I", n),  # checksum
            ("I", n + 1),  # name offsets
            ("Q", 3 * n_segments),  # PT_LOAD: offset, file size, virtual address
            ("B", names_bytes),
            ("B", label_bytes),
            ("Q", 2 * n_described),  # [start, end) described by DWARF, sorted, disjoint
        ]
        sections = _sections(self._buf, sizes)
        self._starts, self._ends, self._crcs, name_offs, segments, names, label, described = sections
        if zlib.crc32(described, zlib.crc32(label, zlib.crc32(segments))) != meta_crc:
            raise CorruptFile("segments checksum")
        self.segments = [tuple(segments[i : i + 3]) for i in range(0, len(segments), 3)]
        # Few (node: ~110): a list, bisected by start.
        self.described = [(described[i], described[i + 1]) for i in range(0, len(described), 2)]
        described.release()
        self.label = bytes(label).decode("utf-8", "surrogateescape")
        self._names = _Strings(name_offs, names)
        segments.release()
        label.release()

    def close(self) -> None:
        for v in (self._starts, self._ends, self._crcs):
            v.release()
        self._names.release()
        self._buf.release()
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        """The memory it holds, about (as SymbolIndex.nbytes): the file is mapped, not read."""
        return 200

    def items(self) -> Iterator[tuple[int, int, str]]:
        """(start, end, name) of every symbol, in address order."""
        for i in range(len(self._starts)):
            yield self._starts[i], self._ends[i], self._name(i)

    def vaddr(self, offset: int) -> int | None:
        """The virtual address of a file offset, None outside every PT_LOAD segment."""
        for seg_offset, filesz, vaddr in self.segments:
            if seg_offset <= offset < seg_offset + filesz:
                return offset - seg_offset + vaddr
        return None

    def _name(self, i: int) -> str:
        start, end, name = self._starts[i], self._ends[i], self._names.raw(i)
        if zlib.crc32(name, zlib.crc32(_SYM.pack(start, end, 0))) != self._crcs[i]:
            raise CorruptFile(f"symbol {i}'s checksum")
        return self._names[i]

    def has_dwarf(self, vaddr: int) -> bool:
        """Whether DWARF describes `vaddr` (llvm-symbolizer may add file:line and inlines)."""
        i = bisect_right(self.described, (vaddr, 1 << 64)) - 1
        return i >= 0 and vaddr < self.described[i][1]

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset in it) of the function holding `vaddr`, None outside every function."""
        if not 0 <= vaddr < 1 << 64:
            return None
        i = bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        if vaddr < self._ends[i]:
            return self._name(i), vaddr - self._starts[i]
        # A function can enclose a smaller symbol that starts inside it.
        if i > 0 and self._starts[i - 1] <= vaddr < self._ends[i - 1]:
            return self._name(i - 1), vaddr - self._starts[i - 1]
        return None


def encode_symbols(
    rows: Iterable[tuple[int, int, str]],
    segments: Iterable[tuple[int, int, int]],
    label: str,
    described: Iterable[tuple[int, int]] = (),
) -> Parts:
    """A symbols file of (start, end, name) rows in address order, the (offset, file size, virtual
    address) of each PT_LOAD segment, the binary's display name and the sorted, disjoint [start,
    end) ranges its DWARF describes."""
    starts, ends, crcs, name_offs = array("Q"), array("Q"), array("I"), array("I", [0])
    names = bytearray()
    for start, end, name in rows:
        raw = name.encode("utf-8", "surrogateescape")
        starts.append(start)
        ends.append(end)
        crcs.append(zlib.crc32(raw, zlib.crc32(_SYM.pack(start, end, 0))))
        names += raw
        name_offs.append(len(names))
    segs = array("Q", [v for seg in segments for v in seg])
    label_raw = label.encode("utf-8", "surrogateescape")
    dwarf = array("Q", [v for r in described for v in r])
    # Without ranges, the same checksum as before they were added: older files stay readable.
    meta_crc = zlib.crc32(dwarf, zlib.crc32(label_raw, zlib.crc32(segs.tobytes())))
    counts = [len(starts), len(segs) // 3, len(names), len(label_raw), meta_crc, len(dwarf) // 2]
    return [_header(KIND_SYMBOLS, counts), starts, ends, crcs, name_offs, segs, names, label_raw, dwarf]

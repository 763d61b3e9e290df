"""Kernel symbols from `/proc/kallsyms` snapshots, one per kernel build id.

The agent uploads its `/proc/kallsyms` once per kernel build id; the snapshot
is kept gzip'd under `<state>/kernels/<build_id>.kallsyms.gz` and parsed lazily
into a `KallsymsIndex` (an LRU keeps a few in memory). kallsyms has no sizes,
so an address takes the closest symbol below it, except after a section end
label (`_etext`, `__*_end`) or too far from any symbol.

A snapshot's addresses are those of the boot that wrote it. A session from
another boot of the same kernel (another KASLR slide) is corrected with the
runtime `_text` it carries; module addresses cannot be corrected that way and
resolve only when `_text` matches.

Snapshots are uploaded by anyone holding the write token, so every size is
bounded (the limits below, quoted by docs/api.md): the gzip is decompressed in
slices and parsed slice by slice, never whole.
"""

from __future__ import annotations

import bisect
import gzip
import heapq
import logging
import os
import re
import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import BinaryIO

from .. import atomicfile
from ..errors import BistouriError, GzipError, GzipTooLarge
from ..sha import sha256
from ..wire.snapshot import LoadedCodeDigest
from . import tempfiles
from .gunzip import GZIP_MAGIC, inflate
from .sources import check_build_id

log = logging.getLogger(__name__)

MAX_UPLOAD_BYTES = 16 << 20  # gzip'd, as uploaded; a distro kernel's is ~2 MB
MAX_SNAPSHOT_BYTES = 32 << 20  # uncompressed; a distro kernel with modules is ~15 MB
MAX_SYMBOLS = 500_000  # text symbols (lines of type t, T, w, W); a distro kernel has ~150 000
MAX_SYMBOL_NAME = 512  # the kernel's KSYM_NAME_LEN
MAX_LOADED_BYTES = 64 << 20  # parsed snapshots kept in memory per process (a distro kernel's: ~6 MB)
DEFAULT_LOADED = 64  # snapshots kept parsed: one per boot of a host, most share their kernel part
_SLICE_BYTES = 1 << 20  # decompressed and parsed at a time
_MAX_LINE = MAX_SYMBOL_NAME + 256  # address, type and module around a name
MAX_SYMBOL_SPAN = 1 << 20  # no kernel function is this long: past it the address is unknown
_CORE_LABELS = frozenset(("_text", "_stext", "_etext", "_sinittext", "_einittext"))


_KEY_RE = re.compile(r"[0-9a-f]{2,128}(-[0-9a-f]{32})?")


def kernel_key(build_id: bytes | str, boot_id: bytes = b"") -> str:
    """The name of a kallsyms snapshot: the kernel's build id in hex, and `-<boot id>` when the session
    says which boot it comes from (module and BPF program addresses are per boot)."""
    hexid = check_build_id(build_id) if build_id else ""
    return f"{hexid}-{boot_id.hex()}" if hexid and len(boot_id) == 16 else hexid


def check_kernel_key(key: bytes | str) -> str:
    """A kernel_key() (or a bare build id); ValueError for anything that could escape a path."""
    k = key.hex() if isinstance(key, bytes) else key.lower()
    if not _KEY_RE.fullmatch(k) or len(k.partition("-")[0]) % 2:
        raise ValueError(f"invalid build id {k[:140]!r} (of a kernel: hex, then -<32 hex> of a boot)")
    return k


class KallsymsError(BistouriError, ValueError):
    """A kallsyms snapshot cannot be used."""


class KallsymsTooLarge(KallsymsError):
    """A kallsyms snapshot is over one of the limits."""


class KallsymsConflict(KallsymsError):
    """A snapshot whose kernel (not its modules) differs from the one already held under its key."""


def _is_label(name: str) -> bool:
    # Section boundaries and `__pi_` position-independent aliases name no function of their own.
    return (
        name in _CORE_LABELS
        or name.startswith("__pi_")
        or (name.startswith("__") and name.endswith(("_start", "_end")))
    )


def _is_end_label(name: str) -> bool:
    return name in ("_etext", "_einittext") or (name.startswith("__") and name.endswith("_end"))


class _Table:
    """Symbols sorted by address, in arrays and one name blob: ~15 bytes and the name per symbol."""

    __slots__ = ("__weakref__", "addrs", "cut", "mods", "name_offs", "names")

    def __init__(self, signed: bool) -> None:
        self.addrs = array("q" if signed else "Q")
        self.name_offs = array("I", [0])  # symbol i's name is names[name_offs[i]:name_offs[i + 1]]
        self.names = bytearray()
        self.cut = bytearray()  # 1 where the symbol is an end label: it covers no address
        self.mods = array("H")  # index into the index's module names (left empty for the core)

    def add(self, addr: int, name: str, mod: int | None) -> None:
        self.addrs.append(addr)
        self.names += name.encode()
        self.name_offs.append(len(self.names))
        self.cut.append(1 if name[0] == "_" and _is_end_label(name) else 0)
        if mod is not None:
            self.mods.append(mod)

    def freeze(self) -> None:
        self.names = bytes(self.names)  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        arrays = (self.addrs, self.name_offs, self.mods)
        return sum(a.itemsize * len(a) for a in arrays) + len(self.names) + len(self.cut) + 200

    def name(self, i: int) -> str:
        return bytes(self.names[self.name_offs[i] : self.name_offs[i + 1]]).decode("utf-8", "replace")

    def digest(self) -> bytes:
        h = sha256()
        for part in (self.addrs.tobytes(), self.name_offs.tobytes(), bytes(self.names), bytes(self.cut)):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()


# The kernel's own symbols relative to _text, one object per distinct content in the process: every boot
# of one kernel build (KASLR moves _text, not the layout after it) shares them.
_CORES: weakref.WeakValueDictionary[bytes, _Table] = weakref.WeakValueDictionary()
_CORES_LOCK = threading.Lock()


def _shared_core(table: _Table) -> _Table:
    key = table.digest()
    with _CORES_LOCK:
        got = _CORES.get(key)
        if got is None:
            _CORES[key] = got = table
        return got


class KallsymsIndex:
    """Text symbols of one boot, sorted by address.

    The kernel's own symbols are kept relative to `_text` and shared by every snapshot of the same
    build (other boots, other hosts); those of modules and BPF programs, whose addresses are per boot,
    are the index's own."""

    __slots__ = ("__weakref__", "_base", "_core", "_mods", "_modules", "loaded_code", "text_addr")

    def __init__(
        self,
        core: _Table,
        mods: _Table,
        modules: list[str],
        text_addr: int,
        base: int,
        loaded_code: str = "",
    ) -> None:
        self._core = _shared_core(core)
        self._base = base  # what core addresses are relative to: text_addr when the snapshot has _text
        self._mods = mods
        self._modules = modules
        self.text_addr = text_addr  # runtime _text of the boot that wrote the snapshot
        # The modules and BPF programs it lists (wire/snapshot.py): an agent with others uploads.
        self.loaded_code = loaded_code

    def __len__(self) -> int:
        return len(self._core.addrs) + len(self._mods.addrs)

    @property
    def core_nbytes(self) -> int:
        """Memory of the part shared with other snapshots of the same kernel build, about."""
        return self._core.nbytes

    @property
    def nbytes(self) -> int:
        """Memory of the part of its own, about."""
        return self._mods.nbytes + 8 * len(self._modules) + 300

    @property
    def core_id(self) -> int:
        return id(self._core)

    @property
    def core_key(self) -> tuple[int, int]:
        """What names the kernel itself (its symbols outside modules and BPF programs, and where _text
        is): the same for two snapshots of one boot whatever was loaded between them. Cores are
        interned by content, so while both indexes live, equal cores are one object."""
        return id(self._core), self._base

    def lookup(self, ip: int) -> tuple[str, str, int] | None:
        """(name, module, offset) for a runtime address of this boot; module "" is vmlinux."""
        core, mods, text = self._core, self._mods, self._base
        i = bisect.bisect_right(core.addrs, ip - text) - 1
        j = bisect.bisect_right(mods.addrs, ip) - 1
        c_start = core.addrs[i] + text if i >= 0 else -1
        m_start = mods.addrs[j] if j >= 0 else -1
        if c_start < 0 and m_start < 0:
            return None
        # The closest symbol below ip of either table; it ends at the next symbol of either.
        c_next = core.addrs[i + 1] + text if i + 1 < len(core.addrs) else 1 << 64
        m_next = mods.addrs[j + 1] if j + 1 < len(mods.addrs) else 1 << 64
        if c_start >= m_start:
            table, k, start = core, i, c_start
        else:
            table, k, start = mods, j, m_start
        end = start if table.cut[k] else min(c_next, m_next, start + MAX_SYMBOL_SPAN)
        if ip >= end:
            return None
        module = self._modules[mods.mods[k]] if table is mods else ""
        return table.name(k), module, ip - start

    def rows(self) -> Iterator[tuple[int, int, str, str]]:
        """(address, end, name, module) of every symbol, in address order; streamed (both tables are
        sorted), so that copying an index costs no list of all its symbols."""
        core, mods, text = self._core, self._mods, self._base
        starts = heapq.merge(
            ((core.addrs[i] + text, 0, i) for i in range(len(core.addrs))),
            ((mods.addrs[j], 1, j) for j in range(len(mods.addrs))),
        )
        cur = next(starts, None)
        while cur is not None:
            start, which, k = cur
            cur = next(starts, None)
            table = mods if which else core
            nxt = cur[0] if cur is not None else (1 << 64) - 1
            end = start if table.cut[k] else min(nxt, start + MAX_SYMBOL_SPAN, (1 << 64) - 1)
            yield start, end, table.name(k), self._modules[mods.mods[k]] if which else ""

    def address_of(self, name: str) -> int | None:
        want = name.encode()
        for table, base in ((self._core, self._base), (self._mods, 0)):
            names, offs = table.names, table.name_offs
            pos = names.find(want)
            while pos >= 0:
                i = bisect.bisect_left(offs, pos)
                if i < len(offs) - 1 and offs[i] == pos and offs[i + 1] == pos + len(want):
                    return table.addrs[i] + base
                pos = names.find(want, pos + 1)
        return None


_LINE = re.compile(rb"^([0-9a-fA-F]+) ([tTwW]) (\S+)(?:[ \t]+\[([^\]\n]+)\])?[ \t]*$", re.M)
_ZERO_ADDR = re.compile(rb"^0+ [tTwW] ", re.M)


def parse_kallsyms(data: bytes, max_bytes: int = MAX_SNAPSHOT_BYTES) -> KallsymsIndex:
    """Parse `/proc/kallsyms` text, or its gzip: `addr type name [module]` per line, text symbols only."""
    return _parse(_slices(data, max_bytes))


def _slices(data: bytes, limit: int) -> Iterator[bytes]:
    """The snapshot in slices of whole lines, decompressed as it goes; at most `limit` bytes in all."""
    if data[:2] != GZIP_MAGIC:
        if len(data) > limit:
            raise KallsymsTooLarge(f"the snapshot is larger than {limit} bytes")
        for start in range(0, len(data), _SLICE_BYTES):
            yield data[start : start + _SLICE_BYTES]  # a line cut in two is joined again by _parse
        return
    try:
        yield from inflate((data,), limit, _SLICE_BYTES)
    except GzipTooLarge:
        raise KallsymsTooLarge(f"the snapshot is larger than {limit} bytes uncompressed") from None
    except GzipError as e:
        raise KallsymsError(f"the snapshot {e}") from None


def kallsyms_rows(
    path: str, max_bytes: int = MAX_SNAPSHOT_BYTES
) -> tuple[int, Iterator[tuple[int, int, str, str]]]:
    """`_text` and the (address, end, name, module) rows of a kallsyms file (/proc/kallsyms), as
    `KallsymsIndex.rows` gives them, without making the index: the file is read in slices and
    the sort keys are freed as the rows are made (record copies them to its cache)."""
    with open(path, "rb") as f:
        parsed = _Parsed(_file_slices(f, max_bytes))

    def rows() -> Iterator[tuple[int, int, str, str]]:
        symbols = parsed.symbols()
        cur = next(symbols, None)
        while cur is not None:
            addr, name, module = cur
            cur = next(symbols, None)
            nxt = cur[0] if cur is not None else (1 << 64) - 1
            cut = name[0] == "_" and _is_end_label(name)
            yield addr, addr if cut else min(nxt, addr + MAX_SYMBOL_SPAN, (1 << 64) - 1), name, module

    return parsed.text_addr, rows()


def _file_slices(f: BinaryIO, limit: int) -> Iterator[bytes]:
    total = 0
    # Smaller than a gzip'd snapshot's slices: each is parsed into ~80 bytes of objects a byte.
    while piece := f.read(_SLICE_BYTES // 4):
        total += len(piece)
        if total > limit:
            raise KallsymsTooLarge(f"the snapshot is larger than {limit} bytes")
        yield piece


class _Parsed:
    """A snapshot's text symbols, parsed; `symbols()` gives them once, in address order.

    Kept in arrays (address, preference at that address, name, module): ~25 bytes and the name a
    symbol, not a Python int sort key each (~45 bytes). /proc/kallsyms is in address order but for
    a few modules' symbols, so the rows are merged from their ascending runs; a snapshot with more
    runs than that is sorted by key instead."""

    MAX_RUNS = 256  # ascending runs merged; past them, one sort (a hostile or shuffled snapshot)

    def __init__(self, slices: Iterator[bytes]) -> None:
        self.addrs = array("Q")
        self.prefs = array("B")  # real names before labels, then global before local: lower first
        self.runs = [0]  # first row of each ascending run of addresses
        self.name_blob = bytearray()
        self.name_offs = array("I", [0])
        self.row_module = array("H")  # index into `modules`
        self.modules: list[str] = [""]
        module_ids: dict[bytes, int] = {b"": 0}  # a few hundred distinct
        self.text_addr = 0
        zero_addresses = False
        self.loaded_code = LoadedCodeDigest()
        addrs, prefs, runs = self.addrs, self.prefs, self.runs
        last = 0
        for piece in _lines(slices):
            self.loaded_code.feed(piece)
            for a, typ, n, m in _LINE.findall(piece):
                addr = int(a, 16)
                if not addr:
                    zero_addresses = True
                    continue
                if len(n) > MAX_SYMBOL_NAME:
                    raise KallsymsError(f"a symbol name is over {MAX_SYMBOL_NAME} bytes: {n[:64]!r}…")
                row = len(addrs)
                if row >= MAX_SYMBOLS:
                    raise KallsymsTooLarge(f"the snapshot has more than {MAX_SYMBOLS} text symbols")
                mod = module_ids.get(m)
                if mod is None:
                    mod = module_ids[m] = len(self.modules)
                    self.modules.append(m.decode("utf-8", "replace"))
                if not m and n == b"_text":
                    self.text_addr = addr
                label = n[:1] == b"_" and _is_label(n.decode("utf-8", "replace"))
                if addr < last:
                    runs.append(row)
                last = addr
                addrs.append(addr)
                prefs.append((2 if label else 0) + (typ in (b"t", b"w")))
                self.name_blob += n
                self.name_offs.append(len(self.name_blob))
                self.row_module.append(mod)
        if not addrs:
            if zero_addresses:
                raise KallsymsError(
                    "the snapshot's text symbols all have address 0: it was read without privileges. "
                    "Read /proc/kallsyms as root (or with CAP_SYSLOG) and kernel.kptr_restrict < 2"
                )
            raise KallsymsError("the snapshot has no text symbols: it is not /proc/kallsyms output")

    def _in_address_order(self) -> Iterator[int]:
        """Every row, by address (rows at one address in any order)."""
        addrs, n = self.addrs, len(self.addrs)
        if len(self.runs) <= self.MAX_RUNS:
            bounds = [*self.runs, n]
            return heapq.merge(*(range(a, b) for a, b in zip(bounds, bounds[1:])), key=addrs.__getitem__)
        return iter(sorted(range(n), key=addrs.__getitem__))

    def symbols(self) -> Iterator[tuple[int, str, str]]:
        """(address, name, module) in address order, one per address: the preferred of the names
        there, the first in the snapshot among equals; module "" is the kernel itself."""
        blob, offs, prefs = self.name_blob, self.name_offs, self.prefs
        addrs = self.addrs
        best, best_addr = -1, -1
        for i in self._in_address_order():
            addr = addrs[i]
            if addr != best_addr:
                if best >= 0:
                    yield best_addr, self._name(best), self.modules[self.row_module[best]]
                best, best_addr = i, addr
            elif (prefs[i], i) < (prefs[best], best):
                best = i
        if best >= 0:
            yield best_addr, self._name(best), self.modules[self.row_module[best]]
        del blob, offs
        self.name_blob = bytearray()
        self.addrs, self.prefs = array("Q"), array("B")

    def _name(self, i: int) -> str:
        return self.name_blob[self.name_offs[i] : self.name_offs[i + 1]].decode("utf-8", "replace")


def _parse(slices: Iterator[bytes]) -> KallsymsIndex:
    parsed = _Parsed(slices)
    core = _Table(signed=True)
    mods = _Table(signed=False)
    mod_index: dict[str, int] = {}
    base = parsed.text_addr  # core addresses are kept relative to _text (to the lowest without one)
    for addr, name, module in parsed.symbols():
        if module:
            mods.add(addr, name, mod_index.setdefault(module, len(mod_index)))
        else:
            base = base or addr
            core.add(addr - base, name, None)
    core.freeze()
    mods.freeze()
    return KallsymsIndex(core, mods, list(mod_index), parsed.text_addr, base, parsed.loaded_code.hexdigest())


def _lines(slices: Iterator[bytes]) -> Iterator[bytes]:
    """Slices cut after their last line break: no line is split between two.

    A line too long to be a symbol's is dropped whole, so that reading on to the size limit needs no more
    memory than a slice.
    """
    carry = b""
    skipping = False
    for piece in slices:
        if skipping:
            nl = piece.find(b"\n")
            if nl < 0:
                continue
            piece = piece[nl + 1 :]
            skipping = False
        piece = carry + piece
        cut = piece.rfind(b"\n") + 1
        carry = piece[cut:]
        if len(carry) > _MAX_LINE:
            carry = b""
            skipping = True
        if cut:
            yield piece[:cut]
    if carry:
        yield carry


class KallsymsStore:
    """kallsyms snapshots on disk by kernel build id, parsed on demand. Thread-safe."""

    def __init__(
        self, state_dir: str, *, max_loaded: int = DEFAULT_LOADED, max_bytes: int = MAX_SNAPSHOT_BYTES
    ) -> None:
        self.dir = os.path.join(state_dir, "kernels")
        os.makedirs(self.dir, exist_ok=True)
        self.max_loaded = max(1, max_loaded)
        self.max_bytes = max_bytes
        self._loaded: OrderedDict[str, KallsymsIndex] = OrderedDict()
        # (inode, mtime) of each loaded snapshot's file: another worker may have replaced it since.
        self._mtimes: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._put_lock = threading.Lock()
        self.sweep()

    def path(self, build_id: bytes | str) -> str:
        return os.path.join(self.dir, check_kernel_key(build_id) + ".kallsyms.gz")

    def has(self, build_id: bytes | str) -> bool:
        return os.path.isfile(self.path(build_id))

    def sweep(self) -> int:
        """Remove temporary files of workers that died while writing a snapshot."""
        return tempfiles.sweep(self.dir)

    def put(self, build_id: bytes | str, data: bytes) -> KallsymsIndex:
        """Validate and store a snapshot (plain text or gzip) under a kernel_key(). Raises KallsymsError if
        unusable.

        Write-once for the kernel itself: a later snapshot of the same key replaces the held one only when
        their kernel's own symbols (no module, no BPF program) are the same, i.e. when only the loaded
        modules and programs changed (an agent restarted on the same boot); else KallsymsConflict. The same
        bytes again change nothing.
        """
        hexid = check_kernel_key(build_id)
        if len(data) > MAX_UPLOAD_BYTES:
            raise KallsymsTooLarge(f"the upload is larger than {MAX_UPLOAD_BYTES} bytes")
        index = parse_kallsyms(data, self.max_bytes)
        stored = data if data[:2] == b"\x1f\x8b" else gzip.compress(data, 6, mtime=0)
        with self._put_lock:
            held = self._held_bytes(hexid)
            if held is not None:
                if held == stored:
                    return index
                try:
                    old = parse_kallsyms(held, self.max_bytes)
                except KallsymsError:
                    old = None  # unreadable: replaced by a good one
                if old is not None and old.core_key != index.core_key:
                    raise KallsymsConflict(
                        f"a snapshot of another kernel is held for {hexid}: only its modules may change"
                    )
            self._write(hexid, stored)
        self._remember(hexid, index, self._mtime(hexid))
        log.info("Stored a kallsyms snapshot. build_id=%s symbols=%d", hexid, len(index))
        return index

    def _held_bytes(self, hexid: str) -> bytes | None:
        try:
            with open(self.path(hexid), "rb") as f:
                return f.read(MAX_UPLOAD_BYTES + 1)
        except FileNotFoundError:
            return None

    def _write(self, hexid: str, stored: bytes) -> None:
        # Not synced: the agent uploads it again when the symbolizer lacks it.
        atomicfile.write(
            self.path(hexid), stored
        )  # a gzip upload was checked whole by the parser: kept as it came

    def get(self, build_id: bytes | str) -> KallsymsIndex | None:
        """The parsed snapshot of this kernel, or None if none was uploaded (or it is unreadable)."""
        hexid = check_kernel_key(build_id)
        mtime = self._mtime(hexid)
        with self._lock:
            index = self._loaded.get(hexid)
            if index is not None and self._mtimes.get(hexid) == mtime:
                self._loaded.move_to_end(hexid)
                return index
        with self._load_lock:
            with self._lock:
                index = self._loaded.get(hexid)
            if index is not None and self._mtimes.get(hexid) == mtime:
                return index
            path = self.path(hexid)
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_UPLOAD_BYTES + 1)
                index = parse_kallsyms(data, self.max_bytes)
            except FileNotFoundError:
                return None
            except (OSError, EOFError, KallsymsError) as e:
                log.warning(
                    "Unreadable kallsyms snapshot; kernel frames stay unnamed. path=%s error=%s", path, e
                )
                return None
            self._remember(hexid, index, mtime)
            return index

    def _mtime(self, hexid: str) -> tuple[int, int]:
        try:
            st = os.stat(self.path(hexid))
        except OSError:
            return (0, 0)
        return (st.st_ino, st.st_mtime_ns)

    def remove(self, build_id: bytes | str) -> None:
        """Forget a snapshot (its kernel expired from the database)."""
        hexid = check_kernel_key(build_id)
        with self._lock:
            self._loaded.pop(hexid, None)
            self._mtimes.pop(hexid, None)
        try:
            os.unlink(self.path(hexid))
        except FileNotFoundError:
            pass

    def ids(self) -> list[str]:
        """The build ids of the snapshots on disk."""
        suffix = ".kallsyms.gz"
        return [n[: -len(suffix)] for n in os.listdir(self.dir) if n.endswith(suffix)]

    def _remember(self, hexid: str, index: KallsymsIndex, mtime: tuple[int, int]) -> None:
        with self._lock:
            self._loaded[hexid] = index
            self._mtimes[hexid] = mtime
            self._loaded.move_to_end(hexid)
            # Bounded in bytes too: a few large snapshots weigh as much as many small ones. This is the
            # only strong reference to an index (the resolver keeps weak ones), so dropping one frees it.
            while len(self._loaded) > 1 and (
                len(self._loaded) > self.max_loaded or self.loaded_bytes() > MAX_LOADED_BYTES
            ):
                old, _ = self._loaded.popitem(last=False)
                self._mtimes.pop(old, None)

    def loaded_bytes(self) -> int:
        """Memory of the parsed snapshots kept, about: a kernel build's shared part counted once."""
        cores = {i.core_id: i.core_nbytes for i in self._loaded.values()}
        return sum(cores.values()) + sum(i.nbytes for i in self._loaded.values())

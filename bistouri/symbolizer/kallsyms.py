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
"""

from __future__ import annotations

import bisect
import gzip
import logging
import os
import re
import tempfile
import threading
import zlib
from collections import OrderedDict

from ..errors import BistouriError
from .sources import check_build_id

log = logging.getLogger(__name__)

MAX_SNAPSHOT_BYTES = 64 << 20  # uncompressed; a distro kernel with modules is ~15 MB
DEFAULT_LOADED = 8
MAX_SYMBOL_SPAN = 1 << 20  # no kernel function is this long: past it the address is unknown
_CORE_LABELS = frozenset(("_text", "_stext", "_etext", "_sinittext", "_einittext"))


class KallsymsError(BistouriError, ValueError):
    """A kallsyms snapshot cannot be used."""


def _is_label(name: str) -> bool:
    # Section boundaries and `__pi_` position-independent aliases name no function of their own.
    return (
        name in _CORE_LABELS
        or name.startswith("__pi_")
        or (name.startswith("__") and name.endswith(("_start", "_end")))
    )


def _is_end_label(name: str) -> bool:
    return name in ("_etext", "_einittext") or (name.startswith("__") and name.endswith("_end"))


class KallsymsIndex:
    """Text symbols of one boot, sorted by address."""

    __slots__ = ("_addrs", "_ends", "_modules", "_names", "text_addr")

    def __init__(self, addrs: list[int], names: list[str], modules: list[str], text_addr: int) -> None:
        self._addrs = addrs
        self._names = names
        self._modules = modules
        self.text_addr = text_addr  # runtime _text of the boot that wrote the snapshot
        # Where each symbol stops: the next symbol, a span limit, or at once for end labels.
        n = len(addrs)
        ends = [min(addrs[i + 1], addrs[i] + MAX_SYMBOL_SPAN) for i in range(n - 1)]
        if n:
            ends.append(addrs[-1] + MAX_SYMBOL_SPAN)
        for i, name in enumerate(names):
            if name[0] in "_" and _is_end_label(name):
                ends[i] = addrs[i]
        self._ends = ends

    def __len__(self) -> int:
        return len(self._addrs)

    def lookup(self, ip: int) -> tuple[str, str, int] | None:
        """(name, module, offset) for a runtime address of this boot; module "" is vmlinux."""
        i = bisect.bisect_right(self._addrs, ip) - 1
        if i < 0 or ip >= self._ends[i]:
            return None
        return self._names[i], self._modules[i], ip - self._addrs[i]

    def address_of(self, name: str) -> int | None:
        try:
            return self._addrs[self._names.index(name)]
        except ValueError:
            return None


_LINE = re.compile(rb"^([0-9a-fA-F]+) ([tTwW]) (\S+)(?:[ \t]+\[([^\]\n]+)\])?[ \t]*$", re.M)
_ZERO_ADDR = re.compile(rb"^0+ [tTwW] ", re.M)


def parse_kallsyms(data: bytes) -> KallsymsIndex:
    """Parse `/proc/kallsyms` text: `addr type name [module]` per line, text symbols only."""
    rows = _LINE.findall(data)
    keyed: list[tuple[int, int, int]] = []
    names: list[str] = []
    modules: list[str] = []
    text_addr = 0
    for i, (a, typ, n, m) in enumerate(rows):
        addr = int(a, 16)
        name = n.decode("utf-8", "replace")
        names.append(name)
        modules.append(m.decode("utf-8", "replace") if m else "")
        if not addr:
            continue
        if name == "_text" and not m:
            text_addr = addr
        # Order at one address: real names before labels, then global before local.
        pref = (2 if name[0] == "_" and _is_label(name) else 0) + (typ in (b"t", b"w"))
        keyed.append((addr, pref, i))
    if not keyed:
        if _ZERO_ADDR.search(data):
            raise KallsymsError(
                "the snapshot's text symbols all have address 0: it was read without privileges. "
                "Read /proc/kallsyms as root (or with CAP_SYSLOG) and kernel.kptr_restrict < 2"
            )
        raise KallsymsError("the snapshot has no text symbols: it is not /proc/kallsyms output")
    keyed.sort()
    addrs: list[int] = []
    out_names: list[str] = []
    out_modules: list[str] = []
    last = -1
    for addr, _pref, i in keyed:
        if addr != last:  # later entries at one address are less preferred aliases
            last = addr
            addrs.append(addr)
            out_names.append(names[i])
            out_modules.append(modules[i])
    return KallsymsIndex(addrs, out_names, out_modules, text_addr)


def _decompress(data: bytes, limit: int) -> bytes:
    if data[:2] != b"\x1f\x8b":
        return data
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise KallsymsError(f"the snapshot is not valid gzip: {e}")
    if len(out) > limit:
        raise KallsymsError(f"the snapshot is larger than {limit} bytes uncompressed")
    return out


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
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    def path(self, build_id: bytes | str) -> str:
        return os.path.join(self.dir, check_build_id(build_id) + ".kallsyms.gz")

    def has(self, build_id: bytes | str) -> bool:
        return os.path.isfile(self.path(build_id))

    def put(self, build_id: bytes | str, data: bytes) -> KallsymsIndex:
        """Validate and store a snapshot (plain text or gzip). Raises KallsymsError if unusable."""
        hexid = check_build_id(build_id)
        raw = _decompress(data, self.max_bytes)
        if len(raw) > self.max_bytes:
            raise KallsymsError(f"the snapshot is larger than {self.max_bytes} bytes")
        index = parse_kallsyms(raw)
        fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=self.dir)
        try:
            with (
                os.fdopen(fd, "wb") as f,
                gzip.GzipFile(fileobj=f, mode="wb", compresslevel=6, mtime=0) as gz,
            ):
                gz.write(raw)
            os.replace(tmp, self.path(hexid))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._remember(hexid, index)
        log.info("Stored a kallsyms snapshot. build_id=%s symbols=%d", hexid, len(index))
        return index

    def get(self, build_id: bytes | str) -> KallsymsIndex | None:
        """The parsed snapshot of this kernel, or None if none was uploaded (or it is unreadable)."""
        hexid = check_build_id(build_id)
        with self._lock:
            index = self._loaded.get(hexid)
            if index is not None:
                self._loaded.move_to_end(hexid)
                return index
        with self._load_lock:
            with self._lock:
                index = self._loaded.get(hexid)
            if index is not None:
                return index
            path = self.path(hexid)
            try:
                with gzip.open(path, "rb") as f:
                    raw = f.read(self.max_bytes + 1)
                index = parse_kallsyms(raw[: self.max_bytes])
            except FileNotFoundError:
                return None
            except (OSError, EOFError, KallsymsError) as e:
                log.warning(
                    "Unreadable kallsyms snapshot; kernel frames stay unnamed. path=%s error=%s", path, e
                )
                return None
            self._remember(hexid, index)
            return index

    def _remember(self, hexid: str, index: KallsymsIndex) -> None:
        with self._lock:
            self._loaded[hexid] = index
            self._loaded.move_to_end(hexid)
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)

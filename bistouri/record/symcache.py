"""What `bistouri record` has named before, kept on disk: a persistent, bounded symbol cache.

Naming costs more than capturing: parsing /proc/kallsyms in Python takes ~0.4 s, and a
binary with DWARF has its compile units read (symbolizer/dwarf.py; llvm-symbolizer for what
that reader leaves). A rerun on the same binaries asks the same questions, so the answers
are kept:

- `<build id>.frames`: the frames of every (file offset, leaf?) of one binary resolved so
  far (a binary is its build id: same id, same bytes);
- `<build id>.symbols`: the function symbols of a binary, with the ranges its DWARF describes
  (none for a binary without DWARF; `symbolizer.dwarf.covered_ranges`), so that its new
  addresses outside them are named without reading DWARF (node: a few C files of it);
- `<build id>-<size>-<offset>.lines` and `<build id>-<size>-u<offset>.outer`: one compile
  unit's line rows, as the DWARF reader ran them, and the ranges of its outermost subroutines
  (linefile.py), so that a unit met again by a later run's new addresses is neither run nor
  walked from its first DIE again;
- `<build id>-<size>-<section>.inflated`: a compressed debug section (libc6-dbg's) as the reader
  inflated it (linefile.py), so that a later run's new address there does not inflate it again;
- `k-<boot key>.frames` and `k-<boot key>.kallsyms`: the same for kernel addresses, and the
  kernel's text symbols. Kernel addresses hold for one boot (KASLR slide, loaded modules),
  so the key hashes the kernel build id, the boot id and the modules.

The files are read in place (their format: symfile.py): a run looks up the addresses it
sampled and reads nothing else, whatever the cache holds. Only the misses go to the
resolver (`symbolize`), one probe stack per distinct missing address, and their answers
are added to the cache. A fully cached run imports no part of the resolver.

Safety: the directory is created 0700 and refused when it is a symlink or not ours; files
are opened with O_NOFOLLOW and replaced whole (atomicfile), so readers see whole files;
writers merge under an flock. A file that is not what symfile wrote (truncated, damaged,
an older format) is removed and rebuilt. The directory is bounded in bytes: the least
recently used files go first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from .. import atomicfile
from ..compat import SLOTS, zip_strict
from ..errors import BistouriError
from ..sha import sha256
from . import symfile
from .symfile import CorruptFile, FrameKey, Frames, FrameTable, KallsymsTable, Parts, SymbolTable

if TYPE_CHECKING:  # imported when needed: a fully cached run loads none of the resolver
    from .. import wire
    from ..symbolizer.dwarflines import LineTable
    from ..symbolizer.kallsyms import KallsymsIndex
    from ..symbolizer.model import Profile
    from ..symbolizer.resolve import Resolver
    from ..symbolizer.stacks import SessionStacks

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_MAX_BYTES = 64 << 20
MAX_FILE_BYTES = 32 << 20  # one binary's frames or one kernel's symbols; larger files are not read
MAX_FRAMES_PER_FILE = 200_000  # (address, leaf) entries kept per binary


# (file_lines, known_symbols) -> a Resolver: file_lines False when only the kernel and binaries
# without DWARF miss; known_symbols gives it a binary's cached symbols (Resolver.known_symbols).
# (Optional, not `| None`: an alias is evaluated at import, and Python 3.9 has no `|` between types.)
OpenResolver = Callable[[bool, Callable[[bytes], Optional[SymbolTable]]], "Resolver"]


class CacheUnusable(BistouriError):
    """The cache directory cannot be used safely."""


def kernel_boot_key(build_id: bytes, proc_root: str = "/proc") -> str:
    """What kernel addresses depend on: the kernel, the boot (KASLR) and the loaded modules."""
    h = sha256(build_id)
    for rel in ("sys/kernel/random/boot_id", "modules"):
        try:
            with open(os.path.join(proc_root, rel), "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        if rel == "modules":  # names and load addresses only: the use counts change all the time
            data = b"\n".join(
                b"%s %s" % (f[0], f[-1]) for f in (line.split() for line in data.splitlines()) if f
            )
        h.update(b"\0" + data)
    return "k-" + h.hexdigest()[:32]


def _write_file(path: str, parts: symfile.Parts) -> None:
    """Replace `path` whole with `parts` (a cache: not synced)."""
    with atomicfile.replacing(path) as out:
        for part in parts:
            out.file.write(part)


class SymbolCache:
    """The cache directory. Not thread-safe (record uses it from one thread); safe across processes."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        # A str, not a pathlib.Path: pathlib imports urllib.parse and ipaddress (~3.5 ms of record).
        self.root = os.fspath(root)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._open()

    def _open(self) -> None:
        try:
            parent = os.path.dirname(self.root)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o700)
            st = os.lstat(self.root)
        except OSError as e:
            raise CacheUnusable(f"cannot create the symbol cache {self.root}: {e.strerror}") from e
        if not os.path.isdir(self.root) or os.path.islink(self.root):
            raise CacheUnusable(f"the symbol cache {self.root} is not a directory (a symlink?)")
        if st.st_uid != os.geteuid():
            raise CacheUnusable(f"the symbol cache {self.root} belongs to uid {st.st_uid}, not to us")
        if st.st_mode & 0o022:
            raise CacheUnusable(f"the symbol cache {self.root} is writable by others (mode {st.st_mode:o})")

    # -- files ----------------------------------------------------------------------
    def _path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad cache file name {name!r}")
        return os.path.join(self.root, name)

    def _map(self, name: str) -> Any:
        """The file `name` mapped read-only (bytes when empty), None if absent or over the bound."""
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ELOOP):
                log.warning("Cannot read a symbol cache file. path=%s error=%s", path, e.strerror)
            return None
        try:
            st = os.fstat(fd)
            if st.st_size > MAX_FILE_BYTES or not stat.S_ISREG(st.st_mode):
                self.discard(name, f"{st.st_size} bytes")
                return None
            data = symfile.map_file(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return data

    def discard(self, name: str, why: object) -> None:
        """Remove a file that is not what symfile writes (an older format, damaged)."""
        log.warning("Unusable symbol cache file removed. path=%s error=%s", self._path(name), why)
        with contextlib.suppress(OSError):
            os.unlink(self._path(name))

    def _write(self, name: str, parts: symfile.Parts) -> None:
        size = symfile.size_of(parts)
        if size > MAX_FILE_BYTES:
            log.info("Not caching an oversized symbol file. name=%s bytes=%d", name, size)
            return
        _write_file(self._path(name), parts)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = os.path.join(self.root, ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def evict(self) -> int:
        """Remove the least recently used files until the directory fits `max_bytes`; returns how many."""
        files = []
        for entry in os.scandir(self.root):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith(atomicfile.TEMP_PREFIX) or not entry.name.startswith("."):
                files.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= size
                removed += 1
        return removed

    # -- frames -----------------------------------------------------------------------
    def frames(self, key: str) -> FrameTable | None:
        """The frames file of `key`, open (close it after use), or None."""
        data = self._map(key + ".frames")
        if data is None:
            return None
        try:
            return FrameTable(data)
        except CorruptFile as e:
            self.discard(key + ".frames", e)
            return None

    def add_frames(self, key: str, new: dict[FrameKey, Frames], file_lines: bool) -> None:
        """Merge `new` into the entry of `key` (what another run added meanwhile is kept)."""
        if not new:  # nothing to add: rewriting the file would cost a full re-encoding
            return
        try:
            self._add_frames(key, new, file_lines)
        except OSError as e:  # disk full, a planted link: the cache helps, it must never cost a capture
            log.warning("The symbol cache was not updated. key=%s error=%s", key, e.strerror or e)

    def _add_frames(self, key: str, new: dict[FrameKey, Frames], file_lines: bool) -> None:
        with self._locked():
            old = self.frames(key)
            try:
                # Answers made with DWARF replace names-only ones, never the other way around.
                if old is not None and old.file_lines and not file_lines:
                    return
                parts = None
                if old is not None and old.file_lines == file_lines:  # a warm run's few new answers
                    parts = symfile.append_frames(old, new, MAX_FRAMES_PER_FILE)
                try:
                    if parts is None:
                        parts = symfile.encode_frames(new, file_lines, old, MAX_FRAMES_PER_FILE)
                except CorruptFile as e:
                    self.discard(key + ".frames", e)
                    parts = symfile.encode_frames(new, file_lines, None, MAX_FRAMES_PER_FILE)
            finally:
                if old is not None:
                    old.close()
            self._write(key + ".frames", parts)
            self.evict()

    # -- a binary's symbols (one without DWARF) -------------------------------------------
    def symbols(self, key: str) -> SymbolTable | None:
        data = self._map(key + ".symbols")
        if data is None:
            return None
        try:
            return SymbolTable(data)
        except CorruptFile as e:
            self.discard(key + ".symbols", e)
            return None

    def has_symbols(self, key: str) -> bool:
        """A regular file is there (a planted link is not: writing replaces it)."""
        try:
            return stat.S_ISREG(os.lstat(self._path(key + ".symbols")).st_mode)
        except OSError:
            return False

    def put_symbols(self, key: str, parts: symfile.Parts) -> None:
        try:
            with self._locked():
                self._write(key + ".symbols", parts)
                self.evict()
        except OSError as e:
            log.warning("The symbol cache was not updated. key=%s error=%s", key, e.strerror or e)

    # -- a compile unit's line rows (linefile.py) -------------------------------------
    def line_table(self, name: str) -> LineTable | None:
        """The line table kept in `name` (a `.lines` file), or None. Its arrays keep the file mapped."""
        from .linefile import read_lines

        return self._read_kept(name, read_lines)

    def outer(self, name: str) -> list[tuple[int, int, int, int]] | None:
        """A unit's outermost subroutines kept in `name` (an `.outer` file), or None."""
        from .linefile import read_outer

        return self._read_kept(name, read_outer)

    def put_outer(self, name: str, outer: list[tuple[int, int, int, int]]) -> None:
        from .linefile import encode_outer

        self._put_kept(name, encode_outer, outer)

    def put_line_table(self, name: str, table: LineTable) -> None:
        from .linefile import encode_lines

        self._put_kept(name, encode_lines, table)

    def section(self, name: str) -> memoryview | None:
        """An inflated section kept in `name` (a `.inflated` file), or None; a view of the mapped file."""
        from .linefile import read_section

        return self._read_kept(name, read_section)

    def put_section(self, name: str, data: memoryview) -> None:
        from .linefile import encode_section

        if len(data) < MAX_FILE_BYTES:  # not checksummed to be refused
            self._put_kept(name, encode_section, data)

    def _read_kept(self, name: str, read: Callable[[Any], _T]) -> _T | None:
        data = self._map(name)
        if data is None:
            return None
        try:
            return read(data)
        except CorruptFile as e:
            self.discard(name, e)
            return None

    def _put_kept(self, name: str, encode: Callable[[_T], Parts], value: _T) -> None:
        try:
            parts = encode(value)
        except (OverflowError, ValueError):  # an index past 32 bits: not kept, read again next time
            return
        try:
            with self._locked():
                self._write(name, parts)
                self.evict()
        except OSError as e:
            log.warning("The symbol cache was not updated. name=%s error=%s", name, e.strerror or e)

    # -- kernel symbols -------------------------------------------------------------------
    def kallsyms(self, key: str) -> KallsymsTable | None:
        data = self._map(key + ".kallsyms")
        if data is None:
            return None
        try:
            return KallsymsTable(data)
        except CorruptFile as e:
            self.discard(key + ".kallsyms", e)
            return None

    def put_kallsyms(self, key: str, parts: symfile.Parts) -> bool:
        """False when it could not be written."""
        try:
            with self._locked():
                self._write(key + ".kallsyms", parts)
                self.evict()
            return True
        except OSError as e:
            log.warning("The symbol cache was not updated. key=%s error=%s", key, e.strerror or e)
            return False


class CachedKallsyms:
    """The kallsyms source of record's resolver (in place of the service's `KallsymsStore` of
    uploaded snapshots, same `has`/`get`): this host's kernel only, from the cache when it holds
    this boot's symbols, else read from /proc/kallsyms once and cached."""

    def __init__(self, build_id: bytes, boot_key: str, cache: SymbolCache | None, proc_root: str) -> None:
        self.build_id_hex = build_id.hex()
        self.boot_key = boot_key
        self.cache = cache
        self.proc_root = proc_root
        self._index: KallsymsTable | KallsymsIndex | None = None
        self.failed = False

    def has(self, build_id: bytes | str) -> bool:
        hexid = build_id.hex() if isinstance(build_id, bytes) else build_id
        return bool(hexid) and hexid == self.build_id_hex and not self.failed

    def frames(self, keys: list[FrameKey]) -> dict[FrameKey, Frames] | None:
        """Kernel addresses named from kallsyms alone, as the resolver names them when it has no
        vmlinux with DWARF: without importing the resolver (a rerun's few new kernel addresses
        would cost its imports). None when the symbols are unavailable."""
        from ..symbolizer.demangle import demangle
        from ..symbolizer.model import KIND_KERNEL, Frame

        index = self.get(self.build_id_hex)
        if index is None:
            return None
        out: dict[FrameKey, Frames] = {}
        for ip, leaf in keys:
            hit = index.lookup(ip if leaf else ip - 1)  # a return address points after its call
            if hit is not None:
                frame = Frame(demangle(hit[0]), hit[1] or "vmlinux", kind=KIND_KERNEL)
            else:
                frame = Frame(f"[kernel]+0x{ip:x}", "[kernel]", kind=KIND_KERNEL)  # never cached
            out[(ip, leaf)] = (frame,)
        self.check()
        return out

    def check(self) -> None:
        """Remove the cached symbols if a lookup met a damaged one (its address stayed unnamed)."""
        if isinstance(self._index, KallsymsTable) and self._index.damaged and self.cache is not None:
            self.cache.discard(self.boot_key + ".kallsyms", "a symbol's checksum")

    def get(self, build_id: bytes | str) -> KallsymsTable | KallsymsIndex | None:
        if not self.has(build_id):
            return None
        if self._index is None and self.cache is not None:
            self._index = self.cache.kallsyms(self.boot_key)
        if self._index is None:
            try:
                self._index = self._parse()
            except (OSError, ValueError) as e:
                log.warning("Kernel frames stay unnamed: /proc/kallsyms is unusable. error=%s", e)
                self.failed = True
                return None
        return self._index

    def _parse(self) -> KallsymsTable | KallsymsIndex:
        """This boot's symbols from /proc/kallsyms, put in the cache and read back from it: once
        written, only what lookups touch is in memory (without a cache: the parsed index)."""
        from ..symbolizer import kallsyms

        path = os.path.join(self.proc_root, "kallsyms")
        if self.cache is None:
            with open(path, "rb") as f:
                return kallsyms.parse_kallsyms(f.read())
        text_addr, rows = kallsyms.kallsyms_rows(path)
        parts = symfile.encode_kallsyms(rows, text_addr)
        if self.cache.put_kallsyms(self.boot_key, parts):
            got = self.cache.kallsyms(self.boot_key)
            if got is not None:
                return got
        return KallsymsTable(symfile.joined(parts))


# --- symbolization through the cache ------------------------------------------------------


@dataclass(**SLOTS)
class SymbolizeStats:
    """What a symbolization did: addresses, cache hits, lookups and their cost."""

    addresses: int = 0  # distinct (module, address, leaf?) in the session
    cached: int = 0  # of which answered from the cache
    labels: int = 0  # of which named by what the agent sent (vDSO, JIT, unknown): no lookup
    binaries: int = 0  # modules (build ids, the kernel) with at least one miss
    seconds: float = 0.0  # wall time, set by the caller
    helpers_rss_bytes: int = 0  # peak of the helper processes (llvm-symbolizer), set by the caller


def _frame_keys(stacks: SessionStacks) -> tuple[dict[bytes, set[FrameKey]], set[Any], dict[bytes, str]]:
    """Distinct (offset, leaf?) per build id (b"": kernel addresses), the other user frames
    (vDSO, unknown) with their leaf flag, and the file name the agent sent per build id (the label
    of a file that cannot be found, as the resolver makes it)."""
    from .. import wire

    keys: dict[bytes, set[FrameKey]] = {}
    other: set[tuple[wire.UserFrame, bool]] = set()
    names: dict[bytes, str] = {}
    kernel = keys.setdefault(b"", set())
    for leaf in (True, False):
        for f in stacks.user[leaf].values():
            if f.kind == wire.FRAME_RESOLVED and f.build_id:
                keys.setdefault(f.build_id, set()).add((f.address, leaf))
                if f.name:
                    names.setdefault(f.build_id, f.name)
            else:
                other.add((f, leaf))
        kernel.update((ip, leaf) for ip in stacks.kernel[leaf])
    return keys, other, names


def symbolize(
    session: wire.Session,
    cache: SymbolCache | None,
    open_resolver: OpenResolver,
    kernel_key: str,
    debug_dirs: list[str],
    progress: Callable[[str], None] = lambda _text: None,
    kallsyms: CachedKallsyms | None = None,
) -> tuple[Profile, SymbolizeStats]:
    """Name every frame of `session`: from the cache, else through a resolver opened only if needed
    (`open_resolver(file_lines, known_symbols)`: file_lines False when only kernel addresses miss,
    which kallsyms names without llvm-symbolizer). With `kallsyms` (no vmlinux debug file can be
    found), kernel addresses are named from it directly. The profile is assembled as the resolver's is
    (symbolizer/stacks.py): only the naming differs."""
    from .. import wire
    from ..symbolizer.model import FrameRow
    from ..symbolizer.stacks import ByLeaf, SessionStacks, label
    from ..symbolizer.stacks import Frames as StackFrames

    stacks = SessionStacks(session)
    keys, other_keys, names = _frame_keys(stacks)
    known, stats = _name(
        session, keys, names, cache, open_resolver, kernel_key, debug_dirs, progress, kallsyms
    )
    # The other frames (vDSO, JIT, Python, unknown, files without a build id) are labels: no file to read.
    stats.addresses += len(other_keys)
    stats.labels = len(other_keys)

    # Equal frames become one row object (the assembler indexes frames by id and takes rows,
    # model.FrameRow): the cache's, the resolver's and kallsyms' answers come from separate tables.
    interned: dict[FrameRow, FrameRow] = {}

    def intern(row: FrameRow) -> FrameRow:
        return interned.setdefault(row, row)

    def one(frames: Frames) -> StackFrames:
        return tuple([intern(f.row) for f in frames])

    named = {m: {k: one(known[m][k]) for k in wanted} for m, wanted in keys.items()}
    named_other = {k: (intern(label(k[0])),) for k in other_keys}
    user: ByLeaf = ({}, {})
    kernel: ByLeaf = ({}, {})
    for leaf in (True, False):
        for fid, f in stacks.user[leaf].items():
            if f.kind == wire.FRAME_RESOLVED and f.build_id:
                user[leaf][fid] = named[f.build_id][(f.address, leaf)]
            else:
                user[leaf][fid] = named_other[(f, leaf)]
        kernel[leaf].update((ip, named[b""][(ip, leaf)]) for ip in stacks.kernel[leaf])
    return stacks.profile(user, kernel), stats


def _name(
    session: wire.Session,
    keys: dict[bytes, set[FrameKey]],
    names: dict[bytes, str],
    cache: SymbolCache | None,
    open_resolver: OpenResolver,
    kernel_key: str,
    debug_dirs: list[str],
    progress: Callable[[str], None],
    kallsyms: CachedKallsyms | None,
) -> tuple[dict[bytes, dict[FrameKey, Frames]], SymbolizeStats]:
    """The frames of `keys` per module (b"": the kernel): from the cache, the misses through
    kallsyms or a resolver (then added to the cache)."""
    stats = SymbolizeStats(addresses=sum(map(len, keys.values())))
    known: dict[bytes, dict[FrameKey, Frames]] = {}  # build id (b"": the kernel) -> answers
    missing: dict[bytes, list[FrameKey]] = {}
    names_only: set[bytes] = set()  # binaries known to have no DWARF: llvm-symbolizer has nothing for them
    for module, wanted in keys.items():
        have = known[module] = {}
        table = _usable(cache.frames(_key(module, kernel_key)), module, debug_dirs) if cache else None
        with table or contextlib.nullcontext():
            if table is not None:
                if not table.file_lines:
                    names_only.add(module)
                have.update(_cached(cache, table, _key(module, kernel_key), wanted))
            miss = [k for k in wanted if k not in have]
            stats.cached += len(wanted) - len(miss)
            if miss:
                missing[module] = sorted(_with_neighbours(miss, table) if module else miss)
    # The kernel's misses are named from kallsyms after the binaries' (when no vmlinux with DWARF
    # can be found): llvm-symbolizer has exited by then, so its memory and that of a first read
    # of /proc/kallsyms never add up.
    kernel_miss = missing.pop(b"", None) if kallsyms is not None else None
    if cache is not None:  # named from cached symbols: without DWARF, or where no DWARF describes them
        for module in [m for m in missing if m]:
            dwarf = module not in names_only
            got = _from_symbols(cache, _key(module, kernel_key), missing[module], dwarf)
            if got is None:
                continue
            named, left = got
            log.debug("Named from symbols. module=%s named=%d left=%d", module.hex(), len(named), len(left))
            known[module].update(named)
            cache.add_frames(_key(module, kernel_key), named, dwarf)
            if left:
                missing[module] = left
            else:
                del missing[module]
                stats.binaries += 1
    if missing:
        _through_resolver(
            session, missing, names, names_only, known, cache, open_resolver, kernel_key, progress
        )
        stats.binaries += len(missing)
    if kernel_miss is not None:
        assert kallsyms is not None
        got_kernel = kallsyms.frames(kernel_miss)
        if got_kernel is None:  # no symbols: the resolver labels them
            kernel = {b"": kernel_miss}
            _through_resolver(
                session, kernel, names, names_only, known, cache, open_resolver, kernel_key, progress
            )
        else:
            known[b""].update(got_kernel)
            if cache is not None:
                _remember_kernel(cache, _key(b"", kernel_key), got_kernel)
        stats.binaries += 1
    if cache is not None:
        cache.hits += stats.cached
        cache.misses += stats.addresses - stats.cached
    return known, stats


def _through_resolver(
    session: wire.Session,
    missing: dict[bytes, list[FrameKey]],
    names: dict[bytes, str],
    names_only: set[bytes],
    known: dict[bytes, dict[FrameKey, Frames]],
    cache: SymbolCache | None,
    open_resolver: OpenResolver,
    kernel_key: str,
    progress: Callable[[str], None],
) -> None:
    """Name `missing` (per module, b"": the kernel) through a resolver into `known`, and cache it."""
    todo = sum(map(len, missing.values()))
    progress(f"Symbolizing {todo} addresses not in the cache…")
    opened: list[SymbolTable] = []
    damaged: set[bytes] = set()

    def known_symbols(build_id: bytes) -> SymbolTable | None:
        """A binary's cached symbols for the resolver, when they were cached with its DWARF's
        ranges (so from the files it reads now): a warm run's few addresses in node's libuv need
        not have node's whole symbol table read again."""
        if cache is None or build_id not in missing or build_id in damaged:
            return None
        table = cache.symbols(_key(build_id, kernel_key))
        if table is not None:
            opened.append(table)
            if table.described:
                return table
        return None

    # b"" (the kernel) is named from kallsyms; a binary without DWARF from its symbol table.
    try:
        with open_resolver(any(m and m not in names_only for m in missing), known_symbols) as resolver:
            for n, (module, miss) in enumerate(missing.items(), 1):
                label = module.hex()[:12] if module else "the kernel"
                progress(f"Symbolizing {label} ({n}/{len(missing)} binaries, {len(miss)} addresses)…")
                key = _key(module, kernel_key)
                try:
                    got = _resolve(resolver, session, module, miss, names.get(module, ""))
                except CorruptFile as e:  # its cached symbols: removed, and the binary read again
                    assert cache is not None
                    cache.discard(key + ".symbols", e)
                    damaged.add(module)
                    resolver.forget(module)
                    got = _resolve(resolver, session, module, miss, names.get(module, ""))
                known[module].update(got)
                if cache is not None:
                    _remember(cache, resolver, module, key, got)
    finally:
        for table in opened:
            table.close()


NEIGHBOUR_BYTES = 24  # on each side of a new leaf address
MAX_NEIGHBOURS = 20_000  # extra addresses resolved per binary and run


def _with_neighbours(miss: list[FrameKey], have: FrameTable | None) -> set[FrameKey]:
    """The missing addresses, and the bytes around each missing leaf address.

    A sampled loop lands on neighbouring instructions from one run to the next; resolving the
    bytes around a new leaf once (instruction boundaries are unknown: every byte; llvm answers
    for any byte of an instruction) lets the next runs find them in the cache instead of starting
    the resolver and llvm-symbolizer for a handful of addresses. Call sites (not leaves) are return
    addresses, the same every run: no neighbours."""
    out = set(miss)
    budget = MAX_NEIGHBOURS
    for addr, leaf in miss:
        if not leaf:
            continue
        for near in range(max(0, addr - NEIGHBOUR_BYTES), addr + NEIGHBOUR_BYTES + 1):
            if (near, True) not in out and (have is None or (near, True) not in have) and budget > 0:
                out.add((near, True))
                budget -= 1
    return out


def _key(module: bytes, kernel_key: str) -> str:
    return module.hex() if module else kernel_key


def _from_symbols(
    cache: SymbolCache, key: str, keys: list[FrameKey], dwarf: bool
) -> tuple[dict[FrameKey, Frames], list[FrameKey]] | None:
    """The frames of a binary's `keys` from its cached symbols, as the resolver names them
    (`Resolver._resolve_user`), and the keys left to it: with `dwarf` (the binary has some), those
    its DWARF describes. None when the symbols are not cached (or damaged), or `dwarf` and the
    file has no described ranges (written before they were, or they could not be told)."""
    from ..symbolizer.demangle import demangle
    from ..symbolizer.model import Frame

    table = cache.symbols(key)
    if table is None:
        return None
    out: dict[FrameKey, Frames] = {}
    left: list[FrameKey] = []
    label = table.label
    try:
        if dwarf and not table.described:
            return None
        for off, leaf in keys:
            vaddr = table.vaddr(off if leaf else off - 1) if (leaf or off) else None
            if dwarf and vaddr is not None and table.has_dwarf(vaddr):
                left.append((off, leaf))  # file:line, inlines: llvm-symbolizer's
                continue
            hit = table.lookup(vaddr) if vaddr is not None else None
            frame = Frame(demangle(hit[0]), label) if hit is not None else Frame(f"{label}+0x{off:x}", label)
            out[(off, leaf)] = (frame,)
    except CorruptFile as e:
        cache.discard(key + ".symbols", e)
        return None
    finally:
        table.close()
    return out, left


def _remember(
    cache: SymbolCache, resolver: Resolver, module: bytes, key: str, got: dict[FrameKey, Frames]
) -> None:
    """Cache the answers that will not change: not those of a binary or kernel symbols not found."""
    if module:
        mod = resolver.module(module)
        if mod is not None:
            cache.add_frames(key, got, resolver.gives_lines(mod))
            if mod.go is None and not cache.has_symbols(key):
                # Its next new addresses are named from these, without the resolver, unless DWARF
                # describes them (node: a few C files' worth), or it cannot be told which it does.
                described: list[tuple[int, int]] | None = []
                if mod.dwarf_path:  # no ranges found: every address stays the resolver's
                    from ..symbolizer.dwarf import covered_ranges

                    described = covered_ranges(mod.dwarf_path) or None
                if described is not None:
                    segments = [(seg.offset, seg.filesz, seg.vaddr) for seg in mod.segments]
                    parts = symfile.encode_symbols(mod.symbols.items(), segments, mod.name, described)
                    cache.put_symbols(key, parts)
    else:
        _remember_kernel(cache, key, got)


def _remember_kernel(cache: SymbolCache, key: str, got: dict[FrameKey, Frames]) -> None:
    named = {k: v for k, v in got.items() if not any(f.module == "[kernel]" for f in v)}
    if named:
        cache.add_frames(key, named, False)


def _usable(table: FrameTable | None, module: bytes, debug_dirs: list[str]) -> FrameTable | None:
    """A file made without DWARF is not used when a debug file for the binary has appeared since."""
    if table is None or table.file_lines or not module:
        return table
    hexid = module.hex()
    for d in debug_dirs:
        if os.path.exists(os.path.join(d, ".build-id", hexid[:2], hexid[2:] + ".debug")):
            table.close()
            return None
    return table


def _cached(
    cache: SymbolCache | None, table: FrameTable, key: str, wanted: set[FrameKey]
) -> dict[FrameKey, Frames]:
    """What `table` answers of `wanted` (nothing when it turns out damaged: it is removed)."""
    out = {}
    try:
        for k in wanted:
            got = table.get(k)
            if got is not None:
                out[k] = got
    except CorruptFile as e:
        if cache is not None:
            cache.discard(key + ".frames", e)
        return {}
    return out


_PLACEHOLDER_IP = 0  # below every kernel symbol: always one label frame
# Keys named per pass of the resolver. A first run asks ~50 per new leaf (its neighbours): ~13 000
# for pyenv's libpython, whose probe stacks and profile (~0.5 KB a key) were 6 MB at once, at
# the whole run's peak. A pass reads the module's DWARF again; its units' rows are kept (the cache).
PROBE_BATCH = 2048


def _resolve(
    resolver: Resolver, session: wire.Session, module: bytes, keys: list[FrameKey], file_name: str = ""
) -> dict[FrameKey, Frames]:
    """The frames of `keys` of one module (b"": the kernel), through one probe stack per key;
    `file_name` labels them when the module's file cannot be found (`libc.so.6+0x2724a`)."""
    from .. import wire

    out: dict[FrameKey, Frames] = {}
    for start in range(0, len(keys), PROBE_BATCH):
        batch = keys[start : start + PROBE_BATCH]
        probes = []
        for addr, leaf in batch:
            if module:
                f = wire.UserFrame(wire.FRAME_RESOLVED, module, addr, file_name)
                probes.append(_user_probe(f, leaf))
            else:
                kern = (addr,) if leaf else (_PLACEHOLDER_IP, addr)
                probes.append(wire.Trace(kernel=kern, user=(), pid=0, tid=0, on_cpu=1))
        out.update(zip_strict(batch, _probe(resolver, session, probes, [leaf for _, leaf in batch])))
    return out


def _user_probe(f: wire.UserFrame, leaf: bool) -> wire.Trace:
    """A call site (not a leaf) is probed above a placeholder leaf that names exactly one frame."""
    from .. import wire

    user = (f,) if leaf else (wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0), f)
    return wire.Trace(kernel=(), user=user, pid=0, tid=0, on_cpu=1)


def _probe(
    resolver: Resolver, session: wire.Session, probes: list[wire.Trace], leaves: list[bool]
) -> list[Frames]:
    """Every probe's frames: its stack, less the placeholder frame under a call site."""
    profile = resolver.symbolize(dataclasses.replace(session, traces=probes, threads={}))
    out = []
    for leaf, sample in zip_strict(leaves, profile.samples):
        stack = sample.stack if leaf else sample.stack[:-1]
        out.append(tuple(profile.frames[i] for i in stack))
    return out

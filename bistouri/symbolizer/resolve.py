"""The Resolver: raw stacks of a `wire.Session` → a symbolized `model.Profile`.

Two tiers (docs/symbolization.md):

- names, in process: the ELF symbol table of the build id (`.symtab` of the
  debug file if there is one, else the binary's `.symtab`, else `.dynsym`),
  looked up with bisect after the file offset is turned into a virtual address
  through PT_LOAD; kernel frames through a kallsyms snapshot or the vmlinux;
- file:line and inlined frames from `llvm-symbolizer` when DWARF exists.

The outermost frame of an address always takes its name from the symbol table
when there is one, so a frame is named the same with and without DWARF.
Return addresses (every frame but the leaf) are looked up at address - 1, as
they point after the call, but unnamed frames show the address as sent.

Results are cached per (module generation, address, leaf?) in one dict
bounded in entries; a module reloaded with better information (a debug file
deployed later) gets a new generation, so stale names age out.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import wire
from ..compat import SLOTS, zip_strict
from ..discard import Discarded
from ..elf import ElfFile, ElfFormatError, Segment, SymbolIndex, offset_to_vaddr
from ..errors import GzipError, GzipTooLarge, WireError
from ..gopclntab import GoPclnTab, read_pclntab
from . import model
from .demangle import demangle
from .gunzip import GZIP_MAGIC, gunzip
from .kallsyms import KallsymsIndex, KallsymsStore, kernel_key
from .llvm import LlvmPool, Quarantine, SourceFrame
from .sources import DEBUGINFO, EXECUTABLE, DebugSources
from .stacks import VDSO, ByLeaf, SessionStacks, label
from .tenants import upload_scope

# prometheus_client imported only with a registry: `record` passes none and keeps no metric
# (bistouri.discard), which spares it ~75 modules and ~5-8 MB of RSS.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)
# from_options' default: prometheus_client's REGISTRY, imported then.
_PROCESS_REGISTRY: Any = object()

DEFAULT_CACHE_ENTRIES = 400_000  # results (~150 bytes each) and as many interned frames
DEFAULT_MAX_MODULES = 128
# Parsed symbol tables kept per process (a module's `SymbolIndex`, ~20 bytes and the name per symbol;
# libc's is ~0.3 MB). Past it the least recently used modules are dropped.
DEFAULT_MAX_MODULE_BYTES = 96 << 20
MAX_NAMED_PER_MODULE = 20_000  # names-only results memoized per module
_MODULE_OVERHEAD = 2048
DEFAULT_RETRY_S = 30.0  # how long a module without debug info (or absent) is kept before looking again
_EVICT_FRACTION = 8  # evict 1/8 of the oldest results at once

# One address, root first (outer function, then inlined callees): rows (model.FrameRow), which the
# cyclic collector does not track, cached and handed to SessionStacks, which makes the Frames.
_Frames = tuple[model.FrameRow, ...]


class Symbols(Protocol):
    """A binary's function symbols as the resolver names with them: `elf.SymbolIndex`, read from
    the file, or what a caller read before (record's cache: `record.symfile.SymbolTable`)."""

    source: str

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def lookup(self, vaddr: int) -> tuple[str, int] | None: ...

    def items(self) -> Iterator[tuple[int, int, str]]: ...


@dataclass(**SLOTS)
class _Module:
    """What is known about one user-space build id."""

    gen: int
    hexid: str
    name: str
    segments: list[Segment]
    symbols: Symbols
    dwarf_path: str | None
    complete: bool  # has DWARF: never worth looking for again
    loaded_at: float
    named: dict[str, _Frames] = field(default_factory=dict)  # names-only result per symbol
    # A Go binary without DWARF: names, file:line and inlined calls from its pclntab, and the
    # frames of each of its keys (GoPclnTab.key: the addresses of one line share them).
    go: GoPclnTab | None = None
    go_answers: dict[int, _Frames] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.symbols.nbytes + _MODULE_OVERHEAD + (self.go.nbytes if self.go is not None else 0)


@dataclass(**SLOTS)
class _Kernel:
    """A kernel's symbols for the resolver: its kallsyms snapshot, held weakly."""

    gen: int
    hexid: str
    # Weak: the KallsymsStore's LRU, bounded in bytes, is what keeps a parsed snapshot alive.
    kallsyms: Callable[[], KallsymsIndex | None] | None
    vmlinux: _Module | None
    link_text: int
    link_etext: int
    complete: bool
    loaded_at: float


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter

        self.lookups = Counter(
            "bistouri_symbolizer_frame_lookups_total",
            "Stack frames looked up (before de-duplication), "
            "by kind (user, kernel, vdso, jit, python, unknown)",
            ["kind"],
            registry=registry,
        )
        self.hits = Counter(
            "bistouri_symbolizer_cache_hits_total",
            "Address lookups answered from the result cache, by space (user, kernel)",
            ["space"],
            registry=registry,
        )
        self.misses = Counter(
            "bistouri_symbolizer_cache_misses_total",
            "Address lookups that had to be resolved, by space (user, kernel)",
            ["space"],
            registry=registry,
        )
        self.unresolved = Counter(
            "bistouri_symbolizer_unresolved_frames_total",
            "Addresses left unnamed, by reason (no_file, no_symbol, bad_offset, no_kallsyms)",
            ["reason"],
            registry=registry,
        )
        self.evictions = Counter(
            "bistouri_symbolizer_cache_evictions_total",
            "Results dropped from the bounded result cache",
            registry=registry,
        )
        self.bounds = Counter(
            "bistouri_symbolizer_file_bounds_total",
            "Files read only in part because they hit a bound, "
            "by reason (symbols, gnu_debugdata, dwarf, section_names, gopclntab)",
            ["reason"],
            registry=registry,
        )
        self.module_loads = Counter(
            "bistouri_symbolizer_module_loads_total",
            "Build ids opened, by result (dwarf, symbols, missing, error, quarantined)",
            ["result"],
            registry=registry,
        )


def _display_name(hexid: str, *candidates: tuple[str | None, str | None]) -> str:
    """A module's name: the file's real basename, its SONAME, else the build id's first 8 hex digits."""
    for path, soname in candidates:
        if soname:
            return soname
        if path:
            base = os.path.basename(os.path.realpath(path))
            stem = base.removesuffix(".debug")
            if base not in ("debuginfo", "executable") and stem != hexid[2:] and stem != hexid:
                return stem
    return hexid[:8]


class Resolver:
    """Symbolizes sessions. Thread-safe: share one per process."""

    def __init__(
        self,
        sources: DebugSources | None = None,
        kernels: KallsymsStore | None = None,
        llvm: LlvmPool | None = None,
        *,
        use_llvm: bool = True,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        max_modules: int = DEFAULT_MAX_MODULES,
        max_module_bytes: int = DEFAULT_MAX_MODULE_BYTES,
        retry_s: float = DEFAULT_RETRY_S,
        quarantine_dir: str | None = None,
        registry: CollectorRegistry | None = None,
        known_symbols: Callable[[bytes], Symbols | None] | None = None,
    ) -> None:
        self.sources = sources if sources is not None else DebugSources(debuginfod_urls=[])
        # A build id's symbols read before (record's cache), in place of its symbol table: node's
        # .symtab (78 000 symbols) costs ~0.3 s of CPU to read, for a few new addresses.
        self.known_symbols = known_symbols
        self.kernels = kernels
        if llvm is None and use_llvm:
            dirs = [os.path.dirname(d) for d in self.sources.debug_dirs]
            llvm = LlvmPool(debug_dirs=dirs, quarantine_dir=quarantine_dir, registry=registry)
        self.llvm = llvm
        self.cache_entries = max(1, cache_entries)
        self.max_modules = max(1, max_modules)
        self.max_module_bytes = max_module_bytes
        self._module_bytes = 0
        self.retry_s = retry_s
        self.metrics = _Metrics(registry) if registry is not None else Discarded()
        # Files whose reading killed a worker (the same directory as llvm's: one place to look).
        self.quarantine = Quarantine(quarantine_dir)
        self._cache: dict[tuple[int, int, bool], _Frames] = {}
        self._cache_lock = threading.Lock()
        self._modules: OrderedDict[str, _Module | None] = OrderedDict()
        self._module_time: dict[str, float] = {}
        self._kernels: OrderedDict[tuple[str, bytes, int], _Kernel] = OrderedDict()
        self._lock = threading.Lock()
        self._load_locks: dict[str, threading.Lock] = {}
        self._gen = itertools.count(1)
        # Equal rows share one object, so a session indexes them by id() without hashing.
        self._interned: dict[model.FrameRow, model.FrameRow] = {VDSO: VDSO}
        # The Frame of each row a profile held, for the next profiles (a warm session makes none).
        self._frames: dict[model.FrameRow, model.Frame] = {}

    @classmethod
    def from_options(
        cls,
        state_dir: str | os.PathLike[str],
        debug_dirs: Sequence[str | os.PathLike[str]] = (),
        binary_dirs: Sequence[str | os.PathLike[str]] = (),
        debuginfod_urls: Sequence[str] | None = None,
        *,
        registry: CollectorRegistry | None = _PROCESS_REGISTRY,
        cache_dir: str | os.PathLike[str] | None = None,
        kernels: KallsymsStore | None = None,
        uploads_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> Resolver:
        """The service's resolver: kallsyms snapshots live under `state_dir`, debuginfod downloads
        in `cache_dir` (default `state_dir`/debuginfod).

        `debuginfod_urls=None` reads `DEBUGINFOD_URLS`. `kernels` is the process's KallsymsStore (default:
        a new one under `state_dir`). `uploads_dir` holds the agents' uploads, per tenant (uploads.py), looked
        at after every other source. Other keyword arguments go to `Resolver`.
        """
        if registry is _PROCESS_REGISTRY:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        state = os.fspath(state_dir)
        sources = DebugSources(
            [os.fspath(d) for d in debug_dirs],
            [os.fspath(d) for d in binary_dirs],
            debuginfod_urls,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else os.path.join(state, "debuginfod"),
            registry=registry,
            uploads_dir=os.fspath(uploads_dir) if uploads_dir is not None else None,
        )
        kwargs.setdefault("quarantine_dir", os.path.join(state, "quarantine"))
        return cls(sources, kernels or KallsymsStore(state), registry=registry, **kwargs)

    def close(self) -> None:
        if self.llvm is not None:
            self.llvm.close()
        self.sources.close()

    def __enter__(self) -> Resolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def file_lines(self) -> bool:
        """True when file:line and inlined frames can be produced (llvm-symbolizer present)."""
        return self.llvm is not None and self.llvm.available

    # --- modules ---------------------------------------------------------------

    def _load_lock(self, key: str) -> threading.Lock:
        with self._lock:
            lock = self._load_locks.get(key)
            if lock is None:
                lock = self._load_locks[key] = threading.Lock()
            return lock

    def module(self, build_id: bytes, tenant: str | None = None) -> _Module | None:
        """The cached module of a build id, (re)loading it when absent or incomplete and stale.

        With a `tenant`, that tenant's uploads complete the operator's sources (sources.py); a module built
        with them is cached apart, so that no other tenant's session ever sees it (docs/api.md).
        """
        hexid = build_id.hex()
        scope = upload_scope(tenant) if tenant is not None else None
        if scope is not None and not self.sources.has_upload(hexid, scope):
            scope = None  # nothing of this tenant's: the module every tenant shares
        key = hexid if scope is None else f"{hexid}/{scope}"
        now = time.monotonic()
        with self._lock:
            if key in self._modules:
                mod = self._modules[key]
                self._modules.move_to_end(key)
                if (mod is not None and mod.complete) or now - self._module_time[key] < self.retry_s:
                    return mod
        with self._load_lock(key):
            with self._lock:  # another thread may have loaded it meanwhile
                if key in self._modules and now - self._module_time[key] < self.retry_s:
                    return self._modules[key]
            mod = self._open_module(build_id, hexid, scope)
            with self._lock:
                self._forget_locked(key)
                self._modules[key] = mod
                self._module_bytes += mod.nbytes if mod is not None else 0
                self._module_time[key] = time.monotonic()
                # Bounded in count and in bytes; the module just loaded stays even when alone over.
                while len(self._modules) > 1 and (
                    len(self._modules) > self.max_modules or self._module_bytes > self.max_module_bytes
                ):
                    old = next(iter(self._modules))
                    self._forget_locked(old)
                    self._load_locks.pop(old, None)
            return mod

    def _forget_locked(self, key: str) -> None:
        old = self._modules.pop(key, None)
        if old is not None:
            self._module_bytes -= old.nbytes
        self._module_time.pop(key, None)

    def forget(self, build_id: bytes) -> None:
        """Look for this build id's files again at its next use (one was uploaded meanwhile)."""
        hexid = build_id.hex()
        with self._lock:
            for key in [k for k in self._modules if k == hexid or k.startswith(hexid + "/")]:
                self._forget_locked(key)

    def _open_module(self, build_id: bytes, hexid: str, scope: str | None = None) -> _Module | None:
        key = f"module:{hexid}"  # a name, not a file: kept until the TTL (or an operator deletes it)
        if scope is not None:
            key += f"/{scope}"  # a tenant's upload that killed a worker blocks that tenant's module only
        if self.quarantine.holds(key):
            self.metrics.module_loads.labels("quarantined").inc()
            return None
        with self.quarantine.attempt(key):
            return self._read_module(build_id, hexid, scope)

    def _read_module(self, build_id: bytes, hexid: str, scope: str | None) -> _Module | None:
        try:
            dbg = self.sources.find(build_id, DEBUGINFO, scope)
            dbg_elf = ElfFile(dbg.path) if dbg else None
        except (ElfFormatError, ValueError) as e:
            log.warning("Cannot open the debug file of a build id. build_id=%s error=%s", hexid, e)
            self.metrics.module_loads.labels("error").inc()
            dbg, dbg_elf = None, None
        exe_elf = None
        try:
            if dbg_elf is None or not dbg_elf.loads_have_offsets or not dbg_elf.has_dwarf:
                exe = self.sources.find(build_id, EXECUTABLE, scope)
                if exe is not None and (dbg is None or exe.path != dbg.path):
                    exe_elf = ElfFile(exe.path)
            if dbg_elf is None and exe_elf is None:
                self.metrics.module_loads.labels("missing").inc()
                return None
            files = [f for f in (dbg_elf, exe_elf) if f is not None]
            # Names: the first file with a .symtab, else the best of .dynsym/MiniDebugInfo.
            known = self.known_symbols(build_id) if self.known_symbols is not None else None
            symbols: Symbols = known if known is not None else SymbolIndex.empty()
            for f in files if known is None else ():
                idx = f.symbol_index()
                if len(idx) > len(symbols) or (idx.source == ".symtab" and symbols.source != ".symtab"):
                    symbols = idx
                if symbols.source == ".symtab":
                    break
            # Offsets: the executable's headers are exact; a split debug file's are a guess.
            with_offsets = [f for f in (exe_elf, dbg_elf) if f is not None and f.loads_have_offsets]
            segments = with_offsets[0].segments if with_offsets else files[0].approx_segments()
            dwarf = next((f.path for f in files if f.has_dwarf), None)
            # Go keeps its own line table in the binary, stripped or not (gopclntab.py): its names
            # (`runtime.goexit`, where .symtab says `runtime.goexit.abi0`) whatever else the file has,
            # and its lines and inlined calls when there is no DWARF for llvm-symbolizer.
            go = next((t for t in map(read_pclntab, files) if t is not None), None)
            if go is not None:
                symbols = go.symbols()
                if dwarf is not None and self.llvm is not None and self.llvm.available:
                    go = None
            name = _display_name(hexid, *((f.path, f.soname) for f in (exe_elf, dbg_elf) if f is not None))
        except ElfFormatError as e:
            log.warning("Cannot read the ELF file of a build id. build_id=%s error=%s", hexid, e)
            self.metrics.module_loads.labels("error").inc()
            return None
        finally:
            for opened in (dbg_elf, exe_elf):
                if opened is not None:
                    opened.close()
                    for reason in opened.bounds_hit:
                        self.metrics.bounds.labels(reason).inc()
                        log.warning(
                            "A file was read only in part: it is over a bound. build_id=%s path=%s bound=%s",
                            hexid,
                            opened.path,
                            reason,
                        )
        self.metrics.module_loads.labels("dwarf" if dwarf else "symbols").inc()
        complete = (dwarf is not None or go is not None) and bool(with_offsets)
        mod = _Module(
            next(self._gen), hexid, name, segments, symbols, dwarf, complete, time.monotonic(), go=go
        )
        return mod

    def _kernel(
        self, build_id: bytes, text_addr: int, boot_id: bytes = b""
    ) -> tuple[_Kernel, KallsymsIndex | None]:
        """The kernel of a session, and its kallsyms snapshot (held by the caller while it resolves)."""
        hexid = build_id.hex() if build_id else ""
        key = (hexid, boot_id, text_addr)
        now = time.monotonic()
        kallsyms = self._snapshot(hexid, boot_id)
        with self._lock:
            k = self._kernels.get(key)
        # A snapshot uploaded since the last look (or replaced: the agent's modules changed) is picked
        # up at once: the store hands out one object per snapshot file.
        held = k.kallsyms() if k is not None and k.kallsyms is not None else None
        if k is not None and held is kallsyms and (k.complete or now - k.loaded_at < self.retry_s):
            return k, kallsyms
        vmlinux = self.module(build_id) if hexid else None
        link_text = link_etext = 0
        if vmlinux is not None and vmlinux.dwarf_path:
            with ElfFile(vmlinux.dwarf_path) as f:
                link_text = f.find_symbol("_text") or 0
                link_etext = f.find_symbol("_etext") or 0
            if not (link_text and link_etext > link_text):
                vmlinux = None
        k = _Kernel(
            next(self._gen),
            hexid,
            _weak(kallsyms) if kallsyms is not None else None,
            vmlinux,
            link_text,
            link_etext,
            complete=kallsyms is not None and vmlinux is not None,
            loaded_at=time.monotonic(),
        )
        with self._lock:
            self._kernels[key] = k
            while len(self._kernels) > self.max_modules:
                self._kernels.popitem(last=False)
        return k, kallsyms

    def _snapshot(self, hexid: str, boot_id: bytes) -> KallsymsIndex | None:
        """The kallsyms of this boot of the kernel, else of the kernel (agents that send no boot id)."""
        if self.kernels is None or not hexid:
            return None
        if len(boot_id) == 16:
            index = self.kernels.get(kernel_key(hexid, boot_id))
            if index is not None:
                return index
        return self.kernels.get(hexid)

    def has_kallsyms(self, build_id: bytes) -> bool:
        return self.kernels is not None and self.kernels.has(build_id)

    def put_kallsyms(self, build_id: bytes, data: bytes) -> None:
        """Store an uploaded `/proc/kallsyms` (raw or gzip); KallsymsError if unusable."""
        if self.kernels is None:
            raise RuntimeError("this Resolver has no kallsyms store (state directory)")
        self.kernels.put(build_id, data)
        hexid = build_id.hex()
        with self._lock:
            for key in [k for k in self._kernels if k[0] == hexid]:
                del self._kernels[key]

    def _intern(self, f: model.FrameRow) -> model.FrameRow:
        got = self._interned.setdefault(f, f)
        if got is f and len(self._interned) > self.cache_entries:
            self._interned = {VDSO: VDSO, f: f}  # only sharing is lost
        return got

    def _frame(self, row: model.FrameRow) -> model.Frame:
        got = self._frames.get(row)
        if got is None:
            got = model.Frame(*row)
            if len(self._frames) >= self.cache_entries:
                self._frames = {}  # only sharing is lost
            self._frames[row] = got
        return got

    # --- result cache ----------------------------------------------------------

    def _store(self, key: tuple[int, int, bool], frames: _Frames) -> None:
        cache = self._cache
        cache[key] = frames
        if len(cache) > self.cache_entries:
            with self._cache_lock:
                n = len(cache) - self.cache_entries + self.cache_entries // _EVICT_FRACTION
                # islice over a dict runs in C under the GIL: no concurrent-resize error.
                old = list(itertools.islice(cache, max(0, n)))
                for k in old:
                    cache.pop(k, None)
                self.metrics.evictions.inc(len(old))

    # --- user frames -----------------------------------------------------------

    def _resolve_user(
        self, mod: _Module | None, build_id: bytes, todo: Sequence[tuple[int, bool]], file_name: str = ""
    ) -> list[_Frames | _Uncached]:
        """Frames for (file offset, is_leaf) pairs of one build id; `file_name`, the mapped file's
        name the agent sent, labels them when the file cannot be found (`libc.so.6+0x2724a`)."""
        if mod is None:
            label = file_name or build_id.hex()[:8]
            self.metrics.unresolved.labels("no_file").inc(len(todo))
            return [(self._intern(_row(f"{label}+0x{off:x}", label)),) for off, _ in todo]
        vaddrs: list[int | None] = []
        for off, leaf in todo:
            v = offset_to_vaddr(mod.segments, off if leaf else off - 1) if (leaf or off) else None
            vaddrs.append(v)
        if mod.go is not None and not (mod.dwarf_path and self.llvm is not None):
            return self._go_user_frames(mod, mod.go, todo, vaddrs)
        dwarf: list[list[SourceFrame] | None] = [None] * len(todo)
        if mod.dwarf_path and self.llvm is not None:
            wanted = [i for i, v in enumerate(vaddrs) if v is not None]
            answers = self.llvm.symbolize(mod.dwarf_path, [vaddrs[i] or 0 for i in wanted])
            for i, ans in zip_strict(wanted, answers):
                dwarf[i] = ans
        out: list[_Frames | _Uncached] = []
        final = not mod.dwarf_path or self.llvm is None or not self.llvm.available
        for (off, _leaf), v, src in zip_strict(todo, vaddrs, dwarf):
            frames = self._user_frames(mod, off, v, src)
            # A names-only answer where DWARF exists is not final: llvm may have failed this time.
            out.append(frames if final or src is not None or v is None else _Uncached(frames))
        return out

    def _go_user_frames(
        self, mod: _Module, go: GoPclnTab, todo: Sequence[tuple[int, bool]], vaddrs: list[int | None]
    ) -> list[_Frames | _Uncached]:
        """Go addresses' frames from the pclntab: one answer per key (function, file:line and
        inlined calls), shared by the addresses that give it."""
        intern, module, user = self._intern, mod.name, model.KIND_USER

        def make(function: str, file: str, line: int, inlined: bool) -> model.FrameRow:
            # As _user_frames makes them from llvm's answer; Go's names are not mangled.
            return intern((function, module, _path(file), line, user, inlined))

        got, unnamed = go.answers(vaddrs, make, mod.go_answers, MAX_NAMED_PER_MODULE)
        for i in unnamed:  # an inlined call without a name: labelled by this address, not kept
            label = f"{mod.name}+0x{todo[i][0]:x}"
            got[i] = tuple(f if f[0] else self._intern((label, *f[1:])) for f in got[i] or ())
        out: list[_Frames | _Uncached] = got  # type: ignore[assignment]  # the Nones replaced below
        for i, frames in enumerate(got):
            if frames is None:  # not in the table: from the symbols, as any ELF file's
                out[i] = self._user_frames(mod, todo[i][0], vaddrs[i], None)
        return out

    def gives_lines(self, mod: _Module) -> bool:
        """True when this module's frames carry file:line (DWARF with llvm-symbolizer, or Go's pclntab)."""
        return mod.go is not None or (bool(mod.dwarf_path) and self.file_lines)

    def _user_frames(
        self, mod: _Module, off: int, vaddr: int | None, src: list[SourceFrame] | None
    ) -> _Frames:
        sym = mod.symbols.lookup(vaddr) if vaddr is not None else None
        if not src:
            if sym is None:
                self.metrics.unresolved.labels("bad_offset" if vaddr is None else "no_symbol").inc()
                return (self._intern(_row(f"{mod.name}+0x{off:x}", mod.name)),)
            got = mod.named.get(sym[0])
            if got is None:
                got = (self._intern(_row(demangle(sym[0]), mod.name)),)
                if len(mod.named) < MAX_NAMED_PER_MODULE:
                    mod.named[sym[0]] = got
            return got
        frames = []
        last = len(src) - 1
        for i, sf in enumerate(src):
            if i == last and sym is not None:
                name = demangle(sym[0])
            elif sf.function:
                name = demangle(sf.function)
            else:
                name = f"{mod.name}+0x{off:x}"
            frames.append(self._intern((name, mod.name, _path(sf.file), sf.line, model.KIND_USER, i != last)))
        frames.reverse()  # root first: the outer function, then what was inlined into it
        return tuple(frames)

    # --- kernel frames ---------------------------------------------------------

    def _resolve_kernel(
        self, k: _Kernel, idx: KallsymsIndex | None, text_addr: int, todo: Sequence[tuple[int, bool]]
    ) -> list[_Frames]:
        out: list[_Frames] = [()] * len(todo)
        via_vmlinux: list[tuple[int, int]] = []  # (index, link-time address)
        vm = k.vmlinux
        runtime_text = text_addr or (idx.text_addr if idx else 0)
        for i, (ip, leaf) in enumerate(todo):
            look = ip if leaf else ip - 1
            if vm is not None and runtime_text:
                link = look - runtime_text + k.link_text
                if k.link_text <= link < k.link_etext:
                    via_vmlinux.append((i, link))
                    continue
            out[i] = self._kallsyms_frame(idx, text_addr, ip, look)
        if via_vmlinux and vm is not None:
            links = [a for _, a in via_vmlinux]
            answers: list[list[SourceFrame] | None] = [None] * len(links)
            if vm.dwarf_path and self.llvm is not None:
                answers = self.llvm.symbolize(vm.dwarf_path, links)
            for (i, link), src in zip_strict(via_vmlinux, answers):
                frames = self._user_frames(vm, link, link, src)
                if vm.symbols.lookup(link) is None and not src:
                    frames = self._kallsyms_frame(idx, text_addr, todo[i][0], todo[i][0] - (not todo[i][1]))
                out[i] = tuple(
                    (name, "vmlinux", file, line, model.KIND_KERNEL, inl)
                    for name, _, file, line, _, inl in frames
                )
        return out

    def _kallsyms_frame(self, idx: KallsymsIndex | None, text_addr: int, ip: int, look: int) -> _Frames:
        if idx is not None:
            same_boot = not text_addr or text_addr == idx.text_addr
            hit = idx.lookup(look if same_boot else look - text_addr + idx.text_addr)
            if hit is not None and (same_boot or not hit[1]):
                name, module, _off = hit
                return (self._intern(_row(demangle(name), module or "vmlinux", model.KIND_KERNEL)),)
        self.metrics.unresolved.labels("no_kallsyms" if idx is None else "no_symbol").inc()
        return (self._intern(_row(f"[kernel]+0x{ip:x}", "[kernel]", model.KIND_KERNEL)),)

    # --- sessions --------------------------------------------------------------

    def symbolize(self, session: wire.Session) -> model.Profile:
        """Name every frame of a session. Never raises for unknown frames: they get labels."""
        stacks = SessionStacks(session)
        cache = self._cache
        intern = self._intern
        # [leaf]: the answers SessionStacks.profile assembles, by frame id (user) or address (kernel).
        user: ByLeaf = ({}, {})
        kernel: ByLeaf = ({}, {})

        # 1. Every distinct frame: from the cache, or queued for its module.
        modules: dict[bytes, _Module | None] = {}
        file_names: dict[bytes, str] = {}
        user_todo: dict[bytes, dict[tuple[int, bool], list[int]]] = {}
        hits = [0, 0]
        for leaf in (True, False):
            answers = user[leaf]
            for fid, f in stacks.user[leaf].items():
                if f.kind == wire.FRAME_RESOLVED and f.build_id:
                    bid = f.build_id
                    if bid in modules:
                        mod = modules[bid]
                    else:
                        mod = modules[bid] = self.module(bid, session.tenant)
                    got = cache.get((mod.gen, f.address, leaf)) if mod is not None else None
                    if got is None:
                        user_todo.setdefault(bid, {}).setdefault((f.address, leaf), []).append(fid)
                        if f.name:
                            file_names.setdefault(bid, f.name)
                    else:
                        hits[0] += 1
                        answers[fid] = got
                else:  # a file without a build id, the vDSO, JIT code, Python, unknown: a label
                    answers[fid] = (intern(label(f)),)
        kernel_todo: list[tuple[int, bool]] = []
        k: _Kernel | None = None
        kidx: KallsymsIndex | None = None
        if stacks.kernel[True]:
            k, kidx = self._kernel(session.kernel.build_id, session.kernel.text_addr, session.kernel.boot_id)
            for leaf in (True, False):
                for ip in stacks.kernel[leaf]:
                    got = cache.get((-k.gen, ip, leaf))  # kernel generations are negative
                    if got is None:
                        kernel_todo.append((ip, leaf))
                    else:
                        hits[1] += 1
                        kernel[leaf][ip] = got

        # 2. Misses, in one batch per module (one llvm request each).
        for bid, todo in user_todo.items():
            mod = modules[bid]
            keys = list(todo)
            resolved = self._resolve_user(mod, bid, keys, file_names.get(bid, ""))
            for (off, leaf), frames in zip_strict(keys, resolved):
                if isinstance(frames, _Uncached):
                    frames = frames.frames
                elif mod is not None:
                    self._store((mod.gen, off, leaf), frames)
                for fid in todo[(off, leaf)]:
                    user[leaf][fid] = frames
        if kernel_todo:
            assert k is not None
            cacheable = kidx is not None or k.vmlinux is not None
            resolved_kernel = self._resolve_kernel(k, kidx, session.kernel.text_addr, kernel_todo)
            for (ip, leaf), frames in zip_strict(kernel_todo, resolved_kernel):
                if cacheable:
                    self._store((-k.gen, ip, leaf), frames)
                kernel[leaf][ip] = frames

        # 3. Root-first stacks.
        profile = stacks.profile(user, kernel, self._frame)

        kinds = {"user": 0, "kernel": 0, "vdso": 0, "jit": 0, "python": 0, "unknown": 0}
        for t in stacks.distinct:
            for f in t.user:
                if f.kind == wire.FRAME_RESOLVED and (f.build_id or f.name):
                    kinds["user"] += 1
                elif f.kind == wire.FRAME_VDSO:
                    kinds["vdso"] += 1
                elif f.kind == wire.FRAME_JIT:
                    kinds["jit"] += 1
                elif f.kind == wire.FRAME_PYTHON:
                    kinds["python"] += 1
                else:
                    kinds["unknown"] += 1
            kinds["kernel"] += len(t.kernel)
        misses = [sum(len(v) for v in user_todo.values()), len(kernel_todo)]
        for i, space in enumerate(("user", "kernel")):
            if hits[i]:
                self.metrics.hits.labels(space).inc(hits[i])
            if misses[i]:
                self.metrics.misses.labels(space).inc(misses[i])
        for kind, n in kinds.items():
            if n:
                self.metrics.lookups.labels(kind).inc(n)
        return profile

    def symbolize_file(self, path: str | os.PathLike[str]) -> model.Profile:
        """Symbolize a spooled session file (msgpack, optionally gzip'd) for `bistouri symbolize`."""
        return self.symbolize(read_session_file(path))


def _weak(index: KallsymsIndex) -> Callable[[], KallsymsIndex | None]:
    try:
        return weakref.ref(index)
    except TypeError:  # `bistouri record`'s KallsymsTable: one per run, held
        return lambda: index


def _row(name: str, module: str, kind: str = model.KIND_USER) -> model.FrameRow:
    """A frame with no file:line (a name, or a label) as the resolver holds it."""
    return (name, module, "", 0, kind, False)


class _Uncached:
    """Marks a result that must not enter the cache (llvm failed; it may answer next time)."""

    __slots__ = ("frames",)

    def __init__(self, frames: _Frames) -> None:
        self.frames = frames


_PATHS: dict[str, str] = {}


def _path(p: str) -> str:
    # DWARF paths like build/../Objects/x.c: normalized once per distinct string.
    out = _PATHS.get(p)
    if out is None:
        out = os.path.normpath(p) if p else ""
        if len(_PATHS) < 100_000:
            _PATHS[p] = out
    return out


def read_session_file(path: str | os.PathLike[str], max_bytes: int = 256 << 20) -> wire.Session:
    """One session from a spool file (`wire.frame_session`), bare msgpack, or a one-session
    request body (gzip'd or not). Reads and inflates at most `max_bytes`."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if data[:2] == GZIP_MAGIC:
        data = _gunzip(data, max_bytes, name)
    if len(data) > max_bytes:
        raise WireError("too_large", f"{name} holds more than {max_bytes} bytes")
    if wire.is_framed(data):
        try:
            data = wire.unframe_session(data).data
        except WireError as e:
            raise WireError(e.reason, f"{name}: {e} (a damaged spool file)") from None
    try:
        return wire.decode_session(data)
    except WireError:
        sessions: list[Any] = wire.decode_batch(data)
        if len(sessions) != 1:
            raise WireError("malformed", f"{name} holds {len(sessions)} sessions; expected one")
        return wire.session_from_wire(sessions[0])


def _gunzip(data: bytes, max_bytes: int, name: str) -> bytes:
    try:
        return gunzip(data, max_bytes)
    except GzipTooLarge:
        raise WireError("too_large", f"{name} inflates to more than {max_bytes} bytes") from None
    except GzipError as e:
        raise WireError("malformed", f"{name} {e}") from None


def symbolize_file(
    path: str | os.PathLike[str], resolver: Resolver | None = None, **options: Any
) -> model.Profile:
    """Symbolize one session file; builds a Resolver from `options` when none is given."""
    if resolver is not None:
        return resolver.symbolize_file(path)
    with Resolver(**options) as r:
        return r.symbolize_file(path)

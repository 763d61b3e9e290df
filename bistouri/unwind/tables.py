"""Unwind tables for the BPF walk: built per file, cached on disk, loaded into BPF maps.

For each process it samples, the BPF program needs the unwind rows of every
executable file the process maps (`ehframe.py` compiles them) and the
process's mappings of those files (`unwind_procs` + `unwind_mappings`). This
module owns that:

- `want(pid)` queues a process; the builder thread (`bistouri-unwind`)
  reads its executable file mappings, builds the tables it lacks under a CPU
  budget (it sleeps in proportion to the CPU it used: at most `cpu_share` of a
  core), loads them and publishes the process's mappings, after each new table
  (libc's and the executable's first, `_build_order`). Until then its frames
  are walked by frame pointer: a never-seen binary costs a bounded delay.
- `prepare(pids)` builds tables to the disk cache only, for processes that are
  watched but not sampled yet (the 30 s walk knows them): the first capture
  under pressure then loads them from disk.
- Tables live on disk per build id (`<cache_dir>/<build id>.unw`), bounded in
  bytes (oldest out first), and in the `unwind_rows` BPF array, bounded by its
  size: the least recently wanted files are evicted first, and the processes
  that mapped them lose those mappings (their frames fall back to the frame
  pointer) until wanted again.
"""

from __future__ import annotations

import array
import bisect
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from .. import atomicfile, threads
from ..bpf import abi
from ..bpf.handles import Map
from ..compat import SLOTS
from ..elf import ElfFile, ElfFormatError
from ..host import safeopen
from ..host.procmaps import MappedPath
from .ehframe import ROW, CfaKind, CfiLimits, RbpKind, UnwindTableError, build_table, callers_by_frame_pointer
from .hotspot import JitLimits, jit_rows

log = logging.getLogger(__name__)

_CACHE_MAGIC = b"BSTUNW1\0"
_CACHE_HEAD = struct.Struct("<8sII")  # magic, executable segments, rows
_SEGMENT = struct.Struct("<QQQ")  # file offset, virtual address, size in the file
# start, end, bias, first, count, buckets, bucket_count, bucket_base, bucket_shift
_MAPPING = struct.Struct("<QQQIIIIII")
_PROC = struct.Struct("<III")  # slot, count, flags
_PID = struct.Struct("<I")
_GENERATION = struct.Struct("<Q")  # unwind_generation's one value, at key 0
_GENERATION_KEY = struct.pack("<I", 0)
_MAX_TABLE_ROWS = 1 << 24  # what the BPF binary search covers
_ROWS_PER_BUCKET = 8  # the bucket index: about this many rows between two entries (BPF: 3 steps)
_USER_TOP = 0x7FFFFFFFF000  # end of user space (x86-64, 4-level page tables)
# The code-cache rows (hotspot.py) and the perf trampoline's are read from x86-64 code: none elsewhere.
_X86_64 = os.uname().machine == "x86_64"
_ANON_CHECKED_MAX = 256  # anonymous executable mappings looked at per process
# In a mapping's bucket_shift (BISTOURI_MAPPING_FP_CALLERS): the walk takes a return address in
# the file by frame pointer, without a row search (ehframe.callers_by_frame_pointer; x86-64 only).
_FP_CALLERS = 1 << 31
# In a process's flags (BISTOURI_UNWIND_PROC_NO_PYTHON): it has no python_procs record, its samples
# skip the Python walk's lookup. Only "not Python": a process without an entry is still looked up.
_NO_PYTHON = 1

# CPython >= 3.12 `-X perf` copies this x86-64 trampoline (no CFI, no frame pointer) once per
# Python function, end to end from the start of anonymous executable regions:
# sub $8,%rsp; call *%rcx; add $8,%rsp; ret. One row describes every copy of a region.
PY_TRAMPOLINE = bytes.fromhex("4883ec08ffd14883c408c3")
_PY_TRAMPOLINE_KEY = b"cpython-perf-trampoline"
# A JVM's code-cache mapping: its table comes from the perf map and the code (hotspot.py), keyed by
# the process, the mapping and what the perf map said (a new map, a new table).
_JIT_KEY = b"hotspot-jit:"
_JIT_SEGMENTS = ((0, 0, 1),)  # bias = the mapping's start

# The perf map of a process as (start, end, name), sorted (ProcMaps.jit_code).
JitCode = Callable[[int], Sequence[tuple[int, int, str]]]


@dataclass(frozen=True, **SLOTS)
class Table:
    """A file's rows and its executable segments (to turn a mapping into a bias)."""

    segments: tuple[tuple[int, int, int], ...]
    rows: bytes

    @property
    def row_count(self) -> int:
        return len(self.rows) // ROW.size


@dataclass(**SLOTS)
class UnwindStats:
    """Counters of the unwind tables: built, cached, failed, and their cost."""

    built: int = 0  # tables compiled from ELF files
    build_cpu_s: float = 0.0
    cache_hits: int = 0  # tables read from the disk cache
    failed: int = 0  # files whose CFI could not be read
    refused: dict[str, int] = field(default_factory=dict)  # of those, by UnwindTableError.reason
    loaded_rows: int = 0  # rows in the BPF array now
    evicted: int = 0  # files evicted from the BPF array
    too_large: int = 0  # files whose table exceeds the BPF array
    procs: int = 0  # processes with published mappings
    requests_dropped: int = 0  # want/prepare/forget requests lost to a full queue
    prepared: int = 0  # processes whose files were looked at for the disk cache
    jit_tables: int = 0  # JVM code-cache tables built (hotspot.py)
    jit_framed: int = 0  # ... the compiled methods in them with rows, last built
    jit_unframed: int = 0  # ... the perf-map entries without (interpreter, stubs, unknown prologues)


@dataclass(**SLOTS)
class _Loaded:
    """Where a file's table sits in the rows map: first row, count, bucket index."""

    first: int
    count: int  # rows, then the bucket index after them
    rows: int
    bucket_base: int  # first bucket (pc >> bucket_shift) of the table
    bucket_count: int
    bucket_shift: int  # with _FP_CALLERS when the file is marked
    segments: tuple[tuple[int, int, int], ...]


# _MAPPING's fields and the file's build id
_Entry = tuple[int, int, int, int, int, int, int, int, int, bytes]
# ((start, end), pgoff, path to open, build id) of an executable file mapping
_FileMapping = tuple[tuple[int, int], int, Optional[MappedPath], bytes]  # Optional: a 3.9 runtime alias


@dataclass(**SLOTS)
class _Proc:
    """A process's unwind tables: its slot and the files' entries it uses."""

    slot: int
    entries: list[_Entry] = field(default_factory=list)  # sorted by start
    source: list[tuple[tuple[int, int], bytes]] = field(default_factory=list)  # the file mappings read

    def write(self, mappings: Map, procs: Map, pid: int, flags: int) -> None:
        base = self.slot * abi.UNWIND_MAPPINGS
        if self.entries:
            mappings.update_array(base, b"".join(_MAPPING.pack(*e[:9]) for e in self.entries), _MAPPING.size)
        self.write_flags(procs, pid, flags)

    def write_flags(self, procs: Map, pid: int, flags: int) -> None:
        procs.update(_PID.pack(pid), _PROC.pack(self.slot, len(self.entries), flags))


# CFA = RSP + 16 from after the `sub` (offset 4) until the `add` has run (offset 10).
_PY_TRAMPOLINE_TABLE = Table(
    ((0, 0, 1),),  # bias = the region's start
    ROW.pack(0, len(PY_TRAMPOLINE), 4 | 10 << 8, CfaKind.TRAMPOLINE, RbpKind.UNCHANGED),
)


def read_cached(path: str) -> Table | None:
    """A table from the disk cache, or None for another version or a torn write (rebuilt). The
    rows are read into their own bytes (not sliced out of the file's: node's are 4.5 MB)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_CACHE_HEAD.size)
            if len(head) < _CACHE_HEAD.size:
                return None
            magic, nseg, nrows = _CACHE_HEAD.unpack(head)
            if magic != _CACHE_MAGIC:
                return None
            segs_data = f.read(nseg * _SEGMENT.size)
            rows = f.read(nrows * ROW.size + 1)  # one byte more: the file must end there
    except OSError:
        return None
    if len(segs_data) != nseg * _SEGMENT.size or len(rows) != nrows * ROW.size:
        return None
    return Table(tuple(_SEGMENT.iter_unpack(segs_data)), rows)


def compile_file(path: str, limits: CfiLimits | None = None) -> Table:
    """The table of the ELF file at `path` (UnwindTableError if it cannot be read)."""
    try:
        with ElfFile(path) as elf:
            segs = tuple((s.offset, s.vaddr, s.filesz) for s in elf.segments if s.flags & 1)
    except ElfFormatError as e:
        raise UnwindTableError(path, str(e)) from e
    return Table(segs, build_table(path, limits))


def compile_mapped(where: MappedPath, limits: CfiLimits | None = None) -> Table:
    """The table of a file a process maps, read from one descriptor (see safeopen)."""
    fd = where.open()
    try:
        return compile_file(safeopen.fd_path(fd), limits)
    finally:
        os.close(fd)


class NoUnwind:
    """Unwinding by tables off (no rows configured) or stopped: requests are ignored, user
    stacks are walked by frame pointer."""

    def __init__(self) -> None:
        self.stats = UnwindStats()

    def want(self, pid: int) -> None:
        pass

    def python_record(self, pid: int, has_one: bool) -> None:
        pass

    def prepare(self, processes: list[tuple[int, int]]) -> None:
        pass

    def forget(self, pid: int) -> None:
        pass

    def wait_idle(self, timeout: float) -> bool:
        return True

    def start(self) -> None:
        pass

    def close(self, timeout: float = 0.5) -> None:
        pass


class UnwindTables:
    """The BPF maps of the unwind tables and the thread that fills them."""

    def __init__(
        self,
        maps: Mapping[str, Map],
        *,
        proc_root: str = "/proc",
        cache_dir: str | None = None,
        cache_max_bytes: int = 256 << 20,
        cpu_share: float = 0.25,
        nice: int = 19,
    ) -> None:
        self._rows_map = maps["unwind_rows"]
        self._procs_map = maps["unwind_procs"]
        self._mappings_map = maps["unwind_mappings"]
        # BPF caches rules per CPU under this number: bumped after every write to the three above.
        # It starts at 0, like the cache's zeroed entries, whose PC 0 no walk looks up.
        self._generation_map = maps["unwind_generation"]
        self._generation = 0
        self.capacity = self._rows_map.max_entries
        # A file with more rows than the array holds could not be loaded: parsing stops there.
        self._limits = CfiLimits(max_rows=self.capacity)
        self.proc_root = proc_root
        self.cache_dir = cache_dir
        self.cache_max_bytes = cache_max_bytes
        self.cpu_share = cpu_share
        self.nice = nice
        self.stats = UnwindStats()
        self._loaded: OrderedDict[bytes, _Loaded] = OrderedDict()  # build id -> rows, LRU first
        self._procs: OrderedDict[int, _Proc] = OrderedDict()
        self._free_slots = list(range(abi.UNWIND_PROCS - 1, -1, -1))
        self._queue: queue.Queue[tuple[str, int]] = queue.Queue(maxsize=4096)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()  # held for every write to the BPF maps
        self._closed = False  # the maps may be closed: no more writes
        self._build_ids: dict[tuple[bytes, bytes], bytes] = {}  # (device, inode) -> build id
        self._on_disk: set[bytes] = set()  # build ids known to be in the disk cache
        self._prepared: dict[int, int] = {}  # pid -> start time of the process prepared under it
        self._no_python: set[int] = set()  # sampled processes without a python_procs record (under _lock)
        # A JVM's perf map (set by the profiler): its code cache gets rows (hotspot.py). None: none.
        self.jit_code: JitCode | None = None
        self.jit_limits = JitLimits(max_rows=min(self.capacity // 4, JitLimits().max_rows))
        self._jit_pending: dict[bytes, Table] = {}  # built by _file_mappings, loaded by _publish
        self._jit_keys: dict[int, set[bytes]] = {}  # pid -> its code-cache tables loaded
        # Called (on this thread) once every table of a process wanted is published: raw stack
        # copies of its samples wait for that (capture/rawstacks.py).
        self.on_published: Callable[[int], None] | None = None

    # -- requests (any thread) ---------------------------------------------------------
    def want(self, pid: int) -> None:
        """Load the tables of a sampled process and publish its mappings."""
        self._put(("want", pid))

    def prepare(self, processes: list[tuple[int, int]]) -> None:
        """Build (to the disk cache only) the tables of processes that may be sampled later,
        given as (pid, start time): each process once, not at every walk (its files do not
        change often; a sampled process gets its new files through `want`)."""
        prepared = self._prepared
        if len(prepared) > 65536:
            prepared.clear()
        for pid, starttime in processes:
            if prepared.get(pid) != starttime:
                prepared[pid] = starttime
                self._put(("prepare", pid))

    def python_record(self, pid: int, has_one: bool) -> None:
        """Whether the process has a python_procs record (the profiler's, docs/python-frames.md). One
        without says so in its unwind_procs entry, and its samples skip the Python walk's lookup: call
        this before writing a record and after deleting one, so that the flag never hides a record."""
        with self._lock:
            if has_one:
                self._no_python.discard(pid)
            else:
                self._no_python.add(pid)
            proc = self._procs.get(pid)
            if proc is not None and not self._closed:
                proc.write_flags(self._procs_map, pid, self._flags(pid))

    def _flags(self, pid: int) -> int:
        """Under _lock: the flags of `pid`'s unwind_procs entry."""
        return _NO_PYTHON if pid in self._no_python else 0

    def forget(self, pid: int) -> None:
        with self._lock:
            self._no_python.discard(pid)  # a process under this pid later is described anew
        self._put(("forget", pid))

    def _put(self, item: tuple[str, int]) -> None:
        try:
            self._idle.clear()
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.requests_dropped += 1  # that process is walked by frame pointer
            log.debug("unwind queue full, dropped %s", item)

    def wait_idle(self, timeout: float) -> bool:
        """Whether every queued request was handled within timeout (tests, bench)."""
        return self._idle.wait(timeout)

    # -- thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threads.start("unwind", self._run)

    def close(self, timeout: float = 0.5) -> None:
        """Stop the builder. It may be in the middle of compiling a large table (seconds at nice
        19 on a busy host): it is not waited for, only kept off the BPF maps, which every write
        checks under the lock, so the profiler can close them at once (a quick SIGTERM exit)."""
        self._stop.set()
        self._put(("stop", 0))
        with self._lock:
            self._closed = True
        if self._thread is not None:
            self._thread.join(timeout)  # a daemon thread: it ends at its next check otherwise
            self._thread = None

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError:
            pass
        while not self._stop.is_set():
            # Asleep until a request (close() sends one): no timer waking an idle agent.
            what, pid = self._queue.get()
            try:
                if what == "want":
                    self._publish(pid)
                elif what == "prepare":
                    self.stats.prepared += 1
                    for _rng, _pgoff, where, key in self._file_mappings(pid):
                        if self._stop.is_set():
                            break
                        if key not in self._loaded and key not in self._on_disk:
                            self._table(where, key)
                elif what == "forget":
                    self._drop_proc(pid)
            except Exception:
                if self._stop.is_set():  # the profiler closed its maps under a long build: expected
                    log.debug("unwind tables of pid %d abandoned at close", pid)
                else:
                    log.exception("unwind tables of pid %d", pid)
            if self._queue.empty():
                self._idle.set()

    # -- files -------------------------------------------------------------------------
    def _file_mappings(self, pid: int, *, jit: bool = False) -> list[_FileMapping]:
        """((start, end), pgoff, path to open, build id) of each executable file mapping; with `jit`,
        and the JVM's code cache when its perf map names code there (a table built for it now)."""
        base = f"{self.proc_root}/{pid}"
        try:
            with open(f"{base}/maps", "rb") as f:
                data = f.read()
        except OSError:
            return []
        out: list[_FileMapping] = []
        ids = self._build_ids
        if len(ids) > 8192:
            ids.clear()
        anonymous: list[tuple[int, int]] = []
        for line in data.splitlines():
            parts = line.split(None, 5)
            if len(parts) >= 5 and b"x" in parts[1] and parts[4] == b"0":
                lo, _, hi = parts[0].partition(b"-")
                if len(anonymous) < _ANON_CHECKED_MAX and int(hi, 16) <= _USER_TOP:  # not [vsyscall]
                    anonymous.append((int(lo, 16), int(hi, 16)))
                continue
            if len(parts) < 6 or b"x" not in parts[1] or parts[4] == b"0" or not parts[5].startswith(b"/"):
                continue
            lo, _, hi = parts[0].partition(b"-")
            # The mapped file itself, even deleted or in another mount namespace.
            name = parts[5].decode(errors="replace").removesuffix(" (deleted)")
            where = MappedPath(base, parts[0].decode(), name)
            # Read once per (device, inode); a replaced file has a new inode.
            key = ids.get((parts[3], parts[4]))
            if key is None:
                key = ids[(parts[3], parts[4])] = where.build_id() or b""
            if key:
                out.append(((int(lo, 16), int(hi, 16)), int(parts[2], 16), where, key))
        out.extend((rng, 0, None, _PY_TRAMPOLINE_KEY) for rng in self._py_trampolines(pid, anonymous))
        if jit and _X86_64 and self.jit_code is not None and anonymous and b"/libjvm.so" in data:  # a JVM
            out.extend(self._jit_tables(pid, anonymous))
        return out

    def _jit_tables(self, pid: int, regions: list[tuple[int, int]]) -> list[_FileMapping]:
        """The code-cache mappings of a JVM its perf map names code in, each with a table built from
        it (hotspot.py), under the CPU budget; the table is reused while the perf map is the same."""
        assert self.jit_code is not None
        entries = self.jit_code(pid)
        if not entries:
            return []
        out: list[_FileMapping] = []
        starts = [e[0] for e in entries]
        fd = -1
        try:
            for lo, hi in regions:
                first, last = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
                if first == last:
                    continue
                inside = entries[first:last]
                key = _JIT_KEY + struct.pack("<IQQ", pid, lo, hash(tuple(inside)) & (1 << 64) - 1)
                out.append(((lo, hi), 0, None, key))
                self._jit_keys.setdefault(pid, set()).add(key)
                if key in self._loaded or key in self._jit_pending:
                    continue
                if fd < 0:
                    fd = os.open(f"{self.proc_root}/{pid}/mem", os.O_RDONLY)

                def read(at: int, size: int, fd: int = fd) -> bytes:
                    try:
                        return os.pread(fd, size, at)
                    except OSError:
                        return b""

                cpu = time.thread_time()
                rows, st = jit_rows(lo, hi, inside, read, self.jit_limits)
                used = time.thread_time() - cpu
                self.stats.jit_tables += 1
                self.stats.jit_framed += st.framed
                self.stats.jit_unframed += st.entries - st.framed
                log.debug("JIT unwind rows built. pid=%d entries=%d framed=%d rows=%d cpu_s=%.3f",
                          pid, st.entries, st.framed, len(rows) // ROW.size, used)  # fmt: skip
                self._jit_pending[key] = Table(_JIT_SEGMENTS, rows)
                self.stats.build_cpu_s += used
                if self.cpu_share < 1:  # the same budget as the files' tables
                    self._stop.wait(used * (1 / self.cpu_share - 1))
        except OSError:
            pass  # the process is gone: its other mappings' tables still go in
        finally:
            if fd >= 0:
                os.close(fd)
        return out

    def _py_trampolines(self, pid: int, regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The anonymous executable regions that start with CPython's perf trampoline."""
        if not regions:
            return []
        try:
            fd = os.open(f"{self.proc_root}/{pid}/mem", os.O_RDONLY)
        except OSError:
            return []
        found = []
        try:
            for start, end in regions:
                try:
                    if os.pread(fd, len(PY_TRAMPOLINE), start) == PY_TRAMPOLINE:
                        found.append((start, end))
                except OSError:
                    continue
        finally:
            os.close(fd)
        return found

    def _cache_path(self, key: bytes) -> str | None:
        return os.path.join(self.cache_dir, key.hex() + ".unw") if self.cache_dir else None

    def _table(self, where: MappedPath | None, key: bytes) -> Table | None:
        if key == _PY_TRAMPOLINE_KEY:
            return _PY_TRAMPOLINE_TABLE
        if key.startswith(_JIT_KEY):
            return self._jit_pending.pop(key, None)
        cached = self._cache_path(key)
        if cached:
            t = read_cached(cached)
            if t is not None:
                self.stats.cache_hits += 1
                self._on_disk.add(key)
                return t
        if where is None:
            return None
        cpu = time.thread_time()
        try:
            t = compile_mapped(where, self._limits)
        except (UnwindTableError, OSError) as e:
            self.stats.failed += 1
            reason = e.reason if isinstance(e, UnwindTableError) else "unreadable"
            self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
            log.info("No unwind table for %s: %s", where.name, e)
            return None
        used = time.thread_time() - cpu
        log.debug("Unwind table built. file=%s rows=%d cpu_s=%.3f", where.name, t.row_count, used)
        self.stats.built += 1
        self.stats.build_cpu_s += used
        if cached:
            self._write_cache(cached, t)
        # The budget: sleep so that building takes at most cpu_share of a core.
        if self.cpu_share < 1:
            self._stop.wait(used * (1 / self.cpu_share - 1))
        return t

    def _write_cache(self, path: str, t: Table) -> None:
        assert self.cache_dir is not None
        try:
            os.makedirs(self.cache_dir, mode=0o700, exist_ok=True)
            with atomicfile.replacing(path) as out:  # a cache: rebuilt if lost, not synced
                out.file.write(_CACHE_HEAD.pack(_CACHE_MAGIC, len(t.segments), t.row_count))
                for seg in t.segments:
                    out.file.write(_SEGMENT.pack(*seg))
                out.file.write(t.rows)
            self._on_disk.add(bytes.fromhex(os.path.basename(path).removesuffix(".unw")))
            self._trim_cache()
        except OSError as e:
            log.warning("Cannot write the unwind table cache %s: %s", path, e)

    def _trim_cache(self) -> None:
        assert self.cache_dir is not None
        entries = []
        with os.scandir(self.cache_dir) as it:
            for e in it:
                if e.name.endswith(".unw"):
                    st = e.stat()
                    entries.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.cache_max_bytes:
                break
            os.unlink(p)
            self._on_disk.discard(bytes.fromhex(os.path.basename(p).removesuffix(".unw")))
            total -= size

    # -- BPF maps ------------------------------------------------------------------------
    def _load(self, key: bytes, t: Table, keep: set[bytes]) -> _Loaded | None:
        """The file's rows in the BPF array, evicting files not in `keep` (the process's own) for room."""
        loaded = self._loaded.get(key)
        if loaded is not None:
            self._loaded.move_to_end(key)
            return loaded
        n = t.row_count
        if n == 0 or n > min(self.capacity, _MAX_TABLE_ROWS):
            self.stats.too_large += n > 0
            return None
        # Each row's first field, as 4-byte integers: a list of them was 14 MB more for node.
        pcs = array.array("I", memoryview(t.rows).cast("I")[:: ROW.size // 4].tobytes())
        # Buckets of 2^shift bytes of code holding ~_ROWS_PER_BUCKET rows on average.
        shift = min(max((((pcs[-1] - pcs[0] + 1) * _ROWS_PER_BUCKET) // n).bit_length() - 1, 4), 16)
        bucket_base = pcs[0] >> shift
        bucket_count = (pcs[-1] >> shift) - bucket_base + 1
        total = n + bucket_count + 1
        first = self._allocate(total)
        while first is None and self._evict_oldest(keep):
            first = self._allocate(total)
        if first is None:
            return None
        # Bucket index after the rows: for each bucket, the row covering its start, so the BPF
        # search of a PC looks only between two neighbouring entries (~3 steps, not ~17).
        index = bytearray()
        for b in range(bucket_count + 1):
            at = max(bisect.bisect_right(pcs, (bucket_base + b) << shift) - 1, 0)
            index += ROW.pack(first + at, 0, 0, 0, 0)
        with self._lock:
            if self._closed:
                return None
            self._rows_map.update_array(first, t.rows, ROW.size)  # two writes: no copy of the rows
            self._rows_map.update_array(first + n, bytes(index), ROW.size)
            self._tables_changed()
        if _X86_64 and callers_by_frame_pointer(t.rows):
            shift |= _FP_CALLERS
        loaded = self._loaded[key] = _Loaded(first, total, n, bucket_base, bucket_count, shift, t.segments)
        self.stats.loaded_rows += total
        return loaded

    def _allocate(self, n: int) -> int | None:
        """First fit among the holes of the row array."""
        at = 0
        for used in sorted(self._loaded.values(), key=lambda x: x.first):
            if used.first - at >= n:
                return at
            at = used.first + used.count
        return at if self.capacity - at >= n else None

    def _evict_oldest(self, keep: set[bytes]) -> bool:
        """Drop the least recently wanted file; first unpublish it, before its rows are reused."""
        key = next((k for k in self._loaded if k not in keep), None)
        if key is None or self._closed:
            return False
        old = self._loaded.pop(key)
        self.stats.evicted += 1
        self.stats.loaded_rows -= old.count
        with self._lock:
            if self._closed:
                return False
            for pid, proc in self._procs.items():
                if any(e[-1] == key for e in proc.entries):
                    proc.entries = [e for e in proc.entries if e[-1] != key]
                    proc.write(self._mappings_map, self._procs_map, pid, self._flags(pid))
            self._tables_changed()
        return True

    def _publish(self, pid: int) -> None:
        mappings = self._file_mappings(pid, jit=True)
        source = [(m[0], m[3]) for m in mappings]
        published = self._procs.get(pid)
        if (
            published is not None
            and published.source == source
            and all(self._loaded.get(e[-1]) is not None for e in published.entries)
        ):
            self._published(pid)
            return  # the same files, still loaded (the maps changed elsewhere: heap, JIT)
        entries: list[_Entry] = []
        keep = {m[3] for m in mappings}
        for (start, end), pgoff, where, key in _build_order(mappings):
            if self._stop.is_set():
                return
            new = key not in self._loaded
            t = self._table(where, key) if new else None
            loaded = self._loaded.get(key) if t is None else self._load(key, t, keep)
            if loaded is None:
                continue
            bias = _bias(loaded.segments, start, pgoff)
            if bias is None:
                continue
            entries.append(
                (start, end, bias, loaded.first, loaded.rows, loaded.first + loaded.rows, loaded.bucket_count,
                 loaded.bucket_base, loaded.bucket_shift, key)
            )  # fmt: skip
            if len(entries) == abi.UNWIND_MAPPINGS:
                break
            if new:  # the walk has this table before the next one is built (a large one takes seconds)
                self._write_proc(pid, entries, None)
        self._write_proc(pid, entries, source)
        self._drop_jit(pid, {m[3] for m in mappings if m[3].startswith(_JIT_KEY)})
        log.debug("Unwind tables published. pid=%d files=%d", pid, len(entries))
        self._published(pid)

    def _published(self, pid: int) -> None:
        if self.on_published is not None:
            self.on_published(pid)

    def _drop_jit(self, pid: int, keep: set[bytes]) -> None:
        """Free the rows of the process's code-cache tables not in `keep` (an older perf map's, or all
        once it is gone): no other process maps them, and its mappings no longer name them."""
        old = self._jit_keys.pop(pid, set())
        for key in old - keep:
            self._jit_pending.pop(key, None)
            loaded = self._loaded.pop(key, None)
            if loaded is not None:
                self.stats.loaded_rows -= loaded.count
        if keep:
            self._jit_keys[pid] = keep

    def _write_proc(
        self,
        pid: int,
        entries: list[_Entry],
        source: list[tuple[tuple[int, int], bytes]] | None,
    ) -> None:
        """Publish the process's mappings with a table; `source`: the file mappings they come from,
        once all are in (None while some are still being built)."""
        # A file loaded for this process may have evicted one of its earlier files: keep only live rows.
        live = sorted(e for e in entries if self._loaded.get(e[-1]) is not None)
        with self._lock:
            if self._closed:
                return
            proc = self._procs.get(pid)
            if proc is None:
                if not self._free_slots:
                    self._drop_proc_locked(next(iter(self._procs)))
                proc = self._procs[pid] = _Proc(self._free_slots.pop())
            self._procs.move_to_end(pid)
            proc.entries = live
            proc.source = source or []
            proc.write(self._mappings_map, self._procs_map, pid, self._flags(pid))
            self._tables_changed()
            self.stats.procs = len(self._procs)

    def _drop_proc(self, pid: int) -> None:
        with self._lock:
            self._drop_proc_locked(pid)
        self._drop_jit(pid, set())

    def _drop_proc_locked(self, pid: int) -> None:
        if self._closed:
            return
        proc = self._procs.pop(pid, None)
        if proc is None:
            return
        self._procs_map.delete(_PID.pack(pid))
        self._tables_changed()
        self._free_slots.append(proc.slot)
        self.stats.procs = len(self._procs)

    def _tables_changed(self) -> None:
        """After each write to the tables (lock held): retires every rule BPF cached from the old ones
        (rule_cache in bpf/maps.bpf.h). A walk reads the generation before the tables, so a rule
        found halfway through a write is cached under the old number."""
        self._generation += 1
        self._generation_map.update(_GENERATION_KEY, _GENERATION.pack(self._generation))


def _bias(segments: tuple[tuple[int, int, int], ...], start: int, pgoff: int) -> int | None:
    """table pc = ip - bias, for a mapping of the file at pgoff loaded at start."""
    for offset, vaddr, filesz in segments:
        if offset <= pgoff < offset + max(filesz, 1) or (pgoff < offset and offset - pgoff < 0x1000):
            return start - pgoff + offset - vaddr
    return None


def _build_order(
    mappings: list[_FileMapping],
) -> list[_FileMapping]:
    """The order in which a process's tables are built and published, each as soon as it is in:
    the executable (the lowest file mapping) and libc first, which every stack of a C program
    crosses to its entry (`__libc_start_call_main`), then the rest, the smallest code first. A
    large binary's table takes seconds under load: samples that stay in the small files are
    whole meanwhile."""
    if not mappings:
        return mappings
    exe = mappings[0][3]

    def key(m: _FileMapping) -> tuple[bool, int]:
        (start, end), _, where, build_id = m
        libc = where is not None and os.path.basename(where.name).startswith(("libc.so", "libc-"))
        return (build_id != exe and not libc, end - start)

    return sorted(mappings, key=key)

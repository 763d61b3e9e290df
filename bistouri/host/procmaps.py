"""Per-process address maps: raw user IPs from the kernel become (file, file offset).

The BPF program sends raw IPs (the kernel's build-id walk cost ~8 µs a stack and
gave up whenever the mmap lock was busy). This module does that mapping in user
space from `/proc/PID/maps`:

- each executable file is opened through `/proc/PID/map_files/<range>` (the very
  file mapped, even deleted or in another mount namespace), else `<path>` resolved
  inside `/proc/PID/root` (safeopen: no symlink, no FIFO); its build id is read once
  per (device, inode) as the maps line names them: a re-read of 60 000 mappings opens
  only the files not seen before;
- an IP becomes (build id, `ip - start + pgoff`), what the kernel's walk gave;
- a table is read when a process becomes a capture target, when a sample says its
  VMA count changed (BPF sends such a sample at once and wakes the reader: a dlopen
  in a process that lives 100 ms is read before it exits), and on a miss
  (rate-limited); it outlives its process, so late samples still map; all tables
  together are bounded in bytes, least recently used out first;
- anonymous executable memory is JIT code: its names come from the process's perf
  map (`/tmp/perf-PID.map` resolved inside `/proc/PID/root`, PID as in its own
  namespace), re-read when it grows, bounded in bytes. The process writes that file:
  it is read only if it is a regular file owned by the process's user (or root),
  never through a symlink, and outside the lock (the ring thread never waits on it).

Used by the ring-buffer thread (`generation`, `resolve`) and the main thread (`track`,
`file`, `jit_name`): one lock guards everything, and is released while a maps file is
read and new files are opened (a process controls those: a stuck FUSE mount in its
namespace must stall only the thread that opens it). A re-read costs tokens in proportion to
the lines read (a process with 60 000 churning mappings is read a few times a second, not
twenty), and at most `max_mappings` executable mappings of a process are kept.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from ..compat import SLOTS, zip_strict
from ..elf import read_build_id
from . import procfs, safeopen


class FrameStatus(IntEnum):
    """What a mapped user frame is (first field of `USER_FRAME`)."""

    FILE = 1  # file id + offset in that file
    VDSO = 2  # raw IP in the vDSO
    ANON = 3  # raw IP in anonymous executable memory (JIT code): named from the perf map
    UNMAPPED = 4  # raw IP no mapping held, even after a re-read; file id is the `Unmapped` reason


class Unmapped(IntEnum):
    """Why an address has no mapping (the metric label is the lower-case name)."""

    NO_MAPPING = 0  # the process lives, its maps hold no executable range there
    PROCESS_GONE = 1  # the process exited before its maps could be read
    CORRUPTED = 2  # not a user-space address: a broken frame-pointer chain
    NO_ACCESS = 3  # the agent may not read the process's maps (CAP_SYS_PTRACE missing)


# One mapped frame in a sample's stacks: status, file id (or reason), offset or IP.
USER_FRAME = struct.Struct("<IIQ")

# The highest user address: x86-64's with 4-level paging, aarch64's with 48-bit addresses (its
# libraries are mapped just below it, at 0xffff...).
_USER_MAX = 0xFFFF_FFFF_FFFF if os.uname().machine == "aarch64" else 0x7FFF_FFFF_FFFF
_MAPPING_BYTES = 120  # estimated Python memory of one mapping in a table
_TABLE_BYTES = 600
_PERF_ENTRY_BYTES = 100  # + the name
_PERF_MARK_BYTES = 64  # of a perf map's parsed part, compared at each read (a rewrite changes them)
# A perf map written this long before its process's start still counts as its own: the start is
# known to a clock tick, and the wall clock may be stepped between.
_STALE_SLACK_S = 1.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_KNOWN_BYTES = 150  # one remembered address: dict slot, int key, 16-byte bytes
_KNOWN_MAX = 16384  # remembered addresses per table, then forgotten all at once
_NAMES_MAX = 1 << 17  # interned JIT names, then forgotten all at once
_LINES_PER_TOKEN = 4096  # a re-read of the maps costs one token per this many lines


@dataclass(frozen=True, **SLOTS)
class MappedFile:
    """A file mapped by a process: its build id and the basename its frames are labelled with."""

    build_id: bytes  # b"" when the file has none or could not be read
    name: str  # basename, what an unnamed frame is labelled with (`libc.so.6+0x2724a`)


@dataclass(**SLOTS)
class _Table:
    """One process's mappings, sorted by start, as parallel arrays (bisected per frame)."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    pgoffs: list[int] = field(default_factory=list)
    files: list[int] = field(default_factory=list)  # file id, or -1 - FrameStatus for vdso/anon
    read_at: float = -1e9
    stale: bool = True  # a sample reported a changed VMA count since the last read
    map_count: int = -1  # VMAs in the maps as read (mm->map_count then): samples carry theirs
    tokens: float = 0.0  # reads allowed now on a changed count (token bucket)
    tokens_at: float = 0.0
    gone: bool = False  # the process exited: the table is what it last was
    denied: bool = False  # its maps are not ours to read (another user's, no CAP_SYS_PTRACE)
    generation: int = 0
    perf: _PerfMap | None = None
    jvm_outcome: str = ""  # of the last perf-map request to this JVM (jvm.py), "" if none
    known: dict[int, bytes] = field(default_factory=dict)  # (ip << 1 | leaf) -> its USER_FRAME

    @property
    def nbytes(self) -> int:
        perf = self.perf.nbytes if self.perf else 0
        return _TABLE_BYTES + _MAPPING_BYTES * len(self.starts) + _KNOWN_BYTES * len(self.known) + perf


@dataclass(**SLOTS)
class _PerfMap:
    """A process's perf map (`/tmp/perf-PID.map`): where it is, who may own it, what was read."""

    root: str  # the directory it is resolved in: `/`, or the process's `/proc/PID/root`
    path: str  # inside that root
    owners: frozenset[int]  # who may own it: the process's user, root
    # When the process started (wall clock, s): a file last written before is an earlier
    # process's with the same pid (root's maps stay in /tmp after their JVM or node exits).
    started: float = float("-inf")
    read_bytes: int = 0  # of the file, parsed so far
    # What tells a rewrite from an append: the file's inode and the last bytes parsed (a file
    # only appended to still has them where they were; `jcmd Compiler.perfmap` rewrites it whole).
    ino: int = -1
    mark: bytes = b""
    checked_at: float = -1e9
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    truncated: bool = False  # the per-map byte bound was reached: later entries ignored


class _PerfRead(NamedTuple):
    size: int  # of the file
    data: bytes  # from the offset asked (from 0 if rewritten), up to the byte bound
    ino: int
    rewritten: bool  # since it was read up to the offset asked
    stale_tail: bytes | None = None  # an earlier process's file: its last bytes, nothing else read


@dataclass(**SLOTS)
class ProcMapsStats:
    """Counters of the mapping tables: reads, size, evictions, perf maps."""

    tables: int = 0
    bytes: int = 0
    reads: int = 0  # /proc/PID/maps reads
    evicted: int = 0  # tables dropped to stay within the byte bound
    perf_map_reads: int = 0
    perf_map_truncated: int = 0  # perf maps that hit their byte bound
    perf_map_rewrites: int = 0  # perf maps found rewritten (not appended to): read from their start
    perf_map_stale: int = 0  # perf maps last written before their process started: not read
    files_over_bound: int = 0  # mappings of files past max_files: named by offset only
    mappings_over_bound: int = 0  # executable mappings past max_mappings in one read: not kept


class ProcMaps:
    """The address maps of the sampled processes, and the files they map."""

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        max_bytes: int = 16 << 20,
        max_files: int = 1 << 16,
        max_mappings: int = 1 << 14,
        perf_map_max_bytes: int = 8 << 20,
        miss_interval_s: float = 1.0,
        change_reads_burst: int = 5,
        change_reads_per_s: float = 20.0,
        perf_map_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc_root = proc_root
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.max_mappings = max_mappings
        self.perf_map_max_bytes = perf_map_max_bytes
        self.miss_interval_s = miss_interval_s
        self.change_reads_burst = change_reads_burst
        self.change_reads_per_s = change_reads_per_s
        self.perf_map_interval_s = perf_map_interval_s
        self._clock = clock
        # Told of each pid whose maps were read anew (the unwind tables follow a dlopen).
        self.on_reread: Callable[[int], None] | None = None
        self._lock = threading.Lock()
        self._tables: OrderedDict[int, _Table] = OrderedDict()
        self._bytes = 0
        self._files: list[MappedFile] = []
        self._file_ids: dict[tuple[bytes, bytes, str], int] = {}  # (dev, inode, name) of the maps line -> id
        # Files that could not be opened when first seen (their process exited meanwhile): looked at
        # again at the next read that maps them, or every later process of that binary is nameless.
        self._unread: set[tuple[bytes, bytes, str]] = set()
        # Where a build id's file was last seen mapped: what uploader.py reads when it is asked for.
        self._where: dict[bytes, MappedPath] = {}
        self._over_bound = -1  # id of the file entry shared past max_files
        self._names: dict[str, str] = {}  # interned JIT names
        self.stats = ProcMapsStats()

    # -- tables -------------------------------------------------------------------
    def track(self, pid: int) -> None:
        """`pid` becomes a capture target: read its maps now (a table kept from an earlier
        process with the same pid must not stand for this one)."""
        with self._lock:
            self._read(pid, self._table(pid))

    def resolve(self, pid: int, ips: tuple[int, ...]) -> bytes:
        """Raw user IPs (leaf first) as `USER_FRAME`s, back to back."""
        out: list[bytes] = []
        with self._lock:
            t = self._table(pid)
            if t.stale and self._may_read(t):
                self._read(pid, t)
            get = t.known.get
            if ips:
                leaf = ips[0]
                out.append(get(leaf << 1 | 1) or self._map_ip(pid, t, leaf, True))
                # Frames are never empty bytes: `or` falls through only on a miss.
                out.extend([get(ip << 1) or self._map_ip(pid, t, ip, False) for ip in ips[1:]])
            if self._bytes > self.max_bytes:
                self._evict()
        return b"".join(out)

    def _map_ip(self, pid: int, t: _Table, ip: int, leaf: bool) -> bytes:
        # Return addresses point past the call: look the caller up one byte earlier, but
        # report the address itself (the symbolizer subtracts 1 again).
        probe = ip if leaf else ip - 1
        if ip == 0 or ip > _USER_MAX:
            return USER_FRAME.pack(FrameStatus.UNMAPPED, Unmapped.CORRUPTED, ip)
        k = bisect.bisect_right(t.starts, probe) - 1
        missed = k < 0 or probe >= t.ends[k]
        if missed and not t.gone and self._clock() - t.read_at >= self.miss_interval_s:
            self._read(pid, t)
            k = bisect.bisect_right(t.starts, probe) - 1
        if k < 0 or probe >= t.ends[k]:
            # Not remembered: a later read of the maps may still find it.
            if t.denied:
                why = Unmapped.NO_ACCESS
            elif t.gone and not t.starts:
                why = Unmapped.PROCESS_GONE
            else:
                why = Unmapped.NO_MAPPING
            return USER_FRAME.pack(FrameStatus.UNMAPPED, why, ip)
        fid = t.files[k]
        if fid >= 0:
            frame = USER_FRAME.pack(FrameStatus.FILE, fid, ip - t.starts[k] + t.pgoffs[k])
        else:
            frame = USER_FRAME.pack(-1 - fid, 0, ip)
        # Each distinct address is looked up once per read of the maps (the common case: a new
        # stack made of return addresses seen before).
        if len(t.known) >= _KNOWN_MAX:
            self._bytes -= _KNOWN_BYTES * len(t.known)
            t.known.clear()
        t.known[ip << 1 | leaf] = frame
        self._bytes += _KNOWN_BYTES
        return frame

    def generation(self, pid: int, map_count: int) -> int:
        """Changes whenever the table of `pid` is re-read (a cached resolution is stale then).

        `map_count`: the VMA count a sample of `pid` carries. A new count means mappings
        changed: the table is read again now, while the process that was just sampled
        lives (a burst of `change_reads_burst` reads, then `change_reads_per_s`: a process
        that maps and unmaps all the time costs a bounded number of reads; the next
        sample after that reads what was missed).
        """
        with self._lock:
            t = self._table(pid)
            if map_count != t.map_count and not t.gone:
                t.stale = True
            if t.stale and self._may_read(t):
                self._read(pid, t)
            return t.generation

    def _may_read(self, t: _Table) -> bool:
        now = self._clock()
        refill = (now - t.tokens_at) * self.change_reads_per_s
        t.tokens = min(float(self.change_reads_burst), t.tokens + refill)
        t.tokens_at = now
        if t.tokens < 1:
            return False
        t.tokens -= 1
        return True

    def _table(self, pid: int) -> _Table:
        t = self._tables.get(pid)
        if t is None:
            t = self._tables[pid] = _Table(tokens=self.change_reads_burst, tokens_at=self._clock())
            self._bytes += t.nbytes
        else:
            self._tables.move_to_end(pid)
        return t

    def _read(self, pid: int, t: _Table) -> None:
        """Read the maps of `pid` into `t`. Called with the lock held: reading the maps and opening
        the files not seen before is done with it released (the other thread never waits on a
        file a process controls), the table is installed under it."""
        base = f"{self.proc_root}/{pid}"
        t.read_at = self._clock()
        t.stale = False
        self.stats.reads += 1
        with _released(self._lock):
            data, denied = _read_maps(base)
            lines = data.splitlines()
            rows, over = _parse_maps(lines, self.max_mappings)
        if not data:
            # Gone (or a zombie without mm): keep what was read before, for late samples.
            t.denied = denied  # another user's process without CAP_SYS_PTRACE: counted apart
            t.gone = True
            return
        self.stats.mappings_over_bound += over
        # One line per VMA, plus the gate area that is not one.
        t.map_count = len(lines) - (b"[vsyscall]" in data)
        # A big table costs more of the re-read budget (the one read here was already paid).
        t.tokens -= len(lines) // _LINES_PER_TOKEN
        new = {
            key: MappedPath(base, r[6], r[5])
            for r in rows
            if r[2] == _FILE and ((key := (r[3], r[4], r[5])) not in self._file_ids or key in self._unread)
        }
        if new:
            with _released(self._lock):
                build_ids = {key: where.build_id() for key, where in new.items()}
            for key, bid in build_ids.items():
                self._add_file(key, bid)
        starts, ends, pgoffs, files = [], [], [], []
        for start, end, kind, dev, inode, name, rng, pgoff in rows:
            if kind == _FILE:
                fid = self._file_ids[(dev, inode, name)]
                bid = self._files[fid].build_id
                if bid:
                    self._where[bid] = MappedPath(base, rng, name)
            else:
                fid = -1 - kind
            starts.append(start)
            ends.append(end)
            pgoffs.append(pgoff)
            files.append(fid)
        before = t.nbytes
        t.denied = False
        t.starts, t.ends, t.pgoffs, t.files = starts, ends, pgoffs, files
        if t.perf is None and -1 - FrameStatus.ANON in files:
            # Where its perf map is, found while the process lives: a short-lived JIT process
            # (`record -- node …`) is often gone when its frames are named.
            t.perf = self._perf_map(pid)
        t.known = {}
        t.gone = False
        t.generation += 1
        if self._tables.get(pid) is t:  # not evicted while the lock was released
            self._bytes += t.nbytes - before
            self._evict()
        if self.on_reread is not None:
            self.on_reread(pid)

    def _add_file(self, key: tuple[bytes, bytes, str], build_id: bytes | None) -> None:
        """`build_id` None: the file could not be opened now (kept nameless until a later read can)."""
        if key in self._unread and build_id is not None:
            self._unread.discard(key)
            fid = self._file_ids[key]
            self._files[fid] = MappedFile(build_id, self._files[fid].name)
            return
        if key in self._file_ids:  # the other thread added it meanwhile
            return
        if len(self._files) >= self.max_files:
            # Bounded: past this many distinct files (a host replacing binaries for days), new
            # ones share one entry, counted, and their frames keep only an offset.
            self.stats.files_over_bound += 1
            self._file_ids[key] = self._over_bound_file()
            return
        if build_id is None:
            self._unread.add(key)
        self._file_ids[key] = len(self._files)
        self._files.append(MappedFile(build_id or b"", os.path.basename(key[2])))

    def _over_bound_file(self) -> int:
        if self._over_bound < 0:
            self._over_bound = len(self._files)
            self._files.append(MappedFile(b"", "[too many files]"))
        return self._over_bound

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and len(self._tables) > 1:
            _, old = self._tables.popitem(last=False)
            self._bytes -= old.nbytes
            self.stats.evicted += 1
        self.stats.tables = len(self._tables)
        self.stats.bytes = self._bytes

    def locate(self, build_id: bytes) -> MappedPath | None:
        """Where the file of this build id was last seen mapped; the caller checks the build id
        of what it opens."""
        with self._lock:
            return self._where.get(build_id)

    def file(self, file_id: int) -> MappedFile:
        """The file behind a `FrameStatus.FILE` frame's id."""
        with self._lock:
            return self._files[file_id]

    # -- JIT names --------------------------------------------------------------------
    def jit_name(self, pid: int, ip: int) -> str | None:
        """The perf-map name of an address in anonymous executable memory, if any."""
        with self._lock:
            t = self._tables.get(pid)
            if t is None:
                return None
            pm = t.perf
            if pm is None:
                pm = t.perf = self._perf_map(pid)
            name = _perf_name(pm, ip)
            if name is not None:
                return name
        self._read_perf_map(pm)
        with self._lock:
            return _perf_name(pm, ip)

    def jit_code(self, pid: int) -> list[tuple[int, int, str]]:
        """The perf map of a tracked process as (start, end, name), sorted, read again if it grew
        (rate-limited as for names): the unwind tables' rows for a JVM's code (unwind/hotspot.py)."""
        with self._lock:
            t = self._tables.get(pid)
            if t is None:
                return []
            pm = t.perf
            if pm is None:
                pm = t.perf = self._perf_map(pid)
        self._read_perf_map(pm)
        with self._lock:
            return list(zip_strict(pm.starts, pm.ends, pm.names))

    def _read_perf_map(self, pm: _PerfMap) -> None:
        """What was appended to the perf map since it was last read, at most every perf_map_interval_s."""
        with self._lock:
            # A map cut at its bound is still looked at: only a rewrite (jcmd, a new process with
            # that pid) can bring it back under the bound, and _read_perf_file reads nothing else.
            if self._clock() - pm.checked_at < self.perf_map_interval_s:
                return
            pm.checked_at = self._clock()
            offset, ino, mark = pm.read_bytes, pm.ino, pm.mark
        # The process writes that file: read outside the lock (see safeopen), parsed under it.
        got = self._read_perf_file(pm, offset, ino, mark)
        with self._lock:
            if got is not None and pm.read_bytes == offset:
                before = pm.nbytes
                size, data, new_ino, rewritten, stale_tail = got
                if stale_tail is not None:
                    # Skipped as if parsed: what the process appends is read, its own rewrite too.
                    self.stats.perf_map_stale += 1
                    pm.read_bytes, pm.ino, pm.mark = size, new_ino, stale_tail
                    return
                if rewritten:  # by someone else's jcmd, or another process with the same pid
                    self.stats.perf_map_rewrites += 1
                    pm.read_bytes, pm.starts, pm.ends, pm.names, pm.nbytes = 0, [], [], [], 0
                    pm.mark, pm.truncated = b"", False
                pm.ino = new_ino
                self._parse_perf_map(pm, size, data)
                self._bytes += pm.nbytes - before
                self._evict()

    def perf_map_requested(self, pid: int, outcome: str) -> None:
        """A perf-map request to the JVM `pid` ended (jvm.py; on its worker thread). Written: the
        file was rewritten whole, with what was compiled since and code moved or freed, so it is
        read again from its start at the next name looked up."""
        with self._lock:
            t = self._tables.get(pid)
            if t is None or outcome == "not_jvm":  # a process gone or exec'd meanwhile says nothing
                return
            t.jvm_outcome = outcome
            pm = t.perf
            if outcome == "ok" and pm is not None:  # where it is stays known, its content goes
                self._bytes -= pm.nbytes
                pm.read_bytes, pm.starts, pm.ends, pm.names, pm.nbytes = 0, [], [], [], 0
                pm.checked_at, pm.truncated, pm.mark = -1e9, False, b""

    def runtime(self, pid: int) -> tuple[str, str, bool]:
        """What runs JIT code in `pid`, as its maps say: ("jvm" | "node" | "", the outcome of
        the last perf-map request to it, whether a perf map of it named anything)."""
        with self._lock:
            t = self._tables.get(pid)
            if t is None:
                return "", "", False
            names = {self._files[f].name for f in set(t.files) if f >= 0}
            named = t.perf is not None and bool(t.perf.names)
            outcome = t.jvm_outcome
        if "libjvm.so" in names:
            return "jvm", outcome, named
        if "node" in names or any(n.startswith("libnode.so") for n in names):
            return "node", outcome, named
        return "", outcome, named

    def _perf_map(self, pid: int) -> _PerfMap:
        """Named with its pid in its own namespace (NSpid); resolved in the process's root, or in
        ours when it shares our mount namespace (that path outlives the process). The owners are
        found while the process lives: root, and the user of /proc/PID."""
        nspid = pid
        base = f"{self.proc_root}/{pid}"
        started = float("-inf")
        stat = procfs.read_stat(pid, self.proc_root)
        if stat is not None:  # starttime is in boot-clock ticks, a file's mtime on the wall clock
            since = time.clock_gettime(time.CLOCK_BOOTTIME) - stat.starttime / _CLK_TCK
            started = time.time() - since
        try:
            with open(f"{base}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NSpid:"):
                        nspid = int(line.split()[-1])
                        break
        except (OSError, ValueError):
            pass
        try:
            owners = frozenset((0, os.stat(base).st_uid))
        except OSError:
            owners = frozenset((0,))
        root = f"{base}/root"
        try:
            if os.readlink(f"{base}/ns/mnt") == os.readlink(f"{self.proc_root}/self/ns/mnt"):
                root = "/"
        except OSError:
            pass
        return _PerfMap(root, f"tmp/perf-{nspid}.map", owners, started)

    def _read_perf_file(self, pm: _PerfMap, offset: int, ino: int, mark: bytes) -> _PerfRead | None:
        """What the perf map holds past `offset`, None if it cannot be read. Rewritten: another
        inode, or the bytes before `offset` are not `mark`. A file never read that was last
        written before the process started is an earlier process's: skipped whole."""
        try:
            root = safeopen.open_root(pm.root)
            try:
                fd = safeopen.open_in_root(root, pm.path, owners=pm.owners)
            finally:
                os.close(root)
        except OSError:  # absent, gone with its process, or refused (counted by safeopen)
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            rewritten = offset > 0 and (
                st.st_ino != ino or size < offset or os.pread(fd, len(mark), offset - len(mark)) != mark
            )
            if rewritten:
                offset = 0
            if offset == 0 and st.st_mtime < pm.started - _STALE_SLACK_S:
                tail = os.pread(fd, _PERF_MARK_BYTES, max(0, size - _PERF_MARK_BYTES))
                return _PerfRead(size, b"", st.st_ino, rewritten, tail)
            if size <= offset:
                return _PerfRead(size, b"", st.st_ino, rewritten)
            data = os.pread(fd, min(size, self.perf_map_max_bytes) - offset, offset)
            return _PerfRead(size, data, st.st_ino, rewritten)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _parse_perf_map(self, pm: _PerfMap, size: int, data: bytes) -> None:
        """Parse what was appended since the last read (a rewrite was found by _read_perf_file)."""
        if not data:
            return
        self.stats.perf_map_reads += 1
        # A partial last line waits for the next read.
        complete = data.rfind(b"\n") + 1
        pm.read_bytes += complete
        pm.mark = (pm.mark + data[:complete])[-_PERF_MARK_BYTES:]
        if size > self.perf_map_max_bytes and not pm.truncated:  # what lies past it is never read
            pm.truncated = True
            self.stats.perf_map_truncated += 1
        entries = list(zip_strict(pm.starts, pm.ends, pm.names))
        for line in data[:complete].splitlines():
            parts = line.split(None, 2)
            if len(parts) < 3:
                continue
            try:
                start, size_ = int(parts[0], 16), int(parts[1], 16)
            except ValueError:
                continue
            name = parts[2].decode(errors="replace")
            if len(self._names) >= _NAMES_MAX:  # interning only: names in use stay valid
                self._names.clear()
            name = self._names.setdefault(name, name)
            entries.append((start, start + size_, name))
            pm.nbytes += _PERF_ENTRY_BYTES + len(name)
        # Code moved or regenerated at the same address: the later entry wins.
        entries.sort(key=lambda e: e[0])
        dedup: dict[int, tuple[int, int, str]] = {}
        for e in entries:
            dedup[e[0]] = e
        ordered = list(dedup.values())
        pm.starts = [e[0] for e in ordered]
        pm.ends = [e[1] for e in ordered]
        pm.names = [e[2] for e in ordered]


_FILE = -1  # a row of _parse_maps that is a file mapping (else its FrameStatus)


def _read_maps(base: str) -> tuple[bytes, bool]:
    """The content of `base`/maps, and whether it was denied (b"" when unreadable)."""
    try:
        with open(f"{base}/maps", "rb") as f:
            return f.read(), False
    except PermissionError:
        return b"", True
    except OSError:
        return b"", False


# start, end, _FILE or a FrameStatus, device, inode, path, range, pgoff
_Row = tuple[int, int, int, bytes, bytes, str, str, int]


def _parse_maps(lines: list[bytes], max_mappings: int) -> tuple[list[_Row], int]:
    """The executable mappings of a maps file (at most `max_mappings`), and how many were past it."""
    rows: list[_Row] = []
    over = 0
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5 or b"x" not in parts[1]:
            continue
        if len(rows) >= max_mappings:
            over += 1
            continue
        lo, _, hi = parts[0].partition(b"-")
        path = parts[5].decode(errors="replace") if len(parts) > 5 else ""
        if path.startswith("/") and parts[4] != b"0":
            kind = _FILE
            path = path.removesuffix(" (deleted)")
        elif path == "[vdso]":
            kind = FrameStatus.VDSO
        elif path.startswith("[") and not path.startswith("[anon"):
            continue  # [vsyscall] and the like: not user code a stack can name
        else:
            kind = FrameStatus.ANON  # anonymous executable memory: JIT code
        rows.append(
            (int(lo, 16), int(hi, 16), kind, parts[3], parts[4], path, parts[0].decode(), int(parts[2], 16))
        )
    return rows, over


@contextmanager
def _released(lock: threading.Lock) -> Iterator[None]:
    """The lock held by the caller, released for some I/O."""
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


def _perf_name(pm: _PerfMap, ip: int) -> str | None:
    k = bisect.bisect_right(pm.starts, ip) - 1
    return pm.names[k] if k >= 0 and ip < pm.ends[k] else None


@dataclass(frozen=True, **SLOTS)
class MappedPath:
    """A file a process maps, as a line of its maps names it."""

    proc: str  # /proc/PID
    range: str  # the line's first field, `start-end` in hex
    name: str  # its path in the process's root

    def open(self, *, max_bytes: int | None = None) -> int:
        """A descriptor of the file (see safeopen): the very file through map_files, else `name`
        inside the process's root (no symlink, a regular file only, at most `max_bytes`). OSError if
        neither."""
        try:
            return safeopen.open_mapped(f"{self.proc}/map_files/{self.range}", max_bytes=max_bytes)
        except safeopen.Refused:
            raise
        except OSError:
            root = safeopen.open_root(f"{self.proc}/root")
            try:
                return safeopen.open_in_root(root, self.name, max_bytes=max_bytes)
            finally:
                os.close(root)

    def build_id(self) -> bytes | None:
        """Its build id, b"" when it has none or is refused (safeopen), None when it cannot be opened
        now (its process exited between the maps and the open: another process may map it later)."""
        try:
            fd = self.open()
        except safeopen.Refused:
            return b""
        except OSError:
            return None
        try:
            return read_build_id(safeopen.fd_path(fd)) or b""
        finally:
            os.close(fd)


__all__ = ["USER_FRAME", "FrameStatus", "MappedFile", "MappedPath", "ProcMaps", "ProcMapsStats", "Unmapped"]

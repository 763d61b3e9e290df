"""Per-process address maps: raw user IPs from the kernel become (file, file offset).

The BPF program sends raw IPs (the kernel's build-id walk cost ~8 µs a stack and
gave up whenever the mmap lock was busy). This module does that mapping in user
space from `/proc/PID/maps`:

- each executable file is opened through `/proc/PID/map_files/<range>` (the very
  file mapped, even deleted or in another mount namespace), else
  `/proc/PID/root/<path>`; its build id is read once per (device, inode, mtime);
- an IP becomes (build id, `ip - start + pgoff`), what the kernel's walk gave;
- a table is read when a process becomes a capture target, when a sample says its
  VMA count changed (BPF sends such a sample at once and wakes the reader: a dlopen
  in a process that lives 100 ms is read before it exits), and on a miss
  (rate-limited); it outlives its process, so late samples still map; all tables
  together are bounded in bytes, least recently used out first;
- anonymous executable memory is JIT code: its names come from the process's perf
  map (`/tmp/perf-PID.map` seen through `/proc/PID/root`, PID as in its own
  namespace), re-read when it grows, bounded in bytes.

Used by the ring-buffer thread (`generation`, `resolve`) and the main thread (`track`,
`file`, `jit_name`): one lock guards everything.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from .symbolizer.elf import read_build_id


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

_USER_MAX = 0x7FFF_FFFF_FFFF  # x86_64, 4-level paging
_MAPPING_BYTES = 120  # estimated Python memory of one mapping in a table
_TABLE_BYTES = 600
_PERF_ENTRY_BYTES = 100  # + the name
_KNOWN_BYTES = 150  # one remembered address: dict slot, int key, 16-byte bytes
_KNOWN_MAX = 16384  # remembered addresses per table, then forgotten all at once
_NAMES_MAX = 1 << 17  # interned JIT names, then forgotten all at once


@dataclass(frozen=True, slots=True)
class MappedFile:
    build_id: bytes  # b"" when the file has none or could not be read
    name: str  # basename, what an unnamed frame is labelled with (`libc.so.6+0x2724a`)


@dataclass(slots=True)
class _Table:
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
    known: dict[int, bytes] = field(default_factory=dict)  # (ip << 1 | leaf) -> its USER_FRAME

    @property
    def nbytes(self) -> int:
        perf = self.perf.nbytes if self.perf else 0
        return _TABLE_BYTES + _MAPPING_BYTES * len(self.starts) + _KNOWN_BYTES * len(self.known) + perf


@dataclass(slots=True)
class _PerfMap:
    path: str
    read_bytes: int = 0  # of the file, parsed so far
    checked_at: float = -1e9
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    truncated: bool = False  # the per-map byte bound was reached: later entries ignored


@dataclass(slots=True)
class ProcMapsStats:
    tables: int = 0
    bytes: int = 0
    reads: int = 0  # /proc/PID/maps reads
    evicted: int = 0  # tables dropped to stay within the byte bound
    perf_map_reads: int = 0
    perf_map_truncated: int = 0  # perf maps that hit their byte bound
    files_over_bound: int = 0  # mappings of files past max_files: named by offset only


class ProcMaps:
    """The address maps of the sampled processes, and the files they map."""

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        max_bytes: int = 16 << 20,
        max_files: int = 1 << 16,
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
        self._file_ids: dict[tuple[int, int, int, str], int] = {}  # (dev, inode, mtime_ns, name) -> id
        # Where a build id's file was last seen mapped: what uploader.py reads when it is asked for.
        self._where: dict[bytes, tuple[str, str]] = {}  # build id -> (map_files path, root path)
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
        base = f"{self.proc_root}/{pid}"
        t.read_at = self._clock()
        t.stale = False
        self.stats.reads += 1
        try:
            with open(f"{base}/maps", "rb") as f:
                data = f.read()
        except PermissionError:
            # Another user's process without CAP_SYS_PTRACE: nothing to map with, counted apart.
            t.denied = True
            data = b""
        except OSError:
            data = b""
        if not data:
            # Gone (or a zombie without mm): keep what was read before, for late samples.
            t.gone = True
            return
        t.denied = False
        before = t.nbytes
        starts, ends, pgoffs, files = [], [], [], []
        lines = data.splitlines()
        # One line per VMA, plus the gate area that is not one.
        t.map_count = len(lines) - (b"[vsyscall]" in data)
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 5 or b"x" not in parts[1]:
                continue
            lo, _, hi = parts[0].partition(b"-")
            start, end = int(lo, 16), int(hi, 16)
            path = parts[5].decode(errors="replace") if len(parts) > 5 else ""
            if path.startswith("/") and parts[4] != b"0":
                fid = self._file_id(base, parts[0].decode(), parts[3], int(parts[4]), path)
            elif path == "[vdso]":
                fid = -1 - FrameStatus.VDSO
            elif path.startswith("[") and not path.startswith("[anon"):
                continue  # [vsyscall] and the like: not user code a stack can name
            else:
                fid = -1 - FrameStatus.ANON  # anonymous executable memory: JIT code
            starts.append(start)
            ends.append(end)
            pgoffs.append(int(parts[2], 16))
            files.append(fid)
        t.starts, t.ends, t.pgoffs, t.files = starts, ends, pgoffs, files
        if t.perf is None and -1 - FrameStatus.ANON in files:
            # Where its perf map is, found while the process lives: a short-lived JIT process
            # (`record -- node …`) is often gone when its frames are named.
            t.perf = _PerfMap(self._perf_map_path(pid))
        t.known = {}
        t.gone = False
        t.generation += 1
        self._bytes += t.nbytes - before
        self._evict()
        if self.on_reread is not None:
            self.on_reread(pid)

    def _file_id(self, base: str, rng: str, dev: bytes, inode: int, path: str) -> int:
        name = path.removesuffix(" (deleted)")
        via_map_files = f"{base}/map_files/{rng}"
        opened = via_map_files
        try:
            st = os.stat(via_map_files)
        except OSError:
            opened = f"{base}/root{name}"
            try:
                st = os.stat(opened)
            except OSError:
                st = None
        mtime = st.st_mtime_ns if st is not None else 0
        major, _, minor = dev.partition(b":")
        key = (int(major, 16) << 20 | int(minor or b"0", 16), inode, mtime, name)
        fid = self._file_ids.get(key)
        if fid is not None:
            bid = self._files[fid].build_id
            if bid:
                self._where[bid] = (via_map_files, f"{base}/root{name}")
            return fid
        if len(self._files) >= self.max_files:
            # Bounded: past this many distinct files (a host replacing binaries for days), new
            # ones share one entry, counted, and their frames keep only an offset.
            self.stats.files_over_bound += 1
            return self._over_bound_file()
        build_id = (read_build_id(opened) if st is not None else None) or b""
        fid = len(self._files)
        self._files.append(MappedFile(build_id, os.path.basename(name)))
        self._file_ids[key] = fid
        if build_id:
            self._where[build_id] = (via_map_files, f"{base}/root{name}")
        return fid

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

    def locate(self, build_id: bytes) -> tuple[str, ...]:
        """Paths that may open the file of this build id, the process's own view first (a deleted
        file, another mount namespace); the caller checks the build id of what it opens."""
        with self._lock:
            return self._where.get(build_id, ())

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
            if t.perf is None:
                t.perf = _PerfMap(self._perf_map_path(pid))
            pm = t.perf
            k = bisect.bisect_right(pm.starts, ip) - 1
            if (k < 0 or ip >= pm.ends[k]) and self._clock() - pm.checked_at >= self.perf_map_interval_s:
                before = pm.nbytes
                self._read_perf_map(pm)
                self._bytes += pm.nbytes - before
                self._evict()
                k = bisect.bisect_right(pm.starts, ip) - 1
            if k >= 0 and ip < pm.ends[k]:
                return pm.names[k]
            return None

    def _perf_map_path(self, pid: int) -> str:
        """Named with its pid in its own namespace (NSpid); through the process's root, or
        directly when it shares our mount namespace (that path outlives the process)."""
        nspid = pid
        try:
            with open(f"{self.proc_root}/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NSpid:"):
                        nspid = int(line.split()[-1])
                        break
        except (OSError, ValueError):
            pass
        try:
            if os.readlink(f"{self.proc_root}/{pid}/ns/mnt") == os.readlink(f"{self.proc_root}/self/ns/mnt"):
                return f"/tmp/perf-{nspid}.map"
        except OSError:
            pass
        return f"{self.proc_root}/{pid}/root/tmp/perf-{nspid}.map"

    def _read_perf_map(self, pm: _PerfMap) -> None:
        """Parse what was appended since the last read (the file only grows)."""
        pm.checked_at = self._clock()
        if pm.truncated:
            return
        try:
            with open(pm.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < pm.read_bytes:  # rewritten (a new process with the same pid): start over
                    pm.read_bytes, pm.starts, pm.ends, pm.names, pm.nbytes = 0, [], [], [], 0
                if size == pm.read_bytes:
                    return
                f.seek(pm.read_bytes)
                data = f.read(min(size, self.perf_map_max_bytes) - pm.read_bytes)
        except OSError:
            return
        self.stats.perf_map_reads += 1
        # A partial last line waits for the next read.
        complete = data.rfind(b"\n") + 1
        pm.read_bytes += complete
        if size > self.perf_map_max_bytes:  # what lies past the bound is never read
            pm.truncated = True
            self.stats.perf_map_truncated += 1
        entries = list(zip(pm.starts, pm.ends, pm.names, strict=True))
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


__all__ = ["USER_FRAME", "FrameStatus", "MappedFile", "ProcMaps", "ProcMapsStats", "Unmapped"]

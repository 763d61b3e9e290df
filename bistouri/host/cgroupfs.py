"""Cgroup usage counters: the one reader of cgroup files for the episode's aggressors.

A cgroup is read in its cgroup2 directory first: cpu.stat (usage_usec), io.stat (bytes and ios),
memory.current and memory.stat (pgsteal). On a hybrid host the cgroup2 tree has no io or memory
controller (they sit on v1 hierarchies), so those files are missing there: each missing counter
is then read at the same cgroup path under the v1 hierarchy that holds its controller:

- memory: memory.usage_in_bytes, and memory.stat total_pgpgout (pages uncharged from the cgroup
  and its children: what reclaim took, and pages freed; v1 has no pgsteal);
- I/O: blkio.throttle.io_service_bytes_recursive / io_serviced_recursive (bytes and ios of the
  bios the cgroup's tasks submitted), else blkio.io_service_bytes_recursive / io_serviced_recursive;
- CPU: cpuacct.usage (ns) when cpu.stat is absent.

The hierarchies are found in /proc/self/mountinfo (mounts.py, `CgroupMounts`), never assumed. v1 accounts
buffered writeback to the flusher, not to the writer: a v1 cgroup's I/O is its reads, direct I/O
and the writeback its own tasks start (fsync, sync_file_range).
Parsers are pure (bytes in, numbers out); `CgroupReader` does the reading.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..compat import SLOTS
from . import mounts

MAX_FILE_BYTES = 65536  # a cgroup file read past this is cut (io.stat of thousands of devices)
# v1 controllers whose files stand in for missing cgroup2 ones.
V1_CONTROLLERS = ("memory", "blkio", "cpuacct")


@dataclass(frozen=True, **SLOTS)
class Hierarchy:
    """A mounted cgroup hierarchy: where it is mounted, and which cgroup its mount shows as root
    (the mountinfo root field: "/" on a host, a sub-path in a container)."""

    mount: str
    root: str = "/"

    def path_of(self, cgroup: str) -> str | None:
        """The directory of `cgroup` (a path from the hierarchy's root, "/a/b") in this mount;
        None if the mount does not show it."""
        rel = os.path.relpath(cgroup, self.root)
        if rel == ".":
            return self.mount
        if rel.startswith(".."):
            return None
        return os.path.join(self.mount, rel)

    def cgroup_of(self, directory: str) -> str | None:
        """The cgroup path ("/a/b") of a directory of this mount; None if outside it."""
        rel = os.path.relpath(directory, self.mount)
        if rel.startswith(".."):
            return None
        return os.path.normpath(os.path.join(self.root, rel))


@dataclass(frozen=True, **SLOTS)
class CgroupMounts:
    """The cgroup2 hierarchy and the v1 hierarchies by controller (one value, from mountinfo)."""

    v2: Hierarchy | None = None
    v1: Mapping[str, Hierarchy] = field(default_factory=dict)


def cgroup_mounts(found: Iterable[mounts.Mount]) -> CgroupMounts:
    """The cgroup hierarchies among mounts: the first cgroup2 mount, and per v1 controller (from the
    super options, e.g. "rw,cpu,cpuacct") its first mount."""
    v2: Hierarchy | None = None
    v1: dict[str, Hierarchy] = {}
    for m in found:
        if m.fstype == "cgroup2" and v2 is None:
            v2 = Hierarchy(m.point, m.root)
        elif m.fstype == "cgroup":
            for name in m.super_options:
                if name in V1_CONTROLLERS:
                    v1.setdefault(name, Hierarchy(m.point, m.root))
    return CgroupMounts(v2, v1)


def parse_mountinfo(data: bytes) -> CgroupMounts:
    """The cgroup hierarchies of /proc/PID/mountinfo content."""
    return cgroup_mounts(mounts.parse(data))


def find_mounts(proc_root: str = "/proc") -> CgroupMounts:
    """This host's cgroup hierarchies, as this process sees them."""
    return cgroup_mounts(mounts.read(proc_root))


# -- counters and their parsers -----------------------------------------------------------------


@dataclass(frozen=True, **SLOTS)
class CgroupUsage:
    """Cumulative counters of one cgroup (memory_bytes is a level, not a counter)."""

    cpu_usec: int = 0
    io_bytes: int = 0
    io_ops: int = 0
    memory_bytes: int = 0
    reclaimed_pages: int = 0


def _keyed(data: bytes) -> dict[bytes, int]:
    out = {}
    for line in data.splitlines():
        key, _, value = line.partition(b" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def _int(data: bytes | None) -> int | None:
    try:
        return int(data) if data is not None else None
    except ValueError:
        return None


def parse_cpu_stat(data: bytes) -> int:
    """usage_usec of a cpu.stat file."""
    return _keyed(data).get(b"usage_usec", 0)


def parse_io_stat(data: bytes) -> tuple[int, int]:
    """(rbytes + wbytes, rios + wios) summed over the devices of an io.stat file."""
    nbytes = ops = 0
    for line in data.splitlines():
        for field_ in line.split()[1:]:
            key, sep, value = field_.partition(b"=")
            if not sep or not value.isdigit():
                continue
            if key in (b"rbytes", b"wbytes"):
                nbytes += int(value)
            elif key in (b"rios", b"wios"):
                ops += int(value)
    return nbytes, ops


def parse_memory_stat(data: bytes) -> int:
    """Pages reclaimed from the cgroup (pgsteal) of a cgroup2 memory.stat file."""
    return _keyed(data).get(b"pgsteal", 0)


def parse_v1_memory_stat(data: bytes) -> int:
    """Pages uncharged from the cgroup and its children (total_pgpgout) of a v1 memory.stat file:
    v1 has no pgsteal; under a limit, what reclaim took is most of it."""
    return _keyed(data).get(b"total_pgpgout", 0)


def parse_blkio(data: bytes) -> int:
    """Read + Write summed over the devices of a v1 blkio io_service_bytes / io_serviced file
    ("MAJ:MIN Read N" lines; the Sync/Async/Total lines restate them)."""
    total = 0
    for line in data.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in (b"Read", b"Write") and fields[2].isdigit():
            total += int(fields[2])
    return total


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(MAX_FILE_BYTES)
    except OSError:
        return None  # the cgroup went away, or the controller is not there


class CgroupReader:
    """Reads cgroups' usage: cgroup2 files, and the v1 hierarchies' for the ones missing there."""

    def __init__(self, mounts: CgroupMounts) -> None:
        self.mounts = mounts

    def _v1(self, controller: str, cgroup: str | None, name: str) -> bytes | None:
        hier = self.mounts.v1.get(controller)
        if hier is None or cgroup is None:
            return None
        directory = hier.path_of(cgroup)
        return None if directory is None else _read(os.path.join(directory, name))

    def usage(self, cgroup_dir: str) -> CgroupUsage:
        """The counters of the cgroup2 directory `cgroup_dir`."""
        v2 = self.mounts.v2
        cgroup = v2.cgroup_of(cgroup_dir) if v2 is not None else None

        cpu = _read(os.path.join(cgroup_dir, "cpu.stat"))
        if cpu is not None:
            cpu_usec = parse_cpu_stat(cpu)
        else:
            cpu_usec = (_int(self._v1("cpuacct", cgroup, "cpuacct.usage")) or 0) // 1000

        io = _read(os.path.join(cgroup_dir, "io.stat"))
        if io is not None:
            io_bytes, io_ops = parse_io_stat(io)
        else:
            io_bytes = io_ops = 0
            for prefix in ("blkio.throttle.", "blkio."):
                nbytes = self._v1("blkio", cgroup, prefix + "io_service_bytes_recursive")
                if nbytes is not None:
                    io_bytes = parse_blkio(nbytes)
                    io_ops = parse_blkio(self._v1("blkio", cgroup, prefix + "io_serviced_recursive") or b"")
                    break

        current = _int(_read(os.path.join(cgroup_dir, "memory.current")))
        if current is None:
            current = _int(self._v1("memory", cgroup, "memory.usage_in_bytes"))
        mstat = _read(os.path.join(cgroup_dir, "memory.stat"))
        if mstat is not None:
            reclaimed = parse_memory_stat(mstat)
        else:
            reclaimed = parse_v1_memory_stat(self._v1("memory", cgroup, "memory.stat") or b"")
        return CgroupUsage(cpu_usec, io_bytes, io_ops, current or 0, reclaimed)

    def scan(self, cgroup_root: str, max_cgroups: int) -> tuple[dict[str, CgroupUsage], int]:
        """Usage of the leaf cgroups under the cgroup2 directory `cgroup_root` (paths relative to
        it, "/a/b"), breadth first, and as "/" what the root's own processes (and kernel threads)
        used: the root's hierarchical counters minus its children's. Returns them and how many
        directories were left unread past `max_cgroups` (then "/" is left out too: it would hold
        their usage)."""
        out: dict[str, CgroupUsage] = {}
        todo = [cgroup_root]
        top: list[str] = []
        seen = dropped = 0
        while todo:
            d = todo.pop(0)
            try:
                children = [e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue  # removed meanwhile
            if d == cgroup_root:
                top = children
            for c in children:
                if seen >= max_cgroups:
                    dropped += 1
                    continue
                seen += 1
                todo.append(c)
            if not children and d != cgroup_root:
                out["/" + os.path.relpath(d, cgroup_root)] = self.usage(d)
        if not dropped:
            root = self.usage(cgroup_root)
            kids = [self.usage(c) for c in top]
            out["/"] = CgroupUsage(
                cpu_usec=max(0, root.cpu_usec - sum(k.cpu_usec for k in kids)),
                io_bytes=max(0, root.io_bytes - sum(k.io_bytes for k in kids)),
                io_ops=max(0, root.io_ops - sum(k.io_ops for k in kids)),
            )
        return out, dropped

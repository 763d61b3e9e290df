"""cgroupfs.py: the hierarchies from mountinfo, the v1 parsers, and v1 files standing in for
cgroup2 ones a hybrid host lacks (fixture trees, no host cgroup touched)."""

from __future__ import annotations

from pathlib import Path

from bistouri.host.cgroupfs import (
    CgroupMounts,
    CgroupReader,
    CgroupUsage,
    Hierarchy,
    parse_blkio,
    parse_mountinfo,
    parse_v1_memory_stat,
)

# This development host's, plus a container-style sub-root and an escaped mount point.
MOUNTINFO = b"""\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 /kube/pod1 /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/blk\\040io rw,relatime - cgroup cgroup rw,blkio
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
99 31 0:38 / /mnt/again rw,relatime - cgroup2 cgroup2 rw
"""


def test_hierarchies_come_from_mountinfo():
    m = parse_mountinfo(MOUNTINFO)
    assert m.v2 == Hierarchy("/sys/fs/cgroup/unified", "/")  # the first cgroup2 mount
    assert m.v1 == {
        "cpuacct": Hierarchy("/sys/fs/cgroup/cpuacct", "/"),
        "memory": Hierarchy("/sys/fs/cgroup/memory", "/kube/pod1"),
        "blkio": Hierarchy("/sys/fs/cgroup/blk io", "/"),
    }
    assert parse_mountinfo(b"garbage\n1 2 3\n") == CgroupMounts()


def test_a_cgroup_path_maps_between_mounts():
    mem = Hierarchy("/sys/fs/cgroup/memory", "/kube/pod1")
    assert mem.path_of("/kube/pod1/app") == "/sys/fs/cgroup/memory/app"
    assert mem.path_of("/kube/pod1") == "/sys/fs/cgroup/memory"
    assert mem.path_of("/other") is None  # outside what the mount shows
    v2 = Hierarchy("/sys/fs/cgroup/unified")
    assert v2.cgroup_of("/sys/fs/cgroup/unified/a/b") == "/a/b" and v2.cgroup_of("/tmp") is None


def test_v1_parsers():
    blkio = b"254:0 Read 4096\n254:0 Write 8192\n254:0 Sync 12288\n254:0 Async 0\n254:0 Total 12288\n"
    assert parse_blkio(blkio + b"8:0 Read 1\n8:0 Write 0\nTotal 12289\n") == 12289
    assert parse_blkio(b"Total 0\n") == 0
    assert parse_v1_memory_stat(b"cache 4096\npgpgout 7\ntotal_pgpgout 70\n") == 70


def _write(path: Path, name: str, data: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(data)


def test_missing_cgroup2_files_are_read_from_the_v1_hierarchies(tmp_path):
    v2, mem, blk, acct = (tmp_path / n for n in ("unified", "memory", "blkio", "cpuacct"))
    mounts = CgroupMounts(
        Hierarchy(str(v2)),
        {"memory": Hierarchy(str(mem)), "blkio": Hierarchy(str(blk)), "cpuacct": Hierarchy(str(acct))},
    )
    # A hybrid host: cpu.stat in cgroup2, memory and I/O only in v1.
    _write(v2 / "svc" / "app", "cpu.stat", "usage_usec 1500\n")
    _write(mem / "svc" / "app", "memory.usage_in_bytes", "65536\n")
    _write(mem / "svc" / "app", "memory.stat", "total_pgpgout 9\n")
    app = blk / "svc" / "app"
    _write(app, "blkio.throttle.io_service_bytes_recursive", "254:0 Read 100\n254:0 Write 900\n")
    _write(blk / "svc" / "app", "blkio.throttle.io_serviced_recursive", "254:0 Read 1\n254:0 Write 3\n")
    reader = CgroupReader(mounts)
    assert reader.usage(str(v2 / "svc" / "app")) == CgroupUsage(1500, 1000, 4, 65536, 9)
    # No cpu.stat: cpuacct.usage (ns); an older blkio without throttling: the CFQ-era files.
    _write(v2 / "old", "cgroup.procs", "")
    _write(acct / "old", "cpuacct.usage", "7000000\n")
    _write(blk / "old", "blkio.io_service_bytes_recursive", "8:0 Write 4096\n")
    assert reader.usage(str(v2 / "old")) == CgroupUsage(7000, 4096, 0, 0, 0)
    # cgroup2 files win where they exist, and a cgroup absent from v1 counts 0 there.
    _write(v2 / "new", "io.stat", "8:0 rbytes=5 wbytes=5 rios=1 wios=1\n")
    _write(v2 / "new", "memory.current", "10\n")
    _write(blk / "new", "blkio.throttle.io_service_bytes_recursive", "8:0 Write 999\n")
    assert reader.usage(str(v2 / "new")) == CgroupUsage(0, 10, 2, 10, 0)
    usage, dropped = reader.scan(str(v2), 100)
    assert dropped == 0 and usage["/svc/app"].io_bytes == 1000 and usage["/new"].memory_bytes == 10

"""episode.py: cgroup file parsers, the window differences and their ranking, the bounds."""

from __future__ import annotations

from pathlib import Path

from bistouri import wire
from bistouri.bpf import abi
from bistouri.capture.episode import (
    DROP_AGGRESSORS,
    DROP_CGROUPS,
    DROP_VICTIMS,
    PAGE_SIZE,
    EpisodeProbe,
    StateTimes,
    aggressors,
    state_times,
    summary_lines,
    victims,
)
from bistouri.errors import BistouriError
from bistouri.host.cgroupfs import (
    CgroupMounts,
    CgroupReader,
    parse_cpu_stat,
    parse_io_stat,
    parse_memory_stat,
)


def scan_cgroups(root: str, max_cgroups: int = 2048):
    """A fixture tree alone: no v1 hierarchy stands in for its missing files."""
    return CgroupReader(CgroupMounts()).scan(root, max_cgroups)


def test_parsers_read_by_key():
    assert parse_cpu_stat(b"usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n") == 1500
    io = b"8:0 rbytes=4096 wbytes=8192 rios=1 wios=2 dbytes=0 dios=0\n259:0 rbytes=1 wbytes=0 rios=3 wios=0\n"
    assert parse_io_stat(io) == (4096 + 8192 + 1, 1 + 2 + 3)
    assert parse_memory_stat(b"anon 10\npgscan 99\npgsteal 42\n") == 42
    assert parse_cpu_stat(b"garbage\nusage_usec x\n") == 0 and parse_io_stat(b"8:0 rbytes=?\n") == (0, 0)


def _cgroup(root: Path, rel: str, cpu_usec: int, memory: int | None = None, io: bytes | None = None) -> None:
    d = root / rel.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.stat").write_bytes(f"usage_usec {cpu_usec}\n".encode())
    if memory is not None:
        (d / "memory.current").write_bytes(f"{memory}\n".encode())
        (d / "memory.stat").write_bytes(b"pgsteal 10\n")
    if io is not None:
        (d / "io.stat").write_bytes(io)


def test_leaf_cgroups_ranked_by_the_trigger_resource(tmp_path):
    # cpu.stat is hierarchical: a parent holds its children's time, the root the whole machine's.
    _cgroup(tmp_path, "/", 1_000)
    _cgroup(tmp_path, "/a", 200)  # a parent: not ranked itself
    _cgroup(tmp_path, "/a/hogs", 100)
    _cgroup(tmp_path, "/a/victim", 100, memory=1000)
    _cgroup(tmp_path, "/io", 0, io=b"8:0 rbytes=0 wbytes=0 rios=0 wios=0\n")
    start, dropped = scan_cgroups(str(tmp_path))
    assert sorted(start) == ["/", "/a/hogs", "/a/victim", "/io"] and dropped == 0
    assert start["/"].cpu_usec == 800  # the root's own processes: the machine minus its children
    _cgroup(tmp_path, "/a/hogs", 4_100)
    _cgroup(tmp_path, "/a/victim", 1_100, memory=5000)
    _cgroup(tmp_path, "/a", 5_200)
    _cgroup(tmp_path, "/io", 10, io=b"8:0 rbytes=1048576 wbytes=0 rios=9 wios=0\n")
    _cgroup(tmp_path, "/new", 50)  # created in the window: counted from zero
    _cgroup(tmp_path, "/", 1_000 + 300 + 5_000 + 10 + 50)
    end, _ = scan_cgroups(str(tmp_path))
    by_cpu, left = aggressors(start, end, "cpu")
    assert [a.cgroup for a in by_cpu] == ["/a/hogs", "/a/victim", "/", "/new", "/io"] and left == 0
    assert [a.cpu_ns for a in by_cpu] == [4_000_000, 1_000_000, 300_000, 50_000, 10_000]
    assert aggressors(start, end, "io")[0][0].cgroup == "/io"
    mem = aggressors(start, end, "memory")[0]
    assert mem[0].cgroup == "/a/victim" and mem[0].memory_bytes == 4000 and mem[0].reclaim_bytes == 0
    assert aggressors(start, end, "cpu", max_aggressors=2)[1] == 3


def test_cgroup_scan_is_bounded_and_counted(tmp_path):
    for i in range(10):
        _cgroup(tmp_path, f"/c{i}", i)
    usage, dropped = scan_cgroups(str(tmp_path), max_cgroups=4)
    assert len(usage) == 4 and dropped == 6
    counted: list[tuple[str, int]] = []
    probe = EpisodeProbe(
        None, str(tmp_path), lambda r, n: counted.append((r, n)), max_cgroups=4, mounts=CgroupMounts()
    )
    ep = probe.finish(probe.start([1]), [1], "cpu")
    assert counted == [(DROP_CGROUPS, 6), (DROP_CGROUPS, 6)] and ep.victims == ()


def _times(tid: int, state: int, since_ns: int, **ns: int) -> abi.ThreadTimes:
    t = abi.ThreadTimes(pid=10, tid=tid, state=state, since_ns=since_ns, **ns)
    t.comm[:4] = list(b"work")
    return t


def test_open_state_is_counted_up_to_the_snapshot():
    t = _times(11, abi.ThreadState.RUNNABLE, 1_000, runqueue_ns=500, on_cpu_ns=7, reclaim_start_ns=1_500)
    s = state_times(t, 3_000)
    assert (s.runqueue_ns, s.on_cpu_ns, s.reclaim_ns, s.comm) == (2_500, 7, 1_500, "work")
    # An exited thread (state unknown) adds nothing.
    assert state_times(_times(12, abi.ThreadState.UNKNOWN, 1_000, blocked_s_ns=5), 9_000).blocked_s_ns == 5


def test_victims_are_differences_ranked_by_stall():
    start = {1: StateTimes(10, 1, "a", on_cpu_ns=100, runqueue_ns=100), 3: StateTimes(99, 3, "reused")}
    end = {
        1: StateTimes(10, 1, "a", on_cpu_ns=300, runqueue_ns=150),  # stall 50
        2: StateTimes(10, 2, "b", blocked_d_ns=80, blocked_s_ns=1_000),  # new in the window: stall 80
        3: StateTimes(10, 3, "c", blocked_s_ns=40),  # its tid belonged to another process at start
        4: StateTimes(10, 4, "idle"),  # nothing in the window: left out
    }
    rows, left = victims(start, end)
    assert [(v.tid, v.stall_ns) for v in rows] == [(2, 80), (1, 50), (3, 0)] and left == 0
    assert rows[1] == wire.Victim(10, 1, "a", on_cpu_ns=200, runqueue_ns=50)
    assert victims(start, end, max_victims=1)[1] == 2


def test_rows_left_out_are_counted_by_reason(tmp_path):
    counted: dict[str, int] = {}
    times = {t: _times(t, abi.ThreadState.BLOCKED_S, 1, blocked_s_ns=t) for t in range(1, 300)}
    probe = EpisodeProbe(lambda pids: times, None, on_dropped=lambda r, n: counted.update({r: n}))
    start = probe.start([10])
    times = {t: _times(t, abi.ThreadState.BLOCKED_S, 1, blocked_s_ns=2 * t) for t in range(1, 300)}
    probe._thread_times = lambda pids: times
    ep = probe.finish(start, [10], "cpu")
    assert len(ep.victims) == 256 and counted == {DROP_VICTIMS: 43}
    assert DROP_AGGRESSORS not in counted


def test_summary_names_victims_and_aggressors():
    ep = wire.Episode(
        (wire.Victim(10, 11, "worker", 1_000_000, 2_000_000, 3_000_000, 4_000_000, 0),),
        (wire.Aggressor("/hogs", 5_000_000, 1 << 20, 3, 0, 2 * PAGE_SIZE),),
    )
    text = "\n".join(summary_lines(ep))
    [victim] = [line for line in text.splitlines() if "worker (pid 10 tid 11)" in line]
    assert victim.split()[:5] == ["1.0", "2.0", "3.0", "4.0", "0.0"]  # ms by state, in the header's order
    [hogs] = [line for line in text.splitlines() if line.endswith("  /hogs")]
    assert hogs.split()[:3] == ["5.0", "1.0", "3"]


def test_closed_bpf_object_gives_no_victims_not_an_error(tmp_path):
    """At shutdown the agent flushes its sessions after closing the BPF object."""

    def closed(pids):
        raise BistouriError("the BPF object is not loaded")

    probe = EpisodeProbe(closed, str(tmp_path), mounts=CgroupMounts())
    assert probe.finish(probe.start([1]), [1], "cpu").victims == ()

"""Stack records from the ring (decoding) and their aggregation into sessions."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.metrics import AgentMetrics
from bistouri.bpf import abi
from bistouri.capture.events import ResolvedStacks, SentSamples, StackSample, decode_stack, split_stacks
from bistouri.capture.sessions import SessionCapture
from bistouri.host.kernel import KernelMeta
from bistouri.host.procmaps import USER_FRAME, FrameStatus, MappedFile, ProcMaps, Unmapped
from testkit.helpers import build_id, run_python_as_nobody


def fake_proc(root: Path, pid: int, maps: str) -> None:
    """/proc/PID of a process whose root is this machine's /: its files are readable."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "maps").write_text(maps)
    (d / "status").write_text(f"Name:\tx\nNSpid:\t{pid}\t7\n")
    if not (d / "root").exists():
        (d / "root").symlink_to("/")


def burner_maps(workloads: Path) -> str:
    """The burner's text mapped at 0x400000 from file offset 0x1000, the vDSO and JIT code."""
    return (
        f"00400000-00402000 r-xp 00001000 fd:01 1234 {workloads / 'burner'}\n"
        "00600000-00601000 rw-p 00000000 00:00 0 \n"
        "7f0000000000-7f0000010000 rwxp 00000000 00:00 0 \n"
        "7fff00000000-7fff00002000 r-xp 00000000 00:00 0                          [vdso]\n"
    )


BURNER_VMAS = 4  # lines of burner_maps(): what mm->map_count says


def maps_for(tmp_path: Path, workloads: Path, pids: tuple[int, ...] = (7,)) -> ProcMaps:
    for pid in pids:
        fake_proc(tmp_path, pid, burner_maps(workloads))
    return ProcMaps(str(tmp_path))


def record(
    pid: int,
    tid: int,
    kernel: list[int],
    user: list[int],
    kind: int = abi.EventKind.ON_CPU,
    blocked_ns: int = 0,
    ksize: int | None = None,
    waits: int = 1,
) -> ctypes.Array[ctypes.c_char]:
    """A full-size stack_event as the BPF program reserves it, with garbage after the used frames."""
    buf = ctypes.create_string_buffer(b"\xaa" * abi.STACK_EVENT_SIZE, abi.STACK_EVENT_SIZE)
    ev = abi.StackEvent.from_buffer(buf)
    ev.kind, ev.pid, ev.tid, ev.cpu, ev.timestamp_ns, ev.blocked_ns = kind, pid, tid, 1, 123, blocked_ns
    ev.waits = waits
    ev.map_count = BURNER_VMAS
    key = ev.user_key
    key.pid, key.reserved, key.mm, key.hash = pid, 0, 0xFFFF888000001000, hash(tuple(user)) & 0xFFFF_FFFF
    ev.comm = (ctypes.c_uint8 * 16)(*b"burner")
    for i, ip in enumerate(kernel):
        ev.kernel_stack[i] = ip
    for i, ip in enumerate(user):
        ev.user_stack[i] = ip
    ev.kernel_stack_size = len(kernel) * 8 if ksize is None else ksize
    ev.user_stack_size = len(user) * 8
    ev.py_depth, ev.py_status = 0, abi.PyStatus.NOT_PYTHON  # BPF sets them on every event
    return buf


def copy(buf: ctypes.Array[ctypes.c_char]) -> bytes:
    return ctypes.string_at(ctypes.addressof(buf), ctypes.sizeof(buf))  # what the ring callback gets


def decode(
    buf: ctypes.Array[ctypes.c_char], maps: ProcMaps, cache: ResolvedStacks | None = None
) -> StackSample:
    return decode_stack(copy(buf), maps, cache if cache is not None else ResolvedStacks())


def test_decoding_maps_ips_to_file_offsets_and_keeps_only_the_used_frames(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads)
    buf = record(7, 8, [0xFFFFFFFF81000010, 0xFFFFFFFF81000020], [0x400100, 0x400200, 0x401300])
    s = decode(buf, maps)
    assert len(s.stacks) == 2 * 8 + 3 * USER_FRAME.size  # the dedup key: no garbage after the frames
    assert (s.pid, s.tid, s.cpu, s.comm, s.kernel_len, s.weight) == (7, 8, 1, "burner", 16, 1)
    kernel, user = split_stacks(s.stacks, s.kernel_len)
    assert kernel == (0xFFFFFFFF81000010, 0xFFFFFFFF81000020)
    # ip - start + pgoff, as the kernel's build-id walk gave
    assert [(st, off) for st, _, off in user] == [(FrameStatus.FILE, 0x1100), (1, 0x1200), (1, 0x2300)]
    f = maps.file(user[0][1])
    assert f == MappedFile(bytes.fromhex(build_id(workloads / "burner")), "burner")


def test_vdso_jit_and_unmapped_addresses_are_told_apart(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads)
    s = decode(record(7, 8, [], [0x7FFF00000100, 0x7F0000000100, 0x500000, 0xFFFF_FFFF_FFFF_0000]), maps)
    user = split_stacks(s.stacks, s.kernel_len)[1]
    assert [(st, ref) for st, ref, _ in user] == [
        (FrameStatus.VDSO, 0),
        (FrameStatus.ANON, 0),
        (FrameStatus.UNMAPPED, Unmapped.NO_MAPPING),
        (FrameStatus.UNMAPPED, Unmapped.CORRUPTED),
    ]


def test_an_off_cpu_record_decodes_its_blocked_time_and_weight(tmp_path, workloads):
    s = decode(
        record(7, 8, [], [0x400100], abi.EventKind.OFF_CPU, 250_000, waits=40), maps_for(tmp_path, workloads)
    )
    assert (s.kind, s.blocked_ns, s.weight) == (abi.EventKind.OFF_CPU, 250_000, 40)


def test_a_repeated_user_stack_is_mapped_once_until_its_table_is_read_again(tmp_path, workloads):
    now = [100.0]
    fake_proc(tmp_path, 7, burner_maps(workloads))
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0])
    cache = ResolvedStacks()
    first = decode(record(7, 7, [1], [0x400100, 0x400200]), maps, cache)
    reads = maps.stats.reads
    again = decode(record(7, 7, [2], [0x400100, 0x400200]), maps, cache)
    assert again.stacks[8:] == first.stacks[8:] and maps.stats.reads == reads and len(cache) == 1
    # A sample says the process has one more VMA (a dlopen): the table is read again at once,
    # and the stack mapped again.
    changed = record(7, 7, [2], [0x400100, 0x400200])
    abi.StackEvent.from_buffer(changed).map_count = BURNER_VMAS + 1
    decode(changed, maps, cache)
    assert maps.stats.reads == reads + 1 and maps.generation(7, BURNER_VMAS) == 2
    # The maps still say 4 (the new VMA went away again): the next sample of 4 reads nothing more.
    decode(record(7, 7, [2], [0x400100, 0x400200]), maps, cache)
    assert maps.stats.reads == reads + 1


def test_changed_counts_read_the_maps_within_a_budget(tmp_path, workloads):
    """A process that maps and unmaps all the time costs a burst of reads, then a steady rate."""
    now = [100.0]
    fake_proc(tmp_path, 7, burner_maps(workloads))
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0], change_reads_burst=5, change_reads_per_s=20)
    maps.track(7)
    for i in range(100):  # every sample another count, all at the same instant
        maps.generation(7, 100 + i)
    assert maps.stats.reads == 1 + 5
    now[0] += 1.0
    for i in range(100):
        maps.generation(7, 300 + i)
    assert maps.stats.reads == 1 + 5 + 5  # 20 tokens refilled, capped at the burst


def test_a_miss_reads_the_maps_again_at_most_once_per_interval(tmp_path, workloads):
    now = [100.0]
    fake_proc(tmp_path, 7, burner_maps(workloads))
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0])
    maps.track(7)
    assert maps.stats.reads == 1
    dlopened = f"00800000-00801000 r-xp 00000000 fd:01 99 {workloads / 'burner'}\n"
    fake_proc(tmp_path, 7, burner_maps(workloads).replace("00600000", dlopened + "00600000", 1))
    now[0] += 0.5  # within the interval: the miss stays a miss
    assert USER_FRAME.unpack(maps.resolve(7, (0x800010,)))[:2] == (FrameStatus.UNMAPPED, Unmapped.NO_MAPPING)
    assert maps.stats.reads == 1
    now[0] += 1.0
    status, file_id, offset = USER_FRAME.unpack(maps.resolve(7, (0x800010,)))
    assert (status, maps.file(file_id).name, offset) == (FrameStatus.FILE, "burner", 0x10)
    assert maps.stats.reads == 2


def test_a_table_outlives_its_process(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads)
    maps.track(7)
    (tmp_path / "7" / "maps").unlink()  # the process exited
    maps.generation(7, BURNER_VMAS + 1)  # a late sample says its mappings changed: nothing to read
    assert USER_FRAME.unpack(maps.resolve(7, (0x400100,)))[0] == FrameStatus.FILE
    gone = USER_FRAME.unpack(maps.resolve(8, (0x400100,)))
    assert gone[:2] == (FrameStatus.UNMAPPED, Unmapped.PROCESS_GONE)


def test_tables_are_bounded_in_bytes_least_recently_used_out(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads, pids=(1, 2, 3, 4))
    maps.max_bytes = 2000  # two tables of four mappings
    for pid in (1, 2, 3, 4):
        maps.track(pid)
    assert maps.stats.tables == 2 and maps.stats.evicted == 2 and maps.stats.bytes <= 2000
    assert maps.stats.reads == 4 and maps.generation(4, BURNER_VMAS) == 1 and maps.stats.reads == 4
    maps.generation(1, BURNER_VMAS)  # evicted: read again
    assert maps.stats.reads == 5


def test_jit_names_come_from_the_perf_map_through_the_process_root(tmp_path, workloads):
    now = [0.0]
    fake_proc(tmp_path, 7, burner_maps(workloads))
    (tmp_path / "7" / "root").unlink()
    root = tmp_path / "7" / "root"
    (root / "tmp").mkdir(parents=True)
    perf_map = root / "tmp" / "perf-7.map"  # named with the pid in its own namespace (NSpid)
    perf_map.write_text("7f0000000100 40 JS:*hotLoop /app/x.js:2:17\n7f0000000200 10 Stub")
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0])
    maps.track(7)
    assert maps.jit_name(7, 0x7F0000000120) == "JS:*hotLoop /app/x.js:2:17"
    assert maps.jit_name(7, 0x7F0000000205) is None  # its line is not complete yet
    with perf_map.open("a") as f:
        f.write("\n7f0000000300 10 JS:~warm /app/x.js:9:1\n")
    now[0] += 1  # the map grew: read again (only what was appended)
    assert maps.jit_name(7, 0x7F0000000305) == "JS:~warm /app/x.js:9:1"
    assert maps.jit_name(7, 0x7F0000000205) == "Stub"
    assert maps.stats.perf_map_reads == 2


@pytest.mark.parametrize("replace", [False, True], ids=["truncated_and_rewritten", "replaced"])
def test_a_perf_map_rewritten_by_someone_elses_jcmd_is_read_from_its_start(tmp_path, workloads, replace):
    """`jcmd PID Compiler.perfmap` run by someone else rewrites the file whole, maybe larger: what
    lies at the offset read so far is not an append (code moved, freed, compiled since)."""
    now = [0.0]
    fake_proc(tmp_path, 7, burner_maps(workloads))
    (tmp_path / "7" / "root").unlink()
    (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
    perf_map = tmp_path / "7" / "root" / "tmp" / "perf-7.map"
    perf_map.write_text("7f0000000100 40 Hot::old\n7f0000000200 10 Stub\n")
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0])
    maps.track(7)
    assert maps.jit_name(7, 0x7F0000000120) == "Hot::old"
    rewrite = "7f0000000100 20 Hot::moved\n7f0000000200 10 Stub\n7f0000000300 40 Hot::new\n"
    if replace:  # another file put in its place
        new = perf_map.with_suffix(".tmp")
        new.write_text(rewrite)
        new.replace(perf_map)
    else:  # the JVM's own way: the same file truncated and written again
        with perf_map.open("r+") as f:
            f.truncate(0)
            f.write(rewrite)
    now[0] += 1
    assert maps.jit_name(7, 0x7F0000000305) == "Hot::new"
    assert maps.jit_name(7, 0x7F0000000105) == "Hot::moved"
    assert maps.jit_name(7, 0x7F0000000130) is None  # past the moved method's new end
    assert maps.stats.perf_map_rewrites == 1
    with perf_map.open("a") as f:  # appended to afterwards: read on from where it was
        f.write("7f0000000400 10 Hot::later\n")
    now[0] += 1
    assert maps.jit_name(7, 0x7F0000000405) == "Hot::later"
    assert maps.stats.perf_map_rewrites == 1 and maps.jit_name(7, 0x7F0000000305) == "Hot::new"


def test_a_perf_map_left_by_an_earlier_process_with_the_same_pid_is_not_read(tmp_path, workloads):
    """Root's /tmp/perf-PID.map outlives its JVM or node: a new process given that pid is not
    named from it. Only what the new process appends (CPython -X perf appends), or its rewrite
    (node, a JVM's jcmd), is read."""
    fake_proc(tmp_path, 7, burner_maps(workloads))
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(time.clock_gettime(time.CLOCK_BOOTTIME) * ticks) - ticks  # a second ago
    (tmp_path / "7" / "stat").write_text(f"7 (x) S 1 {' '.join(['0'] * 17)} {started} 0\n")
    (tmp_path / "7" / "root").unlink()
    (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
    perf_map = tmp_path / "7" / "root" / "tmp" / "perf-7.map"
    perf_map.write_text("7f0000000100 40 Earlier::process\n")
    old = time.time() - 60
    os.utime(perf_map, (old, old))
    now = [0.0]
    maps = ProcMaps(str(tmp_path), clock=lambda: now[0])
    maps.track(7)
    assert maps.jit_name(7, 0x7F0000000120) is None
    assert maps.stats.perf_map_stale == 1 and maps.stats.perf_map_reads == 0
    with perf_map.open("a") as f:  # the new process appends its own
        f.write("7f0000000200 10 New::one\n")
    now[0] += 1
    assert maps.jit_name(7, 0x7F0000000205) == "New::one"
    assert maps.jit_name(7, 0x7F0000000120) is None
    with perf_map.open("r+") as f:  # and rewrites it whole
        f.truncate(0)
        f.write("7f0000000100 40 New::moved\n")
    now[0] += 1
    assert maps.jit_name(7, 0x7F0000000120) == "New::moved"
    assert maps.stats.perf_map_stale == 1 and maps.stats.perf_map_rewrites == 1


def test_a_perf_map_written_since_its_process_started_is_read(tmp_path, workloads):
    fake_proc(tmp_path, 7, burner_maps(workloads))
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(time.clock_gettime(time.CLOCK_BOOTTIME) * ticks) - 60 * ticks  # a minute ago
    (tmp_path / "7" / "stat").write_text(f"7 (x) S 1 {' '.join(['0'] * 17)} {started} 0\n")
    (tmp_path / "7" / "root").unlink()
    (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
    (tmp_path / "7" / "root" / "tmp" / "perf-7.map").write_text("7f0000000100 40 Mine\n")
    maps = ProcMaps(str(tmp_path))
    maps.track(7)
    assert maps.jit_name(7, 0x7F0000000120) == "Mine"
    assert maps.stats.perf_map_stale == 0


def test_a_perf_map_is_bounded_in_bytes(tmp_path, workloads):
    fake_proc(tmp_path, 7, burner_maps(workloads))
    (tmp_path / "7" / "root").unlink()
    (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
    lines = "".join(f"{0x7F0000000000 + i * 16:x} 10 fn{i}\n" for i in range(1000))
    (tmp_path / "7" / "root" / "tmp" / "perf-7.map").write_text(lines)
    now = [0.0]
    maps = ProcMaps(str(tmp_path), perf_map_max_bytes=1000, clock=lambda: now[0])
    maps.track(7)
    assert maps.jit_name(7, 0x7F0000000005) == "fn0"
    assert maps.jit_name(7, 0x7F0000000000 + 999 * 16) is None
    now[0] += 1  # looked at again: still over its bound, counted once
    assert maps.jit_name(7, 0x7F0000000000 + 999 * 16) is None
    assert maps.stats.perf_map_truncated == 1
    # Rewritten under the bound (someone's jcmd): read again from its start, whole.
    new = tmp_path / "7" / "root" / "tmp" / "perf-7.map.tmp"
    new.write_text("7f0000100000 10 fresh\n")
    new.replace(tmp_path / "7" / "root" / "tmp" / "perf-7.map")
    now[0] += 1
    assert maps.jit_name(7, 0x7F0000100004) == "fresh"
    assert maps.jit_name(7, 0x7F0000000005) is None
    assert maps.stats.perf_map_rewrites == 1


def test_sent_samples_are_bounded_in_entries_and_bytes_and_forgotten_in_the_kernel(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads)
    forgotten: list[bytes] = []
    sent = SentSamples(max_entries=3, max_bytes=1000, forget=forgotten.append)
    small = decode(record(7, 8, [1], [0x400100]), maps)  # 8 + 16 bytes of stacks
    for i in range(4):
        sent.remember(bytes([i]) * 40, small)
    assert len(sent) == 3 and forgotten == [bytes([0]) * 40]  # entries
    assert sent.get(bytes([1]) * 40) is small  # counted: now the most recent
    big = decode(record(7, 9, [1] * 100, [0x400100] * 20), maps)  # 800 + 320 bytes
    sent.remember(b"b" * 40, big)
    assert sent.get(b"b" * 40) is None and len(sent) == 0  # bytes: everything older went first
    assert forgotten[1:] == [bytes([2]) * 40, bytes([3]) * 40, bytes([1]) * 40, b"b" * 40]


def test_a_failed_kernel_stack_fetch_decodes_as_no_kernel_frames(tmp_path, workloads):
    s = decode(record(7, 8, [], [0x400100], ksize=-14), maps_for(tmp_path, workloads))  # -EFAULT
    kernel, user = split_stacks(s.stacks, s.kernel_len)
    assert s.kernel_len == 0 and kernel == () and len(user) == 1


def test_sizes_beyond_the_record_are_clamped(tmp_path, workloads):
    s = decode(record(7, 8, [1], [], ksize=1 << 30), maps_for(tmp_path, workloads))
    assert s.kernel_len == len(s.stacks) == abi.MAX_DEPTH * 8


class _Filter:
    def __init__(self, maps: ProcMaps) -> None:
        self.pids: dict[int, int] = {}
        self.maps = maps

    def set_pid_filter(self, pid: int, flags: int) -> None:
        if flags:
            self.pids[pid] = flags
        else:
            self.pids.pop(pid, None)


class _Sink:
    def __init__(self) -> None:
        self.sessions: dict[str, wire.Session] = {}

    def put(self, session_id: str, data: bytes) -> object:
        self.sessions[session_id] = wire.decode_session(data)
        return None


def test_samples_are_deduplicated_per_thread_and_counted_in_every_overlapping_session(tmp_path, workloads):
    reg = CollectorRegistry()
    maps = maps_for(tmp_path, workloads, pids=(7, 42))
    flt, sink = _Filter(maps), _Sink()
    orch = SessionCapture(
        flt,
        sink,
        AgentMetrics(reg),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
    )
    a = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    b = orch.start_session(wire.Trigger("io"), "svc", {}, {7: "burner", 9: "other"}, 60)
    assert a and b and flt.pids.keys() == {7, 9}
    hot = record(7, 8, [0xFFFFFFFF81000010], [0x400100])
    samples = [decode(hot, maps) for _ in range(5)]
    samples.append(dataclasses.replace(samples[0], weight=10))  # 10 repeats counted in the kernel
    # A rate-limited off-CPU capture standing for itself and 2 skipped waits.
    samples.append(decode(record(7, 8, [], [0x400100], abi.EventKind.OFF_CPU, 2_000_000, waits=3), maps))
    samples.append(decode(record(42, 42, [], [0x400100]), maps))  # no session: unmatched
    orch.add_samples(samples)
    orch.flush_all()
    assert flt.pids == {}  # every reference released
    for sid in (a, b):
        traces = sink.sessions[sid].traces
        assert sorted((t.on_cpu, t.off_cpu, t.off_cpu_ns) for t in traces) == [(0, 3, 6_000_000), (15, 0, 0)]
        on = next(t for t in traces if t.on_cpu)
        assert on.kernel == (0xFFFFFFFF81000010,) and on.user[0].address == 0x1100
        assert on.user[0].name == "burner" and on.user[0].kind == wire.FRAME_RESOLVED
    assert reg.get_sample_value("bistouri_samples_total", {"kind": "on_cpu"}) == 15
    assert reg.get_sample_value("bistouri_samples_total", {"kind": "off_cpu"}) == 3
    assert reg.get_sample_value("bistouri_samples_unmatched_total") == 1


def test_each_session_says_what_the_kernel_lacks(tmp_path, workloads):
    """On an older kernel (bpf/features.py) the data-quality note counts the samples taken without."""
    maps = maps_for(tmp_path, workloads)
    flt, sink = _Filter(maps), _Sink()
    orch = SessionCapture(
        flt,
        sink,
        AgentMetrics(CollectorRegistry()),
        KernelMeta("5.15", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
        degraded=("no_bpf_loop",),
    )
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    orch.add_samples([decode(record(7, 7, [], [0x400100]), maps) for _ in range(3)])
    orch.flush_all()
    assert sid is not None and sink.sessions[sid].unwind.kernel == {"no_bpf_loop": 3}


def test_every_user_frame_ends_named_or_counted(tmp_path, workloads):
    """A file frame carries its file name, JIT code its perf-map name; the rest is counted by reason."""
    reg = CollectorRegistry()
    fake_proc(tmp_path, 7, burner_maps(workloads))
    (tmp_path / "7" / "root").unlink()
    (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
    (tmp_path / "7" / "root" / "tmp" / "perf-7.map").write_text("7f0000000100 40 JS:*hot\n")
    maps = ProcMaps(str(tmp_path))
    flt, sink = _Filter(maps), _Sink()
    orch = SessionCapture(
        flt,
        sink,
        AgentMetrics(reg),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
    )
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    ips = [0x7F0000000110, 0x7F0000000901, 0x7FFF00000100, 0x400100, 0x500000, 0xFFFF_FFFF_FFFF_0000]
    orch.add_samples([decode(record(7, 7, [], ips), maps)])
    orch.flush_all()
    assert sid is not None
    (trace,) = sink.sessions[sid].traces
    assert [(f.kind, f.name) for f in trace.user] == [
        (wire.FRAME_JIT, "JS:*hot"),
        (wire.FRAME_UNKNOWN, ""),  # JIT code the perf map does not name
        (wire.FRAME_VDSO, ""),
        (wire.FRAME_RESOLVED, "burner"),
        (wire.FRAME_UNKNOWN, ""),  # no mapping
    ]  # the corrupted address is dropped
    got = {
        k: reg.get_sample_value("bistouri_user_frames_total", {"kind": k})
        for k in ("jit", "jit_unnamed", "vdso", "resolved", "no_mapping", "corrupted")
    }
    assert got == dict.fromkeys(got, 1.0)


def test_distinct_files_are_bounded_and_the_excess_counted(tmp_path, workloads):
    fake_proc(tmp_path, 7, burner_maps(workloads))
    maps = ProcMaps(str(tmp_path), max_files=2)
    lines = "".join(
        f"{0x1000000 * (i + 1):08x}-{0x1000000 * (i + 1) + 0x1000:08x} r-xp 00000000 fd:01 {100 + i} "
        f"{workloads / 'burner'}\n"
        for i in range(5)
    )
    fake_proc(tmp_path, 7, lines)
    maps.track(7)
    names = {maps.file(USER_FRAME.unpack(maps.resolve(7, (0x1000000 * (i + 1),)))[1]).name for i in range(5)}
    assert names == {"burner", "[too many files]"} and maps.stats.files_over_bound == 3


def test_a_table_of_a_reused_pid_is_read_again_when_it_becomes_a_target(tmp_path, workloads):
    maps = maps_for(tmp_path, workloads)
    maps.track(7)
    fake_proc(tmp_path, 7, f"00900000-00901000 r-xp 00000000 fd:01 77 {workloads / 'burner'}\n")
    maps.track(7)  # another process got pid 7
    assert USER_FRAME.unpack(maps.resolve(7, (0x900010,)))[0] == FrameStatus.FILE


def test_maps_the_agent_may_not_read_are_counted_apart():
    """As another user without CAP_SYS_PTRACE, a root process's maps are refused: its frames are
    counted as no_access, not mistaken for an exited process."""
    code = (
        "from bistouri.host.procmaps import ProcMaps, USER_FRAME; m = ProcMaps(); m.track(1); "
        "print(USER_FRAME.unpack(m.resolve(1, (0x400100,)))[:2])"
    )
    out = run_python_as_nobody(code)
    assert out.stdout.strip() == str((int(FrameStatus.UNMAPPED), int(Unmapped.NO_ACCESS)))


def test_the_recorder_samples_at_its_own_rate_and_sessions_at_full_rate(tmp_path, workloads):
    """A recorded process is in the filter with a divisor (1 sample kept in 5 at 100 Hz for
    20 Hz), each kept sample weighs 5; a session switches it to every sample and back."""
    maps = maps_for(tmp_path, workloads, pids=(7,))
    flt, sink = _Filter(maps), _Sink()
    orch = SessionCapture(
        flt,
        sink,
        AgentMetrics(CollectorRegistry()),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=10_000_000,  # 100 Hz
        proc_root=str(tmp_path),
    )
    full = orch.filter_flags  # what to capture: unchanged by the rate
    orch.watch(7, 5.0, recorder_hz=20)
    assert flt.pids == {7: abi.filter_value(full, 5)}
    orch.add_samples([decode(record(7, 7, [], [0x400100]), maps)])  # before the trigger: weighs 5
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60, recorder_secs=5)
    assert sid and flt.pids == {7: abi.filter_value(full, 1)}
    orch.add_samples([decode(record(7, 7, [], [0x400100]), maps)])  # in the session: weighs 1
    orch.flush_all()
    assert flt.pids == {7: abi.filter_value(full, 5)}  # recorded again at its own rate
    traces = sink.sessions[sid].traces
    assert sorted((t.pre_trigger, t.on_cpu) for t in traces) == [(False, 1), (True, 5)]
    orch.unwatch(7)
    assert flt.pids == {}


def test_session_ids_are_random_uuid4s() -> None:
    import uuid

    from bistouri.capture.sessions import random_uuid

    ids = {random_uuid() for _ in range(200)}
    assert len(ids) == 200
    for text in ids:
        u = uuid.UUID(text)
        assert str(u) == text and u.version == 4 and u.variant == uuid.RFC_4122

"""Stack records from the ring (decoding) and their aggregation into sessions."""

from __future__ import annotations

import ctypes
import dataclasses

from prometheus_client import CollectorRegistry

from bistouri import abi, wire
from bistouri.capture import CaptureOrchestrator
from bistouri.events import SentSamples, UserStackCache, decode_stack, split_stacks
from bistouri.kernel import KernelMeta
from bistouri.metrics import AgentMetrics

BUILD_ID = bytes(range(20))


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
    buf = ctypes.create_string_buffer(b"\xaa" * ctypes.sizeof(abi.StackEvent), ctypes.sizeof(abi.StackEvent))
    ev = abi.StackEvent.from_buffer(buf)
    ev.kind, ev.pid, ev.tid, ev.cpu, ev.timestamp_ns, ev.blocked_ns = kind, pid, tid, 1, 123, blocked_ns
    ev.waits = waits
    ev.user_format = abi.UserFormat.FRAMES
    key = ev.user_key
    key.pid, key.reserved, key.mm, key.hash = pid, 0, 0xFFFF888000001000, 0x1234
    ev.comm = (ctypes.c_uint8 * 16)(*b"burner")
    for i, ip in enumerate(kernel):
        ev.kernel_stack[i] = ip
    for i, off in enumerate(user):
        ev.user_stack[i].status = 1  # BPF_STACK_BUILD_ID_VALID
        ev.user_stack[i].build_id = (ctypes.c_uint8 * 20)(*BUILD_ID)
        ev.user_stack[i].offset_or_ip = off
    ev.kernel_stack_size = len(kernel) * 8 if ksize is None else ksize
    ev.user_stack_size = len(user) * abi.USER_FRAME.size
    return buf


def copy(buf: ctypes.Array[ctypes.c_char]) -> bytes:
    return ctypes.string_at(ctypes.addressof(buf), ctypes.sizeof(buf))  # what the ring callback gets


def test_decoding_keeps_only_the_used_frames():
    buf = record(7, 8, [0xFFFFFFFF81000010, 0xFFFFFFFF81000020], [0x1100, 0x1200, 0x1300])
    s = decode_stack(copy(buf))
    assert len(s.stacks) == 2 * 8 + 3 * abi.USER_FRAME.size  # the dedup key: no garbage after the frames
    assert (s.pid, s.tid, s.cpu, s.comm, s.kernel_len, s.weight) == (7, 8, 1, "burner", 16, 1)
    kernel, user = split_stacks(s.stacks, s.kernel_len)
    assert kernel == (0xFFFFFFFF81000010, 0xFFFFFFFF81000020)
    assert [(st, bid, off) for st, bid, off in user] == [(1, BUILD_ID, o) for o in (0x1100, 0x1200, 0x1300)]


def test_an_off_cpu_record_decodes_its_blocked_time_and_weight():
    s = decode_stack(copy(record(7, 8, [], [0x1100], abi.EventKind.OFF_CPU, 250_000, waits=40)))
    assert (s.kind, s.blocked_ns, s.weight) == (abi.EventKind.OFF_CPU, 250_000, 40)


def ips_record(pid: int, ips: list[int], fmt: abi.UserFormat, key_hash: int) -> ctypes.Array[ctypes.c_char]:
    """A record whose user part is raw IPs (a known stack, or build ids off)."""
    buf = record(pid, pid, [0xFFFFFFFF81000010], [])
    ev = abi.StackEvent.from_buffer(buf)
    ev.user_format = fmt
    ev.user_key.hash = key_hash
    raw = (ctypes.c_uint64 * len(ips))(*ips)
    ctypes.memmove(ctypes.addressof(ev) + abi.USER_STACK_OFFSET, raw, ctypes.sizeof(raw))
    ev.user_stack_size = ctypes.sizeof(raw)
    return buf


def test_a_known_user_stack_gets_the_frames_sent_with_its_first_sample():
    forgotten: list[bytes] = []
    cache = UserStackCache(forget=forgotten.append)
    first = record(7, 7, [0xFFFFFFFF81000010], [0x1100, 0x1200])
    abi.StackEvent.from_buffer(first).user_key.hash = 0xABC
    whole = decode_stack(copy(first), cache)
    again = decode_stack(copy(ips_record(7, [0x401100, 0x401200], abi.UserFormat.KNOWN, 0xABC)), cache)
    assert again.stacks == whole.stacks and len(cache) == 1 and cache.misses == 0 and not forgotten


def test_an_unknown_user_stack_keeps_its_addresses_and_is_forgotten_in_the_kernel():
    forgotten: list[bytes] = []
    cache = UserStackCache(forget=forgotten.append)
    s = decode_stack(copy(ips_record(7, [0x401100, 0x401200], abi.UserFormat.KNOWN, 0xDEF)), cache)
    _, user = split_stacks(s.stacks, s.kernel_len)
    assert user == [(2, bytes(20), 0x401100), (2, bytes(20), 0x401200)]  # status 2: a raw address
    assert cache.misses == 1 and len(forgotten) == 1
    assert abi.USER_STACK_KEY.unpack(forgotten[0]) == (7, 0, 0xFFFF888000001000, 0xDEF)


def test_raw_ips_with_build_ids_off_decode_as_addresses():
    s = decode_stack(copy(ips_record(7, [0x401100], abi.UserFormat.IPS, 0)))
    assert split_stacks(s.stacks, s.kernel_len)[1] == [(2, bytes(20), 0x401100)]


def test_the_user_stack_cache_is_bounded_in_bytes_and_forgets_the_oldest():
    forgotten: list[bytes] = []
    cache = UserStackCache(max_bytes=100, forget=forgotten.append)
    for i in range(5):
        cache.remember(bytes([i]) * 24, b"f" * 40)
    assert len(cache) == 2 and forgotten == [bytes([i]) * 24 for i in range(3)]
    cache.frames(bytes([3]) * 24, b"")  # a hit refreshes it: 4 goes out next
    cache.remember(b"n" * 24, b"f" * 40)
    assert forgotten[-1] == bytes([4]) * 24


def test_sent_samples_are_bounded_in_entries_and_bytes_and_forgotten_in_the_kernel():
    forgotten: list[bytes] = []
    sent = SentSamples(max_entries=3, max_bytes=1000, forget=forgotten.append)
    small = decode_stack(copy(record(7, 8, [1], [0x1100])))  # 8 + 32 bytes of stacks
    for i in range(4):
        sent.remember(bytes([i]) * 40, small)
    assert len(sent) == 3 and forgotten == [bytes([0]) * 40]  # entries
    assert sent.get(bytes([1]) * 40) is small  # counted: now the most recent
    big = decode_stack(copy(record(7, 9, [1] * 100, [0x1100] * 10)))  # 800 + 320 bytes
    sent.remember(b"b" * 40, big)
    assert sent.get(b"b" * 40) is None and len(sent) == 0  # bytes: everything older went first
    assert forgotten[1:] == [bytes([2]) * 40, bytes([3]) * 40, bytes([1]) * 40, b"b" * 40]


def test_a_failed_kernel_stack_fetch_decodes_as_no_kernel_frames():
    s = decode_stack(copy(record(7, 8, [], [0x1100], ksize=-14)))  # -EFAULT from bpf_get_stack
    kernel, user = split_stacks(s.stacks, s.kernel_len)
    assert s.kernel_len == 0 and kernel == () and len(user) == 1


def test_sizes_beyond_the_record_are_clamped():
    s = decode_stack(copy(record(7, 8, [1], [], ksize=1 << 30)))
    assert s.kernel_len == len(s.stacks) == abi.MAX_DEPTH * 8


class _Filter:
    def __init__(self) -> None:
        self.pids: dict[int, int] = {}

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


def test_samples_are_deduplicated_per_thread_and_counted_in_every_overlapping_session(tmp_path):
    reg = CollectorRegistry()
    flt, sink = _Filter(), _Sink()
    orch = CaptureOrchestrator(
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
    hot = record(7, 8, [0xFFFFFFFF81000010], [0x1100])
    samples = [decode_stack(copy(hot)) for _ in range(5)]
    samples.append(dataclasses.replace(samples[0], weight=10))  # 10 repeats counted in the kernel
    # A rate-limited off-CPU capture standing for itself and 2 skipped waits.
    samples.append(decode_stack(copy(record(7, 8, [], [0x1100], abi.EventKind.OFF_CPU, 2_000_000, waits=3))))
    samples.append(decode_stack(copy(record(42, 42, [], [0x1]))))  # no session: unmatched
    orch.add_samples(samples)
    orch.flush_all()
    assert flt.pids == {}  # every reference released
    for sid in (a, b):
        traces = sink.sessions[sid].traces
        assert sorted((t.on_cpu, t.off_cpu, t.off_cpu_ns) for t in traces) == [(0, 3, 6_000_000), (15, 0, 0)]
        on = next(t for t in traces if t.on_cpu)
        assert on.kernel == (0xFFFFFFFF81000010,) and on.user[0].address == 0x1100
    assert reg.get_sample_value("bistouri_samples_total", {"kind": "on_cpu"}) == 15
    assert reg.get_sample_value("bistouri_samples_total", {"kind": "off_cpu"}) == 3
    assert reg.get_sample_value("bistouri_samples_unmatched_total") == 1

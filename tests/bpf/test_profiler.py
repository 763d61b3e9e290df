"""The real BPF object in the real kernel: on-CPU and off-CPU stacks, teardown without leaks."""

from __future__ import annotations

import dataclasses
import os
import signal
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from bistouri.bpf import abi
from bistouri.bpf.handles import Map
from bistouri.capture.events import ExecMatch, SentSamples, StackSample, split_stacks
from bistouri.capture.profiler import EPISODE_PROGRAMS, ObjectLoad, Profiler, ProfilerOptions
from bistouri.errors import BpfError
from bistouri.host.procmaps import FrameStatus
from bistouri.unwind.tables import UnwindTables
from testkit.helpers import (
    bistouri_prog_ids,
    build_id,
    kernel_function_names,
    own_prog_ids,
    symbols,
    wait_until,
)

pytestmark = pytest.mark.bpf


def _collect(agent: Profiler, seconds: float) -> list:
    events = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        agent.check_thread()
        events.extend(agent.take(timeout=0.1))
    events.extend(agent.take())
    return events


def _on_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _collect_on_cpu(agent: Profiler, pid: int, since_ns: int, seconds: float) -> list:
    """Collect until `pid` has run `seconds` on a CPU since `since_ns` (its schedstat): a window
    of CPU time, not of wall time, so a busy host gives as many samples, later (at most 60 s)."""
    events = []
    deadline = time.monotonic() + 60
    while _on_cpu_ns(pid) - since_ns < seconds * 1e9 and time.monotonic() < deadline:
        events.extend(_collect(agent, 0.25))
    return events


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP, returning once the process is stopped (no sample of it can follow)."""
    proc.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: _state(proc.pid) == "T", 10)


def _function_at(syms: dict[str, tuple[int, int]], offset: int) -> str | None:
    for name, (addr, size) in syms.items():
        if addr <= offset < addr + size:
            return name
    return None


def test_on_cpu_stacks_map_to_build_id_and_offsets_in_the_call_chain(workloads):
    burner = workloads / "burner"
    bid = bytes.fromhex(build_id(burner))
    syms = symbols(burner)
    # Killed at the end: runs as long as the window needs. Sampled once it says its loader and lazy
    # binding are behind it (a sample in ld.so has no frame of the burner).
    proc = subprocess.Popen(
        [str(burner), "60"], env={**os.environ, "BURNER_READY": "1"}, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        opts = ProfilerOptions(freq_hz=99, offcpu=False, unwind_nice=0, unwind_cpu_share=1.0)
        with Profiler(opts) as agent:
            agent.start()
            on_cpu_before = _on_cpu_ns(proc.pid)
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            # The tables of the burner and libc loaded (the walk reaches _start from then on),
            # then 3 s more on a CPU: every sample of the window is counted below.
            assert agent.unwind is not None and agent.unwind.wait_idle(60)
            events = _collect_on_cpu(agent, proc.pid, _on_cpu_ns(proc.pid), 3.0)
            # Stopped, the burner takes no more samples: its CPU time is the window's, and
            # closing the agent drains every count the kernel still holds.
            _stop(proc)
            on_cpu = (_on_cpu_ns(proc.pid) - on_cpu_before) / 1e9
            sent = len(agent.sent)
            agent.close()
            events.extend(agent.take())
    finally:
        proc.kill()
        proc.wait()
    samples = [e for e in events if isinstance(e, StackSample) and e.pid == proc.pid]
    total = sum(s.weight for s in samples)
    # 99 samples per second the burner was on a CPU (a whole one on a quiet machine: ~297),
    # repeats counted in the kernel.
    assert 0.85 * 99 * on_cpu <= total <= 1.1 * 99 * on_cpu + 2, f"{total} samples for {on_cpu:.2f} s on CPU"
    assert on_cpu > 1.0, "the burner ran"
    assert sent < total / 10, "repeats were counted in the kernel, not sent: one event per distinct stack"
    # The IPs were mapped in user space: each distinct stack once, from one read of the maps.
    assert agent.maps.stats.reads <= 3 and len(agent.resolved) < total / 4, (agent.maps.stats, total)
    assert all(s.kind == abi.EventKind.ON_CPU for s in samples)
    chains = Counter()
    for s in samples:
        _kernel, user = split_stacks(s.stacks, s.kernel_len)
        own = [
            (status, ref, off)
            for status, ref, off in user
            if status == FrameStatus.FILE and agent.maps.file(ref).build_id == bid
        ]
        frames = [(st, agent.maps.file(r).name if st == FrameStatus.FILE else r, hex(o)) for st, r, o in user]
        assert own, ("every sample of the burner has frames of the burner", frames, s.walk, s.weight)
        names = tuple(_function_at(syms, off if i == 0 else off - 1) for i, (_, _, off) in enumerate(own))
        chains[names] += s.weight
    expected = ("hot_spin", "level2", "level1", "main")
    assert sum(n for names, n in chains.items() if names[:4] == expected) / total > 0.8, chains
    # Through libc's frameless __libc_start_call_main to the burner's _start once libc's
    # .eh_frame table is loaded (before it, the frame-pointer walk stops in libc).
    assert chains[(*expected, "_start")] > 0, chains


def test_kernel_frames_present_for_samples_in_the_kernel(workloads, tmp_path):
    # fsync spends its on-CPU time in the kernel: those samples must carry kernel IPs.
    proc = subprocess.Popen([str(workloads / "fsyncer"), str(tmp_path / "data"), "5"])
    try:
        with Profiler(ProfilerOptions(freq_hz=99, offcpu=False)) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            events = _collect(agent, 3.0)
    finally:
        proc.kill()
        proc.wait()
    samples = [e for e in events if isinstance(e, StackSample) and e.pid == proc.pid]
    assert samples
    with_kernel = [s for s in samples if s.kernel_len > 0]
    assert with_kernel, "fsync samples taken in the kernel have kernel frames"
    kernel, _ = split_stacks(with_kernel[0].stacks, with_kernel[0].kernel_len)
    assert all(ip >= 0xFFFF_8000_0000_0000 for ip in kernel)


def _off_cpu_of_fsyncer(
    workloads: Path, tmp_path: Path, options: ProfilerOptions, seconds: float
) -> tuple[subprocess.Popen, list, dict]:
    """Profile the off-CPU waits of an fsync loop: (its process, the events, the BPF counters)."""
    proc = subprocess.Popen([str(workloads / "fsyncer"), str(tmp_path / "data"), str(seconds + 3)])
    try:
        with Profiler(options) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.OFF_CPU)
            events = _collect(agent, seconds)
            counters = agent.counters()
    finally:
        proc.kill()
        proc.wait()
    return proc, events, counters


def test_off_cpu_waits_are_timed_with_io_wait_kernel_frames(workloads, tmp_path):
    proc, events, counters = _off_cpu_of_fsyncer(workloads, tmp_path, ProfilerOptions(freq_hz=19), 3.0)
    waits = [e for e in events if isinstance(e, StackSample) and e.kind == abi.EventKind.OFF_CPU]
    assert waits, f"no off-CPU event; counters={counters}"
    assert all(w.pid == proc.pid for w in waits)
    floor = ProfilerOptions().offcpu_min_ns
    # An fsync storm is rate-limited: captures stand for the waits skipped before them,
    # and never for more waits than the kernel side counted.
    weight = sum(w.weight for w in waits)
    assert counters[abi.Counter.OFFCPU_RATE_LIMITED] > 0 and weight > len(waits), (weight, counters)
    seen = (abi.Counter.OFFCPU_RATE_LIMITED, abi.Counter.OFF_CPU_SAMPLES, abi.Counter.OFFCPU_TOO_SHORT)
    assert weight <= sum(counters[c] for c in seen)
    assert all(w.blocked_ns >= floor for w in waits), "waits under offcpu_min_ns are filtered"
    names = set()
    for w in waits:
        kernel, user = split_stacks(w.stacks, w.kernel_len)
        assert kernel and user
        names.update(kernel_function_names(list(kernel)))
    assert "__schedule" in names or "schedule" in names, names
    assert names & {
        "io_schedule",
        "io_schedule_timeout",
        "wait_for_completion_io",
        "folio_wait_bit_common",
        "wait_on_page_bit_common",
        "jbd2_log_wait_commit",
        "blk_mq_get_tag",
        "bit_wait_io",
        "file_write_and_wait_range",
        "filemap_fdatawait_range",
        "__filemap_fdatawait_range",
        "folio_wait_writeback",
        "wait_for_completion_io_timeout",
    }, names
    # The per-process rate limit bounds the capture cost of an fsync storm.
    assert counters[abi.Counter.OFF_CPU_SAMPLES] <= 3.0 * 100 + 50


def test_off_cpu_time_is_the_d_time_the_kernel_counted(workloads, tmp_path):
    """Captures stand for the rate-limited waits by their time, timed switch-out to wakeup as the
    episode hooks time D: the two totals agree, however loaded the machine (run-queue time,
    after the wakeup, is neither's)."""
    opts = ProfilerOptions(freq_hz=19, offcpu_min_ns=0)
    proc = subprocess.Popen([str(workloads / "fsyncer"), str(tmp_path / "data"), "30"])
    try:
        with Profiler(opts) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.OFF_CPU | abi.EpisodeFilter.ON)
            events = _collect(agent, 3.0)
            # Stopped, fsyncer ends the wait it is in and starts no other: both counts are final.
            _stop(proc)
            events += _collect(agent, 0.3)
            (times,) = agent.thread_times({proc.pid}).values()
            # The waits skipped since the last capture, which the next one would have carried.
            limit = agent._require().maps["offcpu_last"].lookup(struct.pack("<I", proc.pid))
            assert limit is not None
            _, _, carried_ns = struct.unpack("<Qqq", limit)
    finally:
        proc.kill()
        proc.wait()
    waits = [e for e in events if isinstance(e, StackSample) and e.kind == abi.EventKind.OFF_CPU]
    sampled_ns = sum(w.blocked_ns * w.weight for w in waits)
    assert times.blocked_d_ns > 0 and times.d_waits > len(waits) > 0, (times.d_waits, len(waits))
    # The two programs on each tracepoint run one after the other, and read the clock apart:
    # by a capture's walk (tens of microseconds, under load) when it runs first, else by ~1 µs.
    margin = 100_000 * len(waits) + 1_000 * times.d_waits
    assert abs(sampled_ns + carried_ns - times.blocked_d_ns) <= margin, (
        sampled_ns,
        carried_ns,
        times.blocked_d_ns,
        len(waits),
    )


def test_exec_of_a_matching_comm_is_reported_with_rule_id_and_cgroup(workloads):
    from bistouri.agent.matcher import lpm_key

    with Profiler(ProfilerOptions(freq_hz=19, offcpu=False)) as agent:
        agent.start()
        agent.set_comm_rules([(lpm_key(b"burner", (len(b"burner") + 1) * 8), 7)])
        proc = subprocess.Popen([str(workloads / "burner"), "0.2"])
        proc.wait()
        events = _collect(agent, 0.5)
    # The rule is host-wide: another `burner` (another test run on the host) matches too.
    matches = [e for e in events if isinstance(e, ExecMatch) and e.pid == proc.pid]
    assert [(m.rule_id, m.pid, m.comm) for m in matches] == [(7, proc.pid, "burner")]
    assert matches[0].cgroup_id == os.stat("/sys/fs/cgroup/unified").st_ino or matches[0].cgroup_id > 0


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_twenty_load_attach_destroy_cycles_leak_nothing():
    before_fds = _fd_count()
    ours: set[int] = set()
    for _ in range(20):
        agent = Profiler(ProfilerOptions(freq_hz=19))
        agent.open()
        agent.start()
        loaded = own_prog_ids()
        # perf_event, the off-CPU pair (sched_switch, sched_wakeup), exec and the episode hooks
        assert len(loaded) == 4 + len(EPISODE_PROGRAMS) and loaded <= bistouri_prog_ids(), loaded
        ours |= loaded
        agent.close()
        agent.close()  # idempotent
        assert not own_prog_ids()
    assert _fd_count() == before_fds
    # Programs are freed asynchronously (RCU): allow them a few seconds to go.
    assert wait_until(lambda: not (bistouri_prog_ids() & ours), 10), bistouri_prog_ids() & ours


def test_an_object_loaded_on_a_thread_is_handed_over_or_released(workloads):
    """`record` loads the object on a thread (ObjectLoad) while it imports the rest: the profiler then
    samples with it; an agent closed before open() releases it; a failed load raises on open()."""
    before_fds = _fd_count()
    options = ProfilerOptions(freq_hz=99, offcpu=False, exec_discovery=False, episode=False, unwind_rows=0)
    proc = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        with Profiler(options, loading=ObjectLoad(options)) as agent:
            assert len(own_prog_ids()) == 1  # handle_perf: the options were applied
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            assert wait_until(lambda: agent.counters()[abi.Counter.ON_CPU_SAMPLES] > 0, 10)
    finally:
        proc.kill()
        proc.wait()
    assert not own_prog_ids()

    never_opened = Profiler(options, loading=ObjectLoad(options))
    never_opened.close()
    assert not own_prog_ids()
    assert _fd_count() == before_fds

    missing = dataclasses.replace(options, object_path=Path("/nonexistent/bistouri.bpf.o"))
    with pytest.raises(BpfError, match="opening BPF object"):
        Profiler(missing, loading=ObjectLoad(missing)).open()
    assert _fd_count() == before_fds


def test_a_failed_attach_leaves_nothing_behind(monkeypatch):
    from bistouri.bpf import perf

    before_fds = _fd_count()
    before_progs = bistouri_prog_ids()

    def refuse(cpu: int, freq: int) -> int:
        raise OSError(13, "refused for the test")

    monkeypatch.setattr(perf, "open_cpu_clock", refuse)
    agent = Profiler(ProfilerOptions(freq_hz=19))
    with pytest.raises(OSError):
        agent.open()
    assert _fd_count() == before_fds
    assert wait_until(lambda: bistouri_prog_ids() <= before_progs, 10)


def test_callback_exception_is_reraised_on_the_owning_thread(workloads):
    from bistouri.bpf.handles import RingBuffer

    proc = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        with Profiler(ProfilerOptions(freq_hz=99, offcpu=False)) as agent:
            obj = agent._obj
            assert obj is not None

            def boom(data: bytes) -> None:
                raise ValueError("handler failed")

            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            # Samples in the ring: the burner's CPU time, not the wall's (a busy host gives it less).
            since = _on_cpu_ns(proc.pid)
            assert wait_until(lambda: _on_cpu_ns(proc.pid) - since >= 0.3e9, 60.0), "the burner ran"
            with RingBuffer([(obj.maps["stack_events"], boom)]) as rb, pytest.raises(ValueError):
                rb.consume()
    finally:
        proc.kill()
        proc.wait()


def test_waits_under_the_floor_are_counted_not_reported(workloads, tmp_path):
    # A floor of 10 s: every fsync wait is shorter, so none may come out.
    opts = ProfilerOptions(freq_hz=19, offcpu_min_ns=10**10)
    _, events, counters = _off_cpu_of_fsyncer(workloads, tmp_path, opts, 2.0)
    assert not [e for e in events if isinstance(e, StackSample) and e.kind == abi.EventKind.OFF_CPU]
    assert counters[abi.Counter.OFFCPU_TOO_SHORT] > 0, counters


def _cpu_s(pid: int) -> float:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def _drain_all(agent: Profiler) -> list:
    """Everything the kernel holds, handed over: two drains, as a count whose sample has not
    arrived waits for the next drain before it is called orphaned."""
    agent.catch_up()
    agent.catch_up()
    return agent.take()


def _lose_a_cache_midway(
    workloads: Path, options: ProfilerOptions, lose: Callable[[Profiler], Callable[[], int]]
) -> tuple[int, list[StackSample], float]:
    """Profile a burner for 1 s of its CPU time; with the burner stopped and every sample drained,
    make the agent lose a cache (`lose` returns how to read what it lost); let the burner run 2 s of
    CPU more, stop it and drain again. Returns (that reading, the samples of the second run, the
    burner's time on CPU in it). The stops make the second run's edges exact whatever the machine's
    load: every sample in it was taken between them and handed over after the second; its length in
    CPU time, not wall time, gives a busy host as many samples."""
    proc = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        with Profiler(options) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            _collect_on_cpu(agent, proc.pid, 0, 1.0)
            _stop(proc)
            _drain_all(agent)
            lost = lose(agent)
            cpu0 = _cpu_s(proc.pid)
            proc.send_signal(signal.SIGCONT)
            late = _collect_on_cpu(agent, proc.pid, _on_cpu_ns(proc.pid), 2.0)
            _stop(proc)
            on_cpu = _cpu_s(proc.pid) - cpu0
            late += _drain_all(agent)
            reading = lost()
    finally:
        proc.kill()
        proc.wait()
    return reading, [e for e in late if isinstance(e, StackSample)], on_cpu


def _lose_sent_samples(agent: Profiler) -> Callable[[], int]:
    # The agent loses the samples the kernel counts repeats of.
    assert len(agent.sent) > 0
    agent.sent = SentSamples(forget=agent._forgetter("known_samples"))
    return lambda: agent.orphaned


def test_counts_of_samples_lost_in_user_space_are_dropped_counted_and_resent(workloads):
    opts = ProfilerOptions(freq_hz=99, offcpu=False)
    orphaned, late, on_cpu = _lose_a_cache_midway(workloads, opts, _lose_sent_samples)
    assert orphaned > 0, "counts with no sample to weigh are dropped and counted"
    # Their keys were forgotten in the kernel: the stacks came whole again and count on. Every
    # sample of the second run is either weighed or orphaned: ~99 per second the burner ran.
    got = sum(e.weight for e in late)
    assert got > 0, "the forgotten samples were sent whole again"
    expected = 99 * on_cpu
    assert on_cpu > 0.5 and 0.85 * expected - 3 <= got + orphaned <= 1.15 * expected + 3, (
        got,
        orphaned,
        on_cpu,
    )


def test_the_counts_map_is_read_whole_only_when_it_holds_counts(workloads, monkeypatch):
    """A dormant agent's drains find no count: they ask for the map's first key instead of a batch
    read that takes every bucket's lock. Counts that are there are all weighed in."""
    reads: list[int] = []
    take_all = Map.take_all

    def counted(m: Map) -> list[tuple[bytes, bytes]]:
        out = take_all(m)
        if m.name == "on_cpu_counts":
            reads.append(len(out))
        return out

    monkeypatch.setattr(Map, "take_all", counted)
    proc = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        with Profiler(ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0)) as agent:
            agent.start()
            for _ in range(3):
                agent.catch_up()
            assert reads == []  # nothing sampled: no batch read
            before = _on_cpu_ns(proc.pid)
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            events = _collect_on_cpu(agent, proc.pid, before, 2.0)
            _stop(proc)
            on_cpu = (_on_cpu_ns(proc.pid) - before) / 1e9
            events += _drain_all(agent)
            assert reads and all(n > 0 for n in reads), reads  # only maps holding counts
            got = sum(e.weight for e in events if isinstance(e, StackSample))
            expected = 99 * on_cpu
            assert 0.85 * expected - 3 <= got + agent.orphaned <= 1.15 * expected + 3, (got, on_cpu)
    finally:
        proc.kill()
        proc.wait()


def test_a_divisor_in_the_filter_keeps_one_sample_in_n(workloads):
    """The flight recorder's lower rate: BPF keeps 1 on-CPU sample in 4 of the process."""
    proc = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        with Profiler(ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0)) as agent:
            agent.start()
            before = _on_cpu_ns(proc.pid)
            agent.set_pid_filter(proc.pid, abi.filter_value(abi.FilterFlags.ON_CPU, 4))
            events = _collect_on_cpu(agent, proc.pid, before, 3.0)
            _stop(proc)
            on_cpu = (_on_cpu_ns(proc.pid) - before) / 1e9
            agent.close()
            events.extend(agent.take())
    finally:
        proc.kill()
        proc.wait()
    total = sum(e.weight for e in events if isinstance(e, StackSample) and e.pid == proc.pid)
    expected = 99 * on_cpu / 4
    assert on_cpu > 1.0 and 0.8 * expected <= total <= 1.15 * expected + 2, (total, on_cpu)


def test_the_slow_drain_reads_the_ring_once_a_second_and_a_session_catches_up(workloads):
    """While only the flight recorder samples (no session: the agent sets the slow drain), the ring
    is read once a second, not five times; catch_up() (a session starting) then hands over every
    sample the kernel kept, at once; a session brings back the 200 ms drain."""
    proc = subprocess.Popen([str(workloads / "burner"), "60"])
    try:
        options = ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0, drain_interval_s=0.2)
        with Profiler(options) as agent:
            agent.start()
            agent.set_slow_drain(True)
            agent.set_pid_filter(proc.pid, abi.filter_value(abi.FilterFlags.ON_CPU, 10))
            drains, t0 = agent.drains, time.monotonic()
            events = _collect(agent, 3.0)
            recorder_drains, recorder_s = agent.drains - drains, time.monotonic() - t0
            _stop(proc)
            kept = agent.counters()[abi.Counter.ON_CPU_SAMPLES]
            agent.catch_up()
            events.extend(agent.take())
            assert agent.counters()[abi.Counter.STACK_RESERVE_FAILED] == 0

            agent.set_slow_drain(False)
            agent.set_pid_filter(proc.pid, abi.filter_value(abi.FilterFlags.ON_CPU, 1))
            proc.send_signal(signal.SIGCONT)
            drains, t0 = agent.drains, time.monotonic()
            _collect(agent, 2.0)
            full_drains, full_s = agent.drains - drains, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    # One timer drain a second, plus the one set_pid_filter's kick may cause.
    assert recorder_drains <= recorder_s / 1.0 + 2, (recorder_drains, recorder_s)
    delivered = sum(e.weight for e in events if isinstance(e, StackSample) and e.pid == proc.pid)
    assert kept > 0 and delivered == kept, (delivered, kept)
    assert full_drains >= full_s / 0.2 / 2, (full_drains, full_s)


def test_an_idle_recorder_drains_ever_less_often_and_its_samples_wake_the_main_thread_in_batches(workloads):
    """At the slow drain, each drain that found nothing doubles the wait (1, 2, 4 s...) and wakes no
    one; samples bring the 1 s drain back, and the recorder's alone wake the main thread once per
    recorder_announce_s, not at every drain; a session's, at every drain."""
    woken: list[float] = []
    sleeper = subprocess.Popen(["sleep", "60"])
    proc = subprocess.Popen([str(workloads / "burner"), "60"])
    try:
        options = ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0, recorder_announce_s=2.5)
        with Profiler(options, notify=lambda: woken.append(time.monotonic())) as agent:
            agent.start()
            agent.set_slow_drain(True)
            agent.set_pid_filter(sleeper.pid, abi.FilterFlags.ON_CPU)
            drains = agent.drains
            time.sleep(7.5)
            idle_drains = agent.drains - drains  # at ~1, 3 and 7 s
            assert not woken and not agent.events.qsize()

            agent.set_pid_filter(proc.pid, abi.filter_value(abi.FilterFlags.ON_CPU, 10))
            drains, t0 = agent.drains, time.monotonic()
            assert wait_until(lambda: agent.drains - drains >= 6, 12, step=0.05)
            busy_drains, busy_s = agent.drains - drains, time.monotonic() - t0
            recorder_wakeups = len(woken)
            assert agent.take()  # what the main thread takes when woken

            agent.set_slow_drain(False)
            woken.clear()
            time.sleep(1.6)  # 500 ms drains, each with samples
            session_wakeups = len(woken)
    finally:
        for p in (sleeper, proc):
            p.kill()
            p.wait()
    assert idle_drains <= 4, idle_drains
    assert busy_s <= 7.5, busy_s  # every second again (the new process's kick, then 1 s)
    assert 1 <= recorder_wakeups <= busy_s / 2.5 + 1, (recorder_wakeups, busy_drains, busy_s)
    assert session_wakeups >= 2, session_wakeups


def test_the_sampler_first_samples_alone_then_the_rest_shares_its_maps(workloads, tmp_path):
    """`record`'s start-up: a frame-pointer sampler is loaded, attached and armed on the loading
    thread; the table-walking sampler and the off-CPU program load right after in a second object,
    whose waits come through the first's maps (filter, ring), and once it is loaded every sample
    goes through the table walk: one capture, whatever loaded it."""
    before_fds = _fd_count()
    options = ProfilerOptions(
        freq_hz=99, offcpu=True, exec_discovery=False, episode=False, unwind_rows=0, sampler_first=True
    )
    burner = subprocess.Popen([str(workloads / "burner"), "30"])
    fsyncer = subprocess.Popen([str(workloads / "fsyncer"), str(tmp_path / "data"), "30"])
    flags = abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU
    try:
        loading = ObjectLoad(options, arm={burner.pid: flags, fsyncer.pid: flags})
        loading.wait()
        with Profiler(options, loading=loading) as agent:
            # Armed on the loading thread: sampling before anything else is set up.
            assert wait_until(lambda: agent.counters()[abi.Counter.ON_CPU_SAMPLES] > 0, 10)
            agent.start()
            agent.attach_rest()
            handed_over = time.monotonic_ns()
            # + handle_perf (reached by the tail call) and the off-CPU pair, from the second object
            assert len(own_prog_ids()) == 4
            # The maps only the rest uses were created by the second object, and are the first's too.
            assert agent._require().maps["offcpu_skipped"].fd >= 0
            agent.attach_rest()  # nothing left: a no-op
            for pid in (burner.pid, fsyncer.pid):
                agent.set_pid_filter(pid, flags)
            seen: list = []

            def off_cpu_wait_seen() -> bool:
                seen.extend(e for e in agent.take(timeout=0.2) if isinstance(e, StackSample))
                late = [e for e in seen if e.kind == abi.EventKind.ON_CPU and e.timestamp_ns > handed_over]
                return len(late) >= 20 and any(
                    e.kind == abi.EventKind.OFF_CPU and e.pid == fsyncer.pid for e in seen
                )

            assert wait_until(off_cpu_wait_seen, 15), agent.counters()
    finally:
        for p in (burner, fsyncer):
            p.kill()
            p.wait()
    on_cpu = sorted(
        (e for e in seen if e.kind == abi.EventKind.ON_CPU and e.pid == burner.pid),
        key=lambda e: e.timestamp_ns,
    )
    # The first sampler's walks say no reason they ended (the kernel's frame-pointer walk); the table
    # walk always says one. The companion took over at one moment: none of the first's samples after
    # one of the table walk's, and every sample once attach_rest() returned is the table walk's.
    walked = [e.walk[2] != 0 for e in on_cpu]
    assert walked == sorted(walked), [e.walk for e in on_cpu]
    late = [e for e in on_cpu if e.timestamp_ns > handed_over]
    assert late and all(e.walk[2] != 0 for e in late), [e.walk for e in late]
    assert not own_prog_ids()
    assert _fd_count() == before_fds

    # Loaded but never opened: the sampler's links and both objects go with the agent.
    never_opened = Profiler(options, loading=ObjectLoad(options, arm={}))
    never_opened.close()
    assert not own_prog_ids()
    assert _fd_count() == before_fds


def test_the_targets_tables_are_loaded_and_walked_before_attach_rest(tmp_path):
    """Issue 27: with sampler_first, the target's unwind tables are loaded from Profiler.start() on,
    into maps of the first object, while the first sampler samples; and the table walk takes over
    as soon as the companion is loaded, not at attach_rest() (which the capture calls only after
    its own set-up: ~0.3 s of cut-short stacks of a frameless program before)."""
    options = ProfilerOptions(
        freq_hz=99,
        offcpu=False,
        exec_discovery=False,
        episode=False,
        sampler_first=True,
        unwind_cache_dir=str(tmp_path / "unwind"),
        unwind_cpu_share=1.0,
        unwind_nice=0,
    )
    script = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nwhile True:\n    fib(20)\n"
    busy = subprocess.Popen(["/usr/bin/python3", "-c", script])  # Debian's: no frame pointers
    try:
        loading = ObjectLoad(options, arm={busy.pid: abi.FilterFlags.ON_CPU})
        with Profiler(options, loading=loading) as agent:
            agent.set_pid_filter(busy.pid, abi.FilterFlags.ON_CPU)
            agent.start()
            tables = agent.unwind
            assert isinstance(tables, UnwindTables)
            assert tables.wait_idle(120), "tables loaded"
            assert tables.stats.procs == 1 and tables.stats.loaded_rows > 1000, tables.stats
            assert agent._require().maps["unwind_procs"].lookup(struct.pack("<I", busy.pid)) is not None
            seen: list = []

            def walked_by_table() -> bool:
                agent.check_thread()
                seen.extend(e for e in agent.take(timeout=0.2) if isinstance(e, StackSample))
                return sum(e.walk[0] > 2 for e in seen) >= 5

            assert wait_until(walked_by_table, 30), [e.walk for e in seen][-20:]
            assert agent._companion is not None, "attach_rest() was not called: the walk did not wait for it"
            agent.attach_rest()
    finally:
        busy.kill()
        busy.wait()


def test_the_first_sampler_loads_without_the_kernels_btf(caplog):
    """record's first sampler reads no kernel struct: libbpf loads it against an empty BTF
    (NoKernelTypes) and never parses /sys/kernel/btf/vmlinux, ~11 ms of its start-up. A CO-RE
    relocation added to it would fail that load: this test then sees the fallback, which reads
    the kernel's BTF, and the warning that says so."""
    import logging

    from bistouri.bpf import loader
    from bistouri.bpf.loader import load_object

    options = ProfilerOptions(freq_hz=99, exec_discovery=False, episode=False, sampler_first=True)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="bistouri"):
        loaded = load_object(options)
    # Every map but the companion's is there, the ones the first sampler does not use created
    # after its load (the unwind tables' 16 MiB among them): Profiler fills them while it samples.
    late = loader._late_maps(loaded.obj)
    assert "unwind_rows" in late and not set(late) & loader.FIRST_SAMPLER_MAPS, late
    assert all(m.fd >= 0 for name, m in loaded.obj.maps.items() if name not in loader.COMPANION_MAPS)
    assert loaded.obj.maps["unwind_rows"].max_entries == options.unwind_rows
    loaded.obj.close()
    messages = [r.getMessage() for r in caplog.records]
    assert loaded.programs == ("handle_perf_fp",)
    assert not [m for m in messages if "/sys/kernel/btf/vmlinux" in m]
    assert not [m for m in messages if "without kernel types" in m]
    # The agent's programs do read kernel structs: the same log names the kernel's BTF for them.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="bistouri"):
        loaded = load_object(ProfilerOptions(freq_hz=99, exec_discovery=False, episode=False))
    loaded.obj.close()
    assert any("/sys/kernel/btf/vmlinux" in r.getMessage() for r in caplog.records)

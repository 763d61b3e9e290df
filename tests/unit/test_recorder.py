"""The flight recorder: bounded in time and bytes, and sessions that start with its samples."""

from __future__ import annotations

import tracemalloc

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.metrics import AgentMetrics
from bistouri.bpf import abi
from bistouri.capture.events import ResolvedStacks, StackSample, decode_stack
from bistouri.capture.flight import ENTRY_OVERHEAD_BYTES, FlightRecorder, Recorded
from bistouri.capture.sessions import SessionCapture
from bistouri.host.kernel import KernelMeta
from bistouri.host.procmaps import ProcMaps
from tests.unit.test_capture import _Filter, _Sink, copy, record


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000_000

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


# No /proc here: user frames map as addresses of a gone process, which is all the recorder needs.
_NO_PROC = ProcMaps("/nonexistent-proc")


def _sample(pid: int, leaf: int = 0x1100, depth: int = 3) -> StackSample:
    raw = copy(record(pid, pid, [0xFFFFFFFF81000010] * depth, [leaf] * depth))
    return decode_stack(raw, _NO_PROC, ResolvedStacks())


def test_samples_of_watched_processes_are_kept_for_their_horizon_only():
    clock = _Clock()
    rec = FlightRecorder(1 << 20, clock_ns=clock)
    assert rec.watch(7, 5.0) and not rec.watch(7, 5.0)
    rec.add([_sample(7), _sample(8)])  # 8 is not watched
    assert len(rec) == 1
    clock.advance(3)
    rec.add([_sample(7, 0x2200)])
    assert [r.sample.pid for r in rec.recent([7], 5.0)] == [7, 7]
    assert len(rec.recent([7], 2.0)) == 1  # a shorter horizon asked: only the last 2 s
    clock.advance(2.5)  # the first sample is now 5.5 s old
    rec.expire()
    assert len(rec) == 1 and rec.nbytes == len(_sample(7).stacks) + ENTRY_OVERHEAD_BYTES
    rec.watch(8, 1.0)
    assert rec.unwatch(7) and not rec.watches(7)
    rec.add([_sample(7)])
    assert len(rec) == 0  # no new samples once unwatched, and the shorter horizon applies to the rest
    rec.add([_sample(8)])
    assert rec.unwatch(8) and not rec.watching
    rec.expire()
    assert len(rec) == 0 and rec.nbytes == 0  # nobody watched: nothing kept


def test_the_ring_lets_the_oldest_go_at_its_byte_bound_and_counts_them():
    dropped: list[int] = []
    rec = FlightRecorder(64 * 1024, on_dropped=dropped.append)
    for pid in range(1000):  # an exec storm: every new process watched
        rec.watch(pid, 60.0)
        rec.add([_sample(pid)])
        assert rec.nbytes <= rec.max_bytes
    cost = len(_sample(1).stacks) + ENTRY_OVERHEAD_BYTES
    assert len(rec) == rec.max_bytes // cost
    assert sum(dropped) == rec.dropped == 1000 - len(rec)
    assert rec.recent(range(1000), 60.0)[-1].sample.pid == 999  # the newest are the ones kept


def test_entry_overhead_covers_what_python_allocates():
    """ENTRY_OVERHEAD_BYTES must cover the objects around a sample's stack bytes."""
    rec = FlightRecorder(1 << 30)
    rec.watch(7, 60.0)
    n = 5000
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    samples = [_sample(7, 0x1000 + i) for i in range(n)]
    rec.add(samples)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    stacks = sum(len(s.stacks) for s in samples)
    assert (grown - stacks) / n <= ENTRY_OVERHEAD_BYTES, (grown - stacks) / n


def _orch(tmp_path, filt, sink, reg=None, **kw) -> SessionCapture:
    return SessionCapture(
        filt,
        sink,
        AgentMetrics(reg or CollectorRegistry()),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
        **kw,
    )


def test_a_session_starts_with_the_recorded_samples_marked_before_the_trigger(tmp_path):
    clock = _Clock()
    reg = CollectorRegistry()
    filt, sink = _Filter(_NO_PROC), _Sink()
    orch = _orch(tmp_path, filt, sink, reg)
    orch.recorder = FlightRecorder(1 << 20, clock_ns=clock)
    orch.watch(7, 5.0)
    assert filt.pids.keys() == {7}  # sampled between sessions
    orch.add_samples([_sample(7, 0x1111)])
    clock.advance(2)
    orch.add_samples([_sample(7, 0x2222)])
    assert reg.get_sample_value("bistouri_samples_unmatched_total") == 0  # recorded, not lost
    clock.advance(0.5)
    sid = orch.start_session(
        wire.Trigger("cpu", time_ns=10**18), "svc", {}, {7: "burner"}, 60, recorder_secs=5
    )
    orch.add_samples([_sample(7, 0x1111)])
    assert sid
    orch.flush_all()
    s = sink.sessions[sid]
    assert s.pre_trigger_ns == 2_500_000_000
    pre = sorted((t.user[0].address, t.on_cpu) for t in s.traces if t.pre_trigger)
    post = [(t.user[0].address, t.on_cpu) for t in s.traces if not t.pre_trigger]
    assert pre == [(0x1111, 1), (0x2222, 1)] and post == [(0x1111, 1)]
    assert filt.pids.keys() == {7}  # the session let go of its reference, the recorder keeps its own
    orch.unwatch(7)
    assert filt.pids == {}


def _wait(pid: int, waits: int, blocked_ns: int) -> StackSample:
    sleep = abi.EpisodeKind.SLEEP
    raw = copy(record(pid, pid, [0xFFFFFFFF81000010], [0x3300], sleep, blocked_ns, waits=waits))
    return decode_stack(raw, _NO_PROC, ResolvedStacks())


def test_a_session_starts_with_the_waits_the_kernel_counted_for_the_recorder(tmp_path):
    """With a reader of the kernel's counts, a process only recorded is marked so in the filter
    (BPF counts its waits instead of sending them) and unmarked while a session samples it; the
    session's pre-trigger part merges those counts with the samples that came through the ring."""
    clock = _Clock()
    asked: list[tuple[set[int], int]] = []

    def kernel_waits(pids, since_ns):
        asked.append((set(pids), since_ns))
        return [Recorded(clock.ns - 3_000_000_000, _wait(7, 5, 1000))]

    filt, sink = _Filter(_NO_PROC), _Sink()
    orch = _orch(tmp_path, filt, sink)
    orch.recorder = FlightRecorder(1 << 20, clock_ns=clock, kernel_waits=kernel_waits)
    orch.watch(7, 5.0, recorder_hz=250)  # 1 on-CPU sample in 4 kept by BPF
    assert filt.pids[7] & abi.FilterFlags.RECORDED
    clock.advance(1)
    orch.add_samples([_sample(7, 0x1111), _wait(7, 2, 500)])  # a wait with Python frames comes this way
    clock.advance(1)
    sid = orch.start_session(wire.Trigger("cpu", time_ns=10**18), "svc", {}, {7: "x"}, 60, recorder_secs=5)
    assert sid and not filt.pids[7] & abi.FilterFlags.RECORDED  # sessions get every record
    assert asked == [({7}, clock.ns - 5_000_000_000)]
    orch.flush_all()
    assert filt.pids[7] & abi.FilterFlags.RECORDED  # only recorded again
    s = sink.sessions[sid]
    assert s.pre_trigger_ns == 3_000_000_000  # the kernel's waits are the oldest
    pre = sorted((t.user[0].address, t.on_cpu, t.off_cpu, t.off_cpu_ns) for t in s.traces if t.pre_trigger)
    # The on-CPU sample stands for the 4 BPF let go; a wait stands for its own waits only.
    assert pre == [(0x1111, 4, 0, 0), (0x3300, 0, 7, 5 * 1000 + 2 * 500)]


def test_recorder_off_keeps_processes_out_of_the_filter(tmp_path):
    filt, sink = _Filter(_NO_PROC), _Sink()
    orch = _orch(tmp_path, filt, sink)
    orch.recorder.max_bytes = 0  # --recorder-max-bytes 0
    orch.watch(7, 5.0)
    assert filt.pids == {}


def test_only_sessions_ask_for_raw_stack_copies_and_release_theirs_as_they_end(tmp_path):
    """The agent's sessions: their processes send raw copies while their tables are not in, a process
    only recorded never does; an ending session's catch-up names its processes (their copies still
    held come to it as they are)."""
    from bistouri.agent.daemon import session_flags
    from bistouri.agent.settings import AgentSettings

    raw = abi.FilterFlags.RAW_STACK
    caught_up: list[set[int]] = []
    filt = _Filter(_NO_PROC)
    orch = _orch(
        tmp_path,
        filt,
        _Sink(),
        filter_flags=session_flags(AgentSettings()),
        catch_up=lambda pids: caught_up.append(set(pids)),
    )
    orch.watch(7, 5.0)
    assert not filt.pids[7] & raw
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "a", 8: "b"}, 1)
    assert sid and filt.pids[7] & raw and filt.pids[8] & raw
    orch.extend_session(sid, {9: "a fork"})  # a process joining later asks for copies too
    assert filt.pids[9] & raw
    assert orch.tick(orch._clock() + 2) == [sid]
    assert caught_up == [{7, 8, 9}]
    assert filt.pids.keys() == {7} and not filt.pids[7] & raw  # back to the recorder's value
    assert not session_flags(AgentSettings(raw_stacks_max_bytes=0)) & raw


def test_the_recorder_leaves_room_in_the_pid_filter_for_sessions(tmp_path):
    from bistouri.capture.sessions import RECORDER_MAX_PROCESSES

    reg = CollectorRegistry()
    filt, sink = _Filter(_NO_PROC), _Sink()
    orch = _orch(tmp_path, filt, sink, reg)
    for pid in range(1, RECORDER_MAX_PROCESSES + 11):
        orch.watch(pid, 5.0)
    assert len(filt.pids) == RECORDER_MAX_PROCESSES
    assert reg.get_sample_value("bistouri_recorder_dropped_total", {"reason": "filter_full"}) == 10
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {RECORDER_MAX_PROCESSES + 5: "x"}, 60)
    assert sid and len(filt.pids) == RECORDER_MAX_PROCESSES + 1


def test_tracked_processes_are_recorded_until_gone_or_reloaded(tmp_path):
    """Watcher keeps each tracked process of a recording target in the filter, and lets go
    when the process is gone or the config is replaced (recorder_secs: 0 leaves it out)."""
    import os
    import threading

    import pytest

    from bistouri.agent.config import parse_targets_config
    from bistouri.agent.discovery import walk_processes
    from bistouri.agent.watcher import Watcher
    from bistouri.host.psi import PsiLoop
    from tests.unit.test_trigger_pid_reuse import _process

    if not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("no PSI on this kernel")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "pressure").symlink_to("/proc/pressure")
    _process(proc, 100, "burner", 4242)
    _process(proc, 101, "quiet", 4243)
    reg = CollectorRegistry()
    filt = _Filter(_NO_PROC)
    orch = _orch(tmp_path, filt, _Sink(), reg)
    loop = PsiLoop(registry=reg)
    watcher = Watcher(
        loop, orch, lambda e: None, orch.metrics, proc_root=str(proc), cgroup_root=None, default_capture_s=10
    )
    cpu = "scope: system, resources: [{resource: cpu, threshold: 50, window_ms: 2000}]"
    try:
        watcher.apply_config(
            parse_targets_config(
                "targets:\n"
                f"  - {{rule: {{type: Exact, comm: burner}}, service_id: a, {cpu}}}\n"
                f"  - {{rule: {{type: Exact, comm: quiet}}, service_id: b, recorder_secs: 0, {cpu}}}\n"
            )
        )
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        assert set(watcher.processes) == {100, 101} and filt.pids.keys() == {100}
        (proc / "100" / "stat").unlink()  # gone
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        assert filt.pids == {}
        _process(proc, 100, "burner", 5000)
        watcher.on_walk(walk_processes(watcher.walk_job(), str(proc), threading.Event()))
        assert filt.pids.keys() == {100}
        watcher.apply_config(
            parse_targets_config(f"targets:\n  - {{unit: x.service, service_id: c, {cpu}}}\n")
        )
        assert filt.pids == {} and not orch.recorder.watching
    finally:
        loop.clear()


def test_held_samples_are_timed_by_the_kernel_and_wake_the_agent_once_they_would_all_be_gone(tmp_path):
    """The ring thread hands the recorder's samples over seconds after the kernel took them: each
    is timed by the kernel's clock (a wait when it ended, repeats when their count was read), and
    the main loop's only deadline for them is when the newest has aged out."""
    import dataclasses

    clock = _Clock()
    rec = FlightRecorder(1 << 20, clock_ns=clock)
    orch = _orch(tmp_path, _Filter(_NO_PROC), _Sink())
    orch.recorder = rec
    assert orch.recorder_deadline() is None
    rec.watch(7, 5.0)
    taken = clock.ns
    clock.advance(4)  # read from the ring 4 s after it was taken
    rec.add([dataclasses.replace(_sample(7), timestamp_ns=taken)])
    wait = dataclasses.replace(_sample(7, 0x2200), timestamp_ns=taken, blocked_ns=3 * 10**9)
    repeats = _sample(7, 0x3300).weighed(5, clock.ns)
    rec.add([wait, repeats])
    assert [r.at_ns - taken for r in rec.recent([7], 5.0)] == [0, 3 * 10**9, 4 * 10**9]
    assert orch.recorder_deadline() == (clock.ns + 5 * 10**9) / 1e9  # the newest, 5 s on
    clock.advance(1.5)  # the first is 5.5 s old
    rec.expire()
    assert len(rec) == 2
    clock.advance(3.6)
    rec.expire()
    assert len(rec) == 0 and orch.recorder_deadline() is None

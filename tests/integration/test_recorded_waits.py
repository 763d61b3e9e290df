"""Issue 22: the flight recorder's waits counted in the kernel (bpf/recorder.bpf.h).

A process only the recorder watches sends no wait record: BPF counts its waits by thread, kind,
stack and second, and a session that starts reads them as its pre-trigger waits. Checked against
what the kernel itself counted (the episode hooks' thread times, the recorder's counters), with
the workload stopped before anything is compared, never against a fixed time.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.bpf import abi
from bistouri.capture.events import StackSample
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.symbolizer.kallsyms import parse_kallsyms
from testkit.agent_harness import SessionSink, capture_in_process
from testkit.helpers import build_id, symbols, wait_until

pytestmark = pytest.mark.bpf

_WAIT_KINDS = {int(abi.EventKind.OFF_CPU), *(int(k) for k in abi.EpisodeKind)}


def _thread_states(pid: int) -> list[str]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return out


def test_waits_of_a_recorded_process_are_counted_in_the_kernel_and_read_at_the_session(workloads):
    """A futex convoy watched only by the recorder: no wait record reaches the ring, the kernel
    keeps them; the session then starts with them as pre-trigger waits: S stacks in futex_wait,
    and run-queue weights that are, per thread, exactly the run-queue time the episode hooks
    counted less what no stack carries yet (to a nanosecond a wait: each second's mean is an
    integer division). Each worker blocks at two places, again and again: its user stack is walked
    once per place and then copied from the recorder's entry (STACKS_REUSED), and still every S
    stack is its place's (futex_wait under take_lock, the nanosleep under hold_and_sleep) and the
    S waits the stacks stand for are every sleep the hooks counted."""
    threads, iterations, hold_us = 3, 400, 2000
    convoy = subprocess.Popen(
        [str(workloads / "convoy"), str(threads), str(iterations), str(hold_us)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    sink = SessionSink()
    try:
        assert convoy.stdin is not None
        with Profiler(ProfilerOptions(freq_hz=49, drain_interval_s=0.1)) as agent:
            agent.start()
            orch = capture_in_process(agent, sink, 49, recorded_waits=agent.recorded_waits)
            orch.watch(convoy.pid, 60.0)
            ring: list[StackSample] = []

            def drain() -> None:
                got = [e for e in agent.take(timeout=0.05) if type(e) is StackSample]
                ring.extend(e for e in got if e.pid == convoy.pid)
                orch.add_samples(got)

            # Its tables in before it starts: on a busy host they came after the 200 entries below, and
            # every stack ended at `work` (by frame pointer past libc), none at the waits' own leaves.
            assert agent.unwind.wait_idle(60)
            convoy.stdin.write("go\n")
            convoy.stdin.flush()

            def kept_enough() -> bool:
                drain()
                return agent.recorder_counters()[abi.RecorderCounter.KEPT] >= 200

            assert wait_until(kept_enough, 60, step=0.05), agent.recorder_counters()
            convoy.send_signal(signal.SIGSTOP)
            assert wait_until(lambda: set(_thread_states(convoy.pid)) == {"T"}, 10)
            # Its last switch-outs follow the state by a moment; then nothing of it changes.
            assert wait_until(
                lambda: all(
                    t.state != abi.ThreadState.RUNNING for t in agent.thread_times({convoy.pid}).values()
                ),
                10,
            )
            times = agent.thread_times({convoy.pid})
            counters = agent.recorder_counters()
            reused = agent.episode_counters()[abi.EpisodeCounter.STACKS_REUSED]
            pending = {tid: _pending_sleep_waits(agent, tid) for tid in times}
            unstored = agent.counters()[abi.Counter.OFFCPU_PENDING_FULL]
            drain()
            sid = orch.start_session(
                wire.Trigger("cpu", time_ns=time.time_ns()), "s", {}, {convoy.pid: "c"}, 60, recorder_secs=60
            )
            assert sid is not None
            orch.flush_all()
    finally:
        convoy.kill()
        convoy.wait()
    assert [e for e in ring if e.kind in _WAIT_KINDS] == [], "a recorded process's waits were sent"
    assert counters[abi.RecorderCounter.REFUSED] == 0 and counters[abi.RecorderCounter.ENTRIES] > 0
    [s] = sink.sessions
    pre = [t for t in s.traces if t.pre_trigger]
    assert s.pre_trigger_ns > 0 and pre
    # Its workers: the main thread only read the go line, then waits for them.
    workers = {tid for tid, t in times.items() if tid != convoy.pid and t.s_waits}
    assert len(workers) == threads, {tid: t.s_waits for tid, t in times.items()}
    for tid in workers:
        rq = [t for t in pre if t.tid == tid and t.wait == wire.WAIT_RUNQUEUE]
        waits = sum(t.off_cpu for t in rq)  # each second's mean rounds down by less than 1 ns a wait
        carried = sum(t.off_cpu_ns for t in rq) + times[tid].runqueue_unsent_ns
        assert 0 <= times[tid].runqueue_ns - carried <= waits, (tid, carried, times[tid])
    kallsyms = parse_kallsyms(Path("/proc/kallsyms").read_bytes())
    sleeps = [t for t in pre if t.wait == wire.WAIT_S and t.tid in workers]
    names = {(kallsyms.lookup(ip) or ("?",))[0] for t in sleeps for ip in t.kernel}
    assert any(n.startswith("futex_wait") for n in names), sorted(names)[:40]
    # 400 iterations, two sleeps each, a stack at most every 10 ms per thread: most are copies.
    assert reused > 0
    places: Counter[tuple[str, str]] = Counter()
    leaf = _own_leaf(workloads / "convoy")
    for t in sleeps:
        kernel = {(kallsyms.lookup(ip) or ("?",))[0] for ip in t.kernel}
        place = "futex" if any(n.startswith("futex_wait") for n in kernel) else "sleep"
        places[place, leaf(t)] += t.off_cpu
    # Stacks walked before the convoy's tables were in end at `work` (by frame pointer past libc):
    # as before. A copy never puts one place's user stack on the other's wait.
    assert places[("futex", "take_lock")] and places[("sleep", "hold_and_sleep")], places
    assert set(places) <= {
        ("futex", "take_lock"),
        ("sleep", "hold_and_sleep"),
        ("futex", "work"),
        ("sleep", "work"),
    }
    for tid in workers:
        # A sleep's stack stands for it and the ones the rate limit skipped before it; the skips
        # since, and those a stack still pending carries, no stack has counted yet.
        counted = sum(t.off_cpu for t in sleeps if t.tid == tid) + times[tid].skipped + pending[tid]
        # A stack the pending map could not store (NO_PREALLOC: its allocation can fail under memory
        # pressure) is counted in the BPF errors and loses the waits it stood for: as before.
        assert counted == times[tid].s_waits or (unstored and counted < times[tid].s_waits), (
            tid,
            counted,
            times[tid].s_waits,
            unstored,
        )


def _pending_sleep_waits(agent: Profiler, tid: int) -> int:
    """The skipped sleeps a sleep stack still pending for `tid` carries (its own has not ended)."""
    raw = agent._require().maps["wait_pending"].lookup(struct.pack("<I", tid))
    if raw is None:
        return 0
    ev = abi.StackEvent.from_buffer_copy(raw)
    return ev.waits - 1 if ev.kind == abi.EpisodeKind.SLEEP else 0


def _own_leaf(binary: Path) -> Callable[[wire.Trace], str]:
    """A trace's innermost function of `binary` in its user frames ("?": none)."""
    bid, syms = bytes.fromhex(build_id(binary)), symbols(binary)

    def leaf(trace: wire.Trace) -> str:
        own = [f.address for f in trace.user if f.kind == wire.FRAME_RESOLVED and f.build_id == bid]
        return next((n for n, (a, size) in syms.items() if own and a <= own[0] < a + size), "?")

    return leaf


def test_a_session_reads_each_second_of_its_processes_entries_once_and_nothing_older():
    """The reader, on entries written from here: another process's are skipped, each second in the
    window is one sample standing for that second's waits (their mean time), timed at the second's
    start or at the window's, and seconds before the window (or of a slot reused 64 s on) are not."""
    with Profiler(ProfilerOptions(freq_hz=19)) as agent:
        m = agent._require().maps["recorder_waits"]
        now_s = time.monotonic_ns() // 1_000_000_000
        for pid, tid in ((4242, 1), (4343, 2)):
            key = abi.RecorderKey(tid=tid, kind=int(abi.EpisodeKind.SLEEP), kernel_hash=tid)
            key.user_key.pid = pid
            ev = abi.StackEvent(kind=int(abi.EpisodeKind.SLEEP), pid=pid, tid=tid, kernel_stack_size=8)
            ev.kernel_stack[0] = 0xFFFFFFFF81000010
            value = abi.RecordedWait()
            value.event[:] = bytes(ev)[: abi.RECORDED_EVENT_BYTES]
            for ago, waits in ((0, 3), (2, 5), (4, 7)):
                slot = value.slots[(now_s - ago) % abi.RECORDER_SLOTS]
                slot.second, slot.waits, slot.blocked_ns = now_s - ago, waits, waits * 1000 + ago
            stale = value.slots[(now_s - 1) % abi.RECORDER_SLOTS]  # last written 65 s ago
            stale.second, stale.waits, stale.blocked_ns = now_s - 1 - abi.RECORDER_SLOTS, 9, 9000
            m.update(bytes(key), bytes(value))
        since = (now_s - 3) * 1_000_000_000 + 500_000_000  # halfway into the second 3 s ago
        got = agent.recorded_waits({4242}, since)
    assert [(r.sample.pid, r.sample.tid) for r in got] == [(4242, 1)] * 2
    # The second 4 s ago ended before the window; 2 s ago and now are in it, oldest first.
    assert [(r.at_ns, r.sample.weight, r.sample.blocked_ns) for r in got] == [
        ((now_s - 2) * 1_000_000_000, 5, 1000),
        (now_s * 1_000_000_000, 3, 1000),
    ]
    assert got[0].sample.kind == abi.EpisodeKind.SLEEP and got[0].sample.kernel_len == 8

"""User frames named from raw IPs in the real kernel: the cases the kernel's build-id walk lost."""

from __future__ import annotations

import subprocess
import time
from collections import Counter

import pytest

from bistouri.bpf import abi
from bistouri.capture.events import StackSample, split_stacks
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.host.procmaps import FrameStatus
from testkit.helpers import build_id, symbols, wait_until

pytestmark = pytest.mark.bpf


def _function_at(syms: dict[str, tuple[int, int]], offset: int) -> str | None:
    for name, (addr, size) in syms.items():
        if addr <= offset < addr + size:
            return name
    return None


def _named_leaf(
    agent: Profiler, sample: StackSample, bid: bytes, syms: dict[str, tuple[int, int]]
) -> str | None:
    """The function of the sample's leaf frame in the file with build id `bid`, if it is there."""
    user = split_stacks(sample.stacks, sample.kernel_len)[1]
    if not user or user[0][0] != FrameStatus.FILE or agent.maps.file(user[0][1]).build_id != bid:
        return None
    return _function_at(syms, user[0][2])


def test_a_library_dlopened_by_a_short_lived_process_is_mapped_at_its_first_sample(workloads):
    """The library is mapped after the process became a target, and the ring is drained on a
    timer far longer than the process's life: only the first sample after the mapping changed,
    which wakes the reader, gets the maps read while the process lives. The process is let go
    once that read happened (it may take longer than 100 ms on a busy machine: waited for, not
    raced), and its samples, drained after it exited, name the library's functions."""
    lib = workloads / "libhot.so"
    bid = bytes.fromhex(build_id(lib))
    syms = symbols(lib)
    proc = subprocess.Popen([str(workloads / "dlopener"), str(lib), "100"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    opts = ProfilerOptions(freq_hz=999, offcpu=False, exec_discovery=False, drain_interval_s=600.0)
    try:
        with Profiler(opts) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)  # maps read now: no libhot yet
            reads = agent.maps.stats.reads
            proc.stdin.write(b"g")
            proc.stdin.flush()
            # Only the wakeup for a changed mapping can read the maps again: the timer is 10 min.
            assert wait_until(lambda: agent.maps.stats.reads > reads, 60.0), "a changed mapping was read"
            proc.stdin.close()
            assert proc.wait(timeout=30) == 0
            agent.close()  # drains what the ring still holds
            events = agent.take()
            leaves = Counter()
            for e in events:
                if isinstance(e, StackSample) and e.pid == proc.pid:
                    leaves[_named_leaf(agent, e, bid, syms)] += e.weight
    finally:
        proc.kill()
        proc.wait()
    total = sum(leaves.values())
    in_lib = leaves["lib_hot_spin"] + leaves["lib_entry"]
    # ~100 samples at 999 Hz while it spun (fewer if the machine is busy); nearly all in the library.
    assert total >= 10, leaves
    assert in_lib / total >= 0.8, leaves


def test_a_process_holding_its_mmap_lock_for_long_still_gets_named_frames(workloads):
    """The kernel's build-id walk gave bare IPs whenever the mmap lock was taken (a thread
    changing the protection of a large populated region holds it for milliseconds): measured
    with it, 10 % of the main thread's samples and 72 % of the churning thread's had raw frames.
    A frame-pointer walk of raw IPs does not need the lock, and user space maps them."""
    binary = workloads / "unmapper"
    bid = bytes.fromhex(build_id(binary))
    syms = symbols(binary)
    proc = subprocess.Popen([str(binary), "30"])
    chains: Counter[tuple[str | None, ...]] = Counter()
    churn: Counter[bool] = Counter()  # the other thread's samples: all user frames mapped?
    try:
        with Profiler(ProfilerOptions(freq_hz=199, offcpu=False, exec_discovery=False)) as agent:
            agent.start()
            agent.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            t0 = time.monotonic()

            def enough() -> bool:
                agent.check_thread()
                for e in agent.take(timeout=0.1):
                    if not (isinstance(e, StackSample) and e.pid == proc.pid):
                        continue
                    user = split_stacks(e.stacks, e.kernel_len)[1]
                    if e.tid != proc.pid:
                        churn[bool(user) and all(st == FrameStatus.FILE for st, _, _ in user)] += e.weight
                    else:
                        own = tuple(
                            _function_at(syms, off if i == 0 else off - 1)
                            if st == FrameStatus.FILE and agent.maps.file(ref).build_id == bid
                            else None
                            for i, (st, ref, off) in enumerate(user[:4])
                        )
                        chains[own] += e.weight
                return sum(chains.values()) >= 300 and sum(churn.values()) >= 100

            assert wait_until(enough, 60.0, step=0), chains
            reads, elapsed = agent.maps.stats.reads, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    total = sum(chains.values())
    named = chains[("hot_spin", "level2", "level1", "main")]
    # Main thread samples: the whole chain named in nearly all (the old walk lost a large share).
    assert named / total >= 0.95, chains.most_common(5)
    # The churning thread, sampled inside mprotect/munmap (libc frames): every frame mapped.
    assert churn[True] / sum(churn.values()) >= 0.95, churn
    # Its VMA count changes all the time: reads of its maps stay within the budget (a burst of
    # 5, then 20 a second, plus the first read).
    assert reads <= 1 + 5 + 20 * elapsed + 1, (reads, elapsed)

"""The sampling side of bench_sampling, in its own process (so a git ref's code can run it).

Usage: _sampler.py PID SECONDS FREQ [OBJECT] [FUNCTION]. Samples PID on-CPU with a
Profiler of whatever `bistouri` is first on sys.path, drains for SECONDS and prints
one JSON line: BPF run time per sample of its perf_event program (its own fdinfo; stats
must be enabled), also net of the runs for other processes (their early-return cost is
measured for 1 s before the target is filtered in), samples received, this process's CPU
per sample and share of one core, and, given FUNCTION, how many samples have a JIT frame
the perf map names so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def own_cpu_ns() -> int:
    total = 0
    for f in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(f.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


def prog_stats() -> tuple[int, int]:
    ns = cnt = 0
    for info in Path("/proc/self/fdinfo").glob("*"):
        try:
            text = info.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("prog_type", "").strip() == "7":  # BPF_PROG_TYPE_PERF_EVENT
            ns += int(fields.get("run_time_ns", "0"))
            cnt += int(fields.get("run_cnt", "0"))
    return ns, cnt


def main() -> int:
    pid, seconds, freq = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    obj = Path(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
    function = sys.argv[5] if len(sys.argv) > 5 else ""
    from bistouri.bpf import abi
    from bistouri.capture.events import StackSample, split_stacks
    from bistouri.capture.profiler import Profiler, ProfilerOptions

    opts = ProfilerOptions(freq_hz=freq, offcpu=False, exec_discovery=False, object_path=obj)
    samples = named = frames = 0
    with Profiler(opts) as agent:
        agent.start()
        # Runs for other processes return after the pid filter: their cost, measured alone,
        # is subtracted below to give the BPF time of the target's samples themselves.
        e0 = prog_stats()
        time.sleep(1.0)
        e1 = prog_stats()
        early_ns = (e1[0] - e0[0]) / max(1, e1[1] - e0[1])
        agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        unwind = getattr(agent, "unwind", None)  # None in code older than the .eh_frame walk
        if unwind is not None:
            unwind.wait_idle(120)  # measured once its unwind tables are loaded
        agent.take()
        ns0, cnt0 = prog_stats()
        cpu0, t0 = own_cpu_ns(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            for e in agent.take(timeout=0.2):
                if type(e) is not StackSample or e.pid != pid:
                    continue
                samples += e.weight
                frames += e.weight * len(split_stacks(e.stacks, e.kernel_len)[1])
                if function:
                    user = split_stacks(e.stacks, e.kernel_len)[1]
                    names = (
                        agent.maps.jit_name(pid, ip if i == 0 else ip - 1)
                        for i, (status, _ref, ip) in enumerate(user)
                        if status == 3  # procmaps.FrameStatus.ANON
                    )
                    if any(n and function in n for n in names):
                        named += e.weight
        agent.set_pid_filter(pid, 0)
        ns1, cnt1 = prog_stats()
        agent.drain()
        cpu1, t1 = own_cpu_ns(), time.monotonic()
    span = t1 - t0
    print(
        json.dumps(
            {
                # Its program runs on every CPU at FREQ and returns early for other pids.
                "bpf_ns_per_run": (ns1 - ns0) / max(1, cnt1 - cnt0),
                # All of it charged to the target's samples: an upper bound per sample.
                "bpf_ns_per_sample": (ns1 - ns0) / max(1, samples),
                # Less the runs that were not the target's, at the early-return cost measured alone.
                "bpf_ns_per_sample_net": (ns1 - ns0 - early_ns * max(0, cnt1 - cnt0 - samples))
                / max(1, samples),
                "early_ns_per_run": early_ns,
                "runs": cnt1 - cnt0,
                "samples": samples,
                "named": named,
                "user_frames": frames / max(1, samples),
                "reader_ns_per_sample": (cpu1 - cpu0) / max(1, samples),
                "reader_share_of_one_core": (cpu1 - cpu0) / 1e9 / span,
                "pid": os.getpid(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

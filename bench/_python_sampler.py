"""The bistouri side of bench_python_frames, in its own process (its CPU and its BPF programs its own).

Usage: _python_sampler.py PID SECONDS FREQ [--truth FILE] [--counter FILE] [--no-walk] [--window W].
Samples PID on-CPU with a Profiler, names every sample's Python frames as the capture does
(`Profiler.python.name`) and prints one JSON line:
- BPF run time of its perf_event program (its own fdinfo; the bench enables the stats): per sample of the
  target, all runs charged to it (upper bound) and net of the runs for other processes (their early-return
  cost measured for 1 s before the target is filtered in, as bench/_sampler.py does);
- samples of the target's main thread, the share whose Python frames name `hot_loop`, native and Python
  frames per sample;
- with --truth (the target's JSON line), the share of sampled frames on CPython's own line for their
  instruction offset, and the samples of each of its code objects by line;
- the CPU of this process over the window less this bench's own checks of each sample (thread CPU time
  around them), of its ring thread (the drain and decoding) and of naming the frames (around
  `python.name`);
- with --counter, the target's work over the window (bench/python_target.py) per second (work_rates).
--no-walk deletes the target's record from `python_procs` after it was pushed: the same process sampled
with its native stack only.
--window W also cuts the BPF time into windows of W seconds, their edges at multiples of W of
CLOCK_MONOTONIC (so two samplers started together have the same windows, and their ratios can be taken
window by window: `windows`, each its index k, run time, runs and the target's samples in it, a sample
counted in the window its kernel time falls in). With --window, once ready to measure it prints
`ready` and waits for a line on its standard input: two samplers then measure the same seconds.
"""

from __future__ import annotations

import argparse
import bisect
import json
import struct
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._sampler import own_cpu_ns, prog_stats  # noqa: E402


def thread_cpu_ns(comm: str) -> int:
    """CPU time of this process's threads named `comm`."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() == comm:
                total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


def tasks_cpu_ns(pid: int) -> int:
    """CPU time of a process, all its threads (schedstat, ns)."""
    return tasks_sched_ns(pid)[0]


def tasks_sched_ns(pid: int) -> tuple[int, int]:
    """(time on a CPU, time runnable waiting for one) of a process, all its threads (schedstat, ns)."""
    cpu = wait = 0
    for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            fields = f.read_text().split()
            cpu, wait = cpu + int(fields[0]), wait + int(fields[1])
        except (OSError, IndexError, ValueError):
            pass
    return cpu, wait


def work_rates(work: int, seconds: float, cpu_ns: int, wait_ns: int) -> dict[str, float]:
    """A target's work per second three ways: of wall time (what other tenants' load moves most), of
    its own CPU time (blind to the time a profiler keeps it stopped), and of wall time less its
    run-queue waits (a busy loop is otherwise always on a CPU or stopped: the time it would have
    taken on a machine of its own, stops included)."""
    return {
        "work_per_s": work / seconds,
        "work_per_cpu_s": work / max(1e-9, cpu_ns / 1e9),
        "work_per_own_s": work / max(1e-9, seconds - wait_ns / 1e9),
    }


def read_counter(path: str | None) -> int:
    if path is None:
        return 0
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


class Windows:
    """The perf_event program's run time cut at every multiple of `width` seconds of CLOCK_MONOTONIC
    (bpf_ktime_get_ns's clock, which stamps the samples); width 0: no windows."""

    def __init__(self, width: float) -> None:
        self.width_ns = int(width * 1e9)
        self.edges: list[tuple[int, int, int, int]] = []  # (k, at ns, run ns, runs), in time order
        self.samples: list[tuple[int, int]] = []  # (kernel time, weight)
        self.next_k = time.monotonic_ns() // self.width_ns + 1 if self.width_ns else 0

    def timeout(self, most: float) -> float:
        """How long a drain may wait: not past the next edge, so it is taken on time."""
        if not self.width_ns:
            return most
        return max(0.0, min(most, (self.next_k * self.width_ns - time.monotonic_ns()) / 1e9))

    def sample(self, at_ns: int, weight: int) -> None:
        if self.width_ns:
            self.samples.append((at_ns, weight))

    def edge(self) -> None:
        if not self.width_ns:
            return
        now = time.monotonic_ns()
        if now < self.next_k * self.width_ns:
            return
        ns, runs = prog_stats()
        self.edges.append((now // self.width_ns, time.monotonic_ns(), ns, runs))
        self.next_k = now // self.width_ns + 1

    def rows(self, early_ns: float) -> list[dict]:
        """Per window between two edges: its k (the later edge's), run time, runs, samples and the run
        time per sample net of the early returns for other processes, as the whole window's."""
        starts = [at for _, at, _, _ in self.edges]
        counts = [0] * len(self.edges)
        for at, w in self.samples:
            i = bisect.bisect_right(starts, at)
            if 0 < i < len(starts):
                counts[i] += w
        out = []
        for i in range(1, len(self.edges)):
            (_, _, ns0, n0), (k, _, ns1, n1) = self.edges[i - 1], self.edges[i]
            n = counts[i]
            net = (ns1 - ns0 - early_ns * max(0, n1 - n0 - n)) / n if n else None
            out.append({"k": k, "ns": ns1 - ns0, "runs": n1 - n0, "samples": n, "net_ns_per_sample": net})
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("seconds", type=float)
    ap.add_argument("freq", type=int)
    ap.add_argument("--truth")
    ap.add_argument("--counter")
    ap.add_argument("--no-walk", action="store_true")
    ap.add_argument("--window", type=float, default=0.0)
    args = ap.parse_args()
    pid = args.pid

    from bistouri.bpf import abi
    from bistouri.capture.events import StackSample, split_stacks
    from bistouri.capture.profiler import Profiler, ProfilerOptions
    from bistouri.cpython.splice import decode

    truth: dict[int, dict[int, int | None]] = {}
    names: dict[int, str] = {}
    if args.truth:
        dump = json.loads(Path(args.truth).read_text())
        truth = {c["id"]: {u: line for u, line in c["lines"]} for c in dump["codes"]}
        names = {c["id"]: c["name"] for c in dump["codes"]}

    opts = ProfilerOptions(freq_hz=args.freq, offcpu=False, exec_discovery=False)
    samples = hot = native = python = frames = exact = 0
    code_lines: dict[str, Counter[int]] = {}  # the truth's code objects' samples by line, by name
    naming_ns = bookkeeping_ns = 0  # this bench's own checks, not an agent's work: taken out below
    with Profiler(opts) as agent:
        agent.start()
        e0 = prog_stats()
        time.sleep(1.0)
        e1 = prog_stats()
        early_ns = (e1[0] - e0[0]) / max(1, e1[1] - e0[1])
        agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        walked = agent.python.interpreter(pid) is not None
        if args.no_walk:
            agent._require().maps["python_procs"].delete(struct.pack("<I", pid))
        agent.unwind.wait_idle(120)  # measured once its unwind tables are loaded
        agent.take()
        if args.window:
            print("ready", flush=True)
            sys.stdin.readline()
            agent.take()
        ns0, cnt0 = prog_stats()
        cpu0, ring0, target0 = own_cpu_ns(), thread_cpu_ns("ringbuf"), tasks_sched_ns(pid)
        work0, t0 = read_counter(args.counter), time.monotonic()
        windows = Windows(args.window)
        while time.monotonic() - t0 < args.seconds:
            for e in agent.take(timeout=windows.timeout(0.2)):
                if type(e) is not StackSample or e.pid != pid:
                    continue
                c0 = time.thread_time_ns()
                named = agent.python.name(pid, e.python)
                c1 = time.thread_time_ns()
                naming_ns += c1 - c0
                if e.tid != pid:
                    continue
                w = e.weight
                windows.sample(e.counted_ns or e.timestamp_ns, w)
                samples += w
                native += w * len(split_stacks(e.stacks, e.kernel_len)[1])
                python += w * len(named)
                hot += w * any(f.name == "hot_loop" for f in named)
                for raw, name in zip(decode(e.python), named, strict=True):
                    lines = truth.get(raw.code)
                    if lines is not None:
                        code_lines.setdefault(names[raw.code], Counter())[name.line] += w
                        frames += w
                        exact += w * (name.line == (lines.get(-1 if raw.offset is None else raw.offset) or 0))
                bookkeeping_ns += time.thread_time_ns() - c1
            windows.edge()
        ns1, cnt1 = prog_stats()
        cpu1, ring1, target1 = own_cpu_ns(), thread_cpu_ns("ringbuf"), tasks_sched_ns(pid)
        work1, t1 = read_counter(args.counter), time.monotonic()
        agent.set_pid_filter(pid, 0)
    span = t1 - t0
    n = max(1, samples)
    print(
        json.dumps(
            {
                "walked": walked,
                "samples": samples,
                "hot_share": hot / n,
                "native_frames": native / n,
                "python_frames": python / n,
                "frames_checked": frames,
                "lines_exact": exact / frames if frames else None,
                "code_lines": {k: dict(v) for k, v in code_lines.items()},
                "bpf_ns_per_run": (ns1 - ns0) / max(1, cnt1 - cnt0),
                "bpf_ns_per_sample": (ns1 - ns0) / n,
                "bpf_ns_per_sample_net": (ns1 - ns0 - early_ns * max(0, cnt1 - cnt0 - samples)) / n,
                "bpf_share_of_one_core": (ns1 - ns0) / 1e9 / span,
                "cpu_share_of_one_core": (cpu1 - cpu0 - bookkeeping_ns) / 1e9 / span,
                "bookkeeping_share_of_one_core": bookkeeping_ns / 1e9 / span,
                "ring_share_of_one_core": (ring1 - ring0) / 1e9 / span,
                "naming_share_of_one_core": naming_ns / 1e9 / span,
                **work_rates(work1 - work0, span, target1[0] - target0[0], target1[1] - target0[1]),
                "seconds": span,
                "windows": windows.rows(early_ns),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

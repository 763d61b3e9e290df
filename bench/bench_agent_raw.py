"""What the agent's raw stack copies cost while they flow, against the same session without them.

The case they are for: a session starts with its process, before its unwind tables are in. Here the
agent's own profiler and session flags (`daemon.profiler_options`, `session_flags`, at --freq 19)
sample Debian's frameless `xz -9 -T1` from its start, its tables held back (the table builder's
publication waits on a gate) until SAMPLES on-CPU samples were taken; then the gate opens and the
copies held are walked. Rounds alternate copies on (the default 8 MiB) and off
(--raw-stacks-max-bytes 0), in one process, so the rest of the machine's load hits both.

Per run, over the window before the tables: BPF time of the on-CPU sampler per sample (run_time_ns
of this process's perf_event programs, bpf_enable_stats; every run charged to xz's samples, the
early returns for other processes included), the ring thread's CPU per sample (schedstat), bytes
per copy held; after the gate: the walks' CPU per copy and the time from the gate to the last copy
walked, and the share of the session's on-CPU samples whose walk reached the entry (the note).
Run as root: `python -m bench.bench_agent_raw [--rounds N] [--samples N] [--freq HZ]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._sampler import prog_stats  # noqa: E402
from bench.bench_agent import enable_bpf_stats  # noqa: E402
from bistouri import wire  # noqa: E402
from bistouri.agent.daemon import profiler_options, session_flags  # noqa: E402
from bistouri.agent.settings import AgentSettings  # noqa: E402
from bistouri.bpf import abi  # noqa: E402
from bistouri.capture.events import StackSample  # noqa: E402
from bistouri.capture.profiler import Profiler  # noqa: E402
from bistouri.unwind.tables import UnwindTables  # noqa: E402
from testkit.agent_harness import SessionSink, capture_in_process  # noqa: E402
from testkit.helpers import wait_until  # noqa: E402


def ring_thread_ns() -> int:
    """CPU time of this process's bistouri-ringbuf thread (schedstat, ns)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "ringbuf":  # its kernel name (threads.py)
                return int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return 0


def one_run(copies: bool, samples: int, freq: int, tmp: Path) -> dict[str, float]:
    gate = threading.Event()
    publish = UnwindTables._publish

    def gated(self: UnwindTables, pid: int) -> None:
        gate.wait(300)
        publish(self, pid)

    settings = AgentSettings(
        spool_dir=str(tmp / "spool"), offcpu=False, freq=freq, raw_stacks_max_bytes=(8 << 20) if copies else 0
    )
    sink = SessionSink()
    UnwindTables._publish = gated  # type: ignore[method-assign]
    try:
        with Profiler(profiler_options(settings)) as agent:
            agent.start()

            def catch_up(release: Collection[int]) -> None:
                agent.catch_up(release)
                feed()

            capture = capture_in_process(
                agent, sink, freq, filter_flags=session_flags(settings), catch_up=catch_up
            )

            on_cpu = [0, 0]  # samples, of which walked to the entry

            def feed() -> bool:
                batch = [e for e in agent.take() if isinstance(e, StackSample)]
                for e in batch:
                    if e.kind == abi.EventKind.ON_CPU:
                        on_cpu[0] += e.weight
                        on_cpu[1] += e.weight * (e.walk[2] == abi.Counter.WALK_END)
                capture.add_samples(batch)
                return False

            def taken() -> int:
                return agent.counters()[abi.Counter.ON_CPU_SAMPLES]

            with open("/dev/urandom", "rb") as endless:
                xz = subprocess.Popen(["xz", "-9", "-T1", "-c"], stdin=endless, stdout=subprocess.DEVNULL)
            try:
                sid = capture.start_session(wire.Trigger("cpu"), "xz", {}, {xz.pid: "xz"}, 3600)
                assert sid is not None
                ns0, cnt0 = prog_stats()
                ring0, n0 = ring_thread_ns(), taken()
                assert wait_until(lambda: feed() or taken() >= n0 + samples, 300), "samples"
                agent.catch_up()
                feed()
                ns1, cnt1 = prog_stats()
                ring1, n1 = ring_thread_ns(), taken()
                held, held_bytes = len(agent.raw), agent.raw.nbytes
                opened = time.monotonic()
                gate.set()
                assert wait_until(lambda: feed() or (agent.unwind.wait_idle(0) and len(agent.raw) == 0), 120)
                walked_s = time.monotonic() - opened
                assert capture.tick(time.monotonic() + 7200) == [sid]
            finally:
                xz.kill()
                xz.wait()
            stats = agent.raw.stats
            lost = agent.counters()[abi.Counter.RAW_STACK_LOST]
    finally:
        UnwindTables._publish = publish  # type: ignore[method-assign]
    [session] = sink.sessions
    n = max(1, n1 - n0)
    return {
        "samples": n,
        "bpf_ns_per_sample": (ns1 - ns0) / n,
        "bpf_runs": cnt1 - cnt0,
        "ring_ns_per_sample": (ring1 - ring0) / n,
        "copies_held": held,
        "bytes_per_copy": held_bytes / held if held else 0.0,
        "walk_us_per_copy": stats.walk_cpu_s * 1e6 / stats.walked if stats.walked else 0.0,
        "gate_to_walked_s": walked_s,
        "copies_lost": lost,
        "copies_dropped": stats.dropped,
        "on_cpu_samples": sum(t.on_cpu for t in session.traces),
        # Of the session's on-CPU samples, those whose walk (in BPF, or of their copy) reached the entry.
        "whole_share": on_cpu[1] / max(1, on_cpu[0]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=100, help="on-CPU samples before the tables are let in")
    ap.add_argument("--freq", type=int, default=19)
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent_raw.json"))
    args, _ = ap.parse_known_args()  # `make bench` passes every bench the same flags
    if shutil.which("xz") is None or os.geteuid() != 0:
        print("needs root and xz", file=sys.stderr)
        return 1
    if enable_bpf_stats() < 0:
        print("bpf_enable_stats is unavailable: no BPF run times", file=sys.stderr)
        return 1
    runs: dict[str, list[dict[str, float]]] = {"copies": [], "none": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-agent-raw-") as d:
        for r in range(args.rounds):
            order = ["copies", "none"] if r % 2 == 0 else ["none", "copies"]
            for mode in order:
                res = one_run(mode == "copies", args.samples, args.freq, Path(d) / f"{mode}{r}")
                runs[mode].append(res)
                print(mode, json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
            load.append(os.getloadavg()[0])
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    print(
        f"\nmedians of {args.rounds} rounds at {args.freq} Hz, load average {min(load):.2f}-{max(load):.2f}"
    )
    for k in med["copies"]:
        c, n = med["copies"][k], med["none"][k]
        ratio = f"{c / n:.2f}x" if n else "-"
        print(f"{k:>22} copies {c:>12.3f}  none {n:>12.3f}  {ratio}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "medians": med, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

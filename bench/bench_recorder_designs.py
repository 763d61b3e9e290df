"""The flight recorder's two designs, measured: agent-side (what bistouri does: the ring is
drained once a second while no session runs, the samples kept in the agent) against a
kernel-side buffer (nothing read until a session starts), emulated by never draining.

BPF's work per kept sample is the same in both (one record written into a kernel buffer;
a kernel-side design would need an overwriting one, which BPF's ring buffer is not), so what
differs is the agent's ring-buffer thread. Two watched processes burn both CPUs at 19 Hz.
Run as root: `python -m bench.bench_recorder_designs [SECONDS]`."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bistouri.bpf import abi
from bistouri.capture.profiler import Profiler, ProfilerOptions

ROOT = Path(__file__).resolve().parent.parent
BURNER = ROOT / "tests" / "fixtures" / "build" / "workloads" / "burner"


def thread_cpu_ns() -> dict[str, int]:
    """CPU time of this process's threads by name (schedstat, ns)."""
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            name = Path(task, "comm").read_text().strip()
            out[name] = out.get(name, 0) + int(Path(task, "schedstat").read_text().split()[0])
        except OSError:
            pass
    return out


def sampler_bpf_ns() -> int:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return sum(p.get("run_time_ns", 0) for p in json.loads(out) if p.get("name") == "handle_perf")


def measure(slow_drain_s: float, seconds: float, burner: Path) -> dict[str, float]:
    """Two watched processes burning both CPUs at 19 Hz, no session: the recorder's steady state."""
    procs = [subprocess.Popen([str(burner), "600"]) for _ in range(2)]
    try:
        options = ProfilerOptions(freq_hz=19, exec_discovery=False, slow_drain_interval_s=slow_drain_s)
        with Profiler(options) as agent:
            agent.start()
            agent.set_slow_drain(True)
            for p in procs:
                agent.set_pid_filter(p.pid, abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU)
            time.sleep(2)
            cpu0, bpf0, t0 = thread_cpu_ns(), sampler_bpf_ns(), time.monotonic()
            drains0 = agent.drains
            while time.monotonic() - t0 < seconds:
                agent.take(timeout=1.0)  # what the agent's main loop does with what arrives
            cpu1, bpf1, span = thread_cpu_ns(), sampler_bpf_ns(), time.monotonic() - t0
            return {
                "ring_thread_pct": (cpu1.get("ringbuf", 0) - cpu0.get("ringbuf", 0)) / 1e9 / span * 100,
                "bpf_pct": (bpf1 - bpf0) / 1e9 / span * 100,
                "drains_per_s": (agent.drains - drains0) / span,
            }
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1")
    with tempfile.TemporaryDirectory() as d:
        burner = Path(d) / "recburner"  # its own name: tests and benches watch "burner"
        shutil.copy(BURNER, burner)
        for label, slow in (
            ("agent-side, drained once a second", 1.0),
            ("kernel-side, read at a session", 3600.0),
        ):
            r = measure(slow, seconds, burner)
            print(
                f"{label:36s} ring thread {r['ring_thread_pct']:.4f} %  BPF {r['bpf_pct']:.4f} %  "
                f"drains/s {r['drains_per_s']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the episode hooks (issue 12) on a context-switch-heavy workload.

The workload (built here) is two threads of one process passing a byte back and
forth through two pipes, ROUND_TRIPS times: every round trip is two sleeps, two
wakeups and four context switches. It is run to completion (fixed work) under
four configurations of a Profiler in this process:

- `hooks_off`: the episode programs not loaded (the agent as before issue 12);
- `d_sampler`: hooks off, only the existing D-state sampler on sched_switch, workload
  unwatched (what every switch of the machine paid before issue 12);
- `unwatched`: the hooks attached, the workload not in the pid filter (the cost
  every other thread of the machine pays: one hash lookup per hook);
- `watched`: the workload's threads timed by state (the episode filter bit);
- `watched_999hz`: the same plus on-CPU sampling at 999 Hz and the D-state sampler
  (what a session does).

For each: the workload's round trips per second, the BPF run time per event of the
tracing programs (`run_time_ns / run_cnt` from this process's own fdinfo with
bpf_enable_stats on, so other tenants' programs never count), events per second,
and this process's CPU (drain thread included) as a share of one core.

BCC's runqlat and offcputime side by side: BCC's Python tools compile at run time
against kernel headers this kernel lacks, so the bench runs their CO-RE ports from
Debian's `libbpf-tools` package (`/usr/sbin/runqlat`, `/usr/sbin/offcputime`, the
same BPF programs precompiled), each in turn on the same workload, machine-wide
(no pid filter, as they are usually run): `runqlat` and `offcputime` rows give
the BPF time per event of the tool's own programs (read from the tool process's
fdinfo), events per second and the tool's CPU. The tool reports at exit (after
the workload), so its CPU covers only the tracing.

Run as root: `python -m bench.bench_episode`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_agent import proc_cpu_ns  # noqa: E402

PROG_TYPE_TRACING = 26
PROG_TYPE_PERF_EVENT = 7
ROUND_TRIPS = 200_000

PINGPONG = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static int ab[2], ba[2];
static long n;
static void *pong(void *arg) {
    char c;
    for (long i = 0; i < n; i++) { if (read(ab[0], &c, 1) != 1 || write(ba[1], &c, 1) != 1) exit(3); }
    return arg;
}
int main(int argc, char **argv) {
    char line[8], c = 'x';
    struct timespec t0, t1;
    pthread_t t;
    n = atol(argv[1]);
    if (pipe(ab) || pipe(ba) || !fgets(line, sizeof(line), stdin)) return 2;
    pthread_create(&t, NULL, pong, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) { if (write(ab[1], &c, 1) != 1 || read(ba[0], &c, 1) != 1) return 3; }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(t, NULL);
    printf("%lld\n", (t1.tv_sec - t0.tv_sec) * 1000000000LL + t1.tv_nsec - t0.tv_nsec);
    return 0;
}
"""


def prog_stats(prog_type: int | None, pid: int | str = "self") -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over the BPF programs of process `pid` of `prog_type`
    (None: every type)."""
    ns = cnt = 0
    for info in Path(f"/proc/{pid}/fdinfo").glob("*"):
        try:
            text = info.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        kind = fields.get("prog_type", "").strip()
        if kind and (prog_type is None or kind == str(prog_type)):
            ns += int(fields.get("run_time_ns", "0"))
            cnt += int(fields.get("run_cnt", "0"))
    return ns, cnt


def enable_bpf_stats() -> int:
    from bistouri.bpf.handles import library

    lib = library()
    if not lib.has("bpf_enable_stats"):
        return -1
    return int(lib.lib.bpf_enable_stats(0))  # BPF_STATS_RUN_TIME


def run_config(name: str, binary: Path, round_trips: int) -> dict:
    from bistouri.bpf import abi
    from bistouri.capture.profiler import Profiler, ProfilerOptions

    episode = name not in ("hooks_off", "d_sampler")
    sampling = name == "watched_999hz"
    opts = ProfilerOptions(
        freq_hz=999, offcpu=sampling or name == "d_sampler", exec_discovery=False, episode=episode
    )
    with Profiler(opts) as agent:
        agent.start()
        p = subprocess.Popen(
            [str(binary), str(round_trips)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert p.stdin is not None and p.stdout is not None
        if name.startswith("watched"):
            flags = int(abi.EpisodeFilter.ON)
            if sampling:
                flags |= abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU
            agent.set_pid_filter(p.pid, flags)
        tr0, pe0 = prog_stats(PROG_TYPE_TRACING), prog_stats(PROG_TYPE_PERF_EVENT)
        cpu0, t0 = proc_cpu_ns(os.getpid()), time.monotonic()
        p.stdin.write("go\n")
        p.stdin.flush()
        elapsed_ns = int(p.stdout.readline())
        p.wait()
        cpu1, t1 = proc_cpu_ns(os.getpid()), time.monotonic()
        tr1, pe1 = prog_stats(PROG_TYPE_TRACING), prog_stats(PROG_TYPE_PERF_EVENT)
        times = agent.thread_times({p.pid}) if name.startswith("watched") else {}
        agent.set_pid_filter(p.pid, 0)
    span = t1 - t0
    runs = tr1[1] - tr0[1]
    return {
        "config": name,
        "round_trips_per_s": round_trips / (elapsed_ns / 1e9),
        "tracing_events_per_s": runs / span,
        "bpf_ns_per_event": (tr1[0] - tr0[0]) / runs if runs else 0.0,
        "perf_event_ns_per_run": (pe1[0] - pe0[0]) / max(1, pe1[1] - pe0[1]),
        "agent_core_pct": 100 * (cpu1 - cpu0) / 1e9 / span,
        "threads_timed": len(times),
        "switches_timed": sum(t.runqueue_waits + t.s_waits + t.d_waits for t in times.values()),
    }


# libbpf-tools (BCC's CO-RE tools, Debian package libbpf-tools) and the arguments to run them
# until SIGINT, machine-wide.
TOOLS = {"runqlat": ["runqlat"], "offcputime": ["offcputime"]}


def run_tool(name: str, binary: Path, round_trips: int) -> dict | None:
    """The workload under one libbpf-tools tool; None if the tool is not installed."""
    exe = shutil.which(TOOLS[name][0], path="/usr/sbin:/usr/bin:/sbin:/bin")
    if exe is None:
        return None
    tool = subprocess.Popen([exe, *TOOLS[name][1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Attached once its programs have run: wait for a run count (the machine always switches).
        deadline = time.monotonic() + 30
        while prog_stats(None, tool.pid)[1] == 0:
            if tool.poll() is not None or time.monotonic() > deadline:
                err = tool.stderr.read().decode(errors="replace") if tool.stderr else ""
                raise RuntimeError(f"{name} did not start: {err.strip()[-300:]}")
            time.sleep(0.05)
        p = subprocess.Popen(
            [str(binary), str(round_trips)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert p.stdin is not None and p.stdout is not None
        st0, cpu0, t0 = prog_stats(None, tool.pid), proc_cpu_ns(tool.pid), time.monotonic()
        p.stdin.write("go\n")
        p.stdin.flush()
        elapsed_ns = int(p.stdout.readline())
        p.wait()
        st1, cpu1, t1 = prog_stats(None, tool.pid), proc_cpu_ns(tool.pid), time.monotonic()
    finally:
        tool.send_signal(signal.SIGINT)
        try:
            tool.wait(60)
        except subprocess.TimeoutExpired:
            tool.kill()
            tool.wait()
    span, runs = t1 - t0, st1[1] - st0[1]
    return {
        "config": name,
        "round_trips_per_s": round_trips / (elapsed_ns / 1e9),
        "tracing_events_per_s": runs / span,
        "bpf_ns_per_event": (st1[0] - st0[0]) / runs if runs else 0.0,
        "perf_event_ns_per_run": 0.0,
        "agent_core_pct": 100 * (cpu1 - cpu0) / 1e9 / span,
        "threads_timed": 0,
        "switches_timed": 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round-trips", type=int, default=ROUND_TRIPS)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (the median is kept)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/episode.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_episode needs root (BPF)", file=sys.stderr)
        return 2
    stats_fd = enable_bpf_stats()
    if stats_fd < 0:
        print("bpf_enable_stats is unavailable: no BPF run times", file=sys.stderr)
        return 2
    results: dict = {"round_trips": args.round_trips, "configs": []}
    with tempfile.TemporaryDirectory() as d:
        src, binary = Path(d) / "pingpong.c", Path(d) / "pingpong"
        src.write_text(PINGPONG)
        subprocess.run(["gcc", "-O2", "-pthread", "-o", str(binary), str(src)], check=True)
        for name in ("hooks_off", "d_sampler", "unwatched", "watched", "watched_999hz"):
            runs = sorted(
                (run_config(name, binary, args.round_trips) for _ in range(args.repeat)),
                key=lambda r: r["round_trips_per_s"],
            )
            results["configs"].append(runs[len(runs) // 2])
        for name in TOOLS:
            tool_runs = [run_tool(name, binary, args.round_trips) for _ in range(args.repeat)]
            if None in tool_runs:
                results["missing"] = results.get("missing", []) + [name]
                continue
            kept = sorted((r for r in tool_runs if r), key=lambda r: r["round_trips_per_s"])
            results["configs"].append(kept[len(kept) // 2])
    os.close(stats_fd)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    base = results["configs"][0]["round_trips_per_s"]
    print(f"{'config':>14} {'trips/s':>9} {'vs off':>7} {'events/s':>9} {'BPF ns/ev':>10} {'CPU %core':>9}")
    for c in results["configs"]:
        print(
            f"{c['config']:>14} {c['round_trips_per_s']:9.0f} {c['round_trips_per_s'] / base:7.3f} "
            f"{c['tracing_events_per_s']:9.0f} {c['bpf_ns_per_event']:10.0f} {c['agent_core_pct']:9.2f}"
        )
    if results.get("missing"):
        print(f"not installed (apt-get install libbpf-tools): {', '.join(results['missing'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

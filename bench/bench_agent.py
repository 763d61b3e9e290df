"""Agent overhead: workload slowdown, agent + BPF CPU and RSS at 19/99/999 Hz, and idle cost.

Each frequency runs the same fixed-work workload (3 burners on 2 CPUs in a
child cgroup, so it stalls) without the agent (baseline) and with the agent,
whose trigger fires on that stall ~2 s in and captures until the end; baseline
and agent runs alternate, in one process, so noise from the rest of the
machine hits both. The idle case watches 100 processes in 100
cgroups and measures the agent while nothing stalls, with the flight recorder
off and on: all 100 asleep, and with 2 of them burning both CPUs (the most the
recorder can take at --freq: every CPU's samples are a watched process's).

Agent CPU = the agent's threads' time on CPU (schedstat, ns), BPF CPU =
run_time_ns of every program the agent holds (bpf_enable_stats; the scheduler
and reclaim hooks included), both over the capture window only (from "Capture
started" to the end of the workload): the steady cost while sampling, not
diluted by the seconds before PSI fires. Run as root:
`python -m bench.bench_agent`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.agent_harness import AgentProcess  # noqa: E402
from testkit.helpers import Cgroup, wait_until  # noqa: E402

BURNER = ROOT / "tests/fixtures/build/workloads/burner"
BPF_STATS_RUN_TIME = 0


def proc_cpu_ns(pid: int) -> int:
    """Time on CPU of every thread of `pid`, in ns (utime+stime only has 10 ms ticks)."""
    total = 0
    for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(f.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended
    return total


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """Time on CPU of `pid`'s threads by thread name, in ns (threads of one name summed)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0) + int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended
    return out


def thread_wakeups(pid: int) -> dict[str, int]:
    """Times `pid`'s threads went to sleep of their own (voluntary context switches), by thread name:
    each is a wake-up later, and on a shared CPU a wake-up costs more than its work."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[name] = out.get(name, 0) + int(line.split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended
    return out


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def agent_prog_ids(pid: int) -> set[int]:
    """The BPF programs the process `pid` holds (its fds' prog_id): every program of the agent's,
    the scheduler and reclaim hooks included, and no other tenant's."""
    ids = set()
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = info.read_text()
        except OSError:
            continue  # closed meanwhile
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


def bpf_programs(pid: int) -> dict[str, tuple[int, int]]:
    """(run time ns, runs) of each program of the agent `pid`, by name (stats must be enabled)."""
    ids = agent_prog_ids(pid)
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True).stdout
    progs: dict[str, tuple[int, int]] = {}
    for p in json.loads(out or "[]"):
        if p.get("id") in ids:
            t, n = progs.get(p["name"], (0, 0))
            progs[p["name"]] = (t + p.get("run_time_ns", 0), n + p.get("run_cnt", 0))
    return progs


def bpf_runtime_ns(pid: int) -> int:
    """Total run time of the programs of the agent `pid` (stats must be enabled)."""
    return sum(t for t, _ in bpf_programs(pid).values())


def enable_bpf_stats() -> int:
    from bistouri.bpf.handles import library

    lib = library()
    if not lib.has("bpf_enable_stats"):
        return -1
    return int(lib.lib.bpf_enable_stats(BPF_STATS_RUN_TIME))


def run_workload(
    cg: Cgroup, iters: int, while_running: Callable[[], None] | None = None, n: int = 3
) -> tuple[float, float, list[int]]:
    """Three burners on two CPUs (so the cgroup stalls) for a fixed amount of work.

    Returns (wall seconds, CPU seconds, pids).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    procs = [cg.spawn([str(BURNER), f"n={iters}"]) for _ in range(n)]
    if while_running:
        while_running()
    for p in procs:
        p.wait()
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, [p.pid for p in procs]


def capture_window_start(agent: AgentProcess, window: dict[str, float]) -> None:
    """Wait for the session to start, then note the time and the agent's and BPF's CPU so far."""
    assert agent.proc is not None
    if wait_until(lambda: "Capture started" in agent.log(), 30, step=0.02):
        pid = agent.proc.pid
        window.update(t=time.monotonic(), cpu=proc_cpu_ns(pid), bpf=bpf_runtime_ns(pid))


def config(capture_s: float) -> str:
    return (
        "targets:\n"
        "  - rule: {type: Exact, comm: burner}\n"
        "    service_id: bench\n"
        "    resources: [{resource: cpu, threshold: 1}]\n"
        f"    capture_duration_secs: {capture_s}\n"
        # One session for the whole workload: with a short cooldown PSI (which fires every window
        # while the stall lasts) started a new session every 2 s, and each sample was counted into
        # all of them, so the figure grew with the workload's length.
        f"    cooldown_secs: {capture_s}\n"
    )


def bench_freq(freq: int, iters: int, rounds: int) -> dict:
    """Baseline and agent runs alternate. With the agent, the workload's own pressure triggers the
    capture (~2 s after it starts, the PSI window here) and the session lasts until it ends."""
    base_wall: list[float] = []
    base_cpu: list[float] = []
    agent_wall: list[float] = []
    agent_cpu: list[float] = []
    agent_own: list[float] = []
    bpf_s: list[float] = []
    rss: list[float] = []
    sampled: list[bool] = []
    capture_s: list[float] = []
    for _ in range(rounds):
        with Cgroup.create() as cg:
            w, c, _ = run_workload(cg, iters)
            base_wall.append(w)
            base_cpu.append(c)
        with tempfile.TemporaryDirectory() as d, Cgroup.create() as cg:
            agent = AgentProcess(Path(d), config(600), "--freq", str(freq), walk_interval=30).start()
            try:
                pid = agent.proc.pid  # type: ignore[union-attr]
                window: dict[str, float] = {}
                w, c, _ = run_workload(cg, iters, functools.partial(capture_window_start, agent, window))
                t1, cpu1, bpf1 = time.monotonic(), proc_cpu_ns(pid), bpf_runtime_ns(pid)
                rss.append(proc_rss_mb(pid))
            finally:
                agent.stop()
            sampled.append(bool(window))
            agent_wall.append(w)
            agent_cpu.append(c)
            if window:
                span = t1 - window["t"]
                agent_own.append((cpu1 - window["cpu"]) / 1e9 / span)
                bpf_s.append((bpf1 - window["bpf"]) / 1e9 / span)
                capture_s.append(span)
    med = statistics.median
    return {
        "freq_hz": freq,
        "captured": all(sampled),
        "baseline_wall_s": med(base_wall),
        "agent_wall_s": med(agent_wall),
        "slowdown_wall": med(agent_wall) / med(base_wall) - 1,
        "baseline_cpu_s": med(base_cpu),
        "agent_cpu_s_workload": med(agent_cpu),
        "slowdown_cpu": med(agent_cpu) / med(base_cpu) - 1,
        "capture_window_s": med(capture_s) if capture_s else 0.0,
        "agent_cpu_share_of_one_core": med(agent_own) if agent_own else float("nan"),
        "bpf_cpu_share_of_one_core": med(bpf_s) if bpf_s else float("nan"),
        "agent_plus_bpf_share_of_one_core": med(agent_own) + med(bpf_s) if agent_own else float("nan"),
        "agent_rss_mb": max(rss),
    }


# The idle JVMs of bench_idle_jvms: a class that sleeps, compiled once (javac) into the bench's directory.
IDLE_JAVA = """public class Idle {
    public static void main(String[] a) throws Exception { Thread.sleep(Long.parseLong(a[0]) * 1000L); }
}
"""
JDKS = (Path("/usr/lib/jvm/java-17-openjdk-amd64"), Path("/usr/lib/jvm/temurin-25-jdk-amd64"))
# Small and quiet: a 16 MB heap, one GC thread, one compiler thread.
JVM_FLAGS = ("-Xms16m", "-Xmx16m", "-XX:+UseSerialGC", "-XX:CICompilerCount=2", "-XX:TieredStopAtLevel=1")


class TreeAgent(AgentProcess):
    """The agent of another tree (`--before`: an earlier commit's files), run by this interpreter:
    `python -m` imports the package of its working directory first."""

    def __init__(self, tree: Path, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tree = tree

    def start(self, wait_active: bool = True) -> AgentProcess:
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.tree, env=env
            )
        if wait_active:
            ok = wait_until(lambda: "Agent active" in self.log() or self.proc.poll() is not None, 30)  # type: ignore[union-attr]
            assert ok and self.proc.poll() is None, f"agent did not start:\n{self.log()}"  # type: ignore[union-attr]
        return self


def bench_idle(
    n: int, seconds: float, recorder: bool = False, busy: int = 0, jvms: int = -1, tree: Path | None = None
) -> dict:
    """`jvms` >= 0: one more cgroup, watched by its own rule (memory only: never triggers), holding
    that many idle JVMs (OpenJDK 17 and Temurin 25 in turn), or with 0 as many sleepers as the JVM
    run of the same round has JVMs: the agent's cost of watching JVMs, against watching plain processes.
    `tree`: the agent of that tree (an earlier commit), not this one's."""
    cgs = [Cgroup.create(prefix="bistouri-bench-idle") for _ in range(n)]
    jvm_cg = Cgroup.create(prefix="bistouri-bench-jvm") if jvms >= 0 else None
    java: list[int] = []
    # A private copy of sleep with its own comm: other tenants' `sleep`s must not wake the agent.
    sleeper = Path(tempfile.mkdtemp()) / "idlebench"
    shutil.copy("/bin/sleep", sleeper)
    spinner = sleeper.parent / "idlespin"  # the same comm-length trick for the busy ones
    shutil.copy(BURNER, spinner)
    try:
        for i, cg in enumerate(cgs):
            cg.spawn([str(spinner), "0"] if i < busy else [str(sleeper), "600"])
        if jvm_cg is not None:
            java = _java_members(jvm_cg, jvms, sleeper)
        # Memory only when some burn: their CPU stall must not start sessions (not idle then).
        resources = "{resource: memory, threshold: 90}" if busy else "{resource: cpu, threshold: 50}"
        cfg = (
            "targets:\n"
            "  - rule: {type: Exact, comm: idlebench}\n    service_id: idle\n"
            f"    resources: [{resources}, {{resource: io, threshold: 50}}]\n"
            "  - rule: {type: Exact, comm: idlespin}\n    service_id: spin\n"
            "    resources: [{resource: memory, threshold: 90}]\n"
        )
        if jvm_cg is not None:
            cfg += (
                f"  - cgroup: {jvm_cg.rel}\n    service_id: jvms\n"
                "    resources: [{resource: memory, threshold: 90}]\n"
            )
        extra = () if recorder else ("--recorder-max-bytes", "0")
        with tempfile.TemporaryDirectory() as d:
            agent = (
                AgentProcess(Path(d), cfg, *extra, walk_interval=30)
                if tree is None
                else TreeAgent(tree, Path(d), cfg, *extra, walk_interval=30)
            ).start()
            try:
                wait_until(lambda: f"cgroup=/{cgs[-1].path.name}" in agent.log(), 20)
                time.sleep(2)
                if jvm_cg is not None:  # the walk found them: every one of them watched
                    wait_until(lambda: _matched(agent.metrics()) >= n + len(java), 60)
                    time.sleep(5)  # the perf-map requests of their first look, done
                watchers = agent.metrics().get("bistouri_psi_watchers", 0)
                pid = agent.proc.pid  # type: ignore[union-attr]
                c0, p0, t0, w0 = proc_cpu_ns(pid), bpf_programs(pid), thread_cpu_ns(pid), thread_wakeups(pid)
                time.sleep(seconds)
                c1, p1, t1, w1 = proc_cpu_ns(pid), bpf_programs(pid), thread_cpu_ns(pid), thread_wakeups(pid)
                # Per thread: which of the agent's loops the idle cost is, and how often each wakes.
                per_thread = {name: (t - t0.get(name, 0)) / 1e3 / seconds for name, t in sorted(t1.items())}
                wakeups = {name: (w - w0.get(name, 0)) / seconds for name, w in sorted(w1.items())}
                b0, b1 = (sum(t for t, _ in p.values()) for p in (p0, p1))
                # Per program: the scheduler hooks run at every switch of the host, watched or not.
                per_prog = {
                    name: {
                        "share_of_one_core": (t - p0.get(name, (0, 0))[0]) / 1e9 / seconds,
                        "runs_per_s": (n - p0.get(name, (0, 0))[1]) / seconds,
                    }
                    for name, (t, n) in sorted(p1.items())
                }
                rss = proc_rss_mb(pid)
                metrics = agent.metrics()
            finally:
                agent.stop()
        jvm_part = {}
        if jvm_cg is not None:
            jvm_part = {
                "jvms": jvms,
                "jvm_processes": len(java),
                "processes_matched": _matched(metrics),
                "perf_maps": {
                    k.partition('reason="')[2].rstrip('"}'): v
                    for k, v in metrics.items()
                    if k.startswith("bistouri_jvm_perf_maps_total{")
                },
            }
        return {
            **jvm_part,
            "agent": str(tree) if tree else "this tree",
            "load_average": os.getloadavg()[0],
            "watched_cgroups": n,
            "recorder": recorder,
            "busy_processes": busy,
            "psi_watchers": watchers,
            "seconds": seconds,
            "agent_cpu_share_of_one_core": (c1 - c0) / 1e9 / seconds,
            "bpf_cpu_share_of_one_core": (b1 - b0) / 1e9 / seconds,
            "bpf_programs": per_prog,
            "agent_thread_us_per_s": per_thread,
            "agent_thread_wakeups_per_s": wakeups,
            "agent_rss_mb": rss,
        }
    finally:
        for cg in cgs if jvm_cg is None else [*cgs, jvm_cg]:
            cg.remove()
        for pid in java if jvms > 0 else ():  # killed: what a JVM removes at its exit stays
            for left in (f"/tmp/perf-{pid}.map", f"/tmp/.java_pid{pid}"):
                Path(left).unlink(missing_ok=True)


def _java_members(cg: Cgroup, jvms: int, sleeper: Path) -> list[int]:
    """`jvms` idle JVMs in `cg` (0: sleepers, as many as JVM_COUNT), started and settled before the agent."""
    if jvms == 0:
        return [cg.spawn([str(sleeper), "600"]).pid for _ in range(JVM_COUNT)]
    jdks = [j for j in JDKS if (j / "bin/java").exists()]
    classes = Path(tempfile.mkdtemp(prefix="bench-idle-jvm-"))
    (classes / "Idle.java").write_text(IDLE_JAVA)
    subprocess.run([str(jdks[0] / "bin/javac"), "-d", str(classes), str(classes / "Idle.java")], check=True)
    pids = []
    for i in range(jvms):
        java = jdks[i % len(jdks)] / "bin/java"
        p = cg.spawn([str(java), *JVM_FLAGS, "-cp", str(classes), "Idle", "900"])
        pids.append(p.pid)
        time.sleep(0.3)  # not all at once on a shared 2-core machine
    # Settled: their start's CPU spent (each JVM's stall must be over before the agent looks).
    time.sleep(10)
    return pids


JVM_COUNT = 20


def _matched(metrics: dict[str, float]) -> float:
    return metrics.get("bistouri_processes_matched", -1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=1000, help="work per burner (n=; 1000: ~14 s unloaded)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--freqs", default="19,99,999")
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent.json"))
    ap.add_argument("--idle-only", action="store_true", help="only the idle cases (flight recorder off/on)")
    ap.add_argument(
        "--jvm-idle-only",
        action="store_true",
        help=f"only the idle cases with {JVM_COUNT} JVMs watched, each against the same with sleepers",
    )
    ap.add_argument(
        "--recorder-on-only",
        action="store_true",
        help="with --jvm-idle-only: only the cases with the recorder on",
    )
    ap.add_argument(
        "--before",
        type=Path,
        help="with --jvm-idle-only: a tree of an earlier commit (its BPF object built or copied in); "
        "each case runs its agent, then this tree's, alternating",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_agent needs root (BPF, cgroups)", file=sys.stderr)
        return 2
    stats_fd = enable_bpf_stats()
    freqs = [] if args.idle_only or args.jvm_idle_only else [f for f in args.freqs.split(",") if f]
    idle = [] if args.jvm_idle_only else [(busy, rec, -1) for busy in (0, 2) for rec in (False, True)]
    # 20 JVMs watched, each case right after the same without them (20 sleepers in their place).
    idle += [
        (0, recorder, jvms)
        for recorder in ((True,) if args.recorder_on_only else (False, True))
        for jvms in (0, JVM_COUNT)
    ]
    trees: tuple[Path | None, ...] = (None,)
    if args.before and args.jvm_idle_only:
        trees = (args.before.resolve(), None)
    results = {
        "freqs": [bench_freq(int(f), args.iters, args.rounds) for f in freqs],
        "idle": [
            bench_idle(100, args.idle_seconds, rec, busy, jvms, tree)
            for busy, rec, jvms in idle
            for tree in trees
        ],
        "bpf_stats": stats_fd >= 0,
    }
    if stats_fd >= 0:
        os.close(stats_fd)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(
        f"{'freq':>6} {'slowdown(wall)':>15} {'slowdown(cpu)':>14} {'agent %core':>12} {'bpf %core':>10} "
        f"{'agent+bpf':>10} {'rss MB':>7}"
    )
    for r in results["freqs"]:
        print(
            f"{r['freq_hz']:>6} {r['slowdown_wall']:>14.1%} {r['slowdown_cpu']:>14.1%} "
            f"{r['agent_cpu_share_of_one_core']:>12.2%} {r['bpf_cpu_share_of_one_core']:>10.2%} "
            f"{r['agent_plus_bpf_share_of_one_core']:>10.2%} {r['agent_rss_mb']:>7.1f}"
        )
    for i in results["idle"]:
        print(
            f"[{i['agent']}, load {i['load_average']:.1f}] "
            f"idle, {i['watched_cgroups']} cgroups ({i['psi_watchers']:.0f} watchers), "
            f"recorder {'on ' if i['recorder'] else 'off'}, {i['busy_processes']} busy: "
            f"{i['agent_cpu_share_of_one_core']:.3%} of a core (+ BPF {i['bpf_cpu_share_of_one_core']:.3%}), "
            f"RSS {i['agent_rss_mb']:.1f} MB"
            + (
                f", {i['jvm_processes']} {'JVMs' if i['jvms'] else 'sleepers'} in the JVM cgroup "
                f"(matched {i['processes_matched']:.0f}, perf maps {i['perf_maps']})"
                if "jvms" in i
                else ""
            )
        )
        busiest = sorted(i["agent_thread_us_per_s"].items(), key=lambda kv: -kv[1])
        wakes = i["agent_thread_wakeups_per_s"]
        print(
            "    agent threads, µs (wake-ups) a second: "
            + ", ".join(f"{n} {us:.0f} ({wakes.get(n, 0):.2f})" for n, us in busiest if us >= 1)
        )
        progs = sorted(i["bpf_programs"].items(), key=lambda kv: -kv[1]["share_of_one_core"])
        print(
            "    BPF by program: "
            + ", ".join(
                f"{name} {p['share_of_one_core']:.3%} ({p['runs_per_s']:.0f}/s)"
                for name, p in progs
                if p["share_of_one_core"] >= 0.0001
            )
        )
    print(
        "(targets: < 1 % of one core at 999 Hz for agent + BPF; idle < 0.05 %, RSS < 40 MB; "
        "recorder on, 19 Hz: <= 0.2 %, RSS <= 50 MB)\n"
        f"written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BPF time per sample and reader CPU at 999 Hz, against bpftrace; JIT names against perf.

Workloads (each one process, one busy thread):
- `probe`: a start-up-probe-like program generated here, 4 000 distinct functions called in
  random chains of 4-12 frames, so nearly every sample is a new stack (no reuse anywhere);
- `repeated`: the burner fixture, one stack all the time.

For each, the sampler (`bench/_sampler.py`, a Profiler in its own process that only
drains) runs 999 Hz on the workload's pid for a fixed time; BPF time per sample is
run_time_ns / run_cnt of its perf_event program (read from its own fdinfo with
bpf_enable_stats on, so other tenants' programs never count), reader CPU is the sampler
process's schedstat over the window. `--baseline-ref REF` (or `--before REF`) measures the
same with the code of a git ref and its BPF object, built by its own Makefile (bench/_before.py).
bpftrace, when installed, runs `profile:hz:999 /pid == P/ { @[ustack, kstack] = count(); }` on
the same workloads and is measured the same way (fdinfo of its program): after bistouri, or with
`--together` at the same time on the same process (bpftrace's window inside bistouri's), which a
loaded host needs for a ratio that holds.

JIT names: node --perf-basic-prof, and java with and without -XX:+PreserveFramePointer whose
perf map the sampler's profiler asks for itself (nobody runs jcmd; perf reads the same map), the
share of samples whose stack names the hot function, by bistouri (the sampler, names from the
perf map) and by `perf record -g` + `perf script` on the same process at the same time.

Run as root: `python -m bench.bench_sampling`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._before import before_tree  # noqa: E402
from testkit.helpers import wait_until  # noqa: E402

BURNER = ROOT / "tests/fixtures/build/workloads/burner"
WORKLOADS_SRC = ROOT / "tests/fixtures/workloads"
SAMPLER = ROOT / "bench/_sampler.py"
PROG_TYPE_PERF_EVENT = 7
N_FUNCTIONS = 4000


def probe_source(n: int = N_FUNCTIONS, seed: int = 1) -> str:
    """C source: n functions, each calling another (fixed, pseudo-random) one until the depth
    runs out, then a short spin. main starts chains at random functions and depths."""
    rng = random.Random(seed)
    lines = [
        "#include <stdlib.h>",
        "#include <time.h>",
        "volatile unsigned long sink;",
        "__attribute__((noinline)) void spin(void) { for (int i = 0; i < 3000; i++) sink += i; }",
    ]
    lines += [f"void f{i}(int d);" for i in range(n)]
    for i in range(n):
        nxt = rng.randrange(n)
        lines.append(f"__attribute__((noinline)) void f{i}(int d) {{ if (d) f{nxt}(d - 1); else spin(); }}")
    lines.append("typedef void (*fn)(int);")
    lines.append("static fn table[] = {" + ", ".join(f"f{i}" for i in range(n)) + "};")
    lines.append(
        "int main(int argc, char **argv) {\n"
        "  double secs = argc > 1 ? atof(argv[1]) : 10; struct timespec a, b;\n"
        "  clock_gettime(CLOCK_MONOTONIC, &a); unsigned r = 1;\n"
        "  for (;;) {\n"
        "    for (int k = 0; k < 64; k++) { r = r * 1103515245u + 12345u;"
        f" table[(r >> 8) % {n}](4 + (r >> 24) % 9); }}\n"
        "    clock_gettime(CLOCK_MONOTONIC, &b);\n"
        "    if ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 >= secs) return 0;\n"
        "  }\n}"
    )
    return "\n".join(lines) + "\n"


def build_probe(tmp: Path) -> Path:
    src = tmp / "probe.c"
    src.write_text(probe_source())
    out = tmp / "probe"
    subprocess.run(
        ["gcc", "-O1", "-fno-omit-frame-pointer", "-fno-optimize-sibling-calls", "-o", str(out), str(src)],
        check=True,
    )
    return out


# ~32 frames (main, 28 recursive calls, the leaf, libc's start): the .eh_frame walk's target case.
FRAMELESS_SOURCE = r"""
#include <stdlib.h>
#include <time.h>
volatile unsigned long sink;
__attribute__((noinline)) unsigned long leaf(unsigned long x)
{
	for (int i = 0; i < 2000; i++)
		x = x * 6364136223846793005UL + 1;
	return x;
}
__attribute__((noinline)) unsigned long rec(int depth, unsigned long x)
{
	unsigned long buf[4];
	buf[depth & 3] = x;
	if (depth == 0)
		return leaf(x);
	unsigned long r = rec(depth - 1, x + buf[(depth + 1) & 3]);
	sink += r;
	return r + 1;
}
int main(int argc, char **argv)
{
	time_t end = time(0) + (argc > 1 ? atoi(argv[1]) : 10);
	while (time(0) < end)
		sink += rec(27, sink);
	return 0;
}
"""


def build_frameless(tmp: Path) -> Path:
    """A 32-frame stack built as distributions build: -O2, no frame pointers."""
    src = tmp / "frameless.c"
    src.write_text(FRAMELESS_SOURCE)
    out = tmp / "frameless"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", str(out), str(src)], check=True)
    return out


WORKLOADS = ("probe", "repeated", "frameless", "python", "node", "java", "java_nofp")

PYTHON_BUSY = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nwhile True:\n    fib(20)\n"


def baseline_tree(ref: str, tmp: Path) -> tuple[Path, Path]:
    """Commit `ref` with its own BPF object (bench/_before.py): (its tree, its x86-64 object). Its
    own bench/_sampler.py samples, so each side reads its object with its own Python."""
    tree = before_tree(ref, tmp)
    return tree, tree / "bistouri/bpf/_bpfobj/bistouri.bpf.o"


def enable_bpf_stats() -> int:
    from bistouri.bpf.handles import library

    lib = library()
    if not lib.has("bpf_enable_stats"):
        return -1
    return int(lib.lib.bpf_enable_stats(0))  # BPF_STATS_RUN_TIME


def perf_event_prog_stats(pid: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over the perf_event programs whose fds `pid` holds."""
    ns = cnt = 0
    for info in Path(f"/proc/{pid}/fdinfo").glob("*"):
        try:
            fields = dict(line.split(":\t", 1) for line in info.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("prog_type", "").strip() == str(PROG_TYPE_PERF_EVENT):
            ns += int(fields.get("run_time_ns", "0"))
            cnt += int(fields.get("run_cnt", "0"))
    return ns, cnt


def run_sampler(pid: int, seconds: float, freq: int, tree: Path | None, obj: Path | None) -> dict:
    env = dict(os.environ)
    sampler = SAMPLER
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        if (tree / "bench/_sampler.py").exists():
            sampler = tree / "bench/_sampler.py"
    argv = [sys.executable, str(sampler), str(pid), str(seconds), str(freq)]
    if obj is not None:
        argv.append(str(obj))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode:
        raise RuntimeError(f"sampler failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_bpftrace(pid: int, seconds: float, freq: int) -> dict | None:
    bpftrace = shutil.which("bpftrace")
    if bpftrace is None:
        return None
    script = f"profile:hz:{freq} /pid == {pid}/ {{ @[ustack, kstack] = count(); }}"
    proc = subprocess.Popen(
        [bpftrace, "-e", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out = ""
    try:
        if not wait_until(lambda: perf_event_prog_stats(proc.pid) != (0, 0) or proc.poll() is not None, 30):
            return None
        ns0, cnt0 = perf_event_prog_stats(proc.pid)
        time.sleep(seconds)
        ns1, cnt1 = perf_event_prog_stats(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=300)  # a probe's map: thousands of stacks to print
        except subprocess.TimeoutExpired:
            proc.kill()
    # The map's counts: the samples of the target (its program also ran, briefly, for others).
    samples = sum(int(line.rsplit("]: ", 1)[1]) for line in out.splitlines() if "]: " in line)
    return {
        "bpf_ns_per_run": (ns1 - ns0) / max(1, cnt1 - cnt0),
        "runs": cnt1 - cnt0,
        "samples": samples,
        "bpf_ns_per_sample": (ns1 - ns0) / max(1, samples),
    }


# With --together: bistouri's sampler loads its object, measures the early return for 1 s and
# waits for the tables before its window opens; bpftrace's window starts this much later.
TOGETHER_DELAY_S = 3.5


def bench_together(name: str, argv: list[str], seconds: float, freq: int) -> dict:
    """bistouri and bpftrace on the same process at the same time, bpftrace's window inside
    bistouri's: both pay the same load, so their ratio holds on a busy host."""
    results: dict = {"workload": name, "together": True}
    proc = subprocess.Popen([*argv, str(seconds + 60)])
    try:
        time.sleep(1.0)  # past its start-up
        sampler = threading.Thread(
            target=lambda: results.update(
                bistouri=run_sampler(proc.pid, seconds + TOGETHER_DELAY_S + 1, freq, None, None)
            )
        )
        sampler.start()
        time.sleep(TOGETHER_DELAY_S)
        results["bpftrace"] = run_bpftrace(proc.pid, seconds, freq)
        sampler.join()
    finally:
        proc.kill()
        proc.wait()
    return results


def bench_workload(
    name: str, argv: list[str], seconds: float, freq: int, tree: Path | None, obj: Path | None
) -> dict:
    results: dict = {"workload": name}
    for label, t, o in (("bistouri", None, None), ("baseline", tree, obj)):
        if label == "baseline" and o is None:
            continue
        proc = subprocess.Popen([*argv, str(seconds + 30)])
        try:
            time.sleep(1.0)  # past its start-up
            results[label] = run_sampler(proc.pid, seconds, freq, t, o)
        finally:
            proc.kill()
            proc.wait()
    proc = subprocess.Popen([*argv, str(seconds + 30)])
    try:
        time.sleep(1.0)
        results["bpftrace"] = run_bpftrace(proc.pid, seconds, freq)
    finally:
        proc.kill()
        proc.wait()
    return results


def perf_share(pid: int, seconds: float, freq: int, function: str, tmp: Path) -> tuple[float, int]:
    data = tmp / f"perf-{pid}.data"
    subprocess.run(
        [
            "perf",
            "record",
            "-q",
            "-g",
            "-F",
            str(freq),
            "-p",
            str(pid),
            "-o",
            str(data),
            "--",
            "sleep",
            str(seconds),
        ],
        check=True,
        capture_output=True,
    )
    text = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True).stdout
    stacks = [s for s in text.split("\n\n") if s.strip()]
    named = sum(1 for s in stacks if function in s)
    return named / max(1, len(stacks)), len(stacks)


def bench_jit(
    name: str, argv: list[str], ready: str, function: str, seconds: float, tmp: Path
) -> dict | None:
    """The share of samples naming `function` in a JIT frame, bistouri's and perf -g's, at once.
    Node writes its perf map itself; a JVM is asked by bistouri's profiler (host/jvm.py) once the
    hot method is compiled: nobody runs jcmd, and perf reads the map the profiler asked for."""
    if shutil.which(argv[0]) is None:
        return None
    java = name.startswith("java")
    if java:
        argv = [argv[0], "-XX:+PrintCompilation", *argv[1:]]
    proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE if java else subprocess.DEVNULL)
    perf_map = Path(f"/tmp/perf-{proc.pid}.map")
    try:
        if java:
            assert proc.stdout is not None
            # Its standard tier-4 compile (PrintCompilation): what a long-running service runs.
            while not re.search(rb"\s4\s+Hot::hotLoop \(", line := proc.stdout.readline()):
                if not line:
                    return {"error": "the JVM exited before compiling the hot method"}
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # the pipe never fills
        elif not wait_until(lambda: perf_map.exists() and ready in perf_map.read_text(errors="replace"), 90):
            return {"error": "the perf map never named the hot function"}
        # Both at once on the same process, perf at a slightly different rate so they interleave.
        sampler = subprocess.Popen(
            [sys.executable, str(SAMPLER), str(proc.pid), str(seconds), "99", "", function],
            stdout=subprocess.PIPE,
            text=True,
        )
        perf, perf_n = perf_share(proc.pid, seconds, 97, function, tmp)
        out, _ = sampler.communicate(timeout=seconds + 120)
        ours = json.loads(out.strip().splitlines()[-1])
        if not (perf_map.exists() and ready in perf_map.read_text(errors="replace")):
            return {"error": "the perf map never named the hot function"}
    finally:
        proc.kill()
        proc.wait()
        perf_map.unlink(missing_ok=True)
    share = ours["named"] / max(1, ours["samples"])
    return {
        "bistouri_share": share,
        "bistouri_samples": ours["samples"],
        "perf_share": perf,
        "perf_samples": perf_n,
        "ratio": share / perf if perf else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument(
        "--baseline-ref",
        "--before",
        default="",
        help="git ref to measure side by side (its code, and its object built by its own Makefile)",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="run bpftrace at the same time as bistouri on the same process (no baseline): the ratio "
        "of the two holds on a loaded host, where runs one after the other meet different loads",
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/sampling.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_sampling needs root (BPF)", file=sys.stderr)
        return 2
    stats_fd = enable_bpf_stats()
    if stats_fd < 0:
        print("bpf_enable_stats is unavailable: no BPF run times", file=sys.stderr)
        return 2
    chosen = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        print(f"unknown workloads: {', '.join(unknown)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tree, obj = baseline_tree(args.baseline_ref, tmp) if args.baseline_ref else (None, None)
        argvs = {
            "probe": lambda: [str(build_probe(tmp))],
            "repeated": lambda: [str(BURNER)],
            # Debian-like binaries without frame pointers: unwound from .eh_frame in BPF.
            "frameless": lambda: [str(build_frameless(tmp))],
            "python": lambda: ["/usr/bin/python3.11", "-c", PYTHON_BUSY],
        }
        results = {
            "freq_hz": args.freq,
            "baseline_ref": args.baseline_ref,
            "workloads": [
                bench_together(name, argvs[name](), args.seconds, args.freq)
                if args.together
                else bench_workload(name, argvs[name](), args.seconds, args.freq, tree, obj)
                for name in WORKLOADS
                if name in chosen and name in argvs
            ],
            "jit": {},
        }
        # runtime -> (argv, what its perf map names once the hot function is compiled, that function)
        jit_runtimes = {
            "node": (
                ["node", "--perf-basic-prof", str(WORKLOADS_SRC / "hot.js"), "120"],
                "JS:*hotLoop",
                "hotLoop",
            ),
            "java": (
                ["java", "-XX:+PreserveFramePointer", str(WORKLOADS_SRC / "Hot.java"), "120"],
                "Hot.hotLoop",
                "hotLoop",
            ),
            # Without -XX:+PreserveFramePointer: the hot method named as the leaf (its IP).
            "java_nofp": (
                ["java", str(WORKLOADS_SRC / "Hot.java"), "120"],
                "Hot.hotLoop",
                "hotLoop",
            ),
        }
        for name, (argv, ready, function) in jit_runtimes.items():
            if name in chosen:
                results["jit"][name] = bench_jit(name, argv, ready, function, args.seconds, tmp)
    os.close(stats_fd)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(
        f"{'workload':>9} {'who':>9} {'BPF us/run':>11} {'BPF us/sample':>14} {'net us/sample':>14} "
        f"{'reader us/sample':>17} {'reader %core':>13} {'user frames':>12}"
    )
    for w in results["workloads"]:
        for who in ("bistouri", "baseline", "bpftrace"):
            r = w.get(who)
            if not r:
                continue
            reader = r.get("reader_ns_per_sample")
            share = r.get("reader_share_of_one_core")
            net = r.get("bpf_ns_per_sample_net")
            print(
                f"{w['workload']:>9} {who:>9} {r['bpf_ns_per_run'] / 1000:>11.2f} "
                f"{r['bpf_ns_per_sample'] / 1000:>14.2f} "
                f"{'' if net is None else f'{net / 1000:.2f}':>14} "
                f"{'' if reader is None else f'{reader / 1000:.2f}':>17} "
                f"{'' if share is None else f'{share:.2%}':>13} {r.get('user_frames', 0):>12.1f}"
            )
    for name, r in results["jit"].items():
        if r and "ratio" in r:
            print(
                f"{name}: hot function named in {r['bistouri_share']:.1%} of bistouri's samples "
                f"({r['bistouri_samples']}), {r['perf_share']:.1%} of perf -g's ({r['perf_samples']}): "
                f"ratio {r['ratio']:.2f}"
            )
    print(
        "(targets: BPF <= 1.5 us/sample on probe and repeated, <= 3 us for ~30 frames; JIT ratio >= 0.90)"
        "\nwritten to " + args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

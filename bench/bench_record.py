"""`bistouri record` side by side with `perf record` (+ `perf script`) and bpftrace, where installed.

Each tool profiles the same running workload by pid for the same time at the same
frequency, in interleaved rounds, on each workload in turn: the `shares` fixture
(70 / 20 / 10 % of its CPU in three functions), Debian's python3.11, pyenv's
python3.12 (libpython with full DWARF) and node running a busy loop (real
programs: large binaries, a large symbol table for node). Measured per run, launch to the last byte written:

- launch -> first sample: CLOCK_MONOTONIC read just before the tool is started,
  against the timestamp of its first sample of the workload (bistouri: its
  summary.json, from `bpf_ktime_get_ns`; perf: `perf record -k mono`, first sample
  of `perf script`; bpftrace: `nsecs` of its first sample);
- CPU: user + system time of the tool and its children (`wait4` rusage; perf:
  `perf record` + `perf script`);
- peak RSS of the whole run: the largest sum of the RSS of the tool and all its
  descendants (helpers: llvm-symbolizer, a child parsing /proc/kallsyms), polled
  every 10 ms (perf: the larger of record's and script's); also `ru_maxrss` (the
  largest single process) and bistouri's own peaks while capturing and while
  symbolizing apart, from its summary.json;
- symbolization time (bistouri: its summary line; perf: `perf script`'s wall time);
- the shares it reports for the three functions (leaf samples; `shares` only).

bistouri runs twice per round: with an empty cache directory (first run on these
binaries) and with a cache that earlier runs filled ("seen before": one
unmeasured 2 s run of every workload first, into the same cache, as a user's cache
holds what they profiled; then each warm run adds what it met). It is started as the
package's /usr/bin/bistouri starts it (`python3 -I -S`, bytecode compiled first).
Run as root: `python -m bench.bench_record`; the table goes into
docs/benchmarks.md (between its bench_record markers) unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench._before import before_tree

ROOT = Path(__file__).resolve().parent.parent
SHARES = ROOT / "tests/fixtures/build/workloads/shares"
DOCS = ROOT / "docs/benchmarks.md"
FUNCTIONS = ("work_seventy", "work_twenty", "work_ten")
# Real programs: an interpreter loop and a JIT's, each in three functions. `-S`: no site import.
PY_LOOP = """
import sys, time
def ten(n): return sum(i * i for i in range(n))
def twenty(n): return ten(n) + ten(n)
def seventy(n): return twenty(n) * 3 + ten(n)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    seventy(20000)
"""
NODE_LOOP = """
function ten(n) { let s = 0; for (let i = 0; i < n; i++) s += Math.sqrt(i) * i; return s; }
function twenty(n) { return ten(n) + ten(n); }
function seventy(n) { return twenty(n) * 3 + ten(n) + JSON.stringify({a: [n, n]}).length; }
const end = Date.now() + 1000 * Number(process.argv[1]);
while (Date.now() < end) seventy(20000);
"""
# pyenv's 3.12: a shared libpython with full DWARF 5 (~14 MB of .debug_info), what a Python built
# from source has; Debian's python3.11 has none installed.
PYENV_312 = next(iter(sorted(Path("/root/.pyenv/versions").glob("3.12*/bin/python3.12"))), None)
WORKLOADS = {
    "shares": lambda secs: [str(SHARES), str(secs)],
    "python3.11": lambda secs: ["/usr/bin/python3.11", "-S", "-c", PY_LOOP, str(secs)],
    "pyenv3.12": lambda secs: [str(PYENV_312), "-S", "-c", PY_LOOP, str(secs)],
    "node": lambda secs: ["/usr/bin/node", "-e", NODE_LOOP, str(secs)],
}
DOC_START = "<!-- bench_record: start -->"
DOC_END = "<!-- bench_record: end -->"
# As packaging/bin/bistouri starts it: the system interpreter in isolated mode without the site
# module's start-up (-I -S), the package and its dependencies first on sys.path (here the source
# tree and the virtualenv's site-packages, without the editable install's import hook, which costs
# ~9 ms of start-up an installed package has not), then the distribution's site directories.
SITE_PACKAGES = next((ROOT / ".venv/lib").glob("python3*/site-packages"), ROOT)


def launcher(tree: Path) -> list[str]:
    """bistouri of the source tree `tree` (its `bistouri` package), started as installed."""
    return [
        "/usr/bin/python3",
        "-I",
        "-S",
        "-c",
        f"import site, sys; sys.path[:0] = [{str(tree)!r}, {str(SITE_PACKAGES)!r}]; "
        "sys.path.extend(p for p in site.getsitepackages() if p not in sys.path); "
        "from bistouri.cli import main; sys.exit(main())",
    ]


LAUNCHER = launcher(ROOT)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _vm(pid: int) -> tuple[int, int, str]:
    """(vsize, resident pages, executable) of a process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return int(fields[20]), int(fields[21]), os.readlink(f"/proc/{pid}/exe")


def tree_rss(pid: int) -> int:
    """RSS in bytes of `pid` and all its descendants now (0 once it is gone). A child that has the
    very address space of its parent (vfork'd or just forked, not yet exec'd or grown) is not
    counted again: it is the parent's memory."""
    total = 0
    todo = [(pid, None)]
    while todo:
        p, parent = todo.pop()
        try:
            vm = _vm(p)
            if vm != parent:
                total += vm[1] * _PAGE
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", "rb") as f:
                    todo.extend((int(c), vm) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


class TreePeak(threading.Thread):
    """The largest RSS of a process tree, polled every 10 ms: helpers run at the same time as their
    parent, so the whole run's peak is a sum, which no single process's `ru_maxrss` gives."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="tree-rss", daemon=True)
        self.pid = pid
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, tree_rss(self.pid))


@dataclass
class Measured:
    launch_ns: int  # CLOCK_MONOTONIC just before the start
    wall_s: float
    cpu_s: float  # user + system, children included
    maxrss_mb: float  # the largest single process (ru_maxrss)
    tree_rss_mb: float  # the largest sum over the process tree


def run_measured(argv: list[str], env: dict[str, str] | None = None, **kw) -> Measured:
    """Start `argv` and wait for it; raises when it fails."""
    launch = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    p = subprocess.Popen(argv, env=env, **kw)
    poll = TreePeak(p.pid)
    poll.start()
    _, status, ru = os.wait4(p.pid, 0)
    wall = (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - launch) / 1e9
    poll.done.set()
    poll.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {' '.join(argv)}")
    maxrss = ru.ru_maxrss / 1024
    return Measured(launch, wall, ru.ru_utime + ru.ru_stime, maxrss, max(poll.peak / 2**20, maxrss))


def shares_of(leaves: Counter) -> dict[str, float]:
    total = sum(leaves.values()) or 1
    return {f: 100 * leaves[f] / total for f in FUNCTIONS}


def run_bistouri(pid: int, seconds: float, freq: int, cache: Path, work: Path, tree: Path = ROOT) -> dict:
    out = work / f"bistouri-{time.monotonic_ns()}"
    argv = [*launcher(tree), "record", "--pid", str(pid), "-d", str(seconds)]
    argv += ["-F", str(freq), "-o", str(out), "--format", "folded,summary", "--cache-dir", str(cache)]
    err = work / "bistouri.err"
    with open(err, "w") as f:
        m = run_measured(argv, stdout=subprocess.DEVNULL, stderr=f, cwd=work)
    summary = json.loads((out / "summary.json").read_text())
    said = _SYMBOLIZED.search(err.read_text(errors="replace"))
    leaves: Counter = Counter()
    for line in (out / "profile.folded").read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaves[stack.rsplit(";", 1)[-1]] += int(n)
    shutil.rmtree(out)
    cap, sym = summary["capture"], summary["symbolization"]
    return {
        "first_sample_ms": (cap["first_sample_monotonic_ns"] - m.launch_ns) / 1e6,
        "wall_s": m.wall_s,
        "cpu_s": m.cpu_s,
        # record resets its peak after the capture (clear_refs), which ru_maxrss follows: the largest
        # process is the larger of the two phases'.
        "maxrss_mb": max(m.maxrss_mb, cap["peak_rss_bytes"] / 2**20),
        "rss_mb": max(m.tree_rss_mb, cap["peak_rss_bytes"] / 2**20),
        "capture_rss_mb": cap["peak_rss_bytes"] / 2**20,
        "symbolize_rss_mb": sym["peak_rss_bytes"] / 2**20,
        "helpers_rss_mb": sym.get("helpers_peak_rss_bytes", 0) / 2**20,
        "symbolize_s": sym.get("seconds", float(said.group(3)) if said else float("nan")),
        "cached": sym["cached"],
        "addresses": sym["addresses"],
        "shares": shares_of(leaves),
    }


_SYMBOLIZED = re.compile(r"Symbolized (\d+) addresses \((\d+) from the cache\) in ([\d.]+) s")


_PERF_SAMPLE = re.compile(r"^\S.*?\s(\d+\.\d+):")


def run_perf(pid: int, seconds: float, freq: int, work: Path) -> dict:
    data = work / "perf.data"
    argv = ["perf", "record", "-q", "-k", "mono", "-F", str(freq), "-g", "-p", str(pid), "-o", str(data)]
    rec = run_measured(
        [*argv, "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    script = work / "perf.txt"
    with open(script, "w") as f:
        scr = run_measured(["perf", "script", "--ns", "-i", str(data)], stdout=f, stderr=subprocess.DEVNULL)
    first_s = None
    leaves: Counter = Counter()
    want_leaf = False
    for line in script.read_text(errors="replace").splitlines():
        m = _PERF_SAMPLE.match(line)
        if m:
            if first_s is None:
                first_s = m.group(1)
            want_leaf = True
        elif want_leaf and line.strip():
            parts = line.split()
            leaves[parts[1].split("+", 1)[0] if len(parts) > 1 else "?"] += 1
            want_leaf = False
    data.unlink()
    script.unlink()
    sec, _, frac = (first_s or "0.0").partition(".")
    first_ns = int(sec) * 10**9 + int(frac.ljust(9, "0")[:9])
    return {
        "first_sample_ms": (first_ns - rec.launch_ns) / 1e6,
        "wall_s": rec.wall_s + scr.wall_s,
        "cpu_s": rec.cpu_s + scr.cpu_s,
        "record_cpu_s": rec.cpu_s,
        "script_cpu_s": scr.cpu_s,
        "maxrss_mb": max(rec.maxrss_mb, scr.maxrss_mb),
        "rss_mb": max(rec.tree_rss_mb, scr.tree_rss_mb),
        "symbolize_s": scr.wall_s,
        "shares": shares_of(leaves),
    }


def run_bpftrace(pid: int, seconds: float, freq: int, work: Path) -> dict:
    prog = (
        f"profile:hz:{freq} /pid == {pid}/ {{ if (@first == 0) {{ @first = nsecs; }} "
        "@[ustack] = count(); }\n"
        f"interval:ms:{int(seconds * 1000)} {{ exit(); }}\n"
    )
    out = work / "bpftrace.txt"
    with open(out, "w") as f:
        m = run_measured(["bpftrace", "-e", prog], stdout=f, stderr=subprocess.DEVNULL)
    text = out.read_text(errors="replace")
    out.unlink()
    leaves: Counter = Counter()
    for block in text.split("@[")[1:]:
        lines = block.strip().splitlines()
        n = re.search(r"\]: (\d+)", block)
        if lines and n:
            leaves[lines[0].strip().split("+", 1)[0]] += int(n.group(1))
    r = {
        "wall_s": m.wall_s,
        "cpu_s": m.cpu_s,
        "maxrss_mb": m.maxrss_mb,
        "rss_mb": m.tree_rss_mb,
        "shares": shares_of(leaves),
    }
    # Its output is not ours to trust: on node it has ended without `@first` (bpftrace spent
    # 196-244 s naming the stacks). The run still counts for what was measured; the row says so.
    first = re.search(r"^@first: (\d+)$", text, re.M)
    if first is None:
        r["unparsed"] = "no @first" if text.strip() else "no output"
    else:
        r["first_sample_ms"] = (int(first.group(1)) - m.launch_ns) / 1e6
    return r


def compile_bytecode(tree: Path = ROOT) -> None:
    """bistouri's bytecode, as an installed package has it (in isolated mode the interpreter writes
    it into the source tree's __pycache__, whatever PYTHONDONTWRITEBYTECODE says)."""
    subprocess.run([*LAUNCHER[:2], "-m", "compileall", "-q", str(tree / "bistouri")], check=True)


def baseline_tree(ref: str, work: Path) -> Path:
    """Commit `ref` of this repository with its own BPF objects (bench/_before.py), compiled as
    installed: what `--before` measures in the same rounds as this tree."""
    tree = before_tree(ref, work)
    compile_bytecode(tree)
    return tree


def startup_runs(
    n: int,
    work: Path,
    cache: Path,
    freq: int,
    have_perf: bool,
    have_bpftrace: bool,
    before: Path | None = None,
) -> dict[str, list[float]]:
    """Launch -> first sample of `n` short (1 s) runs of each tool, interleaved: start-up needs
    many repetitions more than long captures."""
    out: dict[str, list[float]] = {"bistouri": [], "bistouri_before": [], "perf": [], "bpftrace": []}
    workload = subprocess.Popen([str(SHARES), str(n * 16 + 10)])
    try:
        time.sleep(0.5)
        for _ in range(n):
            out["bistouri"].append(run_bistouri(workload.pid, 1, freq, cache, work)["first_sample_ms"])
            if before is not None:
                r = run_bistouri(workload.pid, 1, freq, cache.with_name(cache.name + "-before"), work, before)
                out["bistouri_before"].append(r["first_sample_ms"])
            if have_perf:
                out["perf"].append(run_perf(workload.pid, 1, freq, work)["first_sample_ms"])
            if have_bpftrace:
                r = run_bpftrace(workload.pid, 1, freq, work)
                if "first_sample_ms" in r:  # else left out of the row (`unparsed`)
                    out["bpftrace"].append(r["first_sample_ms"])
    finally:
        workload.kill()
        workload.wait()
    return {k: v for k, v in out.items() if v}


def warm_up(work: Path, cache: Path, freq: int, workloads: list[str], tree: Path = ROOT) -> None:
    """One unmeasured run per workload into `cache`: the standard library's bytecode lands in the
    private pycache prefix too, and the binaries are seen once."""
    for name in workloads:
        workload = subprocess.Popen(WORKLOADS[name](10))
        try:
            time.sleep(0.5)
            run_bistouri(workload.pid, 2, freq, cache, work, tree)
        finally:
            workload.kill()
            workload.wait()


def median_of(runs: list[dict]) -> dict:
    """Medians over the runs that measured each figure (a bpftrace run whose output could not be
    parsed has no first sample); `unparsed`: how many runs' output lacked something, and what."""
    med = statistics.median
    keys = {k for r in runs for k, v in r.items() if isinstance(v, int | float)}
    have = {k: [r[k] for r in runs if k in r] for k in keys}
    out: dict = {k: med(v) for k, v in have.items()}
    out["shares"] = {f: med(r["shares"][f] for r in runs) for f in FUNCTIONS}
    out["ranges"] = {
        k: [min(have[k]), max(have[k])]
        for k in ("first_sample_ms", "cpu_s", "rss_mb", "symbolize_s", "wall_s")
        if k in have
    }
    unparsed = [r["unparsed"] for r in runs if "unparsed" in r]
    if unparsed:
        out["unparsed"] = f"{len(unparsed)} of {len(runs)} runs: {', '.join(sorted(set(unparsed)))}"
    return out


NAMES = {
    "bistouri_cold_before": "bistouri record before (first run)",
    "bistouri_warm_before": "bistouri record before (seen before)",
    "bistouri_cold": "bistouri record (first run)",
    "bistouri_warm": "bistouri record (seen before)",
    "perf": "perf record + perf script",
    "bpftrace": "bpftrace",
}


def table(tools_results: dict, starts: dict[str, list[float]], with_shares: bool) -> str:
    tools = [t for t in NAMES if t in tools_results]
    r = tools_results

    def rng(t: str, k: str, fmt: str) -> str:
        """median (min-max)"""
        if k not in r[t]["ranges"]:
            return "-"
        lo, hi = r[t]["ranges"][k]
        spread = f" ({lo:{fmt}}-{hi:{fmt}})" if f"{lo:{fmt}}" != f"{hi:{fmt}}" else ""
        return f"**{r[t][k]:{fmt}}**{spread}"

    def ratio(k: str) -> str:
        """bistouri's medians over perf's, measured in the same rounds"""
        if "perf" not in r or not r["perf"].get(k):
            return ""
        cells = [
            f"{r[t][k] / r['perf'][k]:.2f}x" if t.startswith("bistouri") and k in r[t] else "" for t in tools
        ]
        return "| ÷ perf | " + " | ".join(cells) + " |"

    lines = [
        "| | " + " | ".join(NAMES[t] for t in tools) + " |",
        "|---" * (len(tools) + 1) + "|",
        "| launch → first sample (ms) | "
        + " | ".join(rng(t, "first_sample_ms", ".0f") for t in tools)
        + " |",
    ]
    if starts:
        base = {
            "bistouri_cold_before": "bistouri_before",
            "bistouri_warm_before": "bistouri_before",
            "bistouri_cold": "bistouri",
            "bistouri_warm": "bistouri",
            "perf": "perf",
            "bpftrace": "bpftrace",
        }
        cells = []
        for t in tools:
            ms = starts.get(base.get(t, ""), [])
            cells.append(f"**{statistics.median(ms):.0f}** (min {min(ms):.0f})" if ms else "-")
        n = len(next(iter(starts.values())))
        lines.append(f"| launch → first sample, {n} short runs (ms) | " + " | ".join(cells) + " |")
    lines += [
        "| launch → last byte written (s) | " + " | ".join(rng(t, "wall_s", ".2f") for t in tools) + " |",
        "| symbolization (s; perf: perf script) | "
        + " | ".join(rng(t, "symbolize_s", ".2f") for t in tools)
        + " |",
        ratio("symbolize_s"),
        "| CPU per run, helpers included (s) | " + " | ".join(rng(t, "cpu_s", ".2f") for t in tools) + " |",
        ratio("cpu_s"),
        "| peak RSS, whole run with helpers (MB) | "
        + " | ".join(rng(t, "rss_mb", ".0f") for t in tools)
        + " |",
        ratio("rss_mb"),
    ]
    for key, label in (
        ("capture_rss_mb", "capturing"),
        ("symbolize_rss_mb", "symbolizing, writing"),
        ("helpers_rss_mb", "of llvm-symbolizer"),
    ):
        cells = [f"{r[t][key]:.0f}" if key in r[t] else "-" for t in tools]
        lines.append(f"| bistouri's peak RSS {label} (MB) | " + " | ".join(cells) + " |")
    cells = [
        f"{r[t]['addresses']:.0f} ({r[t]['cached']:.0f} cached)" if "addresses" in r[t] else "-"
        for t in tools
    ]
    lines.append("| distinct addresses | " + " | ".join(cells) + " |")
    if any("unparsed" in r[t] for t in tools):
        cells = [r[t].get("unparsed", "") for t in tools]
        lines.append("| output not parsed (what it lacked is left out) | " + " | ".join(cells) + " |")
    if with_shares:
        lines.append(
            "| hot/warm/cold shares (truth 70/20/10) | "
            + " | ".join("/".join(f"{r[t]['shares'][f]:.1f}" for f in FUNCTIONS) for t in tools)
            + " |"
        )
    return "\n".join(line for line in lines if line)


def tables(results: dict) -> str:
    out = []
    for name, w in results["workloads"].items():
        out.append(f"**{name}**\n\n" + table(w["tools"], w.get("startup_ms", {}), name == "shares"))
    return "\n\n".join(out)


def write_docs(results: dict) -> None:
    text = DOCS.read_text()
    block = (
        f"{DOC_START}\n{tables(results)}\n\n"
        f"{results['rounds']} interleaved rounds (order rotated) of {results['seconds']:g} s "
        f"at {results['freq_hz']} Hz per workload "
        f"(median, min-max), {time.strftime('%Y-%m-%d')}, load average "
        f"{results['load_average_1min']:.1f} at the end (2 vCPUs)"
        + (f'; "before": commit {results["before"]}, in the same rounds' if results.get("before") else "")
        + f".\n{DOC_END}"
    )
    if DOC_START in text:
        text = re.sub(re.escape(DOC_START) + ".*?" + re.escape(DOC_END), lambda _m: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text)


def rounds_of(
    name: str, args: argparse.Namespace, work: Path, warm_cache: Path, have_perf: bool, have_bpftrace: bool
) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"bistouri_cold": [], "bistouri_warm": []}
    for rnd in range(args.rounds):
        # Killed after the round: never gone before it (bpftrace took 25-128 s a run on node).
        workload = subprocess.Popen(WORKLOADS[name](3600))
        try:
            time.sleep(0.5)
            cold_cache = work / f"cache-cold-{name}-{rnd}"
            steps = ["bistouri_cold", "bistouri_warm"]
            steps += ["bistouri_cold_before", "bistouri_warm_before"] if args.before_tree else []
            steps += ["perf"] if have_perf else []
            steps += ["bpftrace"] if have_bpftrace else []
            # Rotated each round: a tool run right after another one's exit (bpftrace detaching
            # and freeing its programs) starts on a busier host; each gets every place in turn.
            steps = steps[rnd % len(steps) :] + steps[: rnd % len(steps)]
            for step in steps:
                if step.startswith("bistouri"):
                    before = step.endswith("_before")
                    cache = cold_cache if step.startswith("bistouri_cold") else warm_cache
                    if before:  # its own cache: each version's warm runs read what it wrote
                        cache = cache.with_name(cache.name + "-before")
                    tree = args.before_tree if before else ROOT
                    r = run_bistouri(workload.pid, args.seconds, args.freq, cache, work, tree)
                    shutil.rmtree(cold_cache, ignore_errors=True)
                elif step == "perf":
                    r = run_perf(workload.pid, args.seconds, args.freq, work)
                else:
                    r = run_bpftrace(workload.pid, args.seconds, args.freq, work)
                runs.setdefault(step, []).append(r)
                print(
                    f"{name} round {rnd + 1} {step:>14}: "
                    f"first sample {r.get('first_sample_ms', float('nan')):6.1f} ms, "
                    f"run {r['wall_s']:.2f} s, symbolize {r.get('symbolize_s', float('nan')):.2f} s, "
                    f"CPU {r['cpu_s']:.2f} s, RSS {r['rss_mb']:.0f} MB (one process {r['maxrss_mb']:.0f})"
                    + (f", output not parsed: {r['unparsed']}" if "unparsed" in r else ""),
                    flush=True,
                )
        finally:
            workload.kill()
            workload.wait()
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument(
        "--workload", action="append", choices=list(WORKLOADS), help="default: all of them, in turn"
    )
    ap.add_argument(
        "--startup-runs", type=int, default=10, help="short runs of each tool for the start-up row (shares)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/record.json"))
    ap.add_argument(
        "--before",
        metavar="GIT_REF",
        help="also run bistouri of this commit in the same rounds (its own package, BPF objects built by "
        "its own Makefile, and caches): a change measured before and after under the same load",
    )
    ap.add_argument(
        "--no-bpftrace",
        dest="bpftrace",
        action="store_false",
        help="leave bpftrace out (it takes minutes to name node's stacks)",
    )
    ap.add_argument(
        "--no-docs",
        dest="write_docs",
        action="store_false",
        help="do not put the tables into docs/benchmarks.md",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_record needs root (BPF, perf events)", file=sys.stderr)
        return 2
    workloads = args.workload or [w for w in WORKLOADS if w != "pyenv3.12" or PYENV_312 is not None]
    have_perf = shutil.which("perf") is not None
    have_bpftrace = args.bpftrace and shutil.which("bpftrace") is not None
    results: dict = {"rounds": args.rounds, "seconds": args.seconds, "freq_hz": args.freq, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="bistouri-bench-record-") as tmp:
        work = Path(tmp)
        compile_bytecode()
        warm_cache = work / "cache-warm"
        warm_up(work, warm_cache, args.freq, workloads)
        args.before_tree = baseline_tree(args.before, work) if args.before else None
        if args.before_tree:
            warm_up(
                work,
                warm_cache.with_name(warm_cache.name + "-before"),
                args.freq,
                workloads,
                args.before_tree,
            )
        results["before"] = args.before
        for name in workloads:
            runs = rounds_of(name, args, work, warm_cache, have_perf, have_bpftrace)
            starts = {}
            if name == "shares" and args.startup_runs:
                starts = startup_runs(
                    args.startup_runs, work, warm_cache, args.freq, have_perf, have_bpftrace, args.before_tree
                )
            results["workloads"][name] = {
                "tools": {step: median_of(r) for step, r in runs.items() if r},
                "startup_ms": {step: sorted(ms) for step, ms in starts.items()},
                "runs": runs,
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=2))  # each workload's as it is done
    results["load_average_1min"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(tables(results))
    print(
        "(targets: first sample <= 0.4x perf's; seen before: symbolization <= 0.2 s, whole-run RSS <= 50 MB "
        "(shares), <= 80 MB (node), CPU <= perf's; first run: within 2x perf in time and RSS)"
    )
    if args.write_docs:
        write_docs(results)
        print(f"tables written to {DOCS}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`bistouri record` side by side with `perf record` (+ `perf script`) and bpftrace, where installed.

Each tool profiles the same running `shares` workload (70 / 20 / 10 % of its CPU
in three functions) by pid for the same time at the same frequency, in
interleaved rounds. Measured per run:

- launch -> first sample: CLOCK_MONOTONIC read just before the tool is started,
  against the timestamp of its first sample of the workload (bistouri: its
  summary.json, from `bpf_ktime_get_ns`; perf: `perf record -k mono`, first sample
  of `perf script`; bpftrace: `nsecs` of its first sample);
- CPU: user + system time of the tool and its children (`wait4` rusage; perf:
  `perf record` + `perf script`);
- peak RSS (`ru_maxrss`; perf: the larger of record and script); bistouri's peaks
  while capturing and while symbolizing (after the capture) apart, from its
  summary.json;
- the shares it reports for the three functions (leaf samples).

bistouri runs twice per round: with an empty symbol cache (first run on these
binaries) and with a cache that earlier runs filled ("seen before": an unmeasured
2 s run first, then each warm run adds what it met). It is started as the
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
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARES = ROOT / "tests/fixtures/build/workloads/shares"
DOCS = ROOT / "docs/benchmarks.md"
FUNCTIONS = ("work_seventy", "work_twenty", "work_ten")
DOC_START = "<!-- bench_record: start -->"
DOC_END = "<!-- bench_record: end -->"
# As packaging/bin/bistouri starts it: the system interpreter in isolated mode without the site
# module's start-up (-I -S), the package and its dependencies first on sys.path (here the source
# tree and the virtualenv's site-packages, without the editable install's import hook, which costs
# ~9 ms of start-up an installed package has not), then the distribution's site directories.
SITE_PACKAGES = next((ROOT / ".venv/lib").glob("python3*/site-packages"), ROOT)
LAUNCHER = [
    "/usr/bin/python3",
    "-I",
    "-S",
    "-c",
    f"import site, sys; sys.path[:0] = [{str(ROOT)!r}, {str(SITE_PACKAGES)!r}]; "
    "sys.path.extend(p for p in site.getsitepackages() if p not in sys.path); "
    "from bistouri.cli import main; sys.exit(main())",
]


def run_measured(argv: list[str], env: dict[str, str] | None = None, **kw) -> tuple[int, float, float, int]:
    """Start `argv`; returns (launch CLOCK_MONOTONIC ns, CPU s incl. children, peak RSS MB, status)."""
    launch = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    p = subprocess.Popen(argv, env=env, **kw)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {' '.join(argv)}")
    return launch, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, p.returncode


def shares_of(leaves: Counter) -> dict[str, float]:
    total = sum(leaves.values()) or 1
    return {f: 100 * leaves[f] / total for f in FUNCTIONS}


def run_bistouri(pid: int, seconds: float, freq: int, cache: Path, work: Path) -> dict:
    out = work / f"bistouri-{time.monotonic_ns()}"
    argv = [*LAUNCHER, "record", "--pid", str(pid), "-d", str(seconds)]
    argv += ["-F", str(freq), "-o", str(out), "--format", "folded,summary", "--cache-dir", str(cache)]
    launch, cpu, rss, _ = run_measured(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    summary = json.loads((out / "summary.json").read_text())
    leaves: Counter = Counter()
    for line in (out / "profile.folded").read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaves[stack.rsplit(";", 1)[-1]] += int(n)
    shutil.rmtree(out)
    cap = summary["capture"]
    return {
        "first_sample_ms": (cap["first_sample_monotonic_ns"] - launch) / 1e6,
        "cpu_s": cpu,
        # record resets its peak after the capture (clear_refs), which ru_maxrss follows: the overall
        # peak is the larger of the two phases'.
        "rss_mb": max(rss, cap["peak_rss_bytes"] / 2**20),
        "capture_rss_mb": cap["peak_rss_bytes"] / 2**20,
        "symbolize_rss_mb": summary["symbolization"]["peak_rss_bytes"] / 2**20,
        "cached": summary["symbolization"]["cached"],
        "addresses": summary["symbolization"]["addresses"],
        "shares": shares_of(leaves),
    }


_PERF_SAMPLE = re.compile(r"^\S.*?\s(\d+\.\d+):")


def run_perf(pid: int, seconds: float, freq: int, work: Path) -> dict:
    data = work / "perf.data"
    argv = ["perf", "record", "-q", "-k", "mono", "-F", str(freq), "-g", "-p", str(pid), "-o", str(data)]
    launch, cpu1, rss1, _ = run_measured(
        [*argv, "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    script = work / "perf.txt"
    with open(script, "w") as f:
        _, cpu2, rss2, _ = run_measured(
            ["perf", "script", "--ns", "-i", str(data)], stdout=f, stderr=subprocess.DEVNULL
        )
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
        "first_sample_ms": (first_ns - launch) / 1e6,
        "cpu_s": cpu1 + cpu2,
        "record_cpu_s": cpu1,
        "script_cpu_s": cpu2,
        "rss_mb": max(rss1, rss2),
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
        launch, cpu, rss, _ = run_measured(["bpftrace", "-e", prog], stdout=f, stderr=subprocess.DEVNULL)
    text = out.read_text(errors="replace")
    out.unlink()
    first = int(re.search(r"@first: (\d+)", text).group(1))  # type: ignore[union-attr]
    leaves: Counter = Counter()
    for block in text.split("@[")[1:]:
        lines = block.strip().splitlines()
        n = re.search(r"\]: (\d+)", block)
        if lines and n:
            leaves[lines[0].strip().split("+", 1)[0]] += int(n.group(1))
    return {
        "first_sample_ms": (first - launch) / 1e6,
        "cpu_s": cpu,
        "rss_mb": rss,
        "shares": shares_of(leaves),
    }


def compile_bytecode() -> None:
    """bistouri's bytecode, as an installed package has it (in isolated mode the interpreter writes
    it into the source tree's __pycache__, whatever PYTHONDONTWRITEBYTECODE says)."""
    subprocess.run([*LAUNCHER[:2], "-m", "compileall", "-q", str(ROOT / "bistouri")], check=True)


def startup_runs(
    n: int, work: Path, cache: Path, freq: int, have_perf: bool, have_bpftrace: bool
) -> dict[str, list[float]]:
    """Launch -> first sample of `n` short (1 s) runs of each tool, interleaved: start-up needs
    many repetitions more than long captures."""
    out: dict[str, list[float]] = {"bistouri": [], "perf": [], "bpftrace": []}
    workload = subprocess.Popen([str(SHARES), str(n * 12 + 10)])
    try:
        time.sleep(0.5)
        for _ in range(n):
            out["bistouri"].append(run_bistouri(workload.pid, 1, freq, cache, work)["first_sample_ms"])
            if have_perf:
                out["perf"].append(run_perf(workload.pid, 1, freq, work)["first_sample_ms"])
            if have_bpftrace:
                out["bpftrace"].append(run_bpftrace(workload.pid, 1, freq, work)["first_sample_ms"])
    finally:
        workload.kill()
        workload.wait()
    return {k: v for k, v in out.items() if v}


def warm_up(work: Path, cache: Path, freq: int) -> None:
    """One unmeasured run: the standard library's bytecode lands in the private pycache prefix too,
    and the binaries are seen once."""
    workload = subprocess.Popen([str(SHARES), "10"])
    try:
        time.sleep(0.3)
        run_bistouri(workload.pid, 2, freq, cache, work)
    finally:
        workload.kill()
        workload.wait()


def median_of(runs: list[dict]) -> dict:
    med = statistics.median
    out = {k: med(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], int | float)}
    out["shares"] = {f: med(r["shares"][f] for r in runs) for f in FUNCTIONS}
    out["ranges"] = {
        k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in ("first_sample_ms", "cpu_s", "rss_mb")
    }
    return out


def table(results: dict) -> str:
    tools = [t for t in ("bistouri_cold", "bistouri_warm", "perf", "bpftrace") if t in results["tools"]]
    names = {
        "bistouri_cold": "bistouri record (first run)",
        "bistouri_warm": "bistouri record (seen before)",
        "perf": "perf record + perf script",
        "bpftrace": "bpftrace",
    }
    r = results["tools"]

    def rng(t: str, k: str, fmt: str) -> str:
        """median (min-max)"""
        lo, hi = r[t]["ranges"][k]
        spread = f" ({lo:{fmt}}-{hi:{fmt}})" if f"{lo:{fmt}}" != f"{hi:{fmt}}" else ""
        return f"**{r[t][k]:{fmt}}**{spread}"

    lines = [
        "| | " + " | ".join(names[t] for t in tools) + " |",
        "|---" * (len(tools) + 1) + "|",
        "| launch → first sample (ms) | "
        + " | ".join(rng(t, "first_sample_ms", ".0f") for t in tools)
        + " |",
        "| CPU per run (s) | " + " | ".join(rng(t, "cpu_s", ".2f") for t in tools) + " |",
        "| peak RSS (MB) | " + " | ".join(rng(t, "rss_mb", ".0f") for t in tools) + " |",
    ]
    for key, label in (("capture_rss_mb", "capturing"), ("symbolize_rss_mb", "symbolizing, writing")):
        cells = [f"{r[t][key]:.0f}" if key in r[t] else "-" for t in tools]
        lines.append(f"| peak RSS {label} (MB) | " + " | ".join(cells) + " |")
    starts = results.get("startup_ms", {})
    if starts:
        base = {
            "bistouri_cold": "bistouri",
            "bistouri_warm": "bistouri",
            "perf": "perf",
            "bpftrace": "bpftrace",
        }
        cells = []
        for t in tools:
            ms = starts.get(base[t], [])
            cells.append(f"**{statistics.median(ms):.0f}** (min {min(ms):.0f})" if ms else "-")
        lines.insert(
            3,
            f"| launch → first sample, {len(next(iter(starts.values())))} short runs (ms) | "
            + " | ".join(cells)
            + " |",
        )
    lines.append(
        "| hot/warm/cold shares (truth 70/20/10) | "
        + " | ".join("/".join(f"{r[t]['shares'][f]:.1f}" for f in FUNCTIONS) for t in tools)
        + " |"
    )
    return "\n".join(lines)


def write_docs(results: dict) -> None:
    text = DOCS.read_text()
    block = (
        f"{DOC_START}\n{table(results)}\n\n"
        f"{results['rounds']} interleaved rounds (order rotated) of {results['seconds']:g} s "
        f"at {results['freq_hz']} Hz "
        f"(median, min-max), {time.strftime('%Y-%m-%d')}, load average "
        f"{results['load_average_1min']:.1f} at the end (2 vCPUs).\n"
        f"{DOC_END}"
    )
    if DOC_START in text:
        text = re.sub(re.escape(DOC_START) + ".*?" + re.escape(DOC_END), lambda _m: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument(
        "--startup-runs", type=int, default=10, help="short runs of each tool for the start-up row"
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/record.json"))
    ap.add_argument(
        "--no-docs",
        dest="write_docs",
        action="store_false",
        help="do not put the table into docs/benchmarks.md",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_record needs root (BPF, perf events)", file=sys.stderr)
        return 2
    have_perf = shutil.which("perf") is not None
    have_bpftrace = shutil.which("bpftrace") is not None
    runs: dict[str, list[dict]] = {"bistouri_cold": [], "bistouri_warm": []}
    with tempfile.TemporaryDirectory(prefix="bistouri-bench-record-") as tmp:
        work = Path(tmp)
        compile_bytecode()
        warm_cache = work / "cache-warm"
        warm_up(work, warm_cache, args.freq)
        for rnd in range(args.rounds):
            workload = subprocess.Popen([str(SHARES), str(args.seconds * 6 + 10)])
            try:
                time.sleep(0.5)
                cold_cache = work / f"cache-cold-{rnd}"
                steps = ["bistouri_cold", "bistouri_warm"]
                steps += ["perf"] if have_perf else []
                steps += ["bpftrace"] if have_bpftrace else []
                # Rotated each round: a tool run right after another one's exit (bpftrace detaching
                # and freeing its programs) starts on a busier host; each gets every place in turn.
                steps = steps[rnd % len(steps) :] + steps[: rnd % len(steps)]
                for name in steps:
                    if name.startswith("bistouri"):
                        cache = cold_cache if name == "bistouri_cold" else warm_cache
                        r = run_bistouri(workload.pid, args.seconds, args.freq, cache, work)
                    elif name == "perf":
                        r = run_perf(workload.pid, args.seconds, args.freq, work)
                    else:
                        r = run_bpftrace(workload.pid, args.seconds, args.freq, work)
                    runs.setdefault(name, []).append(r)
                    print(
                        f"round {rnd + 1} {name:>14}: first sample {r['first_sample_ms']:6.1f} ms, "
                        f"CPU {r['cpu_s']:.2f} s, RSS {r['rss_mb']:.0f} MB, shares "
                        + "/".join(f"{r['shares'][f]:.1f}" for f in FUNCTIONS),
                        flush=True,
                    )
            finally:
                workload.kill()
                workload.wait()
        starts = startup_runs(args.startup_runs, work, warm_cache, args.freq, have_perf, have_bpftrace)
    results = {
        "load_average_1min": os.getloadavg()[0],
        "rounds": args.rounds,
        "seconds": args.seconds,
        "freq_hz": args.freq,
        "tools": {name: median_of(r) for name, r in runs.items() if r},
        "startup_ms": {name: sorted(ms) for name, ms in starts.items()},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))
    print("(targets: first sample <= 60 ms; capture RSS <= 40 MB; CPU seen before <= perf's)")
    if args.write_docs:
        write_docs(results)
        print(f"table written to {DOCS}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

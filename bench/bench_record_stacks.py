"""How many of `bistouri record`'s stacks are whole from its first sample on (issue 27, items 3-4).

A stack is whole when its outermost frame is the program's entry (`_start`). Two cases, each
`bistouri record --pid` of a busy process as a user would run it (the launcher of
bench_record), in interleaved rounds, optionally side by side with the code and BPF object of
another git ref (`--baseline-ref`):

- python: Debian's /usr/bin/python3.11 running fib + json, 3 s at 999 Hz, unwind tables
  already in the disk cache (an unmeasured run first): what the first ~0.3 s cost when
  they were loaded only after the frame-pointer first sampler had handed over.
- cxx: a first run (empty cache directory) on a 30+ MB stripped C++ binary (gcc's cc1plus,
  35 MB, compiling generated C++ for minutes), 5 s at 99 Hz, with
  `perf record --call-graph dwarf -F 99` on the same process in the same window: every
  sample walked before the binary's table is built is cut short.

Also per run: launch -> first sample (summary.json), to see that start-up did not regress.
Run as root: `python -m bench.bench_record_stacks [--rounds N] [--baseline-ref REF]`; the table
goes into docs/benchmarks.md (between its bench_record_stacks markers) unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_record import LAUNCHER, ROOT, run_measured
from bench.bench_sampling import baseline_tree

DOCS = ROOT / "docs/benchmarks.md"
DOC_START = "<!-- bench_record_stacks: start -->"
DOC_END = "<!-- bench_record_stacks: end -->"
PYTHON = "/usr/bin/python3.11"
CC1PLUS = "/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus"
PYTHON_BUSY = (
    "import json, sys, time\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "end = time.time() + float(sys.argv[1])\n"
    "while time.time() < end:\n    fib(18); json.loads(json.dumps({'a': list(range(200))}))\n"
)


def cxx_source(functions: int) -> str:
    """Template-heavy C++ that keeps cc1plus -O2 busy for about 30 ms a function."""
    body = ["#include <bits/stdc++.h>\n"]
    for i in range(functions):
        body.append(
            f"template <int N> struct S{i} {{ std::map<std::string, std::vector<int>> m; int f(int x) {{ "
            f"std::sort(m[std::to_string(x)].begin(), m[std::to_string(x)].end()); return x * N; }} }};\n"
            f"int g{i}(int x) {{ S{i}<{i}> s; std::unordered_map<int, std::string> u; "
            f"for (int k = 0; k < x; ++k) u[k] = std::to_string(k); return s.f(x) + (int)u.size(); }}\n"
        )
    return "".join(body)


def whole_share(folded: Path) -> tuple[float, float, int]:
    """(share of samples whose outermost frame is _start, share of <= 4 frames, samples)."""
    whole = short = total = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        total += int(n)
        whole += int(n) * (frames[0] == "_start")
        short += int(n) * (len(frames) <= 4)
    return whole / max(total, 1), short / max(total, 1), total


def perf_whole_share(text: str) -> tuple[float, int]:
    """Of `perf script`'s samples, the share whose outermost frame is _start."""
    blocks = [b.strip().splitlines() for b in text.split("\n\n") if b.strip()]
    whole = sum(1 for b in blocks if len(b) > 1 and re.search(r"\s_start\+", b[-1]))
    return whole / max(len(blocks), 1), len(blocks)


def record(
    tree: Path, obj: Path | None, pid: int, seconds: float, freq: int, cache: Path, work: Path
) -> dict:
    out = work / f"record-{time.monotonic_ns()}"
    # The tree's package first on sys.path (the virtualenv's dependencies stay).
    launcher = [a.replace(f"[{str(ROOT)!r},", f"[{str(tree)!r},", 1) for a in LAUNCHER]
    argv = [*launcher, "record", "--pid", str(pid), "-d", str(seconds), "-F", str(freq)]
    argv += ["-o", str(out), "--format", "folded,summary", "--cache-dir", str(cache)]
    env = dict(os.environ, BISTOURI_BPF_OBJECT=str(obj)) if obj else None
    m = run_measured(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    whole, short, samples = whole_share(out / "profile.folded")
    shutil.rmtree(out)
    first = (summary["capture"]["first_sample_monotonic_ns"] - m.launch_ns) / 1e6
    return {"whole": whole, "short": short, "samples": samples, "first_sample_ms": first, "cpu_s": m.cpu_s}


def python_case(tree: Path, obj: Path | None, cache: Path, work: Path) -> dict:
    script = work / "busy.py"
    script.write_text(PYTHON_BUSY)
    proc = subprocess.Popen([PYTHON, str(script), "60"])
    try:
        time.sleep(0.5)
        return record(tree, obj, proc.pid, 3, 999, cache, work)
    finally:
        proc.kill()
        proc.wait()


def cxx_case(tree: Path, obj: Path | None, work: Path, source: Path) -> dict:
    """A first run on cc1plus, perf --call-graph dwarf on it in the same window."""
    # Its own process group: killing g++ alone would leave cc1plus compiling for minutes.
    gxx = subprocess.Popen(
        ["g++", "-O2", "-c", str(source), "-o", "/dev/null"], cwd=work, start_new_session=True
    )
    try:
        pid = 0
        for _ in range(100):
            time.sleep(0.05)
            found = subprocess.run(["pgrep", "-P", str(gxx.pid), "cc1plus"], capture_output=True, text=True)
            if found.stdout.strip():
                pid = int(found.stdout.split()[0])
                break
        if not pid:
            raise RuntimeError("g++ started no cc1plus")
        time.sleep(1.5)  # past its start-up: the busy middle of a compilation
        data = work / "perf.data"
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-F", "99", "--call-graph", "dwarf", "-p", str(pid), "-o", str(data)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cache = work / f"cache-empty-{time.monotonic_ns()}"
        try:
            r = record(tree, obj, pid, 5, 99, cache, work)
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
        shutil.rmtree(cache, ignore_errors=True)
        script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True)
        data.unlink()
        r["perf_whole"], r["perf_samples"] = perf_whole_share(script.stdout)
        return r
    finally:
        os.killpg(gxx.pid, signal.SIGKILL)
        gxx.wait()


def summarize(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], int | float)]
    return {
        k: [statistics.median(r[k] for r in runs), min(r[k] for r in runs), max(r[k] for r in runs)]
        for k in keys
    }


def table(results: dict) -> str:
    def cell(s: dict, k: str, scale: float = 100, fmt: str = ".1f") -> str:
        med, lo, hi = (v * scale for v in s[k])
        return f"**{med:{fmt}}** ({lo:{fmt}}-{hi:{fmt}})"

    lines = [
        "| code | python3.11, 3 s: whole | ≤ 4 frames | first sample (ms) "
        "| cc1plus first run, 5 s: whole | perf dwarf, same window | first sample (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["trees"].items():
        py, cx = r["python"], r["cxx"]
        py_first, cx_first = cell(py, "first_sample_ms", 1, ".0f"), cell(cx, "first_sample_ms", 1, ".0f")
        lines.append(
            f"| {name} | {cell(py, 'whole')} % | {cell(py, 'short')} % | {py_first} "
            f"| {cell(cx, 'whole')} % | {cell(cx, 'perf_whole')} % | {cx_first} |"
        )
    return "\n".join(lines)


def write_docs(results: dict) -> None:
    text = DOCS.read_text()
    block = (
        f"{DOC_START}\n{table(results)}\n\n"
        f"{results['rounds']} interleaved rounds (median, min-max), {time.strftime('%Y-%m-%d')}, "
        f"load average {results['load_average_1min']:.1f} at the end (2 vCPUs).\n{DOC_END}"
    )
    if DOC_START in text:
        text = re.sub(re.escape(DOC_START) + ".*?" + re.escape(DOC_END), lambda _m: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--baseline-ref", default="", help="git ref to measure side by side (its code and object)"
    )
    ap.add_argument("--cases", default="python,cxx")
    ap.add_argument("--out", default=str(ROOT / "bench/results/record_stacks.json"))
    ap.add_argument("--no-docs", dest="write_docs", action="store_false")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_record_stacks needs root (BPF, perf events)", file=sys.stderr)
        return 2
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="bistouri-bench-stacks-") as tmp:
        work = Path(tmp)
        trees: dict[str, tuple[Path, Path | None]] = {"this tree": (ROOT, None)}
        if args.baseline_ref:
            base, obj = baseline_tree(args.baseline_ref, work)
            trees[args.baseline_ref] = (base, obj)
        source = work / "big.cpp"
        source.write_text(cxx_source(3000))
        runs: dict[str, dict[str, list[dict]]] = {name: {c: [] for c in cases} for name in trees}
        for name, (tree, obj) in trees.items():  # unmeasured: tables into each tree's warm cache
            if "python" in cases:
                python_case(tree, obj, work / f"warm-{len(name)}-{abs(hash(name))}", work)
        for rnd in range(args.rounds):
            order = list(trees)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name in order:
                tree, obj = trees[name]
                for case in cases:
                    if case == "python":
                        r = python_case(tree, obj, work / f"warm-{len(name)}-{abs(hash(name))}", work)
                    else:
                        r = cxx_case(tree, obj, work, source)
                    runs[name][case].append(r)
                    print(
                        f"round {rnd + 1} {name:>12} {case:>6}: "
                        + json.dumps(r, default=lambda x: round(x, 3)),
                        flush=True,
                    )
    results = {
        "load_average_1min": os.getloadavg()[0],
        "rounds": args.rounds,
        "trees": {name: {c: summarize(r) for c, r in by.items() if r} for name, by in runs.items()},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    if set(cases) == {"python", "cxx"}:
        print(table(results))
        if args.write_docs:
            write_docs(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

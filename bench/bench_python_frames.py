"""CPython frames from BPF (issue 21), side by side with py-spy on the same process, per interpreter.

For each interpreter of the host (pyenv 3.8-3.13, Debian's /usr/bin/python3.11), on
bench/python_target.py (`hot_loop` under `driver`, its rounds counted in a shared file):

1. names: bistouri (`bench/_python_sampler.py`, a Profiler in its own process that names every
   sample's Python frames as the capture does) and `py-spy record --format raw -t` (default mode) sample
   the plain loop at 99 Hz at the same time. Hot share = samples of the main thread whose stack has
   `hot_loop`;
2. overhead at 999 Hz, the loop also calling `checksum` (a call written over three lines): the target's
   work per second of its own time (wall less run-queue waits), of CPU time and of wall time, with
   nothing attached (before and after), with bistouri, with py-spy (default mode, which stops the process
   at each sample) and with `py-spy --nonblocking`; the profiler's CPU over the window (bistouri: its
   process less the bench's own checks, + its BPF run time; py-spy: its process), bistouri's ring thread
   and naming apart. Lines, from the same windows: bistouri's frames against CPython's own line for their
   instruction offset (`PyCode_Addr2Line`, dumped by the target); py-spy gives a line but no offset, so
   its frames are held to what can be checked from outside: lines no instruction of that code has, the
   call's line for `checksum` (the line-table boundary where a lookup off by one unit names the
   argument's line), and the distance between its `hot_loop` line shares and bistouri's exact ones;
3. BPF time per sample (run_time_ns / run_cnt of the perf_event program, bpf_enable_stats, net of
   other processes' runs) of a 30-deep Python stack (the target recursed), with the Python walk and
   without it (the record deleted from `python_procs`), against bench_sampling's frameless C program
   (~30 native frames, the .eh_frame walk): measured once at the start of the run, and beside each
   measure (a second sampler on it over the same seconds), the ratio taken in 2 s windows and the
   windows' median kept (on a shared host the reference alone moves by half from one minute to the next;
   `--seconds 14` gives six windows);
4. `bistouri record`'s peak RSS on the target, the whole run with its helpers (bench_record's
   measure), twice: its cache directory empty, then holding what the first run put there.

Needs py-spy next to this interpreter (`pip install py-spy`). The tables and what they showed:
docs/benchmarks.md. Run as root: `python -m bench.bench_python_frames [--seconds S] [--only 3.11,...]`.
Prints a JSON line per interpreter and the tables; writes bench/results/python_frames.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._python_sampler import tasks_cpu_ns, tasks_sched_ns, work_rates  # noqa: E402
from bench.bench_record import run_bistouri  # noqa: E402
from bench.bench_sampling import build_frameless, enable_bpf_stats  # noqa: E402
from testkit.helpers import CPYTHONS, cpython  # noqa: E402

TARGET = ROOT / "bench/python_target.py"
SAMPLER = ROOT / "bench/_python_sampler.py"
PYSPY = Path(sys.executable).parent / "py-spy"
RESULTS = ROOT / "bench/results/python_frames.json"
DEEP = 30  # Python frames at hot_loop in the BPF-time measure
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


class Target:
    """bench/python_target.py under `exe`, `depth` Python frames deep at hot_loop, `more` its other
    arguments; killed on exit."""

    def __init__(self, exe: Path, depth: int, tmp: Path, *more: str) -> None:
        self.counter = tmp / f"counter-{time.monotonic_ns()}"
        self.counter.write_bytes(bytes(8))
        self.proc = subprocess.Popen(
            [str(exe), str(TARGET), str(self.counter), str(depth), *more], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.dump = json.loads(self.proc.stdout.readline())
        self.truth = tmp / f"truth-{self.proc.pid}.json"
        self.truth.write_text(json.dumps(self.dump))
        self.pid = self.proc.pid

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()

    def work(self) -> int:
        return int.from_bytes(self.counter.read_bytes()[:8], "little")

    def rate(self, seconds: float) -> dict:
        """Its work rates over `seconds` with nothing attached."""
        w0, c0, t0 = self.work(), tasks_sched_ns(self.pid), time.monotonic()
        time.sleep(seconds)
        w1, c1, t1 = self.work(), tasks_sched_ns(self.pid), time.monotonic()
        return work_rates(w1 - w0, t1 - t0, c1[0] - c0[0], c1[1] - c0[1])


def sampler(pid: int, seconds: float, freq: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SAMPLER), str(pid), str(seconds), str(freq), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sampled(proc: subprocess.Popen, seconds: float) -> dict:
    out, err = proc.communicate(timeout=seconds + 180)
    if proc.returncode:
        raise RuntimeError(f"sampler failed: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


class PySpy:
    """`py-spy record` of a pid, raw collapsed stacks with thread ids; started once it samples."""

    def __init__(self, pid: int, freq: int, seconds: float, out: Path, nonblocking: bool) -> None:
        argv = [
            str(PYSPY),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(freq),
            "--duration",
            str(int(seconds + 0.999)),
        ]
        argv += ["--format", "raw", "-t", "-o", str(out)] + (["--nonblocking"] if nonblocking else [])
        self.out = out
        # It says what it does on stdout, its warnings on stderr.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.said = self.proc.stdout.readline()  # "py-spy> Sampling process N times a second ..."
        if "Sampling" not in self.said:
            self.finish()
            raise RuntimeError(f"py-spy did not start: {self.said}")

    def finish(self) -> str:
        try:
            err, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            err, _ = self.proc.communicate()
        return self.said + err

    def stacks(self) -> Counter[tuple[tuple[str, str, int], ...]]:
        """The main thread's stacks (root first) as (function, file, line) frames, with their counts.
        (Threads are told by name: with --nonblocking py-spy gives their pthread_t, not their tid.)"""
        out: Counter[tuple[tuple[str, str, int], ...]] = Counter()
        for line in self.out.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            parts = stack.split(";")
            if not parts[0].startswith("thread (") or not parts[0].endswith("): MainThread"):
                continue
            frames = []
            for p in parts[1:]:
                m = _FRAME.match(p)
                if m:
                    frames.append((m.group(1), os.path.basename(m.group(2)), int(m.group(3))))
            out[tuple(frames)] += int(n)
        return out


def pyspy_names_and_lines(spy: PySpy, dump: dict, exact: dict[str, dict[str, int]]) -> dict:
    """py-spy's main-thread samples: the hot share, and its lines held to what can be checked without
    the instruction offset (which py-spy does not give): a line no instruction of that code has, and
    each code object's samples by line against `exact` (bistouri's, each frame on CPython's line)."""
    codes = {(c["name"], os.path.basename(c["filename"])): c for c in dump["codes"]}
    valid = {k: {line for _, line in c["lines"] if line is not None} for k, c in codes.items()}
    stacks = spy.stacks()
    samples = sum(stacks.values())
    hot = sum(n for s, n in stacks.items() if any(f[0] == "hot_loop" for f in s))
    frames = impossible = 0
    code_lines: dict[str, Counter[int]] = {}
    for s, n in stacks.items():
        for name, file, line in s:
            lines = valid.get((name, file))
            if lines is None:
                continue
            frames += n
            impossible += n * (line not in lines)
            code_lines.setdefault(name, Counter())[line] += n
    truth = {name: Counter({int(k): v for k, v in lines.items()}) for name, lines in exact.items()}
    return {
        "samples": samples,
        "hot_share": hot / samples if samples else 0.0,
        "frames_checked": frames,
        "lines_impossible": impossible / frames if frames else None,
        "code_lines": {k: dict(v) for k, v in code_lines.items()},
        "distance": {k: distance(v, truth.get(k, Counter())) for k, v in code_lines.items()},
    }


def distance(a: Counter[int], b: Counter[int]) -> float | None:
    """Total variation distance between two line histograms (0: the same shares, 1: disjoint)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return None
    return sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b)) / 2


def names_and_lines(exe: Path, seconds: float, freq: int, tmp: Path) -> dict:
    """The plain loop (hot_loop alone under driver), both profilers at once."""
    with Target(exe, 4, tmp) as t:
        time.sleep(0.5)
        ours = sampler(t.pid, seconds, freq, "--truth", str(t.truth))
        # The sampler needs ~1.5 s before its window (the early-return measure, the unwind tables): py-spy
        # covers it and the window.
        spy = PySpy(t.pid, freq, seconds + 3, tmp / "names.raw", nonblocking=False)
        said = spy.finish()
        bistouri = sampled(ours, seconds)
        theirs = pyspy_names_and_lines(spy, t.dump, bistouri["code_lines"])
        theirs["said"] = said.strip().splitlines()[-2:]
    return {"bistouri": bistouri, "py-spy": theirs}


def pyspy_window(t: Target, freq: int, seconds: float, tmp: Path, nonblocking: bool, exact: dict) -> dict:
    spy = PySpy(t.pid, freq, seconds + 2, tmp / f"overhead-{nonblocking}.raw", nonblocking)
    c0, tc0, w0, t0 = tasks_cpu_ns(spy.proc.pid), tasks_sched_ns(t.pid), t.work(), time.monotonic()
    time.sleep(seconds)
    c1, tc1, w1, t1 = tasks_cpu_ns(spy.proc.pid), tasks_sched_ns(t.pid), t.work(), time.monotonic()
    said = spy.finish()
    m = re.search(r"Samples: (\d+) Errors: (\d+)", said)
    return {
        **pyspy_names_and_lines(spy, t.dump, exact),
        **work_rates(w1 - w0, t1 - t0, tc1[0] - tc0[0], tc1[1] - tc0[1]),
        "cpu_share_of_one_core": (c1 - c0) / 1e9 / (t1 - t0),
        "samples": int(m.group(1)) if m else None,
        "errors": int(m.group(2)) if m else None,
        "behind": "behind in sampling" in said,
    }


def overhead(exe: Path, seconds: float, freq: int, tmp: Path) -> dict:
    with Target(exe, 4, tmp, "checksum") as t:
        time.sleep(0.5)
        before = t.rate(seconds)
        argv = ("--counter", str(t.counter), "--truth", str(t.truth))
        bistouri = sampled(sampler(t.pid, seconds, freq, *argv), seconds)
        blocking = pyspy_window(t, freq, seconds, tmp, False, bistouri["code_lines"])
        nonblocking = pyspy_window(t, freq, seconds, tmp, True, bistouri["code_lines"])
        after = t.rate(seconds)
    out: dict = {"baseline": [before, after]}
    base = {k: (before[k] + after[k]) / 2 for k in before}
    for name, r in (("bistouri", bistouri), ("py-spy", blocking), ("py-spy --nonblocking", nonblocking)):
        out[name] = {
            **r,
            "slowdown_wall": 1 - r["work_per_s"] / base["work_per_s"],
            "slowdown_cpu": 1 - r["work_per_cpu_s"] / base["work_per_cpu_s"],
            "slowdown": 1 - r["work_per_own_s"] / base["work_per_own_s"],
            "profiler_share_of_one_core": r["cpu_share_of_one_core"] + r.get("bpf_share_of_one_core", 0.0),
        }
    return out


def bpf_time(exe: Path, seconds: float, freq: int, tmp: Path, reference: Path) -> dict:
    """The 30-deep stack sampled with the Python walk and without it; and the same depth made of
    distinct functions (the recursion repeats one code object 26 times, which a walk reads once). Each
    beside the native reference (`reference`: the frameless C program, running only for this step)
    sampled at the same time by a sampler of its own: `paired` (see paired_ratio)."""
    with Running(reference) as ref, Target(exe, DEEP, tmp) as t:
        time.sleep(0.5)
        walk, walk_ref = side_by_side(t.pid, ref.pid, seconds, freq, "--truth", str(t.truth))
        native, native_ref = side_by_side(t.pid, ref.pid, seconds, freq, "--no-walk")
    with Running(reference) as ref, Target(exe, DEEP, tmp, "distinct") as t:
        time.sleep(0.5)
        distinct, distinct_ref = side_by_side(t.pid, ref.pid, seconds, freq)
    return {
        "python_walk": walk,
        "native_only": native,
        "distinct": distinct,
        "paired": {
            "python_walk": paired_ratio(walk, walk_ref),
            "native_only": paired_ratio(native, native_ref),
            "distinct": paired_ratio(distinct, distinct_ref),
        },
    }


WINDOW_S = 2.0  # the windows side_by_side's ratios are taken in
# A window counts when both targets got this many samples in it: a target starved of CPU by other
# tenants leaves few, and the early returns taken out of each (their cost estimated once) then swamp them.
MIN_SAMPLES = 150


def side_by_side(pid: int, reference: int, seconds: float, freq: int, *extra: str) -> tuple[dict, dict]:
    """`pid` and the native reference sampled over the same seconds, each by its own sampler (its own BPF
    program and run time), cut into the same windows."""
    both = [
        sampler(pid, seconds, freq, "--window", str(WINDOW_S), *extra),
        sampler(reference, seconds, freq, "--window", str(WINDOW_S)),
    ]
    try:
        for proc in both:  # each says when its tables are in; then both start at once
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"sampler failed: {proc.communicate()[1][-2000:]}")
        for proc in both:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        return sampled(both[0], seconds), sampled(both[1], seconds)
    finally:
        for proc in both:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def paired_ratio(subject: dict, reference: dict) -> dict:
    """The subject's BPF time per sample over the reference's, window by window (both measured in the
    same second, so a load that moves both moves neither ratio): their median and spread, and the
    reference's own spread over those windows (µs)."""
    ref = {w["k"]: w["net_ns_per_sample"] for w in reference["windows"] if w["samples"] >= MIN_SAMPLES}
    pairs = [
        (w["net_ns_per_sample"], ref[w["k"]])
        for w in subject["windows"]
        if w["samples"] >= MIN_SAMPLES and w["k"] in ref
    ]
    if not pairs:
        return {"windows": 0}
    ratios = sorted(a / b for a, b in pairs)
    refs = sorted(b / 1e3 for _, b in pairs)
    return {
        "windows": len(pairs),
        "median": statistics.median(ratios),
        "min": ratios[0],
        "max": ratios[-1],
        "reference_us": [refs[0], statistics.median(refs), refs[-1]],
        "subject_us": statistics.median(a / 1e3 for a, _ in pairs),
    }


class Running:
    """bench_sampling's frameless C program (~30 native frames, the .eh_frame walk), built at `exe`,
    running until the block ends (a CPU burner: not beside the other steps' measures)."""

    def __init__(self, exe: Path) -> None:
        self.proc = subprocess.Popen([str(exe), str(3600)])
        self.pid = self.proc.pid

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def native_walk(exe: Path, seconds: float, freq: int) -> dict:
    with Running(exe) as ref:
        time.sleep(0.5)
        return sampled(sampler(ref.pid, seconds, freq), seconds)


def record_rss(exe: Path, seconds: float, tmp: Path) -> dict:
    """`bistouri record` twice on one target: its cache directory empty, then holding what the first
    run put there (as a user's holds what they profiled before)."""
    work, cache = tmp / "record", tmp / f"cache-{time.monotonic_ns()}"
    work.mkdir(exist_ok=True)
    cache.mkdir()
    keys = ("rss_mb", "capture_rss_mb", "symbolize_rss_mb", "helpers_rss_mb", "wall_s", "cpu_s")
    out = {}
    with Target(exe, 4, tmp) as t:
        time.sleep(0.5)
        for run in ("first", "seen_before"):
            r = run_bistouri(t.pid, seconds, 99, cache, work)
            out[run] = {k: r[k] for k in keys}
    return out


def measure(exe: Path, seconds: float, tmp: Path, reference: Path, bpf_only: bool = False) -> dict:
    if bpf_only:
        return {"bpf": bpf_time(exe, seconds, 999, tmp, reference)}
    return {
        "names": names_and_lines(exe, 2 * seconds, 99, tmp),  # 99 Hz: twice as long for as many samples
        "overhead": overhead(exe, seconds, 999, tmp),
        "bpf": bpf_time(exe, seconds, 999, tmp, reference),
        "record": record_rss(exe, seconds, tmp),
    }


def pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f} %"


def tables(results: dict) -> str:
    rows = {k: v for k, v in results.items() if k in CPYTHONS and "names" in v}
    timed = {k: v for k, v in results.items() if k in CPYTHONS and "bpf" in v}

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b else "n/a"

    out = [
        "| interpreter | 99 Hz together: bistouri | py-spy | ratio (≥ 0.97) |"
        " 999 Hz one after the other: bistouri | py-spy | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in rows.items():
        b, s = v["names"]["bistouri"], v["names"]["py-spy"]
        b9, s9 = v["overhead"]["bistouri"], v["overhead"]["py-spy"]
        out.append(
            f"| {k} | {pct(b['hot_share'])} ({b['samples']}) | {pct(s['hot_share'])} ({s['samples']}) | "
            f"{ratio(b['hot_share'], s['hot_share'])} | {pct(b9['hot_share'])} ({b9['samples']}) | "
            f"{pct(s9['hot_share'])} ({s9['samples']}) | {ratio(b9['hot_share'], s9['hot_share'])} |"
        )
    out += [
        "",
        "| interpreter | bistouri on CPython's line (≥ 99.5 %) | py-spy on a line its code has not |"
        " `checksum` on the call's line: bistouri / py-spy | `hot_loop` lines, bistouri / py-spy"
        " (their distance) |",
        "|---|---|---|---|---|",
    ]
    for k, v in rows.items():
        b, s = v["overhead"]["bistouri"], v["overhead"]["py-spy"]
        bl = {name: Counter({int(x): n for x, n in lines.items()}) for name, lines in b["code_lines"].items()}
        sl = {name: Counter({int(x): n for x, n in lines.items()}) for name, lines in s["code_lines"].items()}

        def share(c: Counter[int], line: int) -> str:
            return f"{100 * c[line] / max(1, c.total()):.1f} %"

        # The call's line: where CPython puts nearly all of checksum's samples (bistouri's frames are
        # each on CPython's line: the column before).
        call = bl["checksum"].most_common(1)[0][0]
        others = ", ".join(f"{x}: {share(sl['checksum'], x)}" for x in sorted(sl["checksum"]) if x != call)
        hot = ", ".join(
            f"{x}: {share(bl['hot_loop'], x)} / {share(sl['hot_loop'], x)}"
            for x in sorted(bl["hot_loop"] | sl["hot_loop"])
            if bl["hot_loop"][x] + sl["hot_loop"][x] > 10
        )
        out.append(
            f"| {k} | {pct(b['lines_exact'], 2)} ({b['frames_checked']}) | {pct(s['lines_impossible'], 2)}"
            f" ({s['frames_checked']}) | line {call}: {share(bl['checksum'], call)} /"
            f" **{share(sl['checksum'], call)}**{f' ({others})' if others else ''} | {hot}"
            f" ({pct(s['distance']['hot_loop'])}) |"
        )
    out += [
        "",
        "| interpreter | work/s alone (own time; wall) | slowdown, own time: bistouri / py-spy / py-spy"
        " --nonblocking | per CPU s: bistouri / py-spy / --nonblocking |"
        " profiler CPU: bistouri (process + BPF) / py-spy / --nonblocking | bistouri ring thread + naming |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in rows.items():
        o = v["overhead"]
        b, s, n = o["bistouri"], o["py-spy"], o["py-spy --nonblocking"]
        own = sum(x["work_per_own_s"] for x in o["baseline"]) / 2
        wall = sum(x["work_per_s"] for x in o["baseline"]) / 2
        out.append(
            f"| {k} | {own:.0f}; {wall:.0f} | "
            f"{pct(b['slowdown'])} / {pct(s['slowdown'])} / {pct(n['slowdown'])} | "
            f"{pct(b['slowdown_cpu'])} / {pct(s['slowdown_cpu'])} / {pct(n['slowdown_cpu'])} | "
            f"**{pct(b['profiler_share_of_one_core'], 2)}** ({pct(b['cpu_share_of_one_core'], 2)} + "
            f"{pct(b['bpf_share_of_one_core'], 2)}) / {pct(s['profiler_share_of_one_core'], 2)} / "
            f"{pct(n['profiler_share_of_one_core'], 2)} | "
            f"{pct(b['ring_share_of_one_core'], 2)} + {pct(b['naming_share_of_one_core'], 2)} |"
        )
    native = results.get("native")
    out += [
        "",
        f"| interpreter | BPF µs/sample, {DEEP}-deep Python stack (net) | without the Python walk |"
        " native + Python frames | ratio to the native walk (≤ 2) | distinct functions: µs, ratio |"
        " sampler CPU (ring + naming) |",
        "|---|---|---|---|---|---|---|",
    ]
    if native:
        out.append(
            f"| frameless C (native walk) | {native['bpf_ns_per_sample_net'] / 1e3:.2f} | | "
            f"{native['native_frames']:.1f} + 0 | 1 | | {pct(native['cpu_share_of_one_core'], 2)} |"
        )
    for k, v in timed.items():
        w, n, d = v["bpf"]["python_walk"], v["bpf"]["native_only"], v["bpf"].get("distinct")
        base = native["bpf_ns_per_sample_net"] if native else float("nan")
        dn = d["bpf_ns_per_sample_net"] if d else 0.0
        other = f"{dn / 1e3:.2f}, {dn / base:.2f}" if d else ""
        out.append(
            f"| {k} | {w['bpf_ns_per_sample_net'] / 1e3:.2f} | {n['bpf_ns_per_sample_net'] / 1e3:.2f} | "
            f"{w['native_frames']:.1f} + {w['python_frames']:.1f} | "
            f"{w['bpf_ns_per_sample_net'] / base:.2f} | "
            f"{other} | "
            f"{pct(w['cpu_share_of_one_core'], 2)} ({pct(w['ring_share_of_one_core'], 2)} + "
            f"{pct(w['naming_share_of_one_core'], 2)}) |"
        )
    out += [
        "",
        "Side by side with the native reference (its own sampler, the same 2 s windows, those where both"
        f" got {MIN_SAMPLES} samples): medians of the windows' ratios (min-max); the Python walk's own"
        " part = with the walk less without (each to its own windows' reference).",
        "",
        "| interpreter | recursed: ratio (≤ 2) | without the Python walk | the walk's own part |"
        " distinct functions: ratio (≤ 2) | the reference's µs (min / median / max) |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in timed.items():
        pr = v["bpf"].get("paired")
        if not pr or not all(x.get("windows") for x in pr.values()):
            continue
        w, n, d = pr["python_walk"], pr["native_only"], pr["distinct"]
        refs = [r for x in (w, n, d) for r in x["reference_us"]]

        def spread(x: dict) -> str:
            return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f}, {x['windows']} windows)"

        out.append(
            f"| {k} | **{spread(w)}** | {spread(n)} | {w['median'] - n['median']:.2f} | **{spread(d)}** | "
            f"{min(refs):.2f} / {statistics.median(refs):.2f} / {max(refs):.2f} |"
        )
    out += [
        "",
        "| interpreter | `record` run | peak RSS, whole run (≤ 50 MB) | capturing | symbolizing | helpers |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in rows.items():
        for run, r in v["record"].items():
            mb = [
                f"{r[x]:.1f} MB" for x in ("rss_mb", "capture_rss_mb", "symbolize_rss_mb", "helpers_rss_mb")
            ]
            out.append(f"| {k} | {run.replace('_', ' ')} | **{mb[0]}** | {mb[1]} | {mb[2]} | {mb[3]} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="each window (default 4)")
    ap.add_argument("--bpf-only", action="store_true", help="only the BPF times per sample")
    ap.add_argument(
        "--only", default="", help="interpreters, comma-separated (default: all of " + ",".join(CPYTHONS)
    )
    args = ap.parse_args()
    if not PYSPY.exists():
        print(f"py-spy is not installed at {PYSPY} (pip install py-spy)", file=sys.stderr)
        return 1
    stats_fd = enable_bpf_stats()
    if stats_fd < 0:
        print("bpf_enable_stats is unavailable: no BPF run times", file=sys.stderr)
        return 1
    results: dict = {"seconds": args.seconds, "load_before": os.getloadavg()}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-pyframes-") as d:
            tmp = Path(d)
            reference = build_frameless(tmp)
            results["native"] = native_walk(reference, args.seconds, 999)
            print(f"{'native':>12}: {json.dumps(results['native'])}", flush=True)
            for which in args.only.split(",") if args.only else CPYTHONS:
                exe = cpython(which)
                if exe is None:
                    print(f"{which:>12}: not installed", flush=True)
                    continue
                results[which] = measure(exe, args.seconds, tmp, reference, args.bpf_only)
                print(f"{which:>12}: {json.dumps(results[which])}", flush=True)
    finally:
        os.close(stats_fd)
    results["load_after"] = os.getloadavg()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

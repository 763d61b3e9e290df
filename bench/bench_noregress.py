"""BPF time per sample and sampler CPU, this tree against an earlier commit, in interleaved rounds.

bench_sampling's sampler (its own process, a Profiler that only drains, 999 Hz on one busy
process) run by each version in turn on the same running workload, the order alternated each round:
the earlier commit (`--before`, default 3d8280b: main when issue 23 was filed) with its own Python
and its own BPF object (bench/_before.py), this tree with its own; with `--together`, both at the
same time on the same process (each its own perf events and program), so that both meet the same
load. The medians over the rounds and their ratio (now / before) hold better on a loaded host than
absolute figures, which do not.

Workloads (bench_sampling's): `frameless` (32 frames of a -O2 program without frame pointers, the
.eh_frame walk), `repeated` (the burner: one stack), `probe` (4 000 functions, nearly every sample
a new stack), `python` (Debian's python3.11 in a recursive function: the CPython walk where the
version has one). Run as root: `python -m bench.bench_noregress`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_sampling import (  # noqa: E402
    BURNER,
    PYTHON_BUSY,
    baseline_tree,
    build_frameless,
    build_probe,
    enable_bpf_stats,
    run_sampler,
)

ISSUE_23 = "3d8280b"  # main when issue 23 was filed, before session 11's merges
KEYS = ("bpf_ns_per_sample", "bpf_ns_per_sample_net", "reader_ns_per_sample", "user_frames", "samples")


def rounds(
    argv: list[str], n: int, seconds: float, freq: int, sides: dict[str, tuple[Path, Path]], together: bool
) -> dict:
    """`n` rounds of now and each of `sides` (label -> its tree and object; "before" among them) on
    one process of `argv`, who goes first rotated each round (or all at once, `together`)."""
    runs: dict[str, list[dict]] = {"now": [], **{who: [] for who in sides}}

    def sample(who: str) -> dict:
        t, o = sides.get(who, (None, None))
        return run_sampler(proc.pid, seconds, freq, t, o)

    proc = subprocess.Popen([*argv, str(n * 2 * (seconds + 30) + 60)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # past its start-up
        for rnd in range(n):
            order = list(runs)[rnd % len(runs) :] + list(runs)[: rnd % len(runs)]
            if together:  # all sample the same ticks of the same process: the same load for each
                with ThreadPoolExecutor(len(order)) as pool:
                    got = dict(zip(order, pool.map(sample, order), strict=True))
            else:
                got = {who: sample(who) for who in order}
            for who in order:
                r = got[who]
                runs[who].append(r)
                print(
                    f"  round {rnd + 1} {who:>8}: BPF {r['bpf_ns_per_sample'] / 1000:.2f} us/sample "
                    f"(net {r['bpf_ns_per_sample_net'] / 1000:.2f}), reader "
                    f"{r['reader_ns_per_sample'] / 1000:.2f} us/sample, {r['user_frames']:.1f} user frames, "
                    f"{r['samples']} samples",
                    flush=True,
                )
    finally:
        proc.kill()
        proc.wait()
    med = {who: {k: statistics.median(r[k] for r in rs) for k in KEYS} for who, rs in runs.items()}
    ratio = {k: med["now"][k] / med["before"][k] if med["before"][k] else float("nan") for k in KEYS}
    ratios = {
        who: {k: med[who][k] / med["before"][k] if med["before"][k] else float("nan") for k in KEYS}
        for who in med
        if who not in ("now", "before")
    }
    return {"runs": runs, "median": med, "ratio": ratio, "ratio_also": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=ISSUE_23, help="git ref to compare with (default: %(default)s)")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REF",
        help="another git ref sampled in the same rounds (repeatable), its ratio to --before printed too",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument("--workloads", default="frameless,repeated,probe,python")
    ap.add_argument(
        "--together",
        action="store_true",
        help="both versions sample the workload at the same time (each its own perf events and "
        "program): on a loaded host, windows one after the other meet different loads",
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/noregress.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_noregress needs root (BPF)", file=sys.stderr)
        return 2
    stats_fd = enable_bpf_stats()
    if stats_fd < 0:
        print("bpf_enable_stats is unavailable: no BPF run times", file=sys.stderr)
        return 2
    results: dict = {
        "before": args.before,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "together": args.together,
        "also": args.also,
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="bistouri-noregress-") as d:
        tmp = Path(d)
        sides = {"before": baseline_tree(args.before, tmp)}
        for ref in args.also:
            sides[ref] = baseline_tree(ref, tmp)
        argvs = {
            "frameless": lambda: [str(build_frameless(tmp))],
            "repeated": lambda: [str(BURNER)],
            "probe": lambda: [str(build_probe(tmp))],
            "python": lambda: ["/usr/bin/python3.11", "-c", PYTHON_BUSY],
        }
        for name in (w for w in args.workloads.split(",") if w):
            print(name, flush=True)
            results["workloads"][name] = rounds(
                argvs[name](), args.rounds, args.seconds, args.freq, sides, args.together
            )
    os.close(stats_fd)
    results["load_average_1min"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(
        f"\n{'workload':>9} | {'BPF us/sample before':>20} | {'now':>6} | {'ratio':>5} | "
        f"{'net before':>10} | {'now':>6} | {'ratio':>5} | {'reader us/sample before':>23} | {'now':>6} | "
        f"{'ratio':>5} | frames before/now"
    )
    for name, w in results["workloads"].items():
        b, n, r = w["median"]["before"], w["median"]["now"], w["ratio"]
        print(
            f"{name:>9} | {b['bpf_ns_per_sample'] / 1e3:>20.2f} | {n['bpf_ns_per_sample'] / 1e3:>6.2f} | "
            f"{r['bpf_ns_per_sample']:>5.2f} | {b['bpf_ns_per_sample_net'] / 1e3:>10.2f} | "
            f"{n['bpf_ns_per_sample_net'] / 1e3:>6.2f} | {r['bpf_ns_per_sample_net']:>5.2f} | "
            f"{b['reader_ns_per_sample'] / 1e3:>23.2f} | {n['reader_ns_per_sample'] / 1e3:>6.2f} | "
            f"{r['reader_ns_per_sample']:>5.2f} | {b['user_frames']:.1f}/{n['user_frames']:.1f}"
        )
    for name, w in results["workloads"].items():
        for who, r in w["ratio_also"].items():
            m = w["median"][who]
            print(
                f"{name:>9} | {who} / before: BPF {m['bpf_ns_per_sample'] / 1e3:.2f} us/sample "
                f"({r['bpf_ns_per_sample']:.2f}), net {m['bpf_ns_per_sample_net'] / 1e3:.2f} "
                f"({r['bpf_ns_per_sample_net']:.2f}), reader {m['reader_ns_per_sample'] / 1e3:.2f} "
                f"({r['reader_ns_per_sample']:.2f}), frames {m['user_frames']:.1f}"
            )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""record's warm symbolization against the size of its cache: N addresses named from a cache
that holds much more (a long-lived ~/.cache/bistouri), time and memory.

The cache gets two files filled to the bound of one file (`MAX_FRAMES_PER_FILE` entries: a
libc seen under many programs, with the bytes around each leaf, and the kernel's frames),
then a session of about N distinct addresses, all cached (stacks of a leaf and a call site
in each file), is named by `symcache.symbolize` in a fresh process, as
record does after a capture. Measured: the wall time of `symbolize`, the process's peak
RSS while it runs (VmHWM reset before), and the cache's size on disk. No root needed.

    python -m bench.bench_symcache [--addresses 1000] [--entries 200000] [--runs 5]

`--tree DIR` runs another checkout's code (one with the same `symcache` entry points) on
its own cache, to compare formats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBC = bytes.fromhex("aa" * 20)
KERNEL_KEY = "k-bench"

# Run in a fresh interpreter, with the tree under test first on sys.path.
CHILD = r"""
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
mode, cache_dir, n_addr, n_entries = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
from bistouri import wire
from bistouri.record import symcache
from bistouri.symbolizer.model import Frame, KIND_KERNEL
LIBC = bytes.fromhex("aa" * 20)
KERNEL = 0xFFFFFFFF81000000

def libc_frames(a):
    outer = Frame(f"outer_{a // 64}", "libc.so.6", "stdlib/qsort.c", a % 500)
    return (outer, Frame(f"f_{a // 64}", "libc.so.6", "x.c", 7, inlined=True))

def kernel_frames(a):
    return (Frame(f"kfunc_{a // 256}", "vmlinux", kind=KIND_KERNEL),)

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0

if mode == "fill":
    cache = symcache.SymbolCache(cache_dir, max_bytes=1 << 30)
    libc = {(0x20000 + 4 * i, i % 2 == 0): libc_frames(i) for i in range(n_entries)}
    cache.add_frames(LIBC.hex(), libc, True)
    kernel = {(KERNEL + 8 * i, i % 2 == 0): kernel_frames(i) for i in range(n_entries)}
    cache.add_frames("k-bench", kernel, False)
    sys.exit(0)

rng = random.Random(7)
quarter = n_addr // 4  # four addresses a stack
libc_idx = rng.sample(range(n_entries), quarter)
kern_idx = rng.sample(range(n_entries), quarter)
traces = []
for li, ki in zip(libc_idx, kern_idx):
    # Leaf first. Entry i was cached as a leaf when i is even, as a call site when odd.
    user = tuple(
        wire.UserFrame(wire.FRAME_RESOLVED, LIBC, 0x20000 + 4 * i, "libc.so.6") for i in (li - li % 2, li | 1)
    )
    kern = (KERNEL + 8 * (ki - ki % 2), KERNEL + 8 * (ki | 1))
    traces.append(wire.Trace(kernel=kern, user=user, pid=1, tid=1, on_cpu=100))
kernel_info = wire.KernelInfo("6.1", b"\x01" * 20, KERNEL)
session = wire.Session("s", wire.Trigger("cpu"), kernel_info, 0, 1, 1, traces=traces)

def no_resolver(file_lines):
    raise AssertionError("everything should be cached")

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = peak()
t0 = time.perf_counter()
cache = symcache.SymbolCache(cache_dir, max_bytes=1 << 30)
profile, stats = symcache.symbolize(session, cache, no_resolver, "k-bench", [])
took = time.perf_counter() - t0
print(json.dumps({"seconds": took, "peak_rss_mb": peak() / 2**20, "added_rss_mb": (peak() - base) / 2**20,
                  "addresses": stats.addresses, "cached": stats.cached}))
"""


def child(tree: Path, *args: object) -> str:
    argv = [sys.executable, "-c", CHILD, str(tree), *map(str, args)]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addresses", type=int, default=1000, help="distinct addresses in the session")
    ap.add_argument("--entries", type=int, default=200_000, help="entries per cache file")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", action="append", help="checkouts to run (default: this one)")
    args = ap.parse_args()
    for tree in map(Path, args.tree or [str(ROOT)]):
        with tempfile.TemporaryDirectory(prefix="bistouri-bench-symcache-") as tmp:
            child(tree, "fill", tmp, args.addresses, args.entries)
            size = sum(p.stat().st_size for p in Path(tmp).iterdir() if not p.name.startswith("."))
            runs = [
                json.loads(child(tree, "name", tmp, args.addresses, args.entries)) for _ in range(args.runs)
            ]
        assert all(r["cached"] == r["addresses"] for r in runs), runs
        med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "peak_rss_mb", "added_rss_mb")}
        print(
            f"{tree}: {runs[0]['addresses']} addresses from a cache of 2 x {args.entries} entries "
            f"({size / 2**20:.1f} MB on disk): symbolize {med['seconds']:.3f} s "
            f"(min {min(r['seconds'] for r in runs):.3f}), peak RSS {med['peak_rss_mb']:.1f} MB "
            f"(+{med['added_rss_mb']:.1f} MB while naming); medians of {args.runs}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())

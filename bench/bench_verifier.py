"""What the BPF object costs to load: verifier instructions processed per program, and load time.

For each program, the kernel verifier's statistics (`log_level` 4: "processed N insns ...");
then the object's load time (`bpf_object__load`, no log) over a few loads. Every agent start
and every `bistouri record` pays that load.

Run as root: `python -m bench.bench_verifier [OBJECT] [--loads N]` (default: the built object).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bistouri.bpf.handles import BpfObject, library  # noqa: E402

STATS = re.compile(r"processed (\d+) insns.*?total_states (\d+) peak_states (\d+)")
DEFAULT_OBJECT = ROOT / "bistouri/bpf/_bpfobj/bistouri.bpf.o"


def verifier_stats(path: Path) -> dict[str, dict[str, int]]:
    """Per program: instructions processed, total and peak states (log_level 4)."""
    lib = library().lib
    lib.bpf_program__set_log_level.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.bpf_program__set_log_level.restype = ctypes.c_int
    out: dict[str, dict[str, int]] = {}
    with BpfObject(path) as obj:
        for p in obj.programs.values():
            lib.bpf_program__set_log_level(ctypes.cast(p._ptr, ctypes.c_void_p), 4)
        # Not obj.load(): it frees the log buffers once the object is loaded.
        ret = library().bpf_object__load(obj._ptr)
        if ret < 0:
            raise SystemExit(f"load failed: {ret}")
        for p in obj.programs.values():
            m = STATS.search(p.verifier_log)
            if m:
                out[p.name] = {"insns": int(m[1]), "total_states": int(m[2]), "peak_states": int(m[3])}
    return out


def load_times(path: Path, loads: int) -> list[float]:
    times = []
    for _ in range(loads):
        with BpfObject(path) as obj:
            t0 = time.perf_counter()
            obj.load()
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", nargs="?", default=str(DEFAULT_OBJECT))
    ap.add_argument("--loads", type=int, default=5)
    args = ap.parse_args()
    path = Path(args.object)
    for name, s in sorted(verifier_stats(path).items()):
        print(f"{name:>32} {s['insns']:>8} insns {s['total_states']:>6} states (peak {s['peak_states']})")
    times = load_times(path, args.loads)
    print(
        f"load: median {statistics.median(times) * 1000:.0f} ms, "
        f"range {min(times) * 1000:.0f}-{max(times) * 1000:.0f} ms over {len(times)} loads"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the BPF object costs to load: verifier instructions processed per program, and load time.

For each program, the kernel verifier's statistics (`log_level` 4: "processed N insns ...");
then the object's load time (`bpf_object__load`, no log) over a few loads. Every agent start
and every `bistouri record` pays that load. The programs loaded are those the agent chooses on
this kernel (bistouri/bpf/features.py: the full ones, or their bounded or compat twins), so it
runs on every kernel from 5.10 (the molecule kernel scenarios run it in their VMs).

Run as root: `python -m bench.bench_verifier [OBJECT] [--loads N]` (default: the object the
agent loads: the built one in a work tree, the packaged one on a host).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bistouri.bpf import features, loader  # noqa: E402
from bistouri.bpf.handles import BpfObject, library  # noqa: E402

STATS = re.compile(r"processed (\d+) insns.*?total_states (\d+) peak_states (\d+)")


def _choose(obj: BpfObject, kernel: features.KernelFeatures) -> None:
    """Autoload what the agent loads on a kernel with `kernel`: each stack program or one twin."""
    chosen = {features.program_for(n, kernel) for n in obj.programs if not features.is_twin(n)}
    for name, prog in obj.programs.items():
        prog.set_autoload(name in chosen)


def verifier_stats(path: Path, kernel: features.KernelFeatures) -> dict[str, dict[str, int]]:
    """Per program: instructions processed, total and peak states (log_level 4)."""
    lib = library().lib
    lib.bpf_program__set_log_level.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.bpf_program__set_log_level.restype = ctypes.c_int
    out: dict[str, dict[str, int]] = {}
    with BpfObject(path) as obj:
        _choose(obj, kernel)
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


def load_times(path: Path, kernel: features.KernelFeatures, loads: int) -> list[float]:
    times = []
    for _ in range(loads):
        with BpfObject(path) as obj:
            _choose(obj, kernel)
            t0 = time.perf_counter()
            obj.load()
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", nargs="?", default=loader.default_object_path())
    ap.add_argument("--loads", type=int, default=5)
    args = ap.parse_args()
    path = Path(args.object)
    kernel = loader.kernel_features()
    print(f"kernel {os.uname().release}: {kernel.suffix[1:] or 'full'} programs")
    for name, s in sorted(verifier_stats(path, kernel).items()):
        print(f"{name:>32} {s['insns']:>8} insns {s['total_states']:>6} states (peak {s['peak_states']})")
    times = load_times(path, kernel, args.loads)
    print(
        f"load: median {statistics.median(times) * 1000:.0f} ms, "
        f"range {min(times) * 1000:.0f}-{max(times) * 1000:.0f} ms over {len(times)} loads"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPython frames from BPF (issue 21): on each interpreter of the host, the share of on-CPU samples whose
Python frames name the hot function, of a thread that released the GIL naming its own, and the share of
sampled frames on CPython's own line for their instruction offset.

The target is tests/fixtures/workloads/cpython_target.py (`hot_loop` under `driver` on the main thread,
`z_inner` under `z_outer` in `zlib.compress` on another). Not yet here: py-spy side by side, BPF time per
sample, the agent's CPU (docs/python-frames.md, next steps).

Run as root: `python -m bench.bench_python_frames [--seconds S] [--hz HZ]`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bistouri.bpf import abi  # noqa: E402
from bistouri.capture.events import StackSample  # noqa: E402
from bistouri.capture.profiler import Profiler, ProfilerOptions  # noqa: E402
from bistouri.cpython import discover  # noqa: E402
from bistouri.cpython.naming import CodeNamer  # noqa: E402
from testkit.helpers import CPYTHON_TARGET, CPYTHONS, cpython  # noqa: E402

_FRAME = ctypes.sizeof(abi.PyFrame)


def _frames(sample: StackSample) -> list[abi.PyFrame]:
    return [abi.PyFrame.from_buffer_copy(sample.python, i) for i in range(0, len(sample.python), _FRAME)]


def measure(exe: Path, seconds: float, hz: int) -> dict[str, float | int | str]:
    proc = subprocess.Popen(
        [str(exe), str(CPYTHON_TARGET), "hot", "zlib"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        dump = json.loads(proc.stdout.readline())
        interp = discover.describe(proc.pid)
        if isinstance(interp, discover.Unsupported):
            return {"unsupported": f"{interp.reason}: {interp.detail}"}
        samples: list[StackSample] = []
        opts = ProfilerOptions(freq_hz=hz, offcpu=False, unwind_nice=0, unwind_cpu_share=1.0)
        with Profiler(opts) as profiler:
            profiler.start()
            profiler.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                profiler.check_thread()
                samples += [e for e in profiler.take(timeout=0.1) if isinstance(e, StackSample)]
            profiler.close()
            samples += [e for e in profiler.take() if isinstance(e, StackSample)]
        lines = {c["id"]: dict(map(tuple, c["lines"])) for c in dump["codes"]}
        main = [s for s in samples if s.pid == proc.pid and s.tid == proc.pid]
        z = [s for s in samples if s.pid == proc.pid and s.tid == dump["z_tid"]]
        frames = exact = 0
        with CodeNamer(interp) as namer:
            for s in main + z:
                for f in _frames(s):
                    code = f.code & ~abi.PY_FRAME_ENTRY
                    if code in lines:
                        unit = -1 if f.offset == abi.PY_NO_OFFSET else f.offset
                        frames += s.weight
                        exact += s.weight * (namer.name(code, f.checksum).line(unit) == lines[code][unit])

        def share(group: list[StackSample], code: int) -> float:
            total = sum(s.weight for s in group)
            hit = sum(s.weight for s in group if any(f.code & ~1 == code for f in _frames(s)))
            return round(hit / total, 4) if total else 0.0

        return {
            "version": ".".join(map(str, interp.version)),
            "main_samples": sum(s.weight for s in main),
            "hot_share": share(main, dump["hot"]),
            "gil_released_samples": sum(s.weight for s in z),
            "gil_released_share": share(z, dump["z_inner"]),
            "frames_checked": frames,
            "lines_exact": round(exact / frames, 4) if frames else 0.0,
        }
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--hz", type=int, default=99)
    args = ap.parse_args()
    for which in CPYTHONS:
        exe = cpython(which)
        if exe is None:
            print(f"{which:>12}: not installed")
            continue
        print(f"{which:>12}: {json.dumps(measure(exe, args.seconds, args.hz))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

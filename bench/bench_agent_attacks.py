"""Hostile watched processes against the agent's readers: time, CPU and peak RSS per case.

Each case runs in a fresh interpreter (its VmHWM is that case's) over this checkout, or over
another one with `--repo` (e.g. the commit before the hardening). Issue 26's targets: agent RSS
<= 100 MiB, no freeze.

- `eh_frame`: unwind table of a file with 10 MB of crafted `.eh_frame` (a row every 3 bytes);
- `churn`: 10 s of samples of a process with 30 000 executable mappings whose VMA count changes
  at every sample (simulated clock: re-reads as the ring-buffer thread would do them);
- `fifo`: the JIT name of an address whose process has a FIFO as its perf map.

    .venv/bin/python -m bench.bench_agent_attacks [--repo /tmp/old-checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testkit.hostile_cfi import EH_FRAME_ADDR, elf_with_eh_frame, row_bomb  # noqa: E402

CASES = {
    "eh_frame": """
from bistouri.unwind.ehframe import build_table
try:
    out = f"{len(build_table(sys.argv[1])) // 12} rows"
except Exception as e:
    out = f"refused: {getattr(e, 'reason', type(e).__name__)}"
""",
    "churn": """
import ctypes
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
for _ in range(30000):
    libc.mmap(None, 4096, 5, 2, fd, 0)
from bistouri.host.procmaps import ProcMaps
now = [0.0]
maps = ProcMaps(clock=lambda: now[0])
cpu = time.process_time()
maps.track(os.getpid())
for i in range(200):
    now[0] += 0.05
    maps.generation(os.getpid(), 100000 + i)
out = f"{maps.stats.reads} reads in 10 s simulated"
""",
    "fifo": """
import mmap, threading
from bistouri.host.procmaps import ProcMaps
mem = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=7)
path = f"/tmp/perf-{os.getpid()}.map"
os.mkfifo(path)
try:
    maps = ProcMaps()
    maps.track(os.getpid())
    t = threading.Thread(target=lambda: maps.jit_name(os.getpid(), 0x1000), daemon=True)
    t.start()
    t.join(10)
    out = "froze (still blocked after 10 s)" if t.is_alive() else "unnamed, at once"
finally:
    os.unlink(path)
""",
}

PRELUDE = "import os, sys, time\nstart, cpu = time.monotonic(), time.process_time()\n"
REPORT = """
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"result": out, "wall_s": round(time.monotonic() - start, 2),
                  "cpu_s": round(time.process_time() - cpu, 2), "peak_rss_mib": hwm >> 10}))
os._exit(0)
"""


def run(repo: Path, case: str, arg: str) -> dict:
    # -S and cwd: no editable install nor the current directory shadows `repo` (stdlib only).
    code = PRELUDE + "import json\n" + CASES[case] + REPORT
    env = {**os.environ, "PYTHONPATH": str(repo)}
    try:
        p = subprocess.run(
            [sys.executable, "-S", "-c", code, arg],
            capture_output=True,
            text=True,
            env=env,
            cwd=repo,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return {"result": "no answer in 120 s"}
    if p.returncode:
        return {"result": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout whose bistouri/ is measured")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bomb = Path(tmp) / "bomb.so"
        bomb.write_bytes(elf_with_eh_frame(row_bomb(10 << 20, address=EH_FRAME_ADDR)))
        page = Path(tmp) / "page"
        page.write_bytes(b"\xc3" * 4096)
        results = {
            "eh_frame": run(args.repo, "eh_frame", str(bomb)),
            "churn": run(args.repo, "churn", str(page)),
            "fifo": run(args.repo, "fifo", ""),
        }
    for case, r in results.items():
        print(f"{case:9} {r}")
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "agent_attacks.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

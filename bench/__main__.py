"""`make bench`: run every benchmark of bench/ in turn (each writes bench/results/*.json)."""

from __future__ import annotations

import subprocess
import sys

BENCHES = (
    "bench.bench_agent",
    "bench.bench_agent_raw",
    "bench.bench_sampling",
    "bench.bench_unwind_tables",
    "bench.bench_symbolize",
    "bench.bench_symcache",
    "bench.bench_warm_dwarf",
    "bench.bench_ingest",
    "bench.bench_fleet",
    "bench.bench_upload",
    "bench.bench_attacks",
    "bench.bench_agent_attacks",
    "bench.bench_service_limits",
    "bench.bench_record",
    "bench.bench_record_stacks",
    "bench.bench_episode",
    "bench.bench_recorder_designs",
    "bench.bench_verifier",
    "bench.bench_python_frames",
    "bench.bench_export",
    "bench.bench_noregress",
)


def main() -> int:
    failed = []
    for mod in BENCHES:
        print(f"== {mod}", flush=True)
        if subprocess.run([sys.executable, "-m", mod, *sys.argv[1:]]).returncode:
            failed.append(mod)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Unwind table build cost: CPU seconds and bytes per file, for the files the issue names.

For each file: CPU time of `ehframe.build_table` (process CPU, one run), rows, bytes of the
table (what the disk cache and the BPF array hold), and the file's size. Run:
`python -m bench.bench_unwind_tables [FILE...]`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bistouri.unwind.ehframe import ROW, build_table  # noqa: E402

DEFAULT = [
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0",
    "/usr/bin/python3.11",
    "/usr/lib/postgresql/15/bin/postgres",
    os.path.realpath(shutil.which("node") or "/usr/bin/node"),
]


def main() -> int:
    files = [a for a in sys.argv[1:] if a.startswith("/")] or DEFAULT  # make bench passes other flags
    out = []
    print(f"{'file':>48} {'CPU s':>7} {'rows':>9} {'table MB':>9} {'file MB':>8}")
    for path in files:
        if not os.path.exists(path):
            print(f"{path:>48} missing")
            continue
        cpu = time.process_time()
        table = build_table(path)
        used = time.process_time() - cpu
        r = {"file": path, "cpu_s": used, "rows": len(table) // ROW.size, "bytes": len(table)}
        r["file_bytes"] = os.path.getsize(path)
        out.append(r)
        mb, file_mb = len(table) / 1e6, r["file_bytes"] / 1e6
        print(f"{path:>48} {used:>7.2f} {r['rows']:>9} {mb:>9.2f} {file_mb:>8.1f}")
    dest = ROOT / "bench/results/unwind_tables.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

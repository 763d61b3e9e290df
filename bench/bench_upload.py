"""Upload on demand of a large binary: from a stored session to named frames, and the symbolizer's RSS.

Starts `bistouri symbolizer` with no sources (real gunicorn, SQLite in a temp dir), builds a
program with `.symtab` padded to --mib MiB by a non-loaded section of real library bytes (as
compressible as real code), runs it, and lets a real exporter (ProcMaps reading the running
program) send one session. Reports the seconds until the stored session's frames are named
(issue 11 target: <= 30 s for 100 MB over loopback), the bytes uploaded against the file's
gzip -6 size, and the peak RSS of the symbolizer's processes while it received the file.

    .venv/bin/python -m bench.bench_upload --mib 100
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testkit.symbolizer import SymbolizerURL, clean_env, free_port, stop, symbolizer_command, wait_healthy  # noqa: E402
from testkit.uploads import Agent, build, names, session  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
TARGET_S = 30.0


def padding(size: int) -> bytes:
    """`size` bytes of the machine's own shared libraries: realistic compression."""
    out = bytearray()
    for root in ("/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/bin"):
        for dirpath, _, files in os.walk(root):
            for f in sorted(files):
                p = os.path.join(dirpath, f)
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                try:
                    with open(p, "rb") as fh:
                        out += fh.read(size - len(out))
                except OSError:
                    continue
                if len(out) >= size:
                    return bytes(out)
    return bytes(out) + os.urandom(size - len(out))


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def tree(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += tree(int(child))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=100, help="size of the uploaded binary (default 100)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp:
        d = Path(tmp)
        prog = build(d, "bench-upload", "symtab")
        blob = d / "blob"
        blob.write_bytes(padding(args.mib << 20))
        subprocess.run(["objcopy", "--add-section", f".bench_blob={blob}", str(prog.path)], check=True)
        blob.unlink()
        size = prog.path.stat().st_size
        gzip_size = len(gzip.compress(prog.path.read_bytes(), 6))
        port = free_port()
        url = SymbolizerURL(f"http://127.0.0.1:{port}")
        cmd = symbolizer_command(
            listen_addr=f"127.0.0.1:{port}", state_dir=d / "state", workers=args.workers, log_level="warning"
        )
        with open(d / "symbolizer.log", "ab") as log:
            url.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=clean_env())
        url.state_dir, url.log_path, url.token = d / "state", d / "symbolizer.log", None
        program = subprocess.Popen([str(prog.path)])
        agent = None
        try:
            wait_healthy(url)
            while str(prog.path) not in Path(f"/proc/{program.pid}/maps").read_text():
                time.sleep(0.01)
            pids = tree(url.proc.pid)
            idle_rss = rss_bytes(pids)
            peak = [idle_rss]
            done = threading.Event()

            def watch() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_bytes(pids))
                    done.wait(0.05)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            agent = Agent(d, url, "bench", program.pid)
            t0 = time.monotonic()
            agent.send(session("bench-1", prog))
            while "upload_leaf" not in names(url, "bench-1"):
                if time.monotonic() - t0 > 300:
                    print((d / "symbolizer.log").read_text()[-3000:], file=sys.stderr)
                    raise SystemExit("no names after 300 s")
                time.sleep(0.1)
            elapsed = time.monotonic() - t0
            done.set()
            watcher.join()
            sent = agent.metric("bistouri_upload_bytes_total")
        finally:
            if agent is not None:
                agent.stop()
            program.kill()
            program.wait()
            stop(url)
    result = {
        "binary_bytes": size,
        "gzip6_bytes": gzip_size,
        "uploaded_bytes": int(sent),
        "seconds_to_named_frames": round(elapsed, 2),
        "target_seconds": TARGET_S,
        "symbolizer_rss_idle_bytes": idle_rss,
        "symbolizer_rss_peak_bytes": peak[0],
        "workers": args.workers,
    }
    print(json.dumps(result, indent=2))
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / time.strftime("bench_upload-%Y%m%dT%H%M%S.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    ok = elapsed <= TARGET_S and sent <= gzip_size * 1.01
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

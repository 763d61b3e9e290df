"""The symbolizer under slow clients and heavy requests (issue 14 targets).

Starts `bistouri symbolizer` with one worker (real gunicorn, real resolver, SQLite in
a temp dir) and measures:

- `/healthz` latency while N connections send their request headers slowly
  (target: < 100 ms with 50);
- one request of F distinct frames in stacks of D frames: wall time and the worker's
  peak RSS (targets: <= 2 s and <= 300 MB; a session over the per-request bounds is
  refused with 413, which is what 1 000 000 frames must get).

    .venv/bin/python -m bench.bench_service_limits --slow-clients 50 --frames 1000000 50000
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bistouri import wire  # noqa: E402
from testkit.symbolizer import clean_env, free_port, symbolizer_command  # noqa: E402


def start(tmp: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = symbolizer_command(listen_addr=f"127.0.0.1:{port}", state_dir=tmp / "state", workers=1)
    with open(tmp / "symbolizer.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/healthz", timeout=1).ok:
                return proc, url, port
        except requests.RequestException:
            time.sleep(0.1)
    raise RuntimeError("symbolizer did not start: " + (tmp / "symbolizer.log").read_text()[-2000:])


def worker_peak_rss_mb(master: int) -> float:
    worker = int(Path(f"/proc/{master}/task/{master}/children").read_text().split()[0])
    for line in Path(f"/proc/{worker}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def healthz_with_slow_clients(port: int, url: str, n: int, calls: int = 9) -> list[float]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    for s in socks:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    took = []
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            try:
                requests.get(url + "/healthz", timeout=5)
                took.append((time.perf_counter() - t0) * 1000)
            except requests.RequestException:
                took.append(float("inf"))
    finally:
        for s in socks:
            s.close()
    return took


def session_map(frames: int, depth: int) -> dict[str, Any]:
    small = wire.Session(
        session_id=f"bench-{frames}",
        trigger=wire.Trigger("cpu"),
        kernel=wire.KernelInfo(),
        start_ns=time.time_ns(),
        duration_ns=10**9,
        period_ns=10**7,
        traces=[wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, b"\xaa" * 20, 16),), 1, 1, on_cpu=1)],
    )
    m = wire.session_to_wire(small)
    m["uframes"] = [[wire.FRAME_RESOLVED, 0, 0x1000 + 16 * i] for i in range(frames)]
    m["stacks"] = [[[], list(range(i, min(i + depth, frames)))] for i in range(0, frames, depth)]
    m["traces"] = [[i, 0, 1, 0, 0] for i in range(len(m["stacks"]))]
    m["total"] = len(m["traces"])
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slow-clients", type=int, default=50)
    ap.add_argument("--frames", type=int, nargs="*", default=[1_000_000, 50_000])
    ap.add_argument("--depth", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bistouri-bench-") as tmp:
        proc, url, port = start(Path(tmp))
        try:
            took = healthz_with_slow_clients(port, url, args.slow_clients)
            print(
                f"healthz with {args.slow_clients} slow clients: median {statistics.median(took):.1f} ms, "
                f"max {max(took):.1f} ms, all {[round(t, 1) for t in took]}"
            )
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        for frames in args.frames:
            proc, url, port = start(Path(tmp) / str(frames))
            try:
                m = session_map(frames, args.depth)
                body = gzip.compress(
                    msgpack.packb({"v": wire.VERSION, "sessions": [m]}, use_bin_type=True), 1
                )
                t0 = time.perf_counter()
                r = requests.post(
                    url + "/v1/sessions",
                    data=body,
                    headers={"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"},
                    timeout=600,
                )
                took_s = time.perf_counter() - t0
                print(
                    f"{frames} distinct frames: HTTP {r.status_code} in {took_s:.2f} s, "
                    f"worker peak RSS {worker_peak_rss_mb(proc.pid):.0f} MB"
                )
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())

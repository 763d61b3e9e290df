"""Ingest throughput of the symbolizer service: sessions and frames per second over HTTP.

Starts `bistouri symbolizer` (real gunicorn, real resolver, SQLite in a temp
dir), builds a small C binary for user frames, uploads a kallsyms snapshot, then
posts batches of synthetic sessions from client threads and reports wall time,
throughput and the service's CPU time.

    .venv/bin/python bench/bench_ingest.py --sessions 2000 --traces 50 --workers 2 --clients 4
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bistouri import wire  # noqa: E402
from testkit.symbolizer import (  # noqa: E402
    DEMO_C,
    KALLSYMS,
    KERNEL_BUILD_ID,
    KERNEL_IPS,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    symbolizer_command,
    wait_healthy,
)


def build_binary(d: Path, existing: str | None) -> tuple[Path, bytes, list[int]]:
    """The demo binary built here, or a copy of an existing ELF file, and offsets in its code."""
    import shutil

    from bistouri.elf import ElfFile

    (d / "bin").mkdir()
    out = d / "bin" / "bench-demo"
    if existing:
        shutil.copy(existing, out)
    else:
        src = d / "demo.c"
        src.write_text(DEMO_C)
        subprocess.run(["gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-o", str(out), str(src)], check=True)
    with ElfFile(out) as elf:
        bid = elf.build_id
        assert bid
        text = next(s for s in elf.segments if s.flags & 1)
        # Spread over the code segment: many distinct addresses, as a real profile has.
        offsets = list(range(text.offset, text.offset + text.filesz, max(4, text.filesz // 200_000)))
    return out, bid, offsets


def make_sessions(n: int, traces: int, depth: int, bid: bytes, offsets: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    kips = list(KERNEL_IPS.values())
    out = []
    for i in range(n):
        ts = []
        for j in range(traces):
            user = tuple(wire.UserFrame(0, bid, rng.choice(offsets)) for _ in range(depth))
            kernel = tuple(rng.choice(kips) for _ in range(rng.randint(0, 4)))
            ts.append(
                wire.Trace(
                    kernel, user, 100, 100 + j % 8, on_cpu=rng.randint(1, 50), off_cpu=rng.randint(0, 3)
                )
            )
        s = wire.Session(
            session_id=f"bench-{seed}-{i}",
            trigger=wire.Trigger("cpu"),
            kernel=wire.KernelInfo("6.18", KERNEL_BUILD_ID, 0xFFFFFFFF81000000),
            start_ns=time.time_ns() - i,
            duration_ns=10**10,
            period_ns=52_631_578,
            service="bench",
            host=f"h{i % 10}",
            processes={100: "bench-demo"},
            traces=ts,
        )
        out.append(wire.encode_session(s))
    return out


def cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its reaped and live children (gunicorn workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / tick
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--traces", type=int, default=50, help="distinct stacks per session")
    ap.add_argument("--depth", type=int, default=12, help="user frames per stack")
    ap.add_argument("--batch", type=int, default=20, help="sessions per request")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--binary", help="an ELF file to take user addresses from (default: a tiny C demo)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bistouri-bench-") as tmp:
        d = Path(tmp)
        binary, bid, offsets = build_binary(d, args.binary)
        print(f"binary {binary.name}: {len(offsets)} candidate addresses")
        encoded = make_sessions(args.sessions, args.traces, args.depth, bid, offsets, seed=1)
        frames = args.sessions * args.traces * args.depth
        batches = [encoded[i : i + args.batch] for i in range(0, len(encoded), args.batch)]
        bodies = [gzip.compress(wire.encode_batch(b)) for b in batches]
        print(
            f"{args.sessions} sessions, {frames} user frames, {len(bodies)} requests, "
            f"{sum(map(len, bodies)) / 1e6:.1f} MB compressed"
        )

        port = free_port()
        cmd = symbolizer_command(
            listen_addr=f"127.0.0.1:{port}",
            state_dir=d / "state",
            workers=args.workers,
            binary_dir=binary.parent,
            log_level="warning",
        )
        log = open(d / "service.log", "wb")  # noqa: SIM115 - kept open for the service's lifetime
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
        )
        url = SymbolizerURL(f"http://127.0.0.1:{port}")
        url.proc, url.log_path = proc, d / "service.log"
        try:
            wait_healthy(url)
            r = requests.put(
                f"{url}/v1/kernels/{KERNEL_BUILD_ID.hex()}", data=gzip.compress(KALLSYMS), timeout=60
            )
            assert r.status_code == 204, r.text
            headers = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
            todo = list(enumerate(bodies))
            lock = threading.Lock()
            accepted = [0]

            def client() -> None:
                http = requests.Session()
                while True:
                    with lock:
                        if not todo:
                            return
                        _, body = todo.pop()
                    resp = http.post(url + "/v1/sessions", data=body, headers=headers, timeout=300)
                    resp.raise_for_status()
                    with lock:
                        accepted[0] += len(resp.json()["accepted"])

            cpu0 = cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            assert accepted[0] == args.sessions, accepted
            print(f"workers={args.workers} clients={args.clients} batch={args.batch}")
            rate = f"{args.sessions / wall:.0f} sessions/s, {frames / wall / 1000:.0f} k frames/s"
            print(f"wall {wall:.2f} s: {rate}")
            print(
                f"service CPU {cpu:.2f} s: {cpu / args.sessions * 1000:.2f} ms per session, "
                f"{cpu / frames * 1e6:.2f} us per frame"
            )
            t1 = time.perf_counter()
            requests.get(
                url + "/v1/profile/pprof", params={"service": "bench"}, timeout=300
            ).raise_for_status()
            print(f"merged pprof of the newest 500 sessions: {time.perf_counter() - t1:.2f} s")
        finally:
            stop(url)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Forwarding cost and backlog drain of the symbolizer (issue 24 targets).

1. Export CPU per session against ingest CPU per session: the same sessions posted to a service
   without endpoints, then to a fresh one sending OTLP and Pyroscope to a local endpoint (kept in
   this process: its CPU is not the service's); the difference of the service's CPU per session is
   what forwarding costs. Target: at most 10 % of ingest.
2. Backlog drain: a service ingests `--backlog` sessions while its endpoint answers 503, is stopped,
   and started again with the endpoint up; from the first session accepted to the last, sessions per
   second and per CPU-second of the service. Target: at least 200 sessions/s per core.

    .venv/bin/python -m bench.bench_export --sessions 1000 --backlog 10000
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_ingest import build_binary, cpu_seconds, make_sessions  # noqa: E402
from bistouri import wire  # noqa: E402
from testkit.sink import Sink  # noqa: E402
from testkit.symbolizer import (  # noqa: E402
    KALLSYMS,
    KERNEL_BUILD_ID,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    symbolizer_command,
    wait_healthy,
)

RESULTS = REPO / "bench" / "results"


def start(d: Path, name: str, binary_dir: Path, **flags: Any) -> SymbolizerURL:
    port = free_port()
    cmd = symbolizer_command(
        listen_addr=f"127.0.0.1:{port}", binary_dir=binary_dir, log_level="warning", **flags
    )
    log = d / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
        )
    url = SymbolizerURL(f"http://127.0.0.1:{port}")
    url.proc, url.log_path = proc, log
    wait_healthy(url)
    return url


def post_all(url: str, bodies: list[bytes], clients: int) -> None:
    headers = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
    r = requests.put(f"{url}/v1/kernels/{KERNEL_BUILD_ID.hex()}", data=gzip.compress(KALLSYMS), timeout=60)
    assert r.status_code in (200, 204), r.text
    todo = list(bodies)
    lock = threading.Lock()

    def client() -> None:
        http = requests.Session()
        while True:
            with lock:
                if not todo:
                    return
                body = todo.pop()
            http.post(url + "/v1/sessions", data=body, headers=headers, timeout=300).raise_for_status()

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_sent(sink: Sink, n: int, timeout_s: float) -> None:
    sink.wait_for(lambda s: len(s.accepted()) >= n, timeout_s, f"{n} sessions at the endpoint")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000, help="sessions of the CPU comparison")
    ap.add_argument("--backlog", type=int, default=10_000, help="sessions of the drain")
    ap.add_argument("--traces", type=int, default=50, help="distinct stacks per session")
    ap.add_argument("--depth", type=int, default=12, help="user frames per stack")
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--workers", type=int, default=1, help="worker processes (1: per-core figures)")
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    result: dict[str, Any] = {"args": vars(args)}

    with tempfile.TemporaryDirectory(prefix="bistouri-bench-export-") as tmp, Sink() as sink:
        d = Path(tmp)
        binary, bid, offsets = build_binary(d, None)

        def bodies(n: int, seed: int) -> list[bytes]:
            enc = make_sessions(n, args.traces, args.depth, bid, offsets, seed=seed)
            return [
                gzip.compress(wire.encode_batch(enc[i : i + args.batch])) for i in range(0, n, args.batch)
            ]

        # 1. CPU per session, without and with forwarding (OTLP and Pyroscope: two sends a session).
        cpu = {}
        for name, flags in (
            ("ingest", {}),
            (
                "ingest+export",
                {"otlp_endpoint": sink.url + "/v1development/profiles", "pyroscope_url": sink.url},
            ),
        ):
            url = start(d, name, binary.parent, state_dir=d / name, workers=args.workers, **flags)
            try:
                work = bodies(args.sessions, seed=len(cpu) + 1)
                c0 = cpu_seconds(url.proc.pid)
                post_all(url, work, args.clients)
                if flags:
                    wait_sent(sink, 2 * args.sessions, 600)
                    time.sleep(1.5)  # an idle sender's poll, as the ingest-only service idles too
                else:
                    time.sleep(1.5)
                cpu[name] = (cpu_seconds(url.proc.pid) - c0) / args.sessions
            finally:
                stop(url)
        export_ms = (cpu["ingest+export"] - cpu["ingest"]) * 1000
        ingest_ms = cpu["ingest"] * 1000
        otlp_bytes = [len(r.body) for r in sink.accepted("/v1development")]
        print(f"ingest CPU per session: {ingest_ms:.2f} ms")
        share = 100 * export_ms / ingest_ms
        print(
            f"export CPU per session (OTLP + Pyroscope): {export_ms:.2f} ms = {share:.1f} % of ingest "
            f"(target <= 10 %); OTLP payload {sum(otlp_bytes) / len(otlp_bytes) / 1024:.1f} KiB"
        )
        result.update(ingest_cpu_ms=ingest_ms, export_cpu_ms=export_ms, export_share=export_ms / ingest_ms)

        # 2. Backlog drain: queued while the endpoint is down, sent after a restart with it up.
        sink.received.clear()
        sink.status = 503
        otlp_only = {"otlp_endpoint": sink.url + "/v1development/profiles"}
        state = d / "drain"
        url = start(d, "drain", binary.parent, state_dir=state, workers=args.workers, **otlp_only)
        try:
            t0 = time.perf_counter()
            post_all(url, bodies(args.backlog, seed=9), args.clients)
            print(f"backlog of {args.backlog} ingested in {time.perf_counter() - t0:.1f} s, endpoint down")
        finally:
            stop(url)
        sink.received.clear()
        sink.status = 200
        url = start(d, "drain", binary.parent, state_dir=state, workers=args.workers, **otlp_only)
        try:
            sink.wait_for(lambda s: bool(s.accepted()), 120, "the first session")
            c0, t0 = cpu_seconds(url.proc.pid), time.perf_counter()
            wait_sent(sink, args.backlog, 1800)
            wall, used = time.perf_counter() - t0, cpu_seconds(url.proc.pid) - c0
        finally:
            stop(url)
        got = len({r.body for r in sink.accepted()})
        rate, per_core = args.backlog / wall, args.backlog / used
        print(
            f"drain: {args.backlog} sessions in {wall:.1f} s = {rate:.0f} sessions/s, "
            f"{per_core:.0f} per CPU-second of the service (target >= 200 per core); distinct payloads {got}"
        )
        result.update(drain_rate=rate, drain_per_cpu_second=per_core, drain_distinct=got)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hostile inputs against a real symbolizer: request wall time and the worker's peak RSS, per attack.

Each attack gets a fresh `bistouri symbolizer` (one gunicorn worker, SQLite in a temp dir), so that the
worker's VmHWM is that attack's. `--repo` runs the service from another checkout (e.g. the commit before
the hardening) with the same attacks. The issue's targets: peak RSS <= 300 MB, <= 2 s per request.

    .venv/bin/python -m bench.bench_attacks [--repo /tmp/old-checkout] [--rust-levels 21 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bistouri import wire  # noqa: E402
from tests.hostile import (  # noqa: E402
    deep_session,
    gunicorn_workers,
    kallsyms_bomb,
    msgpack_budget_filler,
    msgpack_empty_arrays_bomb,
    peak_rss_bytes,
    rust_v0_bomb,
)
from tests.integration.conftest import (  # noqa: E402
    KALLSYMS,
    KERNEL_BUILD_ID,
    KERNEL_IPS,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    wait_healthy,
)

HEADERS = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
KERNEL_STACK = (KERNEL_IPS["io_schedule"], KERNEL_IPS["ksys_read"], KERNEL_IPS["entry_SYSCALL_64"])


def start(repo: Path, tmp: Path) -> SymbolizerURL:
    port = free_port()
    cmd = [sys.executable, "-m", "bistouri", "symbolizer", "--listen-addr", f"127.0.0.1:{port}"]
    cmd += ["--state-dir", str(tmp / f"state-{port}"), "--workers", "1", "--log-level", "warning"]
    env = clean_env()
    env["PYTHONPATH"] = str(repo)
    log_path = tmp / f"symbolizer-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repo, env=env, start_new_session=True
        )
    url = SymbolizerURL(f"http://127.0.0.1:{port}")
    url.proc, url.state_dir, url.log_path, url.token = proc, tmp, log_path, None
    wait_healthy(url)
    return url


def post(url: str, body: bytes) -> requests.Response:
    return requests.post(url + "/v1/sessions", data=body, headers=HEADERS, timeout=300)


def put_kallsyms(url: str, body: bytes) -> requests.Response:
    return requests.put(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), data=body, timeout=300)


def batch(*sessions: Any) -> bytes:
    return gzip.compress(wire.encode_batch(wire.encode_session(s) for s in sessions))


def attack_msgpack_bomb(url: str) -> list[tuple[str, int, float]]:
    t = time.perf_counter()
    r = post(url, msgpack_empty_arrays_bomb())
    return [("POST 16 M empty arrays", r.status_code, time.perf_counter() - t)]


def attack_budget_filler(url: str) -> list[tuple[str, int, float]]:
    t = time.perf_counter()
    r = post(url, msgpack_budget_filler(wire.MAX_BATCH_OBJECTS))
    return [("POST 3 M values, just under the budget", r.status_code, time.perf_counter() - t)]


def attack_deep_stack(url: str) -> list[tuple[str, int, float]]:
    put_kallsyms(url, gzip.compress(KALLSYMS))
    kernel = KERNEL_STACK * 166 + KERNEL_STACK[:2]
    out = []
    t = time.perf_counter()
    r = post(url, batch(deep_session("deep-a", 1000, kernel), deep_session("deep-b", 1000, kernel, leaf=1)))
    out.append(("POST 2 x 1500 frames", r.status_code, time.perf_counter() - t))
    for path in (
        "/v1/sessions/deep-a/flamegraph",
        "/v1/profile/flamegraph?service=deep",
        "/v1/diff/flamegraph?a=deep-a&b=deep-b",
    ):
        t = time.perf_counter()
        r = requests.get(url + path, timeout=300)
        out.append(("GET " + path.split("?")[0], r.status_code, time.perf_counter() - t))
    return out


def attack_rust_symbol(levels: int) -> Callable[[str], list[tuple[str, int, float]]]:
    def run(url: str) -> list[tuple[str, int, float]]:
        bomb = rust_v0_bomb(levels)
        snapshot = KALLSYMS + b"ffffffff81005000 T " + bomb.encode() + b"\n"
        t = time.perf_counter()
        r = put_kallsyms(url, gzip.compress(snapshot))
        out = [(f"PUT kallsyms with a {len(bomb)}-char v0 symbol", r.status_code, time.perf_counter() - t)]
        t = time.perf_counter()
        try:
            r = post(url, batch(deep_session("rust", 1, (0xFFFFFFFF81005010, *KERNEL_STACK))))
            status = r.status_code
        except requests.RequestException:
            status = 0
        out.append(("POST a session with that symbol", status, time.perf_counter() - t))
        return out

    return run


def attack_kallsyms_bomb(url: str) -> list[tuple[str, int, float]]:
    body = kallsyms_bomb(16)
    t = time.perf_counter()
    r = put_kallsyms(url, body)
    return [(f"PUT 16 MiB kallsyms ({len(body) >> 10} KiB gzip)", r.status_code, time.perf_counter() - t)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose service is attacked")
    p.add_argument(
        "--rust-levels", type=int, nargs="*", default=[21, 25], help="v0 bomb levels (21: 206 chars)"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench/results/attacks.json", help="results as JSON")
    args = p.parse_args()
    attacks: list[tuple[str, Callable[[str], list[tuple[str, int, float]]]]] = [
        ("msgpack bomb", attack_msgpack_bomb),
        ("value budget", attack_budget_filler),
        ("deep stacks", attack_deep_stack),
        ("kallsyms bomb", attack_kallsyms_bomb),
    ]
    attacks += [(f"rust v0 bomb x{n}", attack_rust_symbol(n)) for n in args.rust_levels]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as tmp:
        for name, attack in attacks:
            url = start(args.repo, Path(tmp))
            try:
                steps = attack(url)
                workers = gunicorn_workers(url.proc.pid)
                peak = max((peak_rss_bytes(w) for w in workers), default=0)
            finally:
                stop(url)
            for what, status, seconds in steps:
                print(f"{name:18} {what:48} HTTP {status:3}  {seconds:7.2f} s")
            print(f"{name:18} {'worker peak RSS (VmHWM)':48} {peak / 1e6:8.0f} MB", flush=True)
            results.append({"attack": name, "steps": steps, "peak_rss_bytes": peak})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())

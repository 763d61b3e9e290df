"""Hostile inputs against a real symbolizer: request wall time and the worker's peak RSS, per attack.

Each attack gets a fresh `bistouri symbolizer` (one gunicorn worker, SQLite in a temp dir), so that the
worker's VmHWM is that attack's. `--repo` runs the service from another checkout (e.g. the commit before
the hardening) with the same attacks. The issue's targets: peak RSS <= 400 MiB, <= 2 s per request.

    .venv/bin/python -m bench.bench_attacks [--repo /tmp/old-checkout] [--rust-levels 21 25] [--only NAME…]
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
from testkit.hostile import (  # noqa: E402
    FleetKernel,
    deep_session,
    elf_debugdata_bomb,
    elf_note_bomb,
    gunicorn_workers,
    kallsyms_bomb,
    msgpack_budget_filler,
    msgpack_empty_arrays_bomb,
    peak_rss_bytes,
    rust_v0_bomb,
)
from testkit.symbolizer import (  # noqa: E402
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


def _upload(url: str, build_id: bytes, data: bytes) -> requests.Response:
    path = f"{url}/v1/uploads/{build_id.hex()}/executable?claimant=bench"  # the PUT needs the claim
    requests.post(path, timeout=30)
    body = gzip.compress(data, 9)
    return requests.put(path, data=body, headers={"Content-Encoding": "gzip"}, timeout=600)


def attack_note_bomb(url: str) -> list[tuple[str, int, float]]:
    """Issue 26 N1: 20 000 note section headers over one 32 KiB area."""
    t = time.perf_counter()
    r = _upload(url, bytes.fromhex("ab" * 20), elf_note_bomb(20_000, 32 << 10))
    return [("PUT an ELF of 20 000 overlapping note areas", r.status_code, time.perf_counter() - t)]


def attack_debugdata_bomb(url: str) -> list[tuple[str, int, float]]:
    """Issue 26 N2: 8 M symbols in .gnu_debugdata, then a session with a frame in that file."""
    bid = bytes.fromhex("cd" * 20)
    t = time.perf_counter()
    r = _upload(url, bid, elf_debugdata_bomb(8_000_000, bid))
    out = [("PUT an ELF with 8 M MiniDebugInfo symbols", r.status_code, time.perf_counter() - t)]
    s = deep_session("mini", 0, ())
    s.traces = [wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, bid, 0x1008),), 7, 7, on_cpu=5)]
    t = time.perf_counter()
    try:
        status = post(url, batch(s)).status_code
    except requests.RequestException:
        status = 0  # the worker died
    out.append(("POST a session naming a frame in it", status, time.perf_counter() - t))
    return out


def attack_kernel_boots(url: str) -> list[tuple[str, int, float]]:
    """Issue 26 N8: 40 boots (KASLR slides) of this machine's kernel, a session with kernel frames each."""
    kernel = FleetKernel()
    bid, probe = kernel.BUILD_ID, kernel.offset("schedule") + 4
    worst = [0.0, 0.0]
    status = 0
    for host in range(40):
        slide, boot = kernel.boot(host)
        body = kernel.snapshot(slide)
        t = time.perf_counter()
        requests.put(f"{url}/v1/kernels/{bid.hex()}?boot={boot.hex()}", data=body, timeout=300)
        worst[0] = max(worst[0], time.perf_counter() - t)
        s = deep_session(f"boot-{host}", 0, (kernel.text + slide + probe,))
        s.kernel = wire.KernelInfo("6.18", bid, kernel.text + slide, boot)
        t = time.perf_counter()
        try:
            status = post(url, batch(s)).status_code
        except requests.RequestException:
            status = 0
        worst[1] = max(worst[1], time.perf_counter() - t)
    return [
        ("PUT 40 boots' kallsyms (slowest)", 204, worst[0]),
        ("POST a session per boot (slowest)", status, worst[1]),
    ]


def attack_large_merge(url: str) -> list[tuple[str, int, float]]:
    """Issue 26 N7: a merged flamegraph over 11 sessions at the ingest bounds (~5 M frames in stacks)."""
    for i in range(11):
        pool = [
            wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x5555_0000_0000 + (i * 50_000 + f) * 16)
            for f in range(50_000)
        ]
        s = deep_session(f"big-{i}", 0, ())
        s.traces = [
            wire.Trace((), tuple(pool[(j * 45 + d) % 50_000] for d in range(45)), 7, 7, on_cpu=1)
            for j in range(10_000)
        ]
        post(url, batch(s))
    t = time.perf_counter()
    try:
        status = requests.get(url + "/v1/profile/flamegraph?service=deep", timeout=600).status_code
    except requests.RequestException:
        status = 0
    return [("GET a merged flamegraph of 11 large sessions", status, time.perf_counter() - t)]


def attack_list_episodes(url: str) -> list[tuple[str, int, float]]:
    """Issue 26 N7: the session list over 100 sessions of 256 episode rows of ~4 KB."""
    rows = tuple(
        wire.Aggressor(cgroup="/big.slice/" + "x" * 3900 + str(i)) for i in range(wire.MAX_AGGRESSORS)
    )
    for i in range(100):
        s = deep_session(f"ep-{i}", 0, ())
        s.episode = wire.Episode(aggressors=rows)
        post(url, batch(s))
    t = time.perf_counter()
    status = requests.get(url + "/v1/sessions?limit=1000", timeout=600).status_code
    return [("GET /v1/sessions?limit=1000", status, time.perf_counter() - t)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose service is attacked")
    p.add_argument(
        "--rust-levels", type=int, nargs="*", default=[21, 25], help="v0 bomb levels (21: 206 chars)"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench/results/attacks.json", help="results as JSON")
    p.add_argument("--only", nargs="*", default=[], help="attacks to run (by name), all by default")
    args = p.parse_args()
    attacks: list[tuple[str, Callable[[str], list[tuple[str, int, float]]]]] = [
        ("msgpack bomb", attack_msgpack_bomb),
        ("value budget", attack_budget_filler),
        ("deep stacks", attack_deep_stack),
        ("kallsyms bomb", attack_kallsyms_bomb),
    ]
    attacks += [(f"rust v0 bomb x{n}", attack_rust_symbol(n)) for n in args.rust_levels]
    attacks += [
        ("elf note bomb", attack_note_bomb),
        ("debugdata bomb", attack_debugdata_bomb),
        ("kernel boots", attack_kernel_boots),
        ("large merge", attack_large_merge),
        ("large episodes", attack_list_episodes),
    ]
    if args.only:
        attacks = [a for a in attacks if a[0] in args.only]
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

"""Attack suite over real HTTP: hostile bodies against `bistouri symbolizer` running as a real process.

One gunicorn worker, so that every request lands in the process whose peak RSS (VmHWM) is checked: the
issue's target is 300 MB per worker under every input. Times are measured in bench/bench_attacks.py,
not asserted here.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from bistouri import wire
from testkit.hostile import (
    deep_session,
    gunicorn_workers,
    kallsyms_bomb,
    msgpack_budget_filler,
    msgpack_empty_arrays_bomb,
    peak_rss_bytes,
    rust_v0_bomb,
)
from testkit.symbolizer import KALLSYMS, KERNEL_BUILD_ID, KERNEL_IPS, SymbolizerURL
from tests.integration.conftest import post_sessions, put_kernel

MAX_WORKER_RSS = 300 << 20
GZIP_HEADERS = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
KERNEL_STACK = (KERNEL_IPS["io_schedule"], KERNEL_IPS["ksys_read"], KERNEL_IPS["entry_SYSCALL_64"])


def _start(symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path) -> SymbolizerURL:
    return symbolizer_server(tmp_path, workers=1)


def _peak(url: SymbolizerURL) -> int:
    workers = gunicorn_workers(url.proc.pid)
    assert len(workers) == 1, workers
    return peak_rss_bytes(workers[0])


@contextmanager
def _deep_json() -> Iterator[None]:
    # json.loads and == recurse once per level of a flamegraph tree, as json.dumps did in the service.
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _tree_depth(tree: dict[str, Any]) -> int:
    depth = 0
    while tree["children"]:
        tree = tree["children"][0]
        depth += 1
    return depth


def test_empty_arrays_bomb(symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path) -> None:
    """16 KiB of gzip, 16 M empty arrays: a worker went to 1.24 GB before the 400."""
    url = _start(symbolizer_server, tmp_path)
    r = requests.post(
        url + "/v1/sessions", data=msgpack_empty_arrays_bomb(), headers=GZIP_HEADERS, timeout=120
    )
    assert r.status_code == 413 and r.json()["error"] == "too_large", r.text
    # The same shape one level down, inside a session's table.
    table = (
        b"\x82\xa1v\x01\xa8sessions\x91\x81\xa6stacks\xdd"
        + (16 << 20).to_bytes(4, "big")
        + b"\x90" * (16 << 20)
    )
    r = requests.post(url + "/v1/sessions", data=gzip.compress(table, 1), headers=GZIP_HEADERS, timeout=120)
    assert r.status_code == 413 and "session.stacks has 16777216 entries" in r.json()["detail"], r.text
    assert _peak(url) <= MAX_WORKER_RSS
    # The most a request may make a worker decode: just under the value budget, all of it empty arrays.
    # Decoded whole, then refused for the symbolization work its ~500 000 stacks would take.
    filler = msgpack_budget_filler(wire.MAX_BATCH_OBJECTS)
    r = requests.post(url + "/v1/sessions", data=filler, headers=GZIP_HEADERS, timeout=120)
    assert r.status_code == 413 and r.json()["rejected"][0]["id"] == "filler", r.text
    assert f"at most {wire.MAX_FRAMES_PER_REQUEST}, {wire.MAX_STACKS_PER_REQUEST}" in r.text
    assert _peak(url) <= MAX_WORKER_RSS


def test_deep_stacks_render(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path, demo_binary: Any
) -> None:
    """A 1 500-frame stack was stored, then its flamegraph, merged views and diffs answered 500."""
    url = _start(symbolizer_server, tmp_path)
    assert put_kernel(url).status_code == 204
    kernel = KERNEL_STACK * 166 + KERNEL_STACK[:2]  # 500 kernel frames
    sessions = [deep_session("deep-a", 1000, kernel), deep_session("deep-b", 1000, kernel, leaf=1)]
    r = post_sessions(url, sessions)
    assert r.status_code == 200 and r.json()["accepted"] == ["deep-a", "deep-b"], r.text
    for path in (
        "/v1/sessions/deep-a/flamegraph",
        "/v1/profile/flamegraph?service=deep",
        "/v1/diff/flamegraph?a=deep-a&b=deep-b",
        "/v1/diff/flamegraph?a.service=deep&b=deep-a",
    ):
        r = requests.get(url + path, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])
        with _deep_json():
            assert _tree_depth(r.json()) == 1500, path
    for fmt in ("folded", "speedscope", "pprof"):
        assert requests.get(url + f"/v1/sessions/deep-a/{fmt}", timeout=60).status_code == 200, fmt
    # Past the documented limits, a stack is refused with the reason.
    too_deep = deep_session("too-deep", wire.MAX_USER_FRAMES + 1, ())
    r = post_sessions(url, [too_deep])
    assert r.status_code == 413, r.text
    assert "at most 512 and 1024" in r.json()["rejected"][0]["detail"]
    assert _peak(url) <= MAX_WORKER_RSS


def test_exponential_rust_symbol_in_kallsyms(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path
) -> None:
    """A 246-character v0 symbol made the worker time out after 121 s: the session was lost."""
    url = _start(symbolizer_server, tmp_path)
    bomb = rust_v0_bomb(25)
    assert len(bomb) == 246
    snapshot = KALLSYMS + b"ffffffff81005000 T " + bomb.encode() + b"\n"
    r = requests.put(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), data=gzip.compress(snapshot), timeout=60)
    assert r.status_code == 204, r.text
    session = deep_session("rust-bomb", 1, (0xFFFFFFFF81005010, *KERNEL_STACK))
    r = post_sessions(url, [session])
    assert r.status_code == 200 and r.json()["accepted"] == ["rust-bomb"], r.text
    tree = requests.get(url + "/v1/sessions/rust-bomb/flamegraph", timeout=60).json()
    names = []
    while tree["children"]:
        tree = tree["children"][0]
        names.append(tree["name"])
    assert names[-1] == bomb  # left mangled: over the demangling budget
    assert _peak(url) <= MAX_WORKER_RSS


def test_kallsyms_bomb(symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path) -> None:
    """16 MiB of kallsyms in 40 KiB of gzip: a worker went to 658 MB."""
    url = _start(symbolizer_server, tmp_path)
    r = requests.put(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), data=kallsyms_bomb(16), timeout=120)
    assert r.status_code == 413 and "500000 text symbols" in r.json()["detail"], r.text
    huge = gzip.compress(b"ffffffff81000000 T _text\n" + b"\n" * (40 << 20), 9)
    r = requests.put(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), data=huge, timeout=120)
    assert r.status_code == 413 and "uncompressed" in r.json()["detail"], r.text
    assert requests.get(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), timeout=10).status_code == 404
    assert _peak(url) <= MAX_WORKER_RSS
    # The service still takes a real snapshot afterwards.
    assert put_kernel(url).status_code == 204
    assert json.loads(requests.get(url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(), timeout=10).text)["present"]


def test_oversized_text_is_refused_alone(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path
) -> None:
    url = _start(symbolizer_server, tmp_path)
    good = deep_session("good", 3, KERNEL_STACK)
    loud = deep_session("loud", 3, KERNEL_STACK)
    loud.labels = {f"k{i}": "v" for i in range(wire.MAX_LABELS + 1)}
    long_comm = deep_session("long-comm", 3, KERNEL_STACK)
    long_comm.processes = {7: "c" * (wire.MAX_COMM_CHARS + 1)}
    r = post_sessions(url, [good, loud, long_comm])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == ["good"]
    details = {x["id"]: x["detail"] for x in body["rejected"]}
    assert "65 labels, at most 64" in details["loud"]
    assert "processes[0] must be at most 64 characters" in details["long-comm"]

"""The symbolizer service end to end: `bistouri symbolizer` in a subprocess (gunicorn, 2 workers) over HTTP.

Uses the real resolver on a binary built here and a kallsyms snapshot, the real
SQLite store, the vendored pprof schema and speedscope's JSON schema.
"""

from __future__ import annotations

import gzip
import json
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bistouri import wire
from testkit.symbolizer import (
    FIXTURES,
    KALLSYMS,
    KERNEL_BUILD_ID,
    REPO,
    clean_env,
    free_port,
    metric_value,
    stop,
    symbolizer_command,
)
from tests.integration.conftest import DemoBinary, make_session, post_sessions, put_kernel
from tests.pprof_proto import compile_profile_proto

TOKEN = "s3cret-token"
KERNEL_HEX = KERNEL_BUILD_ID.hex()


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


def metrics(url: str) -> str:
    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def folded(url: str, sid: str, value: str = "on_cpu") -> dict[str, int]:
    r = requests.get(f"{url}/v1/sessions/{sid}/folded", params={"value": value}, timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        stack, _, n = line.rpartition(" ")
        out[stack] = int(n)
    return out


def test_ingest_symbolize_and_read_back(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary, profile_pb2: ModuleType
) -> None:
    url = symbolizer_server(tmp_path, token=TOKEN, workers=2, binary_dir=demo_binary.dir)
    t0 = 1_763_000_000 * 10**9
    s1 = make_session("sess-1", demo_binary, start_ns=t0)
    s2 = make_session("sess-2", demo_binary, service="db", start_ns=t0 + 3600 * 10**9, scale=3)

    # The agent checks the kernel first: unknown here.
    # Kernel state is for token holders when tokens are configured (issue 26).
    assert requests.get(f"{url}/v1/kernels/{KERNEL_HEX}", timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"{url}/v1/kernels/{KERNEL_HEX}", headers=auth, timeout=10).status_code == 404
    r = post_sessions(url, [s1, s2], TOKEN)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "accepted": ["sess-1", "sess-2"],
        "duplicates": [],
        "rejected": [],
        "missing_kernels": [KERNEL_HEX],
    }
    # Idempotent: sent again (e.g. after a lost response), stored once.
    r = post_sessions(url, [s1, s2], TOKEN)
    assert r.json()["duplicates"] == ["sess-1", "sess-2"] and r.json()["accepted"] == []

    # User frames are named from the binary's symbols, root first.
    on = folded(url, "sess-1")
    assert on["main;middle_step;leaf_work"] == 40
    assert on["main;middle_step"] == 10
    assert sum(on.values()) == 53
    off = folded(url, "sess-1", "off_cpu")
    assert sum(off.values()) == 5 and not any("io_schedule" in k for k in off)

    # Kernel symbols arrive: the stored sessions are symbolized again.
    assert put_kernel(url).status_code == 401
    assert put_kernel(url, TOKEN).status_code == 204
    assert requests.get(f"{url}/v1/kernels/{KERNEL_HEX}", headers=auth, timeout=10).status_code == 200
    off = folded(url, "sess-1", "off_cpu")
    assert off == {"main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k]": 5}
    assert folded(url, "sess-2", "off_cpu_ns") == {
        "main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k]": 21_000_000
    }

    # Listing, newest first, filters, ISO 8601 and unix-seconds bounds.
    listing = requests.get(url + "/v1/sessions", timeout=10).json()
    assert listing["total"] == 2 and [s["id"] for s in listing["sessions"]] == ["sess-2", "sess-1"]
    assert requests.get(url + "/v1/sessions", params={"service": "db"}, timeout=10).json()["total"] == 1
    since_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0 // 10**9 + 60))
    got = requests.get(url + "/v1/sessions", params={"since": since_iso}, timeout=10).json()
    assert [s["id"] for s in got["sessions"]] == ["sess-2"]
    got = requests.get(url + "/v1/sessions", params={"until": t0 // 10**9 + 60}, timeout=10).json()
    assert [s["id"] for s in got["sessions"]] == ["sess-1"]
    assert requests.get(url + "/v1/sessions", params={"since": "yesterday"}, timeout=10).status_code == 400
    meta = requests.get(url + "/v1/sessions/sess-1", timeout=10).json()
    assert (
        meta["service"] == "api" and meta["comm"] == "bistouri-demo" and meta["trigger"]["resource"] == "cpu"
    )
    assert meta["samples"] == {"on_cpu": 53, "off_cpu": 5, "off_cpu_ns": 7_000_000}
    assert requests.get(url + "/v1/sessions/nope", timeout=10).status_code == 404

    # pprof parses against profile.proto and keeps the session's totals.
    r = requests.get(url + "/v1/sessions/sess-2/pprof", timeout=10)
    assert r.status_code == 200
    prof = profile_pb2.Profile()
    prof.ParseFromString(gzip.decompress(r.content))
    assert [sum(x.value[i] for x in prof.sample) for i in range(3)] == [159, 15, 21_000_000]
    assert "[kernel]" in {prof.string_table[m.filename] for m in prof.mapping}

    # speedscope is valid against its schema; flamegraph totals.
    doc = requests.get(url + "/v1/sessions/sess-1/speedscope", timeout=10).json()
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads((FIXTURES / "speedscope" / "file-format-schema.json").read_text()))
    tree = requests.get(url + "/v1/sessions/sess-1/flamegraph", timeout=10).json()
    assert tree["name"] == "all" and tree["value"] == 53
    assert requests.get(url + "/v1/sessions/sess-1/flamegraph?value=bogus", timeout=10).status_code == 400

    # Merged over a filter, and a diff of the two sessions (same shape: no delta).
    r = requests.get(url + "/v1/profile/folded", params={"since": t0 // 10**9 - 1}, timeout=10)
    assert r.headers["X-Bistouri-Sessions"] == "2"
    assert "main;middle_step;leaf_work 160" in r.text.splitlines()
    diff = requests.get(url + "/v1/diff/flamegraph", params={"a": "sess-1", "b": "sess-2"}, timeout=10).json()
    assert diff["value"] == 159 and diff["base"] == 53 and diff["delta"] == 0
    diff = requests.get(
        url + "/v1/diff/flamegraph",
        params={"a.service": "api", "b.service": "db", "value": "off_cpu"},
        timeout=10,
    ).json()
    assert diff["value"] == 15 and diff["base"] == 5
    assert requests.get(url + "/v1/diff/flamegraph", params={"a": "sess-1"}, timeout=10).status_code == 400

    # Metrics aggregate both workers.
    text = metrics(url)
    assert metric_value(text, "bistouri_symbolizer_sessions_ingested_total") == 2
    assert metric_value(text, "bistouri_symbolizer_sessions_duplicate_total") == 2
    assert metric_value(text, "bistouri_symbolizer_sessions_resymbolized_total") == 2
    assert metric_value(text, "bistouri_symbolizer_kernel_uploads_total") == 1
    assert metric_value(text, "bistouri_symbolizer_symbolize_duration_seconds_count") == 4
    assert metric_value(text, "bistouri_symbolizer_db_sessions") == 2
    assert metric_value(text, "bistouri_symbolizer_frames_total", {"kind": "kernel"}) >= 3

    # The UI is served, / redirects to it.
    r = requests.get(url + "/", allow_redirects=False, timeout=10)
    assert r.status_code == 302 and r.headers["Location"].endswith("/ui/")
    if (REPO / "bistouri" / "symbolizer" / "ui" / "index.html").exists():
        r = requests.get(url + "/ui/", timeout=10)
        assert r.status_code == 200 and "html" in r.headers["Content-Type"]
    assert requests.get(url + "/ui/../server.py", timeout=10).status_code == 404
    assert url.proc.poll() is None
    assert "Traceback" not in url.log_path.read_text()


def test_writes_need_the_token_and_reads_can(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    url = symbolizer_server(tmp_path, token=TOKEN, workers=2, binary_dir=demo_binary.dir)
    s = make_session("t-1", demo_binary)
    r = post_sessions(url, [s])
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert post_sessions(url, [s], "wrong").status_code == 401
    assert requests.get(url + "/v1/sessions", timeout=10).status_code == 200  # reads are open by default
    # A chunked body (no Content-Length) is read up to the limit.
    body = gzip.compress(wire.encode_batch([wire.encode_session(s)]))
    headers = {
        "Content-Type": "application/x-msgpack",
        "Content-Encoding": "gzip",
        "Authorization": f"Bearer {TOKEN}",
    }
    r = requests.post(url + "/v1/sessions", data=iter([body[:10], body[10:]]), headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["accepted"] == ["t-1"]
    assert (
        metric_value(metrics(url), "bistouri_symbolizer_requests_rejected_total", {"reason": "unauthorized"})
        == 2
    )

    # Bad kallsyms uploads are refused with a reason.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    kernel = f"{url}/v1/kernels/{KERNEL_HEX}"
    for body, status, reason in [
        (KALLSYMS, 400, "bad_encoding"),  # not gzip'd
        (gzip.compress(b"hello world\n"), 400, "malformed"),
        (gzip.compress(b"0000000000000000 T _text\n0000000000000000 T schedule\n"), 400, "malformed"),
        (gzip.compress(b"\0" * (16 << 20) * 9), 413, "too_large"),
    ]:
        r = requests.put(kernel, data=body, headers=auth, timeout=60)
        assert (r.status_code, r.json()["error"]) == (status, reason), r.text
    assert requests.put(f"{url}/v1/kernels/xyz", data=b"", headers=auth, timeout=10).status_code == 400
    assert requests.get(kernel, headers=auth, timeout=10).status_code == 404

    locked = symbolizer_server(tmp_path, token=TOKEN, workers=1, read_token=True)
    assert requests.get(locked + "/v1/sessions", timeout=10).status_code == 401
    assert requests.get(locked + "/v1/sessions", headers=auth, timeout=10).status_code == 200
    assert requests.get(locked + "/healthz", timeout=10).status_code == 200


# ---------------------------------------------------------------------------
# Fuzzing: nothing a client sends may crash the service or get anything but a 4xx

MAX_REQUEST = 64 * 1024
FUZZ_EXAMPLES = int(os.environ.get("BISTOURI_FUZZ_EXAMPLES", "10000"))
_HEADERS = {
    "Content-Type": "application/x-msgpack",
    "Content-Encoding": "gzip",
    "Authorization": f"Bearer {TOKEN}",
}


def _valid_session_map(sid: str) -> dict[str, Any]:
    s = wire.Session(
        session_id=sid,
        trigger=wire.Trigger("io"),
        kernel=wire.KernelInfo("6.18", b"\x01" * 20, 1),
        start_ns=1,
        duration_ns=2,
        period_ns=3,
        processes={1: "a"},
        traces=[
            wire.Trace((0xFFFF0000,), (wire.UserFrame(0, b"\x02" * 20, 0x10),), 1, 1, on_cpu=1),
            wire.Trace((), (wire.UserFrame(1, b"", 0x20),), 1, 2, off_cpu=1, off_cpu_ns=5),
        ],
    )
    return wire.session_to_wire(s)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Each mutation makes one session certainly invalid (the rest of the map stays as it was).
_BREAKERS: list[tuple[str, Any]] = [
    ("v", 99),
    ("v", "1"),
    ("v", None),
    ("id", ""),
    ("id", "x" * 65),
    ("id", 12),
    ("trigger", {"resource": "gpu"}),
    ("trigger", []),
    ("kernel", {"build_id": "not-bytes"}),
    ("mappings", ["not-bytes"]),
    ("kframes", [-1]),
    ("kframes", [1.5]),
    ("uframes", [[7, 0, 0]]),
    ("stacks", [[[99], []]]),
    ("traces", [[0, 0, -1, 0, 0]]),
    ("traces", [[0, 0, 1, 0]]),
    ("traces", [[0, 0, 1e300, 0, 0]]),
    ("traces", [[0, 0, 0, 0, -(1 << 63)]]),
    ("traces", [[5, 0, 1, 0, 0]]),
    ("start_ns", -5),
    ("period_ns", "fast"),
    ("labels", {"a": 1}),
    ("processes", [[1]]),
    ("threads", [[1, 2, 3]]),
]
_REQUIRED = (
    "id",
    "trigger",
    "kernel",
    "mappings",
    "kframes",
    "uframes",
    "stacks",
    "threads",
    "traces",
    "start_ns",
)


@st.composite
def bad_payloads(draw: Any) -> tuple[bytes, dict[str, str]]:
    """(body, headers) pairs the service must refuse with a 4xx."""
    headers = dict(_HEADERS)
    kind = draw(
        st.sampled_from(
            [
                "random_gzip",
                "random_raw",
                "random_identity",
                "truncated",
                "broken_session",
                "missing_key",
                "batch_version",
                "batch_shape",
                "huge_array",
                "too_many_sessions",
                "gzip_bomb",
                "oversized",
                "oversized_chunked",
                "content_type",
                "content_encoding",
                "trailing_garbage",
            ]
        )
    )
    valid = _valid_session_map("fuzz-" + draw(st.text("abcdef0123456789", min_size=4, max_size=12)))
    if kind == "random_gzip":
        return gzip.compress(draw(st.binary(max_size=512)), mtime=0), headers
    if kind == "random_raw":  # claims gzip, is not
        body = draw(st.binary(max_size=512))
        if body[:2] == b"\x1f\x8b":
            body = b"\x00" + body
        return body, headers
    if kind == "random_identity":
        headers["Content-Encoding"] = "identity"
        return draw(st.binary(max_size=512)).replace(b"\x82", b"\x80"), headers  # no 2-key map: never a batch
    if kind == "truncated":
        full = gzip.compress(_pack({"v": 1, "sessions": [valid]}), mtime=0)
        return full[: draw(st.integers(0, len(full) - 1))], headers
    if kind == "broken_session":
        key, value = draw(st.sampled_from(_BREAKERS))
        broken = dict(valid, **{key: value})
        return gzip.compress(_pack({"v": 1, "sessions": [broken]}), mtime=0), headers
    if kind == "missing_key":
        key = draw(st.sampled_from(_REQUIRED))
        broken = {k: v for k, v in valid.items() if k != key}
        return gzip.compress(_pack({"v": 1, "sessions": [broken]}), mtime=0), headers
    if kind == "batch_version":
        v = draw(
            st.one_of(
                st.integers(-5, 100).filter(lambda x: x not in wire.READABLE_VERSIONS),
                st.text(max_size=3),
                st.none(),
            )
        )
        return gzip.compress(_pack({"v": v, "sessions": [valid]}), mtime=0), headers
    if kind == "batch_shape":
        obj = draw(
            st.sampled_from(
                [[], {}, {"v": 1}, {"v": 1, "sessions": {}}, {"v": 1, "sessions": "x"}, 1, None, b"x"]
            )
        )
        return gzip.compress(_pack(obj), mtime=0), headers
    if kind == "huge_array":  # an array header claiming billions of entries, then nothing
        n = draw(st.integers(1 << 20, (1 << 32) - 1))
        raw = b"\x82\xa1v\x01\xa8sessions" + b"\xdd" + n.to_bytes(4, "big") + _pack(valid)
        return gzip.compress(raw, mtime=0), headers
    if kind == "too_many_sessions":
        return gzip.compress(_pack({"v": 1, "sessions": [{}] * 1001}), mtime=0), headers
    if kind == "gzip_bomb":
        return _BOMBS[draw(st.integers(0, len(_BOMBS) - 1))], headers
    if kind == "oversized":
        return b"\x1f\x8b" + b"\x00" * (MAX_REQUEST + draw(st.integers(1, 4096))), headers
    if kind == "oversized_chunked":  # no Content-Length: the limit holds while reading
        headers["X-Test-Chunked"] = "1"
        return gzip.compress(_pack({"v": 1, "sessions": [valid]}), mtime=0) * (
            MAX_REQUEST // 200 + 1
        ), headers
    if kind == "content_type":
        headers["Content-Type"] = draw(
            st.sampled_from(["application/json", "text/plain", "", "application/x-msgpackx"])
        )
        return gzip.compress(_pack({"v": 1, "sessions": [valid]}), mtime=0), headers
    if kind == "content_encoding":
        headers["Content-Encoding"] = draw(st.sampled_from(["br", "deflate", "zstd", "gzip, br"]))
        return gzip.compress(_pack({"v": 1, "sessions": [valid]}), mtime=0), headers
    # trailing_garbage: a valid gzip member followed by more bytes
    return gzip.compress(_pack({"v": 1, "sessions": [valid]}), mtime=0) + draw(
        st.binary(min_size=1, max_size=64)
    ), headers


# Gzip bombs: small bodies that expand past 8 x the request limit (zeros, and one valid-looking prefix).
_BOMBS = [
    gzip.compress(b"\x00" * (MAX_REQUEST * 8 + 1), mtime=0),
    gzip.compress(b"\x00" * (MAX_REQUEST * 64), mtime=0),
    gzip.compress(b"\x82\xa1v\x01\xa8sessions\x91" + b"\xc0" * (MAX_REQUEST * 16), mtime=0),
]


def _send(url: str, payload: tuple[bytes, dict[str, str]]) -> tuple[int, Any]:
    """POST one payload; (status, JSON body), or (-1, None) when an oversized chunked upload is cut off."""
    body, headers = payload
    headers = dict(headers)
    data: Any = body
    chunked = bool(headers.pop("X-Test-Chunked", None))
    if chunked:
        data = iter([body[i : i + 8192] for i in range(0, len(body), 8192)])
    try:
        r = requests.post(url + "/v1/sessions", data=data, headers=headers, timeout=30)
    except requests.ConnectionError:
        # The service answers 413 as soon as the limit is passed and closes the connection; a client
        # still sending chunks (requests 2.28) sees a broken pipe instead of the answer.
        assert chunked, "the connection broke on a request that was not an oversized chunked body"
        return -1, None
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300], body[:80], headers)
    err = r.json()
    assert err["error"] and err["detail"]
    return r.status_code, err


FUZZ_PARALLEL = 4  # payloads per example, sent at once: both workers stay busy


@pytest.mark.slow
def test_fuzzed_payloads_get_only_4xx_and_are_counted(symbolizer_server: Any, tmp_path: Path) -> None:
    url = symbolizer_server(tmp_path, token=TOKEN, workers=2, max_request_bytes=MAX_REQUEST)
    sent = 0
    statuses: dict[int, int] = {}
    pool = ThreadPoolExecutor(FUZZ_PARALLEL, thread_name_prefix="bistouri-fuzz")

    @settings(
        max_examples=-(-FUZZ_EXAMPLES // FUZZ_PARALLEL),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(bad_payloads(), min_size=FUZZ_PARALLEL, max_size=FUZZ_PARALLEL))
    def check(payloads: list[tuple[bytes, dict[str, str]]]) -> None:
        nonlocal sent
        for status, _ in pool.map(lambda p: _send(url, p), payloads):
            sent += 1
            statuses[status] = statuses.get(status, 0) + 1

    try:
        check()
    finally:
        pool.shutdown()
    print(f"fuzz: {sent} payloads, statuses {statuses}")
    assert sent >= FUZZ_EXAMPLES
    assert set(statuses) <= {400, 413, 415, -1}, statuses
    text = metrics(url)
    assert metric_value(text, "bistouri_symbolizer_requests_rejected_total") == sent
    assert metric_value(text, "bistouri_symbolizer_sessions_ingested_total") == 0
    # Still healthy, nothing crashed, and a valid batch is accepted afterwards.
    assert url.proc.poll() is None
    body = gzip.compress(_pack({"v": 1, "sessions": [_valid_session_map("after-fuzz")]}))
    r = requests.post(url + "/v1/sessions", data=body, headers=_HEADERS, timeout=30)
    assert r.status_code == 200 and r.json()["accepted"] == ["after-fuzz"]
    log = url.log_path.read_text()
    assert "Traceback" not in log and "WORKER TIMEOUT" not in log


# ---------------------------------------------------------------------------
# Operations: flags, errors, retention, the metrics port, the offline command


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bistouri", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=REPO,
        timeout=timeout,
    )


def test_startup_errors_are_clear(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    port = free_port()
    base = symbolizer_command(listen_addr=f"127.0.0.1:{port}", state_dir=state)[3:]
    r = run_cli(*base, "--token-file", str(tmp_path / "missing-token"))
    assert r.returncode == 2 and "--token-file" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(*base, "--db", "postgresql://u:pw@127.0.0.1:1/db?sslmode=bogus=")
    assert (
        r.returncode == 2
        and "PostgreSQL" in r.stderr
        and "pw" not in r.stderr
        and "Traceback" not in r.stderr
    )
    r = run_cli(*base, "--db", "postgresql://u:pw@127.0.0.1:1/db")  # nothing listens on port 1
    assert r.returncode == 2 and "cannot connect to PostgreSQL" in r.stderr and "pw" not in r.stderr
    r = run_cli(*base, "--listen-addr", "nohost")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = run_cli(*base, "--listen-addr", f"127.0.0.1:{busy}")
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "bistouri", *base],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env=clean_env(BISTOURI_SYMBOLIZER_WORKERS="many"),
    )
    assert r.returncode == 2 and "BISTOURI_SYMBOLIZER_WORKERS" in r.stderr


def test_environment_flags_retention_and_metrics_port(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    # A session whose agent's clock runs half a day ahead (more is refused at ingest), received 3 days
    # ago (the database says so).
    first = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir)
    old = make_session("old-1", demo_binary, start_ns=time.time_ns() + 12 * 3600 * 10**9)
    assert post_sessions(first, [old]).json()["accepted"] == ["old-1"]
    stop(first)
    with sqlite3.connect(first.state_dir / "bistouri.db") as conn:
        conn.execute("UPDATE sessions SET ingested_ns = ?", (time.time_ns() - 3 * 86400 * 10**9,))
    metrics_port = free_port()
    url = symbolizer_server(
        tmp_path,
        workers=1,
        metrics_port=metrics_port,
        state_dir=first.state_dir,
        env={
            "BISTOURI_SYMBOLIZER_RETENTION_DAYS": "1",
            "BISTOURI_SYMBOLIZER_BINARY_DIR": str(demo_binary.dir),
        },
    )
    new = make_session("new-1", demo_binary, start_ns=time.time_ns())
    r = post_sessions(url, [new])
    assert r.status_code == 200 and r.json()["accepted"] == ["new-1"]
    # Retention ran after that ingest: the session received 3 days ago went, whatever its start time
    # said; the binary dir came from the environment.
    assert [s["id"] for s in requests.get(url + "/v1/sessions", timeout=10).json()["sessions"]] == ["new-1"]
    assert "main;middle_step;leaf_work" in folded(url, "new-1")
    m = f"http://127.0.0.1:{metrics_port}"
    text = requests.get(m + "/metrics", timeout=10).text
    assert metric_value(text, "bistouri_symbolizer_sessions_expired_total", {"reason": "age"}) == 1
    assert requests.get(m + "/v1/sessions", timeout=10).status_code == 404


def test_symbolize_command_offline(tmp_path: Path, demo_binary: DemoBinary, profile_pb2: ModuleType) -> None:
    files = []
    for i in range(2):
        f = tmp_path / f"session-{i}.msgpack"
        f.write_bytes(wire.encode_session(make_session(f"off-{i}", demo_binary)))
        files.append(str(f))
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_bytes(KALLSYMS)
    common = ["--binary-dir", str(demo_binary.dir), "--kallsyms", str(kallsyms)]
    r = run_cli("symbolize", *files, *common, "--format", "folded", "--value", "off_cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k] 10\n"
    out = tmp_path / "p.pb.gz"
    r = run_cli("symbolize", files[0], *common, "--format", "pprof", "-o", str(out))
    assert r.returncode == 0, r.stderr
    prof = profile_pb2.Profile()
    prof.ParseFromString(gzip.decompress(out.read_bytes()))
    assert sum(x.value[0] for x in prof.sample) == 53
    r = run_cli("symbolize", files[0], "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["meta"]["id"] == "off-0"
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x93garbage")
    r = run_cli("symbolize", str(bad))
    assert r.returncode == 2 and "not a bistouri session file" in r.stderr and "Traceback" not in r.stderr


_READ_PATHS = [
    "/v1/sessions",
    "/v1/sessions/q-1",
    "/v1/sessions/q-1/pprof",
    "/v1/sessions/q-1/folded",
    "/v1/sessions/q-1/flamegraph",
    "/v1/sessions/q-1/speedscope",
    "/v1/sessions/q-1/nope",
    "/v1/profile/folded",
    "/v1/profile/flamegraph",
    "/v1/diff/flamegraph",
    "/v1/kernels/zz",
]
_PARAM_NAMES = [
    "service",
    "host",
    "since",
    "until",
    "limit",
    "offset",
    "value",
    "a",
    "b",
    "a.since",
    "b.service",
    "part",
    "kind",
    "a.kind",
]
_PARAM_VALUES = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "inf",
            "-inf",
            "nan",
            "1e400",
            "-1",
            "99999999999999999999",
            "2026-13-01",
            "q-1",
            "off_cpu",
            "before",
            "manual",
        ]
    ),
    st.integers().map(str),
)


def test_read_api_refuses_bad_parameters_without_500(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    url = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir)
    assert post_sessions(url, [make_session("q-1", demo_binary)]).status_code == 200
    http = requests.Session()

    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(_READ_PATHS),
        st.dictionaries(st.sampled_from(_PARAM_NAMES), _PARAM_VALUES, max_size=4),
    )
    def check(path: str, params: dict[str, str]) -> None:
        r = http.get(url + path, params=params, timeout=30)
        assert r.status_code < 500, (path, params, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]

    check()
    assert "Traceback" not in url.log_path.read_text()

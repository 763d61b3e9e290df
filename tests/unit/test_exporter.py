"""Exporter against a real HTTP server on 127.0.0.1 that implements the symbolizer's ingest API."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.exporter import Exporter, _retry_after
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from bistouri.compat import pairwise

KERNEL = bytes(range(20))
KALLSYMS = "ffffffff81000000 T _text\nffffffff81000100 T do_syscall_64\n"


def session(n: int = 0, kernel: bytes = KERNEL) -> tuple[str, bytes]:
    sid = f"{n:04d}-{uuid.uuid4().hex[:12]}"
    s = wire.Session(
        session_id=sid,
        trigger=wire.Trigger("cpu", threshold_us=100_000, window_us=2_000_000, cgroup="/t"),
        kernel=wire.KernelInfo("6.18.0", kernel, 0xFFFFFFFF81000000),
        start_ns=1,
        duration_ns=2,
        period_ns=52_631_578,
        tenant="t",
        service="svc",
        traces=[wire.Trace(kernel=(0xFFFFFFFF81000100,), user=(), pid=1, tid=1, on_cpu=3)],
    )
    return sid, wire.encode_session(s)


class FakeSymbolizer:
    """The ingest half of the symbolizer API, with knobs to misbehave."""

    def __init__(self, port: int = 0, token: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.stored: dict[str, int] = {}  # session id -> times accepted
        self.posts: list[tuple[float, list[str]]] = []
        self.kernels: dict[str, bytes] = {}
        self.kernel_gets = 0
        self.auth_headers: list[str | None] = []
        self.script: list[tuple[int, dict[str, str], dict[str, Any]]] = []  # forced next POST answers
        self.always: tuple[int, dict[str, str], dict[str, Any]] | None = None  # once the script is done
        self.max_batch: int | None = None  # more sessions than this: 413
        self.reject: dict[str, str] = {}  # session id -> reason
        self.poison: set[str] = set()  # a batch containing one of these: whole-request 400
        self.missing_once = False
        self.in_flight = threading.Event()  # a POST has arrived
        self.release = threading.Event()  # cleared: a POST's answer is held until it is set again
        self.release.set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if body is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization")
                with owner.lock:
                    owner.auth_headers.append(auth)
                if owner.token is None or auth == f"Bearer {owner.token}":
                    return True
                self._reply(401, {"error": "unauthorized", "detail": "bad bearer token"})
                return False

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._reply(200, "ok")
                    return
                if not self._authorized():
                    return
                bid = self.path.rsplit("/", 1)[-1]
                with owner.lock:
                    owner.kernel_gets += 1
                    known = bid in owner.kernels
                self._reply(200 if known else 404, {"build_id": bid} if known else {"error": "not_found"})

            def do_PUT(self) -> None:
                body = self._body()
                if not self._authorized():
                    return
                assert self.headers.get("Content-Encoding") == "gzip"
                with owner.lock:
                    owner.kernels[self.path.rsplit("/", 1)[-1]] = gzip.decompress(body)
                self._reply(204)

            def do_POST(self) -> None:
                body = self._body()
                if not self._authorized():
                    return
                owner.in_flight.set()
                owner.release.wait(60)
                assert self.headers.get("Content-Type") == "application/x-msgpack"
                assert self.headers.get("Content-Encoding") == "gzip"
                items = wire.decode_batch(gzip.decompress(body))
                ids = [it["id"] for it in items]
                with owner.lock:
                    owner.posts.append((time.monotonic(), ids))
                    if owner.script or owner.always:
                        status, headers, payload = owner.script.pop(0) if owner.script else owner.always
                        self._reply(status, payload, headers)
                        return
                    if owner.max_batch is not None and len(ids) > owner.max_batch:
                        self._reply(413, {"error": "too_large", "detail": f"{len(ids)} sessions"})
                        return
                    if len(ids) > 1 and owner.poison & set(ids):
                        self._reply(400, {"error": "malformed", "detail": "cannot decode"})
                        return
                    result: dict[str, Any] = {
                        "accepted": [],
                        "duplicates": [],
                        "rejected": [],
                        "missing_kernels": [],
                    }
                    for it in items:
                        wire.session_from_wire(it)  # what the agent sends must decode
                        sid = it["id"]
                        if sid in owner.reject or sid in owner.poison:
                            result["rejected"].append(
                                {"id": sid, "reason": owner.reject.get(sid, "malformed")}
                            )
                        elif sid in owner.stored:
                            result["duplicates"].append(sid)
                        else:
                            owner.stored[sid] = 1
                            result["accepted"].append(sid)
                    if owner.missing_once:
                        owner.missing_once = False
                        owner.kernels.clear()
                        result["missing_kernels"] = [KERNEL.hex()]
                    status = 200 if result["accepted"] or result["duplicates"] else 400
                self._reply(status, result)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # type: ignore[method-assign]  # client gave up
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="fake-symbolizer", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[FakeSymbolizer]:
    s = FakeSymbolizer()
    yield s
    s.close()


class Env:
    def __init__(self, tmp_path: Any, url: str, max_bytes: int = 10 << 20, **settings: Any) -> None:
        read_timeout_s = settings.pop("read_timeout_s", None)
        backoff_initial_s = settings.pop("backoff_initial_s", 0.05)
        backoff_max_s = settings.pop("backoff_max_s", 0.3)
        self.reg = CollectorRegistry()
        self.spool = Spool(str(tmp_path / "spool"), max_bytes, registry=self.reg, kernel_build_id=KERNEL)
        self.kallsyms_calls: list[bytes] = []

        def kallsyms(bid: bytes) -> str:
            self.kallsyms_calls.append(bid)
            return KALLSYMS

        self.exporter = Exporter(
            self.spool,
            AgentSettings(symbolizer_endpoint=url, **settings),
            registry=self.reg,
            kallsyms_provider=kallsyms,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            read_timeout_s=read_timeout_s,
        )

    def put(self, n: int, first: int = 0) -> list[str]:
        ids = []
        for i in range(first, first + n):
            sid, data = session(i)
            assert self.spool.put(sid, data)
            ids.append(sid)
        self.exporter.notify()
        return ids

    def metric(self, name: str, **labels: str) -> float:
        return self.reg.get_sample_value(name, labels) or 0.0

    def close(self) -> None:
        assert self.exporter.stop(5)


@pytest.fixture
def make_env(tmp_path: Any) -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def make(url: str, **kw: Any) -> Env:
        e = Env(tmp_path, url, **kw)
        envs.append(e)
        return e

    yield make
    for e in envs:
        e.close()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout} s")


# -- tests


def test_delivers_oldest_first_in_batches_and_uploads_kernel_once(server, make_env):
    env = make_env(server.url)
    ids = env.put(70)  # more than one batch (64)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert sorted(server.stored) == sorted(ids)
    sent_order = [sid for _, batch in server.posts for sid in batch]
    assert sent_order == ids  # oldest first
    assert [len(b) for _, b in server.posts] == [64, 6]
    assert server.kernels == {KERNEL.hex(): KALLSYMS.encode()}
    assert server.kernel_gets == 1 and env.kallsyms_calls == [KERNEL]
    assert env.metric("bistouri_export_sessions_sent_total") == 70
    assert env.metric("bistouri_export_latency_seconds_count") == 2
    assert env.metric("bistouri_export_kernel_uploads_total") == 1
    assert env.metric("bistouri_spool_sessions") == 0
    # A later session of the same kernel does not check the kernel again.
    env.put(1, first=100)
    wait_for(lambda: len(env.spool) == 0)
    assert server.kernel_gets == 1


def test_nothing_lost_while_down_then_back_and_none_twice(make_env):
    probe = FakeSymbolizer()
    port = probe.port
    probe.close()  # nothing listens on the port now
    env = make_env(f"http://127.0.0.1:{port}")
    env.exporter.start()
    ids = env.put(5)
    wait_for(lambda: env.metric("bistouri_export_failures_total", reason="network") >= 3)
    assert len(env.spool) == 5
    ids += env.put(3, first=5)
    back = FakeSymbolizer(port=port)
    try:
        wait_for(lambda: len(env.spool) == 0)
        assert sorted(back.stored) == sorted(ids)
        assert all(n == 1 for n in back.stored.values())
        sent = [sid for _, b in back.posts for sid in b]
        assert len(sent) == len(set(sent)) == 8  # none sent twice
        assert env.metric("bistouri_export_sessions_sent_total") == 8
    finally:
        back.close()


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_obeyed(server, make_env, status):
    server.script.append((status, {"Retry-After": "1"}, {"error": "busy", "detail": "slow down"}))
    env = make_env(server.url)
    env.put(2)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    (t1, first), (t2, second) = server.posts
    assert first == second
    # The backoff alone would retry after ~0.05 s: the gap proves the header was used.
    assert t2 - t1 >= 0.95
    reason = "rate_limited" if status == 429 else "unavailable"
    assert env.metric("bistouri_export_failures_total", reason=reason) == 1


def test_a_503_without_retry_after_waits_the_own_backoff(server, make_env):
    """A load balancer with no server up answers 503 with no Retry-After: the exporter tries
    again after its own (capped, jittered) backoff. It waited a fixed 60 s."""
    server.script.append((503, {}, {"error": "unavailable", "detail": "no server is available"}))
    env = make_env(server.url)
    env.put(2)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0, timeout=5)
    (t1, first), (t2, second) = server.posts
    assert first == second and t2 - t1 <= 0.3 + 0.1  # backoff_max_s of make_env, and some slack


def test_retry_after_parsing():
    assert _retry_after("7", 60, 0) == 7
    assert _retry_after(None, 60, 0) == 60
    assert _retry_after("soon", 60, 0) == 60
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 60, 1445412470.0) == pytest.approx(10.0)


def test_413_halves_the_batch(server, make_env):
    server.max_batch = 5
    env = make_env(server.url)
    ids = env.put(20)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert sorted(server.stored) == sorted(ids)
    sizes = [len(b) for _, b in server.posts]
    assert sizes == [20, 10, 5, 5, 5, 5]  # halved until accepted, then kept
    assert env.metric("bistouri_export_failures_total", reason="too_large") >= 2


def test_single_session_too_large_is_set_aside(server, make_env):
    server.max_batch = 0
    env = make_env(server.url)
    env.put(1)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    [(_, reason)] = env.spool.rejected()
    assert reason.startswith("too_large")
    assert env.metric("bistouri_export_sessions_rejected_total") == 1


def test_401_then_rotated_token_is_picked_up(server, make_env, tmp_path):
    server.token = "s3cret"
    token = tmp_path / "token"
    token.write_text("wrong\n")
    env = make_env(server.url, symbolizer_token_file=str(token))
    ids = env.put(3)
    env.exporter.start()
    wait_for(lambda: env.metric("bistouri_export_failures_total", reason="unauthorized") >= 2)
    assert len(env.spool) == 3 and not server.stored  # kept, not dropped
    assert "Bearer wrong" in server.auth_headers
    token.write_text("s3cret\n")  # rotated in place, no restart
    wait_for(lambda: len(env.spool) == 0)
    assert sorted(server.stored) == sorted(ids)
    assert server.auth_headers[-1] == "Bearer s3cret"


def test_rejected_moved_aside_duplicates_acked(server, make_env):
    env = make_env(server.url)
    ids = env.put(4)
    server.stored[ids[1]] = 1  # already there from an earlier attempt
    server.reject[ids[2]] = "unsupported_version"
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert env.metric("bistouri_export_sessions_sent_total") == 3  # 2 accepted + 1 duplicate
    assert env.metric("bistouri_export_sessions_rejected_total") == 1
    [(name, reason)] = env.spool.rejected()
    assert ids[2] in name and reason == "unsupported_version"
    assert len(server.posts) == 1


def test_whole_batch_400_bisects_to_the_bad_session(server, make_env):
    env = make_env(server.url)
    ids = env.put(8)
    server.poison.add(ids[5])
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert sorted(server.stored) == sorted(set(ids) - {ids[5]})
    [(name, _)] = env.spool.rejected()
    assert ids[5] in name


def test_gzipped_kallsyms_from_the_provider_is_not_compressed_twice(server, tmp_path):
    reg = CollectorRegistry()
    sp = Spool(str(tmp_path / "s"), 1 << 20, registry=reg, kernel_build_id=KERNEL)
    ex = Exporter(
        sp,
        AgentSettings(symbolizer_endpoint=server.url),
        registry=reg,
        kallsyms_provider=lambda bid: gzip.compress(KALLSYMS.encode()),
    )
    sid, data = session()
    sp.put(sid, data)
    ex.start()
    try:
        wait_for(lambda: len(sp) == 0)
    finally:
        ex.stop(2)
    assert server.kernels == {KERNEL.hex(): KALLSYMS.encode()}


def test_missing_kernel_is_uploaded_again(server, make_env):
    env = make_env(server.url)
    env.put(1)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    server.missing_once = True  # the symbolizer lost its kallsyms (e.g. a fresh database)
    env.put(1, first=1)
    wait_for(lambda: len(server.stored) == 2)
    assert server.kernels == {}
    env.put(1, first=2)
    wait_for(lambda: len(env.spool) == 0 and KERNEL.hex() in server.kernels)
    assert env.metric("bistouri_export_kernel_uploads_total") == 2


def test_capture_side_never_waits_on_a_slow_server(server, make_env):
    server.release.clear()  # the first POST's answer held until the sessions below are in the spool
    env = make_env(server.url, read_timeout_s=60.0)
    env.exporter.start()
    env.put(1)
    assert server.in_flight.wait(5)
    env.put(10, first=1)  # returns while the exporter still waits for its answer
    assert not server.posts and env.metric("bistouri_export_failures_total", reason="timeout") == 0
    server.release.set()
    wait_for(lambda: len(env.spool) == 0)
    assert len(server.stored) == 11 and env.metric("bistouri_export_sessions_sent_total") == 11


def test_a_session_stored_after_the_client_gave_up_comes_back_as_a_duplicate(server, make_env):
    server.release.clear()
    env = make_env(server.url, read_timeout_s=1.0)
    env.exporter.start()
    env.put(1)
    assert server.in_flight.wait(5)
    wait_for(lambda: env.metric("bistouri_export_failures_total", reason="timeout") >= 1)
    server.release.set()  # the server stores it now, the client has gone: its retry is a duplicate
    wait_for(lambda: len(env.spool) == 0)
    assert len(server.stored) == 1 and env.metric("bistouri_export_sessions_sent_total") == 1


def test_spool_full_while_down_drops_oldest_and_counts(make_env):
    probe = FakeSymbolizer()
    port = probe.port
    probe.close()
    one = len(session(0)[1]) + wire.FILE_HEADER.size + len(KERNEL)
    env = make_env(f"http://127.0.0.1:{port}", max_bytes=4 * one)
    env.exporter.start()
    ids = env.put(10)
    assert env.metric("bistouri_spool_dropped_total", reason="spool_full") == 6
    back = FakeSymbolizer(port=port)
    try:
        wait_for(lambda: len(env.spool) == 0)
        assert sorted(back.stored) == sorted(ids[6:])  # the newest four survived
    finally:
        back.close()


def test_stop_cuts_a_long_retry_after_short(server, make_env):
    server.script.append((503, {"Retry-After": "3600"}, {"error": "maintenance", "detail": ""}))
    env = make_env(server.url)
    env.put(1)
    env.exporter.start()
    wait_for(lambda: len(server.posts) == 1)
    wait_for(lambda: env.exporter.disabled_until > time.monotonic() + 3000)
    assert env.exporter.flush(time.monotonic() + 0.5) is False  # the server said wait: flush does not push
    t0 = time.monotonic()
    assert env.exporter.stop(2)
    assert time.monotonic() - t0 < 1.0
    assert len(env.spool) == 1  # kept for the next run


def test_flush_skips_own_backoff_and_empties_the_spool(make_env):
    probe = FakeSymbolizer()
    port = probe.port
    probe.close()
    env = make_env(f"http://127.0.0.1:{port}")
    env.exporter._backoff_max = 3600.0  # a long own backoff, which flush must not sit out
    env.exporter._backoff_initial = 3600.0
    env.exporter.start()
    env.put(2)
    wait_for(lambda: env.metric("bistouri_export_failures_total", reason="network") >= 1)
    back = FakeSymbolizer(port=port)
    try:
        assert env.exporter.flush(time.monotonic() + 5) is True
        assert len(back.stored) == 2
    finally:
        back.close()


def test_no_endpoint_means_spool_only(tmp_path):
    reg = CollectorRegistry()
    sp = Spool(str(tmp_path / "s"), 1 << 20, registry=reg, kernel_build_id=KERNEL)
    ex = Exporter(sp, AgentSettings(), registry=reg)
    ex.start()
    sid, data = session()
    sp.put(sid, data)
    ex.notify()
    assert ex.flush(time.monotonic() + 0.1) is False
    assert ex.stop(1)
    assert len(sp) == 1
    assert not [t for t in threading.enumerate() if t.name == "bistouri-exporter"]


def test_thread_is_named_and_daemon(server, make_env):
    env = make_env(server.url)
    env.exporter.start()
    [t] = [t for t in threading.enumerate() if t.name == "bistouri-exporter"]
    assert t.daemon


def _openssl(*args: str, cwd: Any) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: Any) -> Any:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed (apt install openssl)")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d,
        )  # fmt: skip
    return d


def _mtls_server(pki: Any) -> FakeSymbolizer:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "server.pem"), str(pki / "server.key"))
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the agent must show its client certificate
    return FakeSymbolizer(tls=ctx)


def test_tls_with_ca_file_and_client_certificate(pki, make_env):
    srv = _mtls_server(pki)
    try:
        env = make_env(
            srv.url,
            symbolizer_ca_file=str(pki / "ca.pem"),
            symbolizer_client_cert=str(pki / "client.pem"),
            symbolizer_client_key=str(pki / "client.key"),
        )
        ids = env.put(2)
        env.exporter.start()
        wait_for(lambda: len(env.spool) == 0)
        assert sorted(srv.stored) == sorted(ids)
    finally:
        srv.close()


def test_tls_server_not_trusted_without_our_ca(pki, make_env):
    srv = _mtls_server(pki)
    try:
        env = make_env(
            srv.url,
            symbolizer_client_cert=str(pki / "client.pem"),
            symbolizer_client_key=str(pki / "client.key"),
        )
        env.put(1)
        env.exporter.start()
        wait_for(lambda: env.metric("bistouri_export_failures_total", reason="tls") >= 1)
        assert len(env.spool) == 1 and not srv.stored
    finally:
        srv.close()


# -- the ingest contract after the hardening (docs/api.md)


def _failed(*ids: str) -> list[dict[str, str]]:
    return [{"id": i, "reason": "symbolize_failed", "detail": "ENOSPC"} for i in ids]


def test_503_with_failed_sessions_keeps_them_and_drops_the_stored_ones(server, make_env):
    env = make_env(server.url)
    ids = env.put(3)
    server.script.append(
        (
            503,
            {"Retry-After": "0"},
            {"accepted": [ids[0]], "duplicates": [ids[1]], "rejected": [], "failed": _failed(ids[2])},
        )
    )
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    # Only the failed one came again; the stored ones were done after the first answer.
    assert [b for _, b in server.posts] == [ids, [ids[2]]]
    assert env.spool.rejected() == [] and os.listdir(env.spool.rejected_dir) == []
    assert env.metric("bistouri_export_sessions_rejected_total") == 0
    assert env.metric("bistouri_export_sessions_sent_total") == 3
    assert env.metric("bistouri_export_failures_total", reason="unavailable") == 1


def test_a_session_failing_server_side_again_and_again_is_never_rejected(server, make_env):
    env = make_env(server.url)
    [sid] = env.put(1)
    answer = {"accepted": [], "duplicates": [], "rejected": [], "failed": _failed(sid)}
    server.script.extend([(503, {"Retry-After": "0"}, answer)] * 5)
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert [b for _, b in server.posts] == [[sid]] * 6 and server.stored == {sid: 1}
    assert env.spool.rejected() == []


@pytest.mark.parametrize("retry_after", ["0", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_retry_after_zero_or_past_never_waits_less_than_the_backoff(server, make_env, retry_after):
    server.always = (503, {"Retry-After": retry_after}, {"error": "unavailable", "detail": "db down"})
    env = make_env(server.url, backoff_initial_s=0.2, backoff_max_s=0.2)
    env.put(1)
    env.exporter.start()
    wait_for(lambda: len(server.posts) >= 4)
    env.close()
    gaps = [b - a for a, b in pairwise(t for t, _ in server.posts)]
    # Before: ~250 POSTs a second (3-4 ms apart). Each gap is at least the backoff, by construction.
    assert all(g >= 0.2 for g in gaps), gaps
    assert len(env.spool) == 1


def test_an_oversized_answer_is_not_read_whole_nor_trusted(server, make_env):
    env = make_env(server.url)
    ids = env.put(2)
    big = {"accepted": ids, "duplicates": [], "rejected": [], "pad": "x" * (2 << 20)}
    server.script.append((200, {}, big))
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert [b for _, b in server.posts] == [ids, ids]  # the 2 MiB answer was cut off, the batch sent again
    assert env.metric("bistouri_export_failures_total", reason="response_too_large") == 1


def test_an_older_symbolizers_symbolize_failed_rejection_is_kept_not_rejected(server, make_env):
    env = make_env(server.url)
    [sid] = env.put(1)
    old = {"accepted": [], "duplicates": [], "rejected": _failed(sid)}  # before the contract: a 400
    server.script.append((400, {}, old))
    env.exporter.start()
    wait_for(lambda: len(env.spool) == 0)
    assert [b for _, b in server.posts] == [[sid], [sid]] and server.stored == {sid: 1}
    assert env.spool.rejected() == [] and env.metric("bistouri_export_sessions_rejected_total") == 0

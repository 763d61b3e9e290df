"""The agent's /metrics endpoint: idle, slow and oversized clients cannot stall a scrape."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from bistouri.agent.metrics import AgentMetrics, MetricsAndControlServer


class Served:
    def __init__(self, **kw: object) -> None:
        self.reg = CollectorRegistry()
        self.metrics = AgentMetrics(self.reg)
        self.metrics.exec_events.inc(7)
        self.server = MetricsAndControlServer(
            "127.0.0.1",
            0,
            self.reg,
            self.metrics.scrape_connections_dropped,
            **kw,  # type: ignore[arg-type]
        )
        self.thread = threading.Thread(target=self.server.serve, name="test-metrics", daemon=True)
        self.thread.start()
        self.clients: list[socket.socket] = []

    def connect(self, send: bytes = b"") -> socket.socket:
        c = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        if send:
            c.sendall(send)
        self.clients.append(c)
        return c

    def scrape(self, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.port}/metrics", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()

    def dropped(self, reason: str) -> float:
        return (
            self.reg.get_sample_value("bistouri_metrics_connections_dropped_total", {"reason": reason}) or 0
        )

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.server.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(**kw: object) -> Served:
        made.append(Served(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout} s")


def test_a_scrape_is_answered_while_idle_and_slow_header_connections_are_open(serve):
    s = serve()
    for _ in range(10):
        s.connect()  # idle: sends nothing (before, the first one blocked every scrape for good)
    for _ in range(10):
        s.connect(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    status, _, body = s.scrape()
    assert status == 200 and b"bistouri_exec_events_total 7.0" in body


def test_idle_connections_time_out_and_are_counted(serve):
    s = serve(request_timeout_s=0.2)
    c = s.connect(b"GET / HTTP/1.1\r\n")
    assert c.recv(100) == b""  # closed by the server once its time was up
    wait_for(lambda: s.dropped("timeout") == 1)


def test_connections_beyond_the_bound_close_the_oldest(serve):
    s = serve(max_connections=4)
    first = [s.connect() for _ in range(4)]
    s.connect()
    assert first[0].recv(100) == b""  # made room
    wait_for(lambda: s.dropped("overflow") == 1)
    assert s.scrape()[0] == 200


def test_an_endless_request_head_is_refused(serve):
    s = serve()
    c = s.connect(b"GET / HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 9000)
    assert c.recv(100) == b""
    wait_for(lambda: s.dropped("too_large") == 1)


def test_gzip_head_filtering_and_methods(serve):
    s = serve()
    _, headers, body = s.scrape({"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and b"bistouri_exec_events_total" in gzip.decompress(body)
    c = s.connect(b"GET /metrics?name[]=bistouri_exec_events_total HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while chunk := c.recv(65536):
        answer += chunk
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and text.count(b"# TYPE") == 1
    c = s.connect(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert c.recv(100).startswith(b"HTTP/1.1 405")


class _Broken:
    def collect(self):
        raise RuntimeError("collector bug")


def test_a_failing_collector_answers_500_and_the_endpoint_stays(serve):
    s = serve()
    broken = _Broken()
    s.reg.register(broken)  # type: ignore[arg-type]
    c = s.connect(b"GET /metrics HTTP/1.1\r\n\r\n")
    assert c.recv(100).startswith(b"HTTP/1.1 500")
    s.reg.unregister(broken)  # type: ignore[arg-type]
    assert s.scrape()[0] == 200


def _post(served: Served, target: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{served.server.port}{target}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_capture_now_is_handed_to_its_handler_with_the_service(serve):
    asked: list[str] = []

    def capture(service: str) -> tuple[int, dict[str, object]]:
        asked.append(service)
        return (202, {"session_id": "x"}) if service == "web" else (404, {"error": "no"})

    s = serve(capture=capture)
    assert _post(s, "/v1/capture?service=web") == (202, b'{"session_id": "x"}\n')
    assert _post(s, "/v1/capture?service=db")[0] == 404
    assert _post(s, "/v1/capture")[0] == 400  # no service: the handler is not called
    assert _post(s, "/v1/capture?service=a&service=b")[0] == 400
    assert _post(s, "/metrics")[0] == 405  # POST is only for a capture
    assert asked == ["web", "db"]
    assert s.scrape()[0] == 200


def test_capture_now_without_a_handler_is_not_found(serve):
    assert _post(serve(), "/v1/capture?service=web")[0] == 404


def test_only_loopback_peers_may_capture():
    from bistouri.agent.metrics import _is_loopback

    assert _is_loopback(("127.0.0.1", 1)) and _is_loopback(("::1", 1, 0, 0))
    assert _is_loopback(("::ffff:127.0.0.1", 1, 0, 0))
    assert not _is_loopback(("10.0.0.5", 1)) and not _is_loopback(("::ffff:10.0.0.5", 1, 0, 0))
    assert not _is_loopback("") and not _is_loopback(("not an address", 1))

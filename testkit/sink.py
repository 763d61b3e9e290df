"""An HTTP endpoint that keeps what it is sent: the OTLP collector and Pyroscope server of the export
tests and bench. It answers `status` (settable while it runs: 503 plays an outage) after `delay_s`,
and keeps every request with the status it got, in order. With `endless_body`, an answer says it has
a gigabyte of body and sends it a byte at a time until the sink closes (a hostile endpoint).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bistouri.compat import SLOTS


@dataclass(frozen=True, **SLOTS)
class Received:
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes  # as sent, gzip undone
    status: int  # what the sink answered

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300


class Sink:
    """A running endpoint on 127.0.0.1; `url` is its base. A context manager: stops on exit."""

    def __init__(self) -> None:
        self.status = 200
        self.delay_s = 0.0
        self.endless_body = False
        self._closing = threading.Event()
        self.received: list[Received] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # connections kept alive, as collectors and Pyroscope do

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if sink.delay_s:
                    time.sleep(sink.delay_s)
                status = sink.status
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                with sink._lock:
                    sink.received.append(Received(parts.path, query, dict(self.headers), body, status))
                self.send_response(status)
                self.send_header("Content-Length", str(1 << 30 if sink.endless_body else 0))
                self.end_headers()
                while sink.endless_body and not sink._closing.wait(0.5):
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:  # the client hung up: what a client that reads no body does
                        return

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="sink", daemon=True)
        self._thread.start()

    def accepted(self, path: str = "") -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.accepted and r.path.startswith(path)]

    def wait_for(self, predicate: Callable[[Sink], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

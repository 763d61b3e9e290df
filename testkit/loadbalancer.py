"""A real HAProxy (Debian's) in front of symbolizer instances, for fleet tests.

Runs `haproxy -db` (foreground, no systemd) with a generated configuration on loopback
ports: round robin over the backends, health-checked on /healthz every 250 ms, so that
an instance that dies is out of rotation within about half a second. With no backend
up, HAProxy answers 503 without a Retry-After, as a load balancer does in an outage.
Every request is logged (status, time, server, request line) to `log_path`.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from testkit.symbolizer import free_port

_CONFIG = """\
global
    maxconn 4096
    stats socket {admin} mode 600 level admin
    log stdout format raw local0 info

defaults
    mode http
    log global
    # status, total time (ms), server, request line: see request_times()
    log-format "%ST %Ta %s %{{+Q}}r"
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    timeout check 2s
    # A connection refused by a dead instance is tried again on another: nothing was sent.
    retries 2
    option redispatch

frontend symbolizer
    bind 127.0.0.1:{port}
    default_backend instances

backend instances
    balance roundrobin
    option httpchk GET /healthz
{servers}
"""


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if path is None:
        pytest.fail("HAProxy is missing: run `make deps` (haproxy)")
    return path


class HAProxy:
    """`haproxy -db` balancing over `backend_ports`; `.url` is its frontend."""

    def __init__(self, directory: Path, backend_ports: Sequence[int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = directory / "haproxy.sock"
        # A refused connection (a dead instance) is seen at the next check; a busy one answers
        # /healthz within a second, and is not taken out for being slower than the interval.
        check = "check inter 250ms fall 2 rise 1"
        servers = "\n".join(f"    server s{i} 127.0.0.1:{p} {check}" for i, p in enumerate(backend_ports))
        self.config = directory / "haproxy.cfg"
        self.config.write_text(_CONFIG.format(admin=self.admin, port=self.port, servers=servers))
        self.log_path = directory / "haproxy.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [haproxy_binary(), "-db", "-f", str(self.config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log_path.read_text(errors='replace')}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.05)
        raise RuntimeError("haproxy did not listen within 10 s")

    def up_servers(self) -> int:
        """How many backends HAProxy's health checks see up now."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.admin))
            s.sendall(b"show stat\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        rows = [line.split(",") for line in out.decode().splitlines() if line and not line.startswith("#")]
        servers = [r for r in rows if r[0] == "instances" and r[1] not in ("BACKEND", "FRONTEND")]
        return sum(1 for r in servers if r[17] == "UP")  # column 17: status

    def request_times(self, method: str, path_prefix: str) -> list[tuple[int, float, str]]:
        """(status, seconds from the request's first byte to the end of the answer, the server
        or <NOSRV>) of every `method` request under `path_prefix` so far, from HAProxy's log."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[0].isdigit() and parts[3].startswith(f'"{method} {path_prefix}'):
                out.append((int(parts[0]), int(parts[1]) / 1000, parts[2]))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

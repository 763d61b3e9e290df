"""Runs the real agent as a subprocess for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.metrics import AgentMetrics
from bistouri.agent.spool import read_waiting
from bistouri.capture.sessions import SessionCapture
from bistouri.host.kernel import read_kernel_meta
from testkit.helpers import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProcess:
    def __init__(self, workdir: Path, config: str, *extra: str, walk_interval: float = 30.0) -> None:
        self.workdir = workdir
        self.config_path = workdir / "trigger.yaml"
        self.config_path.write_text(config)
        self.spool_dir = workdir / "spool"
        self.log_path = workdir / "agent.log"
        self.metrics_port = free_port()
        self.argv = [
            sys.executable,
            "-m",
            "bistouri",
            "--log-level",
            "debug",
            "agent",
            "--config",
            str(self.config_path),
            "--spool-dir",
            str(self.spool_dir),
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-addr",
            "127.0.0.1",
            "--tenant-id",
            "test",
            "--walk-interval-secs",
            str(walk_interval),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, wait_active: bool = True) -> AgentProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        if wait_active:
            ok = wait_until(lambda: "Agent active" in self.log() or self.proc.poll() is not None, 30)
            assert ok and self.proc.poll() is None, f"agent did not start:\n{self.log()}"
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def sessions(self) -> list[wire.Session]:
        if not self.spool_dir.exists():
            return []
        # Read beside the running agent: a Spool here would remove the agent's half-written files.
        return [wire.decode_session(f.data) for f in read_waiting(str(self.spool_dir))]

    def wait_session(self, predicate, timeout: float) -> wire.Session | None:
        def find() -> wire.Session | None:
            for s in self.sessions():
                if predicate(s):
                    return s
            return None

        return wait_until(find, timeout, step=0.25)  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        import urllib.request

        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM and wait; returns how long the exit took."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - t0

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SessionSink:
    """A SessionCapture's sink that keeps the sessions, decoded, in order."""

    def __init__(self) -> None:
        self.sessions: list[wire.Session] = []

    def put(self, session_id: str, data: bytes) -> str:
        self.sessions.append(wire.decode_session(data))
        return session_id


def capture_in_process(pid_filter: Any, sink: SessionSink, freq_hz: int, **options: Any) -> SessionCapture:
    """The agent's capture path over a Profiler in this process (no trigger, no spool)."""
    return SessionCapture(
        pid_filter,
        sink,
        AgentMetrics(CollectorRegistry()),
        read_kernel_meta(),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000_000 // freq_hz,
        **options,
    )


def burner_config(
    comm: str = "burner", resource: str = "cpu", threshold: float = 5, capture: float = 3, extra: str = ""
) -> str:
    return (
        "targets:\n"
        f"  - rule: {{type: Exact, comm: {comm}}}\n"
        f"    service_id: {comm.replace('-', '_')}_svc\n"
        f"    resources: [{{resource: {resource}, threshold: {threshold}}}]\n"
        f"    capture_duration_secs: {capture}\n"
        f"{extra}"
    )


def environ_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}

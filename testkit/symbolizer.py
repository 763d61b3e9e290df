"""A real symbolizer service in a subprocess, and what feeding it needs: the tests' and the benches'.

`symbolizer_command(**flags)` is `bistouri symbolizer` with flags given as keywords (`workers=2` ->
`--workers 2`, `read_token=True` -> `--read-token`, a list repeats the flag); `SymbolizerURL` is the
base URL of a started one with its process and files; `wait_healthy` and `stop` bracket its life
(tests/integration/conftest.py's `symbolizer_server` fixture starts them). The made-up kernel
(`KALLSYMS`, `KERNEL_BUILD_ID`, `KERNEL_IPS`) and the demo program's source (`DEMO_C`) are the inputs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
START_TIMEOUT_S = 60.0


class SymbolizerURL(str):
    """The base URL of a running symbolizer, with its process and files."""

    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path
    token: str | None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def symbolizer_command(**flags: Any) -> list[str]:
    """`python -m bistouri symbolizer` with flags given as keywords."""
    cmd = [sys.executable, "-m", "bistouri", "symbolizer"]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cmd.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                cmd += [flag, str(v)]
        else:
            cmd += [flag, str(value)]
    return cmd


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without symbolizer settings or debuginfod servers (no network)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BISTOURI_SYMBOLIZER_")}
    env.pop("DEBUGINFOD_URLS", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def wait_healthy(url: SymbolizerURL, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if url.proc.poll() is not None:
            raise RuntimeError(f"symbolizer exited with {url.proc.returncode}:\n{url.log_tail()}")
        try:
            if requests.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"symbolizer not healthy after {timeout_s:.0f} s:\n{url.log_tail()}")


def stop(url: SymbolizerURL, timeout_s: float = 20.0) -> int | None:
    proc = url.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # gunicorn's workers share the master's process group (start_new_session below).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` (with at least these labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        got = {}
        for part in label_text.rstrip("}").split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                got[k] = v.strip('"')
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total += float(value)
    return total


DEMO_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long leaf_work(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += i * i;
    return s;
}
__attribute__((noinline)) long middle_step(long n) { return leaf_work(n) + 1; }
int main(int argc, char **argv) { printf("%ld\n", middle_step(argc > 1 ? atol(argv[1]) : 10)); return 0; }
"""

# A kallsyms snapshot of a made-up kernel: the service only needs text it can parse.
KERNEL_BUILD_ID = bytes.fromhex("6b65726e656c2d666f722d74657374732d303031")
KALLSYMS = b"""ffffffff81000000 T _text
ffffffff81000100 T entry_SYSCALL_64
ffffffff81000400 T do_syscall_64
ffffffff81001000 T ksys_read
ffffffff81002000 t vfs_read
ffffffff81003000 T schedule
ffffffff81003800 T io_schedule
ffffffff81004000 T _etext
"""
KERNEL_IPS = {
    "entry_SYSCALL_64": 0xFFFFFFFF81000110,
    "ksys_read": 0xFFFFFFFF81001020,
    "io_schedule": 0xFFFFFFFF81003810,
}

"""Shared fixtures: a real symbolizer service in a subprocess, and helpers to feed it.

`symbolizer_server(tmp_path, **flags)` starts `bistouri symbolizer` on a free
127.0.0.1 port and returns its URL once /healthz answers. Keyword flags become
command-line flags (`workers=2` → `--workers 2`, `read_token=True` →
`--read-token`, a list repeats the flag). The returned URL is a `str` that also
carries `.proc`, `.state_dir`, `.log_path` and `.token`. Every server is stopped
(SIGTERM, then SIGKILL of its process group) when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

if TYPE_CHECKING:
    from .pg import PgServer

REPO = Path(__file__).resolve().parents[2]
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


# One real PostgreSQL per module that asks for it (pg.py); skipped where none can be started.
@pytest.fixture(scope="module")
def postgres() -> Iterator[PgServer]:
    from .pg import PgUnavailable, running_postgres  # pg.py imports this module

    try:
        with running_postgres() as pg:
            yield pg
    except PgUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def symbolizer_server() -> Iterator[Callable[..., SymbolizerURL]]:
    started: list[SymbolizerURL] = []

    def start(tmp_path: Path, **flags: Any) -> SymbolizerURL:
        port = int(flags.pop("port", 0) or free_port())
        env = clean_env(**flags.pop("env", {}))
        token = flags.pop("token", None)
        if token is not None and "token_file" not in flags:
            token_file = tmp_path / f"token-{port}"
            token_file.write_text(token + "\n")
            flags["token_file"] = token_file
        state_dir = Path(flags.pop("state_dir", tmp_path / f"symbolizer-{port}"))
        flags.setdefault("workers", 2)
        flags.setdefault("log_level", "info")
        cmd = symbolizer_command(listen_addr=f"127.0.0.1:{port}", state_dir=state_dir, **flags)
        log_path = tmp_path / f"symbolizer-{port}.log"
        with open(log_path, "ab") as log:  # appended: a test may restart a server on the same port
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        url = SymbolizerURL(f"http://127.0.0.1:{port}")
        url.proc, url.state_dir, url.log_path, url.token = proc, state_dir, log_path, token
        started.append(url)
        wait_healthy(url)
        return url

    yield start
    for url in started:
        stop(url)


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


# ---------------------------------------------------------------------------
# Inputs: a real binary with frame pointers and debug info, a kallsyms snapshot, sessions

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


class DemoBinary:
    def __init__(self, path: Path, build_id: bytes, offsets: dict[str, int]) -> None:
        self.path = path
        self.dir = path.parent
        self.build_id = build_id
        self.offsets = offsets  # function name -> a file offset inside it


@pytest.fixture(scope="session")
def demo_binary(tmp_path_factory: pytest.TempPathFactory) -> DemoBinary:
    """A small C program built here with -g and frame pointers; offsets of its functions."""
    from bistouri.elf import ElfFile

    cc = next((c for c in ("gcc", "cc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler (gcc, cc or clang) to build the demo binary")
    d = tmp_path_factory.mktemp("bin")
    src = d / "demo.c"
    src.write_text(DEMO_C)
    out = d / "bistouri-demo"
    subprocess.run(
        [cc, "-g", "-O0", "-fno-omit-frame-pointer", "-Wl,--build-id", "-o", str(out), str(src)], check=True
    )
    offsets = {}
    with ElfFile(out) as elf:
        build_id = elf.build_id
        assert build_id, "the demo binary has no GNU build id"
        for name in ("main", "middle_step", "leaf_work"):
            vaddr = elf.find_symbol(name)
            assert vaddr is not None, name
            seg = next(s for s in elf.segments if s.vaddr <= vaddr < s.vaddr + s.filesz)
            offsets[name] = vaddr - seg.vaddr + seg.offset + 4  # a few bytes in, as a return address is
    return DemoBinary(out, build_id, offsets)


def make_session(
    sid: str,
    binary: DemoBinary,
    *,
    service: str = "api",
    host: str = "host-1",
    comm: str = "bistouri-demo",
    resource: str = "cpu",
    start_ns: int = 1_763_000_000 * 10**9,
    kernel: bool = True,
    scale: int = 1,
) -> Any:
    """A wire session: user stacks in `binary`, kernel stacks in the test kernel, vDSO and unknown frames."""
    from bistouri import wire

    def user(*names: str) -> tuple[Any, ...]:  # leaf first, as the wire has it
        return tuple(wire.UserFrame(wire.FRAME_RESOLVED, binary.build_id, binary.offsets[n]) for n in names)

    kernel_stack = (KERNEL_IPS["io_schedule"], KERNEL_IPS["ksys_read"], KERNEL_IPS["entry_SYSCALL_64"])
    traces = [
        wire.Trace((), user("leaf_work", "middle_step", "main"), 100, 100, on_cpu=40 * scale),
        wire.Trace((), user("middle_step", "main"), 100, 101, on_cpu=10 * scale),
        wire.Trace(
            kernel_stack if kernel else (),
            user("main"),
            100,
            101,
            off_cpu=5 * scale,
            off_cpu_ns=7_000_000 * scale,
        ),
        wire.Trace((), (wire.UserFrame(wire.FRAME_VDSO, b"", 0x7FFF_F7FC_1000),), 100, 100, on_cpu=2 * scale),
        wire.Trace(
            (), (wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x5555_0000_1234),), 100, 100, on_cpu=1 * scale
        ),
    ]
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger(
            resource, "some", 100_000, 2_000_000, "/test.slice", start_ns - 10**6, 12.5, 4.0, 1.0, 42
        ),
        kernel=wire.KernelInfo("6.18.0-test", KERNEL_BUILD_ID, 0xFFFFFFFF81000000),
        start_ns=start_ns,
        duration_ns=10 * 10**9,
        period_ns=52_631_578,
        service=service,
        host=host,
        labels={"zone": "z1"},
        processes={100: comm},
        threads={100: comm, 101: "worker"},
        traces=traces,
    )


def post_sessions(url: str, sessions: list[Any], token: str | None = None, **kw: Any) -> requests.Response:
    """POST a batch exactly as the agent's exporter sends it."""
    import gzip

    from bistouri import wire

    body = gzip.compress(wire.encode_batch(wire.encode_session(s) for s in sessions))
    headers = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(url + "/v1/sessions", data=body, headers=headers, timeout=60, **kw)


def put_kernel(url: str, token: str | None = None) -> requests.Response:
    import gzip

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.put(
        url + "/v1/kernels/" + KERNEL_BUILD_ID.hex(),
        data=gzip.compress(KALLSYMS),
        headers=headers,
        timeout=60,
    )

"""Shared fixtures: a real symbolizer service in a subprocess (testkit/symbolizer.py), and helpers to feed it.

`symbolizer_server(tmp_path, **flags)` starts `bistouri symbolizer` on a free
127.0.0.1 port and returns its URL once /healthz answers. Keyword flags become
command-line flags (`workers=2` → `--workers 2`, `read_token=True` →
`--read-token`, a list repeats the flag). The returned URL is a `str` that also
carries `.proc`, `.state_dir`, `.log_path` and `.token`. Every server is stopped
(SIGTERM, then SIGKILL of its process group) when the test ends.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from bistouri.pressure import PressureFigures
from testkit.symbolizer import (
    DEMO_C,
    KALLSYMS,
    KERNEL_BUILD_ID,
    KERNEL_IPS,
    REPO,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    symbolizer_command,
    wait_healthy,
)

if TYPE_CHECKING:
    from testkit.pg import PgServer


# One real PostgreSQL per module that asks for it (pg.py); skipped where none can be started.
@pytest.fixture(scope="module")
def postgres() -> Iterator[PgServer]:
    from testkit.pg import PgUnavailable, running_postgres

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


# ---------------------------------------------------------------------------
# Inputs: a real binary with frame pointers and debug info, a kallsyms snapshot, sessions


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
            resource,
            "some",
            100_000,
            2_000_000,
            "/test.slice",
            start_ns - 10**6,
            pressure=PressureFigures(12.5, 4.0, 1.0, 42),
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

"""kallsyms per (kernel build id, boot), uploaded again when modules or BPF programs change (issue 11).

This machine has no loadable kernel modules (no /proc/modules): a BPF program loaded after the first
upload stands for one; its symbol is tagged `[bpf]` in /proc/kallsyms as a module's is `[name]`.
"""

from __future__ import annotations

import ctypes
import gzip
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.exporter import Exporter
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from bistouri.host.kernel import read_kallsyms, read_kernel_meta
from bistouri.pressure import PressureFigures
from bistouri.symbolizer.kallsyms import KallsymsStore
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.service.server import ServerConfig, SymbolizerApp
from bistouri.wire.snapshot import loaded_code_digest
from testkit.helpers import wait_until
from testkit.wsgiclient import Client

DEADLINE_S = 60.0
BUILD_ID = bytes.fromhex("6b65726e656c2d666f722d74657374732d303031")


def kernel_session(sid: str, build_id: bytes, boot_id: bytes, text_addr: int, ip: int) -> wire.Session:
    frame = wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x1000)
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger(
            "cpu", "some", 100_000, 2_000_000, "/t.slice", 10**18, pressure=PressureFigures(1.0, 1.0, 1.0, 1)
        ),
        kernel=wire.KernelInfo("6.18.0-test", build_id, text_addr, boot_id),
        start_ns=10**18,
        duration_ns=10**9,
        period_ns=10**7,
        service="svc",
        host="h",
        labels={},
        processes={1: "k"},
        threads={1: "k"},
        traces=[wire.Trace((ip,), (frame,), 1, 1, on_cpu=3)],
    )


def kernel_names(client_or_url: Any, sid: str) -> set[str]:
    if isinstance(client_or_url, Client):
        doc = client_or_url.get(f"/v1/sessions/{sid}/speedscope").json
    else:
        r = requests.get(f"{client_or_url}/v1/sessions/{sid}/speedscope", timeout=10)
        doc = r.json() if r.status_code == 200 else {"shared": {"frames": []}}
    assert doc is not None
    return {f["name"] for f in doc["shared"]["frames"]}


def test_each_session_names_module_frames_from_its_own_boots_snapshot(tmp_path: Path) -> None:
    def factory(kernels: KallsymsStore) -> Resolver:
        return Resolver.from_options(
            tmp_path, kernels=kernels, debuginfod_urls=[], registry=CollectorRegistry(), use_llvm=False
        )

    app = SymbolizerApp(ServerConfig(state_dir=tmp_path), factory)
    app.store.migrate()
    client = Client(app)
    text = 0xFFFFFFFF81000000  # no KASLR: both boots have the same _text, their modules differ
    boots = {"a": b"\xaa" * 16, "b": b"\xbb" * 16}
    try:
        for name, boot in boots.items():
            snapshot = (
                f"{text:x} T _text\n{text + 0x100:x} T schedule\n{text + 0x4000:x} T _etext\n"
                f"ffffffffc0001000 t mod_{name}_fn\t[mod_{name}]\n"
                f"ffffffffc0002000 t mod_{name}_end\t[mod_{name}]\n"
            )
            r = client.put(
                f"/v1/kernels/{BUILD_ID.hex()}?boot={boot.hex()}", data=gzip.compress(snapshot.encode())
            )
            assert r.status_code == 204, r.text
        for name, boot in boots.items():
            s = kernel_session(f"boot-{name}", BUILD_ID, boot, text, 0xFFFFFFFFC0001010)
            body = wire.encode_batch([wire.encode_session(s)])
            r = client.post("/v1/sessions", data=body, content_type="application/x-msgpack")
            assert r.json is not None and r.json["accepted"] == [f"boot-{name}"], r.text
        # Kernel frames are shown with a `_[k]` suffix.
        assert {n for n in kernel_names(client, "boot-a") if n.startswith("mod_")} == {"mod_a_fn_[k]"}
        assert {n for n in kernel_names(client, "boot-b") if n.startswith("mod_")} == {"mod_b_fn_[k]"}
    finally:
        app.close()


# -- a BPF program loaded after the first upload -----------------------------------------------

_SYS_BPF = 321  # x86_64
_BPF_PROG_LOAD = 5
_SOCKET_FILTER = 1
_libc = ctypes.CDLL(None, use_errno=True)


def load_bpf_program(name: str) -> int:
    """A two-instruction socket filter named `name` (r0 = 0; exit): its fd."""
    insns = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    insn_buf = ctypes.create_string_buffer(insns, len(insns))
    license = ctypes.create_string_buffer(b"GPL")
    attr = bytearray(128)
    struct.pack_into(
        "<IIQQ", attr, 0, _SOCKET_FILTER, 2, ctypes.addressof(insn_buf), ctypes.addressof(license)
    )
    attr[48 : 48 + len(name)] = name.encode()  # prog_name, after log_level..prog_flags
    buf = ctypes.create_string_buffer(bytes(attr), len(attr))
    fd = _libc.syscall(_SYS_BPF, _BPF_PROG_LOAD, buf, len(attr))
    if fd < 0:
        pytest.skip(f"cannot load a BPF program: {os.strerror(ctypes.get_errno())}")
    return int(fd)


def kallsyms_address(name: str, suffix: bool = False) -> int | None:
    """The address of a text symbol of that name (or ending so: a BPF program's has a tag before)."""
    want = name.encode()
    for line in read_kallsyms().splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[1] not in (b"t", b"T"):
            continue
        if parts[2] == want or (suffix and parts[2].endswith(want)):
            return int(parts[0], 16)
    return None


@pytest.fixture
def bpf_programs() -> Iterator[list[int]]:
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


class _Agent:
    """An agent's exporter and spool, as the agent wires them (its kallsyms, boot and loaded-code digest)."""

    def __init__(self, url: str, directory: Path, kernel: Any) -> None:
        self.kernel = kernel
        self.registry = CollectorRegistry()
        self.spool = Spool(str(directory), 16 << 20, registry=self.registry, kernel_build_id=kernel.build_id)

        def kallsyms(build_id: bytes) -> bytes | None:
            return gzip.compress(read_kallsyms(), 6) if build_id == kernel.build_id else None

        self.exporter = Exporter(
            self.spool,
            AgentSettings(symbolizer_endpoint=url),
            registry=self.registry,
            kallsyms_provider=kallsyms,
            kernel_boot=kernel.boot_id,
            loaded_code_digest=lambda: loaded_code_digest(read_kallsyms()),
            kernel_recheck_s=0,  # every batch: the tests load a program between two
        )

    def send(self, sid: str, ip: int) -> None:
        k = self.kernel
        assert self.spool.put(
            sid, wire.encode_session(kernel_session(sid, k.build_id, k.boot_id, k.text_addr, ip))
        )
        self.exporter.notify()

    def uploads(self) -> float:
        return self.registry.get_sample_value("bistouri_export_kernel_uploads_total") or 0.0


def _live_kernel() -> Any:
    kernel = read_kernel_meta()
    if not kernel.build_id or not kernel.text_addr or len(kernel.boot_id) != 16:
        pytest.skip("needs the kernel's build id, readable kallsyms and a boot id")
    return kernel


def _load_late_program(bpf_programs: list[int], name: str) -> int:
    bpf_programs.append(load_bpf_program(name))
    late = kallsyms_address(f"_{name}", suffix=True)
    assert late is not None, "the kernel lists no JIT'd BPF programs in kallsyms (bpf_jit_kallsyms off)"
    return late


def test_a_bpf_program_loaded_after_the_first_upload_gets_its_name(
    symbolizer_server: Any, tmp_path: Path, bpf_programs: list[int]
) -> None:
    url = symbolizer_server(tmp_path)
    agent = _Agent(url, tmp_path / "spool", _live_kernel())
    try:
        agent.exporter.start()
        schedule = kallsyms_address("schedule")
        assert schedule is not None
        agent.send("before-1", schedule + 4)
        assert wait_until(lambda: "schedule_[k]" in kernel_names(url, "before-1"), DEADLINE_S)
        assert agent.uploads() == 1
        late = _load_late_program(bpf_programs, "i11_late")
        agent.send("after-1", late + 4)
        assert wait_until(lambda: any("i11_late" in n for n in kernel_names(url, "after-1")), DEADLINE_S)
        assert agent.uploads() == 2  # uploaded again: the loaded code changed
    finally:
        agent.exporter.stop()


def test_an_agent_restarted_on_the_same_boot_replaces_an_older_snapshot(
    symbolizer_server: Any, tmp_path: Path, bpf_programs: list[int]
) -> None:
    """A program loaded while the agent was down: the symbolizer already has this boot's snapshot, but an
    older one. The new agent sees that from the digest the symbolizer reports, and uploads."""
    url = symbolizer_server(tmp_path)
    kernel = _live_kernel()
    first = _Agent(url, tmp_path / "spool", kernel)
    try:
        first.exporter.start()
        schedule = kallsyms_address("schedule")
        assert schedule is not None
        first.send("first-run", schedule + 4)
        assert wait_until(lambda: "schedule_[k]" in kernel_names(url, "first-run"), DEADLINE_S)
        assert first.uploads() == 1
    finally:
        first.exporter.stop()
    late = _load_late_program(bpf_programs, "i11_restart")  # while no agent runs
    held = requests.get(f"{url}/v1/kernels/{kernel.build_id.hex()}?boot={kernel.boot_id.hex()}", timeout=10)
    assert held.status_code == 200
    assert held.json()["loaded_code"] not in ("", loaded_code_digest(read_kallsyms()))
    second = _Agent(url, tmp_path / "spool", kernel)
    try:
        second.exporter.start()
        second.send("second-run", late + 4)
        assert wait_until(
            lambda: any("i11_restart" in n for n in kernel_names(url, "second-run")), DEADLINE_S
        )
        assert second.uploads() == 1
    finally:
        second.exporter.stop()

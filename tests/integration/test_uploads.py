"""Upload on demand (issue 11): a symbolizer with no sources gets the files from the agents' hosts.

Real symbolizer processes over HTTP, real exporters and ProcMaps reading real running programs.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.uploader import Uploader
from bistouri.elf import ElfFile
from testkit.helpers import wait_until
from testkit.symbolizer import metric_value
from testkit.uploads import (
    DEADLINE_S,
    Agent,
    build,
    names,
    session,
    speedscope_frames,
)


@pytest.fixture
def run_program() -> Any:
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], path: Path | None = None) -> int:
        p = subprocess.Popen(argv)
        procs.append(p)
        exe = str(path or argv[0])
        # Mapped once the loader is done: its maps name the program.
        assert wait_until(lambda: exe in Path(f"/proc/{p.pid}/maps").read_text(), DEADLINE_S)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_symtab_binary_uploaded_from_the_agent_host_names_the_stored_session(
    symbolizer_server: Any, tmp_path: Path, run_program: Any
) -> None:
    prog = build(tmp_path, "upload-symtab", "symtab")
    url = symbolizer_server(tmp_path)  # no --debug-dir, --binary-dir or debuginfod
    agent = Agent(tmp_path, url, "a", run_program([str(prog.path)]))
    try:
        agent.send(session("up-1", prog))
        assert wait_until(lambda: "upload_leaf" in names(url, "up-1"), DEADLINE_S)
        assert {"upload_leaf", "upload_middle", "main"} <= names(url, "up-1")
        assert wait_until(
            lambda: agent.metric("bistouri_upload_files_total", kind="executable") == 1, DEADLINE_S
        )
        sent = agent.metric("bistouri_upload_bytes_total")
        assert 0 < sent < prog.path.stat().st_size  # compressed on the wire
    finally:
        agent.stop()


def test_dwarf_only_in_the_agent_hosts_build_id_tree_gives_file_and_line(
    symbolizer_server: Any, tmp_path: Path, run_program: Any
) -> None:
    prog = build(tmp_path, "upload-dwarf", "stripped")
    url = symbolizer_server(tmp_path)
    agent = Agent(tmp_path, url, "a", run_program([str(prog.path)]), upload_debug_dir=str(tmp_path / "debug"))
    try:
        agent.send(session("dw-1", prog))

        def leaf() -> dict[str, Any] | None:
            return next((f for f in speedscope_frames(url, "dw-1") if f["name"] == "upload_leaf"), None)

        assert wait_until(lambda: (leaf() or {}).get("line"), DEADLINE_S)
        frame = leaf()
        assert frame is not None and frame["file"].endswith("upload-dwarf.c") and frame["line"] == 3
        assert wait_until(
            lambda: agent.metric("bistouri_upload_files_total", kind="debuginfo") == 1, DEADLINE_S
        )
    finally:
        agent.stop()


def test_binary_visible_only_in_a_private_mount_namespace(
    symbolizer_server: Any, tmp_path: Path, run_program: Any
) -> None:
    prog = build(tmp_path, "upload-ns", "symtab")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    inside = hidden / "prog"
    script = f"mount -t tmpfs tmpfs {hidden} && cp {prog.path} {inside} && exec {inside}"
    pid = run_program(["unshare", "-m", "--propagation", "private", "sh", "-c", script], inside)
    prog.path.unlink()  # nowhere on the host's file system now
    assert not inside.exists()
    url = symbolizer_server(tmp_path)
    agent = Agent(tmp_path, url, "a", pid)
    try:
        agent.send(session("ns-1", prog))
        assert wait_until(lambda: "upload_leaf" in names(url, "ns-1"), DEADLINE_S)
    finally:
        agent.stop()


def test_two_agents_upload_once(symbolizer_server: Any, tmp_path: Path, run_program: Any) -> None:
    prog = build(tmp_path, "upload-two", "symtab")
    url = symbolizer_server(tmp_path)
    pid = run_program([str(prog.path)])
    agents = [Agent(tmp_path, url, name, pid) for name in ("a", "b")]
    try:
        for i, a in enumerate(agents):
            a.send(session(f"two-{i}", prog))
        for i in range(2):
            assert wait_until(lambda i=i: "upload_leaf" in names(url, f"two-{i}"), DEADLINE_S)

        def uploads() -> float:
            return sum(a.metric("bistouri_upload_files_total", kind="executable") for a in agents)

        assert wait_until(lambda: uploads() == 1, DEADLINE_S)  # counted once its answer is read
        text = requests.get(url + "/metrics", timeout=10).text
        assert metric_value(text, "bistouri_symbolizer_uploads_total", {"kind": "executable"}) == 1
    finally:
        for a in agents:
            a.stop()


def test_concurrent_claims_one_wins_then_done(symbolizer_server: Any, tmp_path: Path) -> None:
    prog = build(tmp_path, "upload-claim", "symtab")
    url = symbolizer_server(tmp_path)
    claim = f"{url}/v1/uploads/{prog.build_id.hex()}/executable"
    states: list[str] = []
    barrier = threading.Barrier(8)

    def claimer(i: int) -> None:
        barrier.wait()
        state = requests.post(f"{claim}?claimant=agent-{i}", timeout=10).json()["state"]
        states.append((state, i))

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s for s, _ in states) == ["claimed"] + ["in_progress"] * 7
    winner = next(i for s, i in states if s == "claimed")
    body = gzip.compress(prog.path.read_bytes())
    r = requests.put(
        f"{claim}?claimant=agent-{winner}", data=body, headers={"Content-Encoding": "gzip"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert requests.post(f"{claim}?claimant=late", timeout=10).json()["state"] == "done"


def _stored_files(url: Any) -> list[str]:
    root = Path(url.state_dir) / "uploads"
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts]


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("wrong_build_id", 400, "build_id_mismatch"),
        ("not_elf", 400, "not_elf"),
        ("oversized", 413, "too_large"),
        ("gzip_bomb", 413, "too_large"),
    ],
)
def test_forged_uploads_are_refused_and_nothing_is_stored(
    symbolizer_server: Any, tmp_path: Path, case: str, status: int, reason: str
) -> None:
    prog = build(tmp_path, "upload-forged", "symtab")
    other = build(tmp_path, "upload-other", "symtab")
    url = symbolizer_server(tmp_path, max_upload_bytes="1M")
    target = f"{url}/v1/uploads/{prog.build_id.hex()}/executable"
    body = {
        "wrong_build_id": gzip.compress(other.path.read_bytes()),
        "not_elf": gzip.compress(b"#!/bin/sh\necho not an ELF file\n" * 100),
        "oversized": gzip.compress(prog.path.read_bytes() + os.urandom(2 << 20)),
        "gzip_bomb": gzip.compress(b"\0" * (64 << 20)),
    }[case]
    assert requests.post(target + "?claimant=forger", timeout=10).json()["state"] == "claimed"
    r = requests.put(target + "?claimant=forger", data=body, headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"] == reason
    assert _stored_files(url) == []
    assert requests.get(target, timeout=10).status_code == 404
    # The claim was released: an honest upload is taken at once.
    assert requests.post(target + "?claimant=honest", timeout=10).json()["state"] == "claimed"
    text = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(text, "bistouri_symbolizer_uploads_refused_total", {"reason": reason}) == 1
    log = Path(url.log_path).read_text()
    assert json.dumps(reason).strip('"') in log


def test_a_worker_that_looked_before_the_upload_names_the_session_after_it(tmp_path: Path) -> None:
    """Two workers of one service: A stores the session (the build id missing, remembered as such by
    its resolver), B receives the upload; a read through A must not store A's stale answer again."""
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.service.server import ServerConfig, SymbolizerApp
    from testkit.wsgiclient import Client

    prog = build(tmp_path, "upload-workers", "symtab")
    state = tmp_path / "state"
    state.mkdir()

    def worker() -> SymbolizerApp:
        def factory(kernels: KallsymsStore) -> Resolver:
            return Resolver.from_options(
                state,
                uploads_dir=state / "uploads",
                kernels=kernels,
                debuginfod_urls=[],
                registry=CollectorRegistry(),
                use_llvm=False,
            )

        app = SymbolizerApp(ServerConfig(state_dir=state), factory)
        app.store.migrate()
        return app

    a, b = worker(), worker()
    try:
        body = wire.encode_batch([wire.encode_session(session("w-1", prog))])
        r = Client(a).post("/v1/sessions", data=body, content_type="application/x-msgpack")
        assert r.json is not None and r.json["missing_builds"] == [prog.build_id.hex()]

        def read_names() -> set[str]:
            doc = Client(a).get("/v1/sessions/w-1/speedscope").json
            assert doc is not None
            return {f["name"] for f in doc["shared"]["frames"]}

        assert "upload_leaf" not in read_names()
        # B has the file in place and has not yet re-symbolized the session when A is read.
        hexid = prog.build_id.hex()
        assert b.uploads.claim("default", hexid, "executable", "b") == "claimed"
        with open(prog.path, "rb") as f:
            b.uploads.receive("default", hexid, "executable", "b", f.read, gzipped=False)
        assert "upload_leaf" in read_names()
        b.ingest.received("default", hexid)
        assert "upload_leaf" in read_names()  # and stored so
    finally:
        a.close()
        b.close()


def test_an_upload_that_failed_is_retried(symbolizer_server: Any, tmp_path: Path, run_program: Any) -> None:
    """The first PUT never reaches the symbolizer (as if the network dropped it): retried after a backoff."""
    prog = build(tmp_path, "upload-retry", "symtab")
    url = symbolizer_server(tmp_path)
    agent = Agent(tmp_path, url, "a", run_program([str(prog.path)]))
    uploader = agent.exporter.uploader
    assert isinstance(uploader, Uploader)
    uploader._retry_initial = 0.1  # seconds, not the production 30
    real_send = uploader._send
    dropped: list[str] = []

    def flaky(method: str, path: str, **kw: Any) -> Any:
        if method == "PUT" and not dropped:
            dropped.append(path)
            for _ in kw.get("data", ()):  # the body is read, then the connection "fails"
                pass
            return None
        return real_send(method, path, **kw)

    uploader._send = flaky
    try:
        agent.send(session("retry-1", prog))
        assert wait_until(lambda: "upload_leaf" in names(url, "retry-1"), DEADLINE_S)
        assert wait_until(
            lambda: agent.metric("bistouri_upload_files_total", kind="executable") == 1, DEADLINE_S
        )
        assert dropped and agent.metric("bistouri_upload_failures_total", reason="network") == 1
    finally:
        agent.stop()


def test_uploads_need_the_write_token(symbolizer_server: Any, tmp_path: Path) -> None:
    """Claims and uploads are writes: with --token-file set, no token or a wrong one is 401 and
    nothing is claimed or kept; the agent's token (Authorization: Bearer) is accepted."""
    url = symbolizer_server(tmp_path, token="s3cret-upload-token")
    binary = Path("/usr/bin/xz")
    with ElfFile(str(binary)) as elf:
        hexid = (elf.build_id or b"").hex()
    assert hexid
    path = f"{url}/v1/uploads/{hexid}/executable"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert requests.post(path + "?claimant=a", headers=headers, timeout=10).status_code == 401
        put = requests.put(path + "?claimant=a", data=binary.read_bytes(), headers=headers, timeout=30)
        assert put.status_code == 401
        assert requests.get(path, headers=headers, timeout=10).status_code == 401  # upload state too
    good = {"Authorization": "Bearer s3cret-upload-token"}
    assert requests.get(path, headers=good, timeout=10).status_code == 404  # nothing was kept
    r = requests.post(path + "?claimant=a", headers=good, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "claimed"
    put = requests.put(path + "?claimant=a", data=binary.read_bytes(), headers=good, timeout=30)
    assert put.status_code == 200
    assert requests.get(path, headers=good, timeout=10).json()["state"] == "done"

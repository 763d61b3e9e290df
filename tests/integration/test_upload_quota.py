"""Issue 26 N4: uploads are bounded (a quota of files and bytes, per tenant and in all), go before any
session when the database is over --max-db-bytes, and a worker killed mid-upload leaves no file.

Real `bistouri symbolizer` processes over HTTP (SQLite), real programs built here, a real SIGKILL.
"""

from __future__ import annotations

import gzip
import os
import signal
import socket
from pathlib import Path
from typing import Any

import requests

from bistouri.symbolizer.service.worker import BODY_BUFFER_BYTES
from testkit.helpers import wait_until
from testkit.symbolizer import metric_value, stop
from testkit.uploads import Program, build, names, session
from tests.integration.conftest import post_sessions

DEADLINE_S = 30.0
PAD = 64 << 20  # zeros after the ELF file: 64 MiB inflated from ~64 KB of gzip


def padded(prog: Program, tmp_path: Path, pad: int = PAD) -> Path:
    """The program with `pad` zero bytes after it: still ELF with its build id, large once inflated."""
    out = tmp_path / f"{prog.path.name}.padded-{pad}"
    with open(out, "wb") as f:
        f.write(prog.path.read_bytes())
        f.truncate(f.tell() + pad)
    return out


def upload(url: str, path: Path, build_id: bytes, claimant: str = "agent") -> requests.Response:
    target = f"{url}/v1/uploads/{build_id.hex()}/executable?claimant={claimant}"
    assert requests.post(target, timeout=10).json()["state"] == "claimed"
    with open(path, "rb") as f:
        body = gzip.compress(f.read(), 1)
    return requests.put(target, data=body, headers={"Content-Encoding": "gzip"}, timeout=60)


def uploaded(url: str, prog: Program) -> bool:
    return requests.get(f"{url}/v1/uploads/{prog.build_id.hex()}/executable", timeout=10).status_code == 200


def stored(url: str) -> int:
    return int(requests.get(f"{url}/v1/sessions?limit=1", timeout=10).json()["total"])


def test_uploads_over_the_database_bound_go_before_any_session(
    symbolizer_server: Any, tmp_path: Path
) -> None:
    """The N4 scenario: 21 sessions stored, then uploads from small bodies that inflate past --max-db-bytes.
    A file alone over it is refused while inflating; two that fit alone but not together: the least
    recently used is evicted (right after the upload, and by the next retention of a restarted service);
    every session stays."""
    progs = [build(tmp_path, f"bloat-{i}", "symtab") for i in range(2)]
    state = tmp_path / "state"
    url = symbolizer_server(tmp_path, workers=1, state_dir=state, max_db_bytes="50M")
    r = post_sessions(url, [session(f"keep-{i}", progs[0]) for i in range(21)])
    assert len(r.json()["accepted"]) == 21
    for prog in progs:
        assert upload(url, padded(prog, tmp_path, 30 << 20), prog.build_id).status_code == 200
    stop(url)
    url = symbolizer_server(tmp_path, workers=1, state_dir=state, max_db_bytes="50M")
    assert post_sessions(url, [session("after", progs[0])]).json()["accepted"] == ["after"]  # retention runs
    assert stored(url) == 22
    assert [uploaded(url, p) for p in progs] == [False, True]
    # A file alone over the bound would go at once: refused while inflating.
    r = upload(url, padded(progs[0], tmp_path, 64 << 20), progs[0].build_id, claimant="huge")
    assert r.status_code == 413 and r.json()["error"] == "too_large", r.text


def test_the_quota_evicts_the_least_recently_used_upload_of_the_tenant(
    symbolizer_server: Any, tmp_path: Path
) -> None:
    progs = [build(tmp_path, f"quota-{i}", "symtab") for i in range(3)]
    url = symbolizer_server(tmp_path, workers=1, tenant_upload_quota_files=2)
    assert upload(url, progs[0].path, progs[0].build_id).status_code == 200
    assert upload(url, progs[1].path, progs[1].build_id).status_code == 200
    post_sessions(url, [session("uses-0", progs[0])])  # 0 used after 1 was uploaded
    assert "upload_leaf" in names(url, "uses-0")
    assert upload(url, progs[2].path, progs[2].build_id).status_code == 200
    assert [uploaded(url, p) for p in progs] == [True, False, True]
    text = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(text, "bistouri_symbolizer_uploads_evicted_total", {"reason": "quota"}) == 1


def test_a_file_over_the_quota_is_refused_while_inflating(symbolizer_server: Any, tmp_path: Path) -> None:
    prog = build(tmp_path, "over-quota", "symtab")
    url = symbolizer_server(tmp_path, workers=1, upload_quota_bytes="8M")
    r = upload(url, padded(prog, tmp_path), prog.build_id)
    assert (r.status_code, r.json()["error"]) == (413, "too_large")
    assert not uploaded(url, prog)


def _worker_pids(master: int) -> list[int]:
    text = Path(f"/proc/{master}/task/{master}/children").read_text()
    return [int(p) for p in text.split()]


def _temp_files(state: Path) -> list[Path]:
    return [p for p in (state / "uploads").rglob("*") if p.is_file() and p.name.startswith(".tmp.")]


def test_a_worker_killed_mid_upload_leaves_no_temporary_file(symbolizer_server: Any, tmp_path: Path) -> None:
    prog = build(tmp_path, "killed", "symtab")
    state = tmp_path / "state"
    url = symbolizer_server(tmp_path, workers=1, state_dir=state)
    target = f"/v1/uploads/{prog.build_id.hex()}/executable?claimant=agent"
    assert requests.post(url + target, timeout=10).json()["state"] == "claimed"
    # Past the worker's poller buffer, so that the body reaches the application (and its temp file).
    body = padded(prog, tmp_path, 4 * BODY_BUFFER_BYTES).read_bytes()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"PUT {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body[: 2 * BODY_BUFFER_BYTES])  # the rest never comes
        assert wait_until(lambda: _temp_files(state), DEADLINE_S), "the upload never reached the worker"
        (worker,) = _worker_pids(url.proc.pid)
        os.kill(worker, signal.SIGKILL)
        # gunicorn starts another worker; it answers once it is set up, which sweeps what the dead one left.
        assert wait_until(lambda: _worker_pids(url.proc.pid) not in ([], [worker]), DEADLINE_S)
    assert wait_until(lambda: requests.get(url + "/healthz", timeout=5).status_code == 200, DEADLINE_S)
    assert _temp_files(state) == []

"""Failures on the symbolizer's side answer 503 + Retry-After with a "failed" list (docs/api.md).

Real faults in a real `bistouri symbolizer` process: a full file system (a small tmpfs
filled up) under the database, or under the kallsyms cache of an instance that shares
its database with another. The sessions are then neither stored nor rejected: the agent
keeps them and sends them again, and once the fault is gone they are accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from bistouri import wire
from testkit.symbolizer import KERNEL_BUILD_ID, metric_value
from tests.integration.conftest import DemoBinary, make_session, post_sessions, put_kernel

from .fullfs import fill, small_tmpfs


def _metrics(url: str) -> str:
    return requests.get(url + "/metrics", timeout=10).text


def test_a_full_database_disk_answers_503_and_loses_nothing(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    with small_tmpfs(tmp_path / "dbfs") as fs:
        db = fs / "bistouri.db"
        url = symbolizer_server(tmp_path, db=db, workers=1, binary_dir=demo_binary.dir)
        assert post_sessions(url, [make_session("before", demo_binary)]).status_code == 200
        filler = fill(fs)

        r = post_sessions(url, [make_session("before", demo_binary), make_session("during", demo_binary)])
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) > 0
        body = r.json()
        assert body["duplicates"] == ["before"]
        assert body["accepted"] == [] and body["rejected"] == []
        assert [(f["id"], f["reason"]) for f in body["failed"]] == [("during", "store_failed")]
        assert str(fs) not in r.text, "the database path is for the log, not for clients"
        assert metric_value(_metrics(url), "bistouri_symbolizer_sessions_failed_total") == 1
        # One line in the log for the failure, no traceback at the info level.
        log = url.log_path.read_text()
        assert "session not stored. session=during reason=store_failed error=StoreError" in log
        assert "Traceback" not in log

        filler.unlink()
        r = post_sessions(url, [make_session("during", demo_binary)])
        assert r.status_code == 200, r.text
        assert r.json()["accepted"] == ["during"]


def test_a_full_kallsyms_cache_answers_503_symbolize_failed(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    db = tmp_path / "shared.db"
    # Instance a takes the kernel's symbols into the shared database...
    a = symbolizer_server(tmp_path, db=db, workers=1)
    assert put_kernel(a).status_code == 204
    # ...instance b must copy them to its own kallsyms directory, on a full disk.
    state_b = tmp_path / "b"
    with small_tmpfs(state_b / "kernels") as kernels:
        b = symbolizer_server(tmp_path, db=db, workers=1, state_dir=state_b, binary_dir=demo_binary.dir)
        filler = fill(kernels)
        r = requests.get(f"{b}/v1/kernels/{KERNEL_BUILD_ID.hex()}", timeout=10)
        assert r.status_code == 503 and "No space left on device" in r.json()["detail"], r.text
        assert "Retry-After" in r.headers
        r = post_sessions(b, [make_session("kernel-frames", demo_binary)])
        assert r.status_code == 503, r.text
        assert "Retry-After" in r.headers
        failed = r.json()["failed"]
        assert [(f["id"], f["reason"]) for f in failed] == [("kernel-frames", "symbolize_failed")]
        assert "No space left on device" in failed[0]["detail"]
        assert requests.get(f"{b}/v1/sessions/kernel-frames", timeout=10).status_code == 404

        filler.unlink()
        r = post_sessions(b, [make_session("kernel-frames", demo_binary)])
        assert r.status_code == 200, r.text
        assert r.json() == {
            "accepted": ["kernel-frames"],
            "duplicates": [],
            "rejected": [],
            "missing_kernels": [],
        }


def test_answers_echo_at_most_200_characters_of_the_request(symbolizer_server: Any, tmp_path: Path) -> None:
    import gzip

    import msgpack

    url = symbolizer_server(tmp_path, workers=1)
    huge = "<" + "A" * 100_000
    r = requests.get(url + "/v1/sessions", params={"since": huge[:3000]}, timeout=10)
    assert r.status_code == 400
    assert 0 < len(r.json()["detail"]) < 300
    # A session with a long id, and a resource naming an attacker's text: just under the decoder's
    # string limit, so that each session is refused on its own and its refusal echoes it.
    long = huge[: wire.MAX_STR_BYTES]
    sessions = [{"v": 1, "id": long}, {"v": 1, "id": "x", "trigger": {"resource": long}}]
    batch = msgpack.packb({"v": 1, "sessions": sessions})
    r = requests.post(
        url + "/v1/sessions",
        data=gzip.compress(batch),
        headers={"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"},
        timeout=10,
    )
    assert r.status_code == 400
    assert len(r.text) < 2000, r.text
    assert [len(x["id"]) < 300 and len(x["detail"]) < 300 for x in r.json()["rejected"]] == [True, True]


def test_a_broken_read_logs_one_line(symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary) -> None:
    import sqlite3

    db = tmp_path / "s.db"
    url = symbolizer_server(tmp_path, db=db, workers=1, binary_dir=demo_binary.dir)
    assert post_sessions(url, [make_session("s1", demo_binary)]).status_code == 200
    # The stored profile is damaged on disk (a bad sector, a bad restore).
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE sessions SET profile = ? WHERE id = 's1'", (b"not zlib",))
    r = requests.get(url + "/v1/sessions/s1/folded", timeout=10)
    assert r.status_code == 500
    assert "internal" in r.json()["error"]
    lines = [ln for ln in url.log_path.read_text().splitlines() if "request failed" in ln]
    assert len(lines) == 1 and "error=error: Error -3" in lines[0], lines
    assert "Traceback" not in url.log_path.read_text()

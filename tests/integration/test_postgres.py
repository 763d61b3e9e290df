"""PostgreSQL storage: a real server started here, the store against it, two symbolizers sharing it.

Needs Debian's `postgresql` package (binaries in /usr/lib/postgresql/<v>/bin);
skipped with the reason otherwise. initdb and the server run as the `postgres`
user when the tests run as root.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from bistouri.symbolizer.service.store import SCHEMA_VERSION, Filter, Store, StoredSession
from testkit.pg import PgServer
from testkit.symbolizer import KERNEL_BUILD_ID, metric_value
from tests.integration.conftest import DemoBinary, make_session, post_sessions, put_kernel

psycopg = pytest.importorskip("psycopg", reason="psycopg (3) is the PostgreSQL driver")


@pytest.fixture
def fresh_db(postgres: PgServer) -> str:
    """The shared database emptied of bistouri's tables."""
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE IF EXISTS sessions, kernels, uploads, pending_builds, upload_chunks, upload_files, "
            "upload_parts, export_queue, schema_version"
        )
    return postgres.url


def _record(sid: str, start_ns: int, service: str = "api") -> StoredSession:
    meta = SessionMeta(sid, service=service, host="h", processes={1: "app"}, resource="io", start_ns=start_ns)
    profile = Profile(
        meta, [Frame("main", "app"), Frame("schedule", kind="kernel")], [Sample((0, 1), on_cpu=2)]
    )
    return StoredSession(meta, profile, raw=b"r" * 100, kernel_build_id="ab", kernel_pending=True)


def test_store_on_postgres(fresh_db: str) -> None:
    s = Store(fresh_db, max_db_bytes=None)
    assert s.migrate() == 0
    assert s.migrate() == SCHEMA_VERSION  # idempotent
    for i in range(12):
        assert s.insert(_record(f"p{i:02}", 10**18 + i * 10**9, "api" if i % 2 else "db")) > 0
    assert s.insert(_record("p00", 0)) == 0
    metas, total = s.query(Filter(service="api"), limit=3)
    assert total == 6 and [m.session_id for m in metas] == ["p11", "p09", "p07"]
    assert s.query(Filter(since_ns=10**18 + 10 * 10**9))[1] == 2
    got = s.get_profile("p03")
    assert got is not None and got.frames[1].kind == "kernel" and got.meta.resource == "io"
    assert s.get_raw("p03") == b"r" * 100
    assert len(s.pending_for_kernel("ab")) == 12
    s.put_kernel("ab", b"gz")
    assert s.get_kernel("ab") == b"gz"
    _, used = s.stats()
    s.max_db_bytes = used // 2 + len(b"gz")  # half the sessions, plus the kernel's 2 bytes: they count too
    deleted = s.enforce_retention()
    assert deleted["size"] == 6 and s.stats()[1] <= used // 2
    assert min(m.session_id for m in s.query(Filter())[0]) == "p06"  # oldest first
    # The trigger-kind filter (matched in the metadata JSON) and the before-trigger flag, on PostgreSQL too.
    manual = _record("m00", 10**18 + 20 * 10**9)
    manual.meta.trigger_kind = "manual"
    manual.profile.samples[0].pre_trigger = True
    assert s.insert(manual) > 0
    assert [m.session_id for m in s.query(Filter(kind="manual"))[0]] == ["m00"]
    assert s.query(Filter(kind="psi"))[1] == 6
    got, old = s.get_profile("m00"), s.get_profile("p07")
    assert got is not None and got.samples[0].pre_trigger
    assert old is not None and not old.samples[0].pre_trigger
    s.close()


def test_two_symbolizers_share_one_database(
    symbolizer_server: Any, tmp_path: Path, fresh_db: str, demo_binary: DemoBinary
) -> None:
    a = symbolizer_server(tmp_path, db=fresh_db, workers=2, binary_dir=demo_binary.dir)
    b = symbolizer_server(tmp_path, db=fresh_db, workers=1, binary_dir=demo_binary.dir)
    t0 = time.time_ns()
    s1 = make_session("pg-1", demo_binary, start_ns=t0)
    s2 = make_session("pg-2", demo_binary, service="db", start_ns=t0 + 10**9)
    r = post_sessions(a, [s1])
    assert r.json()["accepted"] == ["pg-1"] and r.json()["missing_kernels"] == [KERNEL_BUILD_ID.hex()]
    r = post_sessions(b, [s1, s2])
    assert r.json()["duplicates"] == ["pg-1"] and r.json()["accepted"] == ["pg-2"]

    # Either instance reads everything.
    for url in (a, b):
        listing = requests.get(url + "/v1/sessions", timeout=10).json()
        assert listing["total"] == 2 and [x["id"] for x in listing["sessions"]] == ["pg-2", "pg-1"]

    # Kernel symbols uploaded to A reach B through the database; B re-symbolizes on read.
    kernel = f"/v1/kernels/{KERNEL_BUILD_ID.hex()}"
    assert requests.get(b + kernel, timeout=10).status_code == 404
    assert put_kernel(a).status_code == 204
    assert requests.get(b + kernel, timeout=10).status_code == 200
    folded = requests.get(b + "/v1/sessions/pg-2/folded?value=off_cpu", timeout=10).text
    assert folded == "main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k] 5\n"
    merged = requests.get(a + "/v1/profile/folded?value=off_cpu", timeout=10).text
    assert merged == "main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k] 10\n"

    # The same batch sent to both at once: every session stored exactly once.
    batch = [make_session(f"race-{i}", demo_binary, start_ns=t0 + i) for i in range(20)]
    results: dict[str, Any] = {}

    def send(name: str, url: str) -> None:
        results[name] = post_sessions(url, batch).json()

    threads = [threading.Thread(target=send, args=(n, u), name=f"post-{n}") for n, u in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    accepted = results["a"]["accepted"] + results["b"]["accepted"]
    assert sorted(accepted) == sorted(s.session_id for s in batch)
    assert sorted(results["a"]["duplicates"] + results["b"]["duplicates"]) == sorted(accepted)
    assert requests.get(a + "/v1/sessions", timeout=10).json()["total"] == 22
    ingested = sum(
        metric_value(
            requests.get(u + "/metrics", timeout=10).text, "bistouri_symbolizer_sessions_ingested_total"
        )
        for u in (a, b)
    )
    assert ingested == 22
    # PostgreSQL text refuses NUL: such input is a 4xx, never a 500.
    nul = make_session("nul-1", demo_binary, service="a\x00b")
    r = post_sessions(a, [nul])
    assert r.status_code == 400 and r.json()["rejected"][0]["reason"] == "malformed"
    assert requests.get(a + "/v1/sessions", params={"host": "x\x00"}, timeout=10).status_code == 400
    assert requests.get(a + "/v1/sessions/x%00y/folded", timeout=10).status_code == 404
    assert "Traceback" not in a.log_path.read_text()


def test_fuzzed_payloads_on_postgres(symbolizer_server: Any, tmp_path: Path, fresh_db: str) -> None:
    """A shorter run of the ingest fuzzing with PostgreSQL behind: its own refusals (NUL in text) included."""
    from hypothesis import HealthCheck, given, settings

    from .test_symbolizer_service import MAX_REQUEST, TOKEN, bad_payloads

    url = symbolizer_server(tmp_path, db=fresh_db, token=TOKEN, workers=2, max_request_bytes=MAX_REQUEST)
    http = requests.Session()
    sent = 0

    @settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bad_payloads())
    def check(payload: tuple[bytes, dict[str, str]]) -> None:
        nonlocal sent
        body, headers = payload
        if headers.pop("X-Test-Chunked", None):
            return  # covered by the SQLite run; nothing database-specific in it
        r = http.post(url + "/v1/sessions", data=body, headers=headers, timeout=30)
        sent += 1
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])

    check()
    text = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(text, "bistouri_symbolizer_requests_rejected_total") == sent
    assert "Traceback" not in url.log_path.read_text()


def test_upload_claims_are_shared_by_instances_on_one_database(
    symbolizer_server: Any, tmp_path: Path, fresh_db: str, demo_binary: DemoBinary
) -> None:
    """Agents behind a balancer reach either instance: of their concurrent claims exactly one wins."""
    a = symbolizer_server(tmp_path, db=fresh_db, workers=2)
    b = symbolizer_server(tmp_path, db=fresh_db, workers=1)
    path = f"/v1/uploads/{demo_binary.build_id.hex()}/executable"
    states: list[str] = []
    barrier = threading.Barrier(8)

    winner: list[int] = []

    def claim(url: str, agent: int) -> None:
        barrier.wait()
        state = requests.post(f"{url}{path}?claimant=agent-{agent}", timeout=10).json()["state"]
        states.append(state)
        if state == "claimed":
            winner.append(agent)

    threads = [threading.Thread(target=claim, args=((a, b)[i % 2], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(states) == ["claimed"] + ["in_progress"] * 7
    r = requests.put(f"{a}{path}?claimant=agent-{winner[0]}", data=demo_binary.path.read_bytes(), timeout=30)
    assert r.status_code == 200, r.text
    with psycopg.connect(fresh_db) as conn:
        row = conn.execute("SELECT state, size_bytes FROM upload_files").fetchone()
    assert row == ("done", demo_binary.path.stat().st_size)  # counted for --max-db-bytes on every instance

    # The file itself is in the database: B, which never received it, names a session's frames with it.
    hexid = demo_binary.build_id.hex()
    assert not (b.state_dir / "uploads" / "default" / ".build-id" / hexid[:2] / hexid[2:]).exists()
    r = post_sessions(b, [make_session("shared-upload", demo_binary)])
    assert r.json()["accepted"] == ["shared-upload"] and "missing_builds" not in r.json(), r.json()
    folded = requests.get(b + "/v1/sessions/shared-upload/folded?value=off_cpu", timeout=10).text
    assert folded.startswith("main;"), folded
    copied = b.state_dir / "uploads" / "default" / ".build-id" / hexid[:2] / hexid[2:]
    assert copied.read_bytes() == demo_binary.path.read_bytes()
    assert requests.post(f"{b}{path}?claimant=agent-9", timeout=10).json()["state"] == "done"

"""The SQLite store: schema migrations, idempotent inserts, filters, retention, several processes."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.pressure import PressureFigures
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from bistouri.symbolizer.service import store as store_mod
from bistouri.symbolizer.service.store import Filter, Store, StoredSession, StoreError

T0 = 1_700_000_000 * 10**9
DAY = 86400 * 10**9


def record(
    sid: str, start_ns: int = T0, service: str = "api", host: str = "h1", comm: str = "app", **kw: object
) -> StoredSession:
    meta = SessionMeta(
        session_id=sid,
        service=service,
        host=host,
        processes={42: comm},
        labels={"zone": "a"},
        resource=str(kw.pop("resource", "cpu")),
        start_ns=start_ns,
        duration_ns=10**9,
        period_ns=10**7,
        on_cpu=3,
    )
    profile = Profile(
        meta=meta,
        frames=[Frame("main", "app", "a.c", 3), Frame("schedule", "vmlinux", kind="kernel", inlined=False)],
        samples=[Sample((0, 1), pid=42, tid=43, thread="t", on_cpu=3, off_cpu=1, off_cpu_ns=(1 << 64) - 1)],
    )
    return StoredSession(meta=meta, profile=profile, raw=b"raw-" + sid.encode() * 50, **kw)  # type: ignore[arg-type]


@pytest.fixture
def db(tmp_path: Path) -> Store:
    s = Store(str(tmp_path / "state" / "bistouri.db"))
    assert s.migrate() == 0
    return s


def test_migrate_is_idempotent_and_versioned(db: Store, tmp_path: Path) -> None:
    assert db.migrate() == store_mod.SCHEMA_VERSION
    conn = sqlite3.connect(tmp_path / "state" / "bistouri.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (store_mod.SCHEMA_VERSION + 1,))
    conn.commit()
    with pytest.raises(StoreError, match="newer than this bistouri"):
        Store(str(tmp_path / "state" / "bistouri.db")).migrate()


def test_unopenable_database_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot open SQLite database"):
        Store(str(tmp_path / "file" / "sub" / "db")).migrate()


def test_bad_postgres_url_is_refused() -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(StoreError, match="bad PostgreSQL URL"):
        Store("postgresql://u:secret@h/db?sslmode=x=y=")


def test_insert_is_idempotent_and_round_trips(db: Store) -> None:
    rec = record("s1")
    assert db.insert(rec) > 0
    assert db.insert(rec) == 0
    assert db.exists("s1") and not db.exists("s2")
    meta = db.get_meta("s1")
    assert meta == rec.meta
    profile = db.get_profile("s1")
    assert profile is not None
    assert profile.frames == rec.profile.frames and profile.samples == rec.profile.samples
    assert db.get_raw("s1") == rec.raw
    assert db.get_profile("nope") is None and db.get_meta("nope") is None
    assert db.stats()[0] == 1


def test_query_filters_orders_and_counts(db: Store) -> None:
    for i in range(30):
        db.insert(record(f"s{i:02}", T0 + i * 10**9, service="api" if i % 3 else "db", host=f"h{i % 2}"))
    metas, total = db.query(Filter(), limit=5)
    assert total == 30 and [m.session_id for m in metas] == ["s29", "s28", "s27", "s26", "s25"]
    metas, total = db.query(Filter(service="db"), limit=100)
    assert total == 10 and all(m.service == "db" for m in metas)
    metas, total = db.query(
        Filter(service="api", host="h1", since_ns=T0 + 10 * 10**9, until_ns=T0 + 20 * 10**9)
    )
    assert [m.session_id for m in metas] == ["s19", "s17", "s13", "s11"] and total == 4
    page2, _ = db.query(Filter(), limit=5, offset=5)
    assert page2[0].session_id == "s24"
    assert db.query(Filter(comm="nope"))[1] == 0
    assert len(list(db.profiles(Filter(service="db"), limit=7))) == 7
    assert len(list(db.profiles(Filter(), limit=1000))) == 30


def test_pending_kernel_sessions(db: Store) -> None:
    db.insert(record("p1", kernel_build_id="ab" * 20, kernel_pending=True))
    db.insert(record("p2", kernel_build_id="ab" * 20, kernel_pending=False))
    assert db.pending_for_kernel("ab" * 20) == ["p1"]
    assert db.pending_kernel("p1") == "ab" * 20 and db.pending_kernel("p2") == ""
    p = db.get_profile("p1")
    assert p is not None
    p.frames[0] = Frame("renamed")
    db.update_profile("p1", p, kernel_pending=False)
    assert db.pending_for_kernel("ab" * 20) == []
    got = db.get_profile("p1")
    assert got is not None and got.frames[0].name == "renamed"
    assert not db.has_kernel("ab" * 20)
    db.put_kernel("ab" * 20, b"gz1")
    db.put_kernel("ab" * 20, b"gz2")
    assert db.has_kernel("ab" * 20) and db.get_kernel("ab" * 20) == b"gz2"


def test_retention_by_age_then_by_size(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "r.db"), retention_days=7)
    s.migrate()
    now = T0 + 30 * DAY
    for i in range(10):  # received on days 0..9: the 7-day window starts at day 23
        s.insert(record(f"old{i}", T0 + i * DAY), received_ns=T0 + i * DAY)
    s.insert(record("new", now - DAY), received_ns=now - DAY)
    assert s.enforce_retention(now) == {"age": 10, "size": 0}
    assert [m.session_id for m in s.query(Filter())[0]] == ["new"]

    s.retention_days = None
    for i in range(20):
        s.insert(record(f"x{i:02}", now + i * 10**9), received_ns=now + i * 10**9)
    _, used = s.stats()
    per = used // 21
    s.max_db_bytes = per * 5 + per // 2
    deleted = s.enforce_retention(now)
    assert deleted["age"] == 0 and deleted["size"] == 16
    left = sorted(m.session_id for m in s.query(Filter())[0])
    assert left == ["x15", "x16", "x17", "x18", "x19"]  # the oldest went first
    assert s.stats()[1] <= s.max_db_bytes


def test_retention_goes_by_the_time_received_not_the_agents_clock(tmp_path: Path) -> None:
    s = Store(str(tmp_path / "r.db"), retention_days=7)
    s.migrate()
    now = T0 + 30 * DAY
    # An agent whose clock runs a century ahead, or behind: received 10 days ago, 1 day ago.
    s.insert(record("future-old", T0 + 36500 * DAY), received_ns=now - 10 * DAY)
    s.insert(record("past-new", 0), received_ns=now - DAY)
    assert s.enforce_retention(now) == {"age": 1, "size": 0}
    assert [m.session_id for m in s.query(Filter())[0]] == ["past-new"]
    # By size too, the first received goes first, whatever it claims.
    s.retention_days = None
    s.insert(record("future-newer", T0 + 36500 * DAY), received_ns=now)
    s.max_db_bytes = s.stats()[1] - 1
    assert s.enforce_retention(now) == {"age": 0, "size": 1}
    assert [m.session_id for m in s.query(Filter())[0]] == ["future-newer"]


def test_merged_pages_neither_repeat_nor_skip_while_sessions_arrive(db: Store) -> None:
    for i in range(120):
        db.insert(record(f"s{i:03}", T0 + i * 10**9))
    seen = []
    for n, p in enumerate(db.profiles(Filter(), 500)):
        seen.append(p.meta.session_id)
        if n == 10:
            # Newer sessions stored while the first page is merged: they come after the read began.
            for j in range(5):
                db.insert(record(f"late{j}", T0 + 10**6 * 10**9 + j))
    assert len(seen) == len(set(seen)) == 120
    assert set(seen) == {f"s{i:03}" for i in range(120)}


def _insert_many(path: str, prefix: str, n: int) -> None:
    s = Store(path)
    for i in range(n):
        s.insert(record(f"{prefix}{i}", T0 + i))
        s.insert(record(f"shared{i}", T0 + i))  # both processes race on these ids
    s.close()


def test_several_processes_share_the_database(db: Store) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_insert_many, args=(db.db, p, 40)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert db.stats()[0] == 40 + 40 + 40


def test_session_meta_from_wire_and_through_its_stored_text() -> None:
    s = wire.Session(
        session_id="w1",
        trigger=wire.Trigger(
            "memory", "full", 1000, 2_000_000, "/a", 5, pressure=PressureFigures(1.5, 2.5, 3.5, 99)
        ),
        kernel=wire.KernelInfo("6.18", b"\x01" * 20, 0xFFFF),
        start_ns=7,
        duration_ns=8,
        period_ns=9,
        service="svc",
        processes={1: "init"},
        traces=[wire.Trace((), (), 1, 1, on_cpu=2, off_cpu=3, off_cpu_ns=4)],
    )
    m = SessionMeta.from_wire(s)
    assert (m.resource, m.stall, m.window_us, m.cgroup, m.pressure.avg300, m.pressure.total_us) == (
        "memory",
        "full",
        2_000_000,
        "/a",
        3.5,
        99,
    )
    assert (m.on_cpu, m.off_cpu, m.off_cpu_ns, m.kernel_release, m.comm) == (2, 3, 4, "6.18", "init")
    assert store_mod.meta_from_text(store_mod.meta_to_text(m)) == m


def test_the_pressure_figures_are_stored_under_the_keys_rows_always_had() -> None:
    m = SessionMeta("p", pressure=PressureFigures(1.5, 2.5, 3.5, 99))
    stored = json.loads(store_mod.meta_to_text(m))
    assert "pressure" not in stored
    assert [stored[k] for k in ("avg10", "avg60", "avg300", "psi_total_us")] == [1.5, 2.5, 3.5, 99]
    assert store_mod.meta_from_text(json.dumps(stored)).pressure == m.pressure


def test_service_answers_503_while_the_database_is_unavailable(tmp_path: Path) -> None:
    from bistouri.symbolizer.service.server import ServerConfig, SymbolizerApp
    from testkit.wsgiclient import Client

    class NoResolver:
        def symbolize(self, session: wire.Session) -> Profile:
            raise AssertionError("not reached: the database fails first")

    (tmp_path / "db-is-a-dir").mkdir()
    app = SymbolizerApp(
        ServerConfig(state_dir=tmp_path, db=str(tmp_path / "db-is-a-dir")), lambda kernels: NoResolver()
    )
    r = Client(app).get("/v1/sessions")
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
    assert r.json is not None and r.json["error"] == "unavailable"
    assert "db-is-a-dir" not in r.text, "the database's path is for the log only"
    assert Client(app).get("/healthz").status_code == 200


def test_uploaded_files_count_in_max_db_bytes_and_go_before_sessions(tmp_path: Path) -> None:
    """Issue 26 N4: an upload that puts the database over its bound is evicted, not the sessions."""
    s = Store(str(tmp_path / "u.db"))
    s.migrate()
    for i in range(4):
        s.insert(record(f"u{i}", T0 + i), received_ns=T0 + i)
    sessions = s.stats()[1]
    assert s.claim_upload("t", "ab" * 20, "executable", 10**12, "agent-1") == "claimed"
    assert s.finish_upload("t", "ab" * 20, "executable", "agent-1", 10 * sessions)
    s.max_db_bytes = 10 * sessions + sessions  # all fit
    assert s.expire_uploads(T0) == []
    assert s.enforce_retention(T0)["size"] == 0
    s.max_db_bytes = 10 * sessions  # over: the upload goes, every session stays
    assert s.expire_uploads(T0) == [("t", "ab" * 20, "executable", "size")]
    assert s.enforce_retention(T0)["size"] == 0
    assert s.stats()[0] == 4
    assert s.upload_bytes() == 0

"""The trigger kind (psi | manual) in the store: a column the list filters by, filled for older sessions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from bistouri import wire
from bistouri.symbolizer.service.store import Filter, Store
from tests.unit.test_store import record


def _stored(db: Store, sid: str, kind: str, labels: dict[str, str], start_ns: int) -> None:
    rec = record(sid, start_ns=start_ns)
    rec.meta.trigger_kind = kind
    rec.meta.labels = labels
    assert db.insert(rec) > 0


def test_kind_filter_and_the_migration_that_fills_it(tmp_path: Path) -> None:
    path = tmp_path / "bistouri.db"
    db = Store(str(path))
    db.migrate()
    # A PSI session whose labels hold the manual session's text, as a key and as a value: not manual.
    decoy = {"trigger_kind": "manual", "note": '"trigger_kind":"manual","trigger_time_ns":1'}
    _stored(db, "psi-1", wire.TRIGGER_PSI, decoy, 10**18)
    _stored(db, "manual-1", wire.TRIGGER_MANUAL, {}, 10**18 + 1)

    def ids(kind: str) -> list[str]:
        return [m.session_id for m in db.query(Filter(kind=kind))[0]]

    assert ids(wire.TRIGGER_MANUAL) == ["manual-1"]
    assert ids(wire.TRIGGER_PSI) == ["psi-1"]
    assert ids("") == ["manual-1", "psi-1"]

    # The same rows as the version before stored them: no column, the kind only in the metadata JSON.
    db.close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX sessions_kind_start")
    conn.execute("ALTER TABLE sessions DROP COLUMN trigger_kind")
    conn.execute("DROP TABLE upload_files")  # and what came after it (versions 4 to 9)
    conn.execute("DROP TABLE pending_builds")
    conn.execute("DROP TABLE upload_parts")  # version 6
    conn.execute("ALTER TABLE sessions DROP COLUMN summary")  # version 7
    conn.execute("DROP TABLE export_queue")  # version 8
    for index in ("sessions_unit_start", "sessions_container_start"):  # version 9
        conn.execute(f"DROP INDEX {index}")
    for column in ("unit", "container_id", "runtime"):
        conn.execute(f"ALTER TABLE sessions DROP COLUMN {column}")
    conn.execute("DELETE FROM schema_version WHERE version >= 3")
    conn.commit()
    conn.close()
    db = Store(str(path))
    assert db.migrate() == 2
    assert ids(wire.TRIGGER_MANUAL) == ["manual-1"]
    assert ids(wire.TRIGGER_PSI) == ["psi-1"]
    db.close()

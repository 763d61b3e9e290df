"""Session storage for the symbolizer: SQLite by default, PostgreSQL when given a URL.

One table of sessions: the metadata in columns (what the read API filters on),
the metadata as JSON (labels, processes), the symbolized profile and the raw
wire session as compressed blobs. The raw session is kept so that a session
stored before its kernel's symbols arrived can be symbolized again. Uploaded
kallsyms live in a second table, so instances sharing a PostgreSQL database
share them too.

Several gunicorn workers open the same database: each process opens its own
connection (SQLite in WAL mode with a busy timeout), inserts are idempotent by
session id, and the schema is migrated once, by the master, before workers fork.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

import msgpack

from ...compat import SLOTS
from ...errors import BistouriError
from ...pressure import PressureFigures
from ..model import Frame, Profile, Sample, SessionMeta
from .store_exports import INSERT_EXPORT, ExportRows
from .store_uploads import UploadRows

log = logging.getLogger(__name__)

SCHEMA_VERSION = 9
_INT64_MAX = (1 << 63) - 1
_BUSY_TIMEOUT_S = 30.0
_RETENTION_BATCH = 500

# Migrations, in order: (version, statements). `{blob}` and `{bigint}` are filled per dialect.
_MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """CREATE TABLE sessions (
                id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                service TEXT NOT NULL,
                host TEXT NOT NULL,
                resource TEXT NOT NULL,
                comm TEXT NOT NULL,
                start_ns {bigint} NOT NULL,
                duration_ns {bigint} NOT NULL,
                ingested_ns {bigint} NOT NULL,
                kernel_build_id TEXT NOT NULL,
                kernel_pending INTEGER NOT NULL,
                meta TEXT NOT NULL,
                profile {blob} NOT NULL,
                raw {blob} NOT NULL,
                size_bytes {bigint} NOT NULL
            )""",
            "CREATE INDEX sessions_start ON sessions (start_ns)",
            "CREATE INDEX sessions_service_start ON sessions (service, start_ns)",
            "CREATE INDEX sessions_host_start ON sessions (host, start_ns)",
            "CREATE INDEX sessions_pending ON sessions (kernel_build_id) WHERE kernel_pending = 1",
            """CREATE TABLE kernels (
                build_id TEXT PRIMARY KEY,
                kallsyms {blob} NOT NULL,
                uploaded_ns {bigint} NOT NULL
            )""",
        ],
    ),
    # Retention goes by the time the server received a session, not by the agent's clock.
    (2, ["CREATE INDEX sessions_ingested ON sessions (ingested_ns, id)"]),
    # The trigger's kind (psi | manual), which the list filters by.
    (
        3,
        [
            "ALTER TABLE sessions ADD COLUMN trigger_kind TEXT NOT NULL DEFAULT 'psi'",
            "CREATE INDEX sessions_kind_start ON sessions (trigger_kind, start_ns)",
            # Sessions stored before: their kind is in the metadata JSON, whose keys are sorted
            # (meta_to_text), so the session's own key is followed by trigger_time_ns.
            """UPDATE sessions SET trigger_kind = 'manual'
               WHERE meta LIKE '%"trigger_kind":"manual","trigger_time_ns":%'""",
        ],
    ),
    # Files agents uploaded (uploads.py): claims shared by every worker and instance, the sizes
    # retention counts, and the sessions waiting for a build id.
    (
        4,
        [
            """CREATE TABLE uploads (
                build_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                state TEXT NOT NULL,
                claimant TEXT NOT NULL,
                changed_ns {bigint} NOT NULL,
                size_bytes {bigint} NOT NULL,
                PRIMARY KEY (build_id, kind)
            )""",
            """CREATE TABLE pending_builds (
                session_id TEXT NOT NULL,
                build_id TEXT NOT NULL,
                have INTEGER NOT NULL,
                PRIMARY KEY (session_id, build_id)
            )""",
            "CREATE INDEX pending_builds_build ON pending_builds (build_id)",
        ],
    ),
    # On PostgreSQL, the uploaded files themselves (in chunks): every instance behind a balancer
    # names frames from an upload that reached another one. SQLite keeps them in the state dir only.
    (
        5,
        [
            """CREATE TABLE upload_chunks (
                build_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                seq INTEGER NOT NULL,
                data {blob} NOT NULL,
                PRIMARY KEY (build_id, kind, seq)
            )""",
        ],
    ),
    # Uploads per tenant (uploads.py, docs/api.md "Trust model"): a tenant's uploads serve its own
    # sessions only. Claims expire (expires_ns) and files are evicted least recently used first
    # (used_ns). Rows of earlier versions were uploaded under the agents' default tenant.
    (
        6,
        [
            """CREATE TABLE upload_files (
                tenant TEXT NOT NULL,
                build_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                state TEXT NOT NULL,
                claimant TEXT NOT NULL,
                changed_ns {bigint} NOT NULL,
                expires_ns {bigint} NOT NULL,
                used_ns {bigint} NOT NULL,
                size_bytes {bigint} NOT NULL,
                PRIMARY KEY (tenant, build_id, kind)
            )""",
            """INSERT INTO upload_files (tenant, build_id, kind, state, claimant, changed_ns, expires_ns,
                 used_ns, size_bytes)
               SELECT 'default', build_id, kind, state, claimant, changed_ns, changed_ns, changed_ns,
                 size_bytes FROM uploads WHERE state = 'done'""",
            "DROP TABLE uploads",
            "CREATE INDEX upload_files_used ON upload_files (used_ns)",
            """CREATE TABLE upload_parts (
                tenant TEXT NOT NULL,
                build_id TEXT NOT NULL,
                kind TEXT NOT NULL,
                seq INTEGER NOT NULL,
                data {blob} NOT NULL,
                PRIMARY KEY (tenant, build_id, kind, seq)
            )""",
            """INSERT INTO upload_parts (tenant, build_id, kind, seq, data)
               SELECT 'default', build_id, kind, seq, data FROM upload_chunks""",
            "DROP TABLE upload_chunks",
        ],
    ),
    # What a session list shows: the metadata without the episode's rows (up to ~1 MB a session),
    # so that listing 1000 sessions parses kilobytes, not a gigabyte. '' for sessions stored before.
    (7, ["ALTER TABLE sessions ADD COLUMN summary TEXT NOT NULL DEFAULT ''"]),
    # Sessions still to send to each export endpoint (exports.py, store_exports.py). size_bytes is the
    # session's as stored, what the queue's byte bound counts.
    (
        8,
        [
            """CREATE TABLE export_queue (
                session_id TEXT NOT NULL,
                endpoint TEXT NOT NULL,
                enqueued_ns {bigint} NOT NULL,
                next_ns {bigint} NOT NULL,
                size_bytes {bigint} NOT NULL,
                attempts INTEGER NOT NULL,
                lease_until_ns {bigint} NOT NULL,
                claimant TEXT NOT NULL,
                PRIMARY KEY (session_id, endpoint)
            )""",
            "CREATE INDEX export_queue_due ON export_queue (endpoint, next_ns)",
            "CREATE INDEX export_queue_age ON export_queue (endpoint, enqueued_ns)",
        ],
    ),
    # What the target's cgroup names, which the list filters by: its
    # systemd unit and its container. '' for sessions stored before, and from agents before them.
    (
        9,
        [
            "ALTER TABLE sessions ADD COLUMN unit TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE sessions ADD COLUMN container_id TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE sessions ADD COLUMN runtime TEXT NOT NULL DEFAULT ''",
            "CREATE INDEX sessions_unit_start ON sessions (unit, start_ns)",
            "CREATE INDEX sessions_container_start ON sessions (container_id, start_ns)",
        ],
    ),
]


class StoreError(BistouriError):
    """The database cannot be opened, migrated or used."""


@dataclass(frozen=True, **SLOTS)
class Filter:
    """What the read API selects sessions by. Times are unix nanoseconds, bounds inclusive."""

    service: str = ""
    host: str = ""
    resource: str = ""
    comm: str = ""
    tenant: str = ""
    kind: str = ""  # trigger kind: wire.TRIGGER_PSI or wire.TRIGGER_MANUAL
    unit: str = ""  # the systemd unit, exactly
    container: str = ""  # a container id or its prefix (`docker ps` shows 12 digits): hex digits only
    runtime: str = ""  # docker | containerd | podman | crio
    since_ns: int | None = None
    until_ns: int | None = None


@dataclass(frozen=True, **SLOTS)
class StoredSession:
    meta: SessionMeta
    profile: Profile
    raw: bytes  # wire.encode_session bytes
    kernel_build_id: str = ""  # hex
    kernel_pending: bool = False  # symbolized without the kernel's symbols


# ---------------------------------------------------------------------------
# Serialization of what goes in the blobs


# The pressure figures are stored flat, under the names SessionMeta gave them before they were one
# value: rows written before and since read the same. PressureFigures field -> stored key.
_PRESSURE_KEYS = {"avg10": "avg10", "avg60": "avg60", "avg300": "avg300", "total_us": "psi_total_us"}


def meta_to_text(m: SessionMeta) -> str:
    d = {f.name: getattr(m, f.name) for f in fields(SessionMeta) if f.name != "pressure"}
    d["processes"] = [[p, c] for p, c in m.processes.items()]
    d.update({key: getattr(m.pressure, name) for name, key in _PRESSURE_KEYS.items()})
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def summary_to_text(m: SessionMeta) -> str:
    """The metadata a session list reads (SessionMeta.to_json(episode_rows=False)): no episode rows."""
    return meta_to_text(replace(m, victims=[], aggressors=[]))


def meta_from_text(text: str) -> SessionMeta:
    d = json.loads(text)
    d["processes"] = {int(p): c for p, c in d.get("processes", [])}
    known = {f.name for f in fields(SessionMeta)} - {"pressure"}
    pressure = PressureFigures(**{name: d[key] for name, key in _PRESSURE_KEYS.items() if key in d})
    return SessionMeta(pressure=pressure, **{k: v for k, v in d.items() if k in known})


def profile_to_blob(p: Profile) -> bytes:
    body = {
        "f": [[f.name, f.module, f.file, f.line, f.kind, f.inlined] for f in p.frames],
        # The before-trigger flag is an 8th value and the wait state a 9th, absent from blobs
        # stored before they existed.
        "s": [
            [list(s.stack), s.pid, s.tid, s.thread, s.on_cpu, s.off_cpu, s.off_cpu_ns, s.pre_trigger, s.wait]
            for s in p.samples
        ],
    }
    return zlib.compress(msgpack.packb(body, use_bin_type=True), 6)


def profile_rows(blob: bytes) -> tuple[Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]]]:
    """A stored profile's frames and samples as rows: tuples of Frame's and Sample's fields in order
    (what the export encodes from: otlp.Request.add_rows). A sample stored before the before-trigger
    flag (7 values) or the wait state (8) gets Sample's defaults for them."""
    body = msgpack.unpackb(zlib.decompress(blob), raw=False, use_list=False)
    samples = body["s"]
    if samples and min(map(len, samples)) < len(_SAMPLE_DEFAULTS):
        samples = [s + _SAMPLE_DEFAULTS[len(s) :] for s in samples]
    return body["f"], samples


_SAMPLE_DEFAULTS = tuple(
    f.default if f.default is not MISSING else () for f in fields(Sample)
)  # a sample row's values when absent (the stack has none: never absent)


def profile_from_rows(
    meta: SessionMeta, frames: Sequence[Sequence[Any]], samples: Sequence[Sequence[Any]]
) -> Profile:
    # Positional: half the cost of keywords (the export sender reads every session it sends).
    return Profile(meta=meta, frames=[Frame(*f) for f in frames], samples=[Sample(*s) for s in samples])


def profile_from_blob(blob: bytes, meta: SessionMeta) -> Profile:
    return profile_from_rows(meta, *profile_rows(blob))


def _i64(n: int) -> int:
    return min(n, _INT64_MAX)


# ---------------------------------------------------------------------------


class Store(UploadRows, ExportRows):
    """A session database. Connections are per process and opened on first use."""

    def __init__(
        self, db: str, *, retention_days: float | None = None, max_db_bytes: int | None = None
    ) -> None:
        self.db = db
        self.postgres = db.startswith(("postgresql://", "postgres://"))
        self.retention_days = retention_days
        self.max_db_bytes = max_db_bytes
        self._conn: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        if self.postgres:
            try:
                import psycopg
            except ImportError:
                raise StoreError("--db is a PostgreSQL URL but psycopg is not installed: pip install psycopg")
            try:
                psycopg.conninfo.conninfo_to_dict(db)
            except psycopg.ProgrammingError as e:
                raise StoreError(f"bad PostgreSQL URL {_redact(db)!r}: {e}")

    @classmethod
    def for_state_dir(cls, db: str, state_dir: Path, **kw: Any) -> Store:
        """`db` may be empty (SQLite in the state dir), a path, or a PostgreSQL URL."""
        if not db:
            db = str(state_dir / "bistouri.db")
        return cls(db, **kw)

    @property
    def display(self) -> str:
        return _redact(self.db)

    # -- connections --------------------------------------------------------

    def _connect(self) -> Any:
        if self.postgres:
            import psycopg

            try:
                return psycopg.connect(self.db, autocommit=True, connect_timeout=10)
            except psycopg.Error as e:
                raise StoreError(f"cannot connect to PostgreSQL at {self.display}: {e}".strip())
        path = Path(self.db)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                str(path), timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            # auto_vacuum must be set before the first table exists; later it is a no-op.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open SQLite database {path}: {e}. Check the path and its permissions")
        return conn

    def _c(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # A connection inherited across fork() must not be used: open a new one.
            self._conn = self._connect()
            self._pid = os.getpid()
        return self._conn

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.close()
            except Exception as e:  # a broken connection may fail to close: it is dropped anyway
                log.debug("closing the database connection failed. error=%s", e)
        self._conn = None

    def _sql(self, q: str) -> str:
        return q.replace("?", "%s") if self.postgres else q

    def _operational_errors(self) -> tuple[type[BaseException], ...]:
        if self.postgres:
            import psycopg

            return (psycopg.OperationalError,)
        return (sqlite3.OperationalError,)

    def _run(self, q: str, params: Sequence[Any], fetch: bool) -> Any:
        with self._lock:
            try:
                cur = self._c().execute(self._sql(q), tuple(params))
                return list(cur.fetchall()) if fetch else int(cur.rowcount or 0)
            except self._operational_errors() as e:
                # Locked too long, server gone, disk full: the caller may retry later on a new connection.
                if self.postgres:
                    self.close()
                raise StoreError(f"database {self.display} unavailable: {e}".strip())

    def _fetch(self, q: str, params: Sequence[Any] = ()) -> list[Any]:
        return list(self._run(q, params, fetch=True))

    def _exec(self, q: str, params: Sequence[Any] = ()) -> int:
        return int(self._run(q, params, fetch=False))

    # -- schema -------------------------------------------------------------

    def migrate(self) -> int:
        """Bring the schema to SCHEMA_VERSION; returns the version found before."""
        conn = self._c()
        blob, bigint = ("BYTEA", "BIGINT") if self.postgres else ("BLOB", "INTEGER")
        with self._lock:
            try:
                if self.postgres:
                    conn.execute("BEGIN")
                    conn.execute("SELECT pg_advisory_xact_lock(7389120417)")  # serialise concurrent starts
                else:
                    conn.execute("BEGIN IMMEDIATE")
                conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
                before = int(row[0] or 0)
                if before > SCHEMA_VERSION:
                    raise StoreError(
                        f"database {self.display} has schema version {before}, newer than this "
                        f"bistouri ({SCHEMA_VERSION}): upgrade bistouri or point --db elsewhere"
                    )
                for version, statements in _MIGRATIONS:
                    if version <= before:
                        continue
                    for stmt in statements:
                        conn.execute(stmt.format(blob=blob, bigint=bigint))
                    conn.execute(self._sql("INSERT INTO schema_version (version) VALUES (?)"), (version,))
                    log.info("database migrated. db=%s version=%d", self.display, version)
                conn.execute("COMMIT")
            except BaseException as e:
                try:
                    conn.execute("ROLLBACK")
                except Exception:
                    pass
                if isinstance(e, StoreError):
                    raise
                if isinstance(e, Exception):
                    raise StoreError(f"cannot migrate database {self.display}: {e}")
                raise
        return before

    # -- writes -------------------------------------------------------------

    def insert(
        self,
        rec: StoredSession,
        received_ns: int | None = None,
        export_to: Sequence[str] = (),
        export_after_ns: int = 0,
    ) -> int:
        """Store a session unless its id exists. Returns the bytes stored, 0 for a duplicate.

        `received_ns` (default: now) is what retention goes by. A session stored is queued, in the same
        transaction, for each endpoint of `export_to`, due `export_after_ns` from now.
        """
        m = rec.meta
        profile = profile_to_blob(rec.profile)
        raw = zlib.compress(rec.raw, 6)
        size = len(profile) + len(raw)
        now = time.time_ns()
        row = (
            m.session_id,
            m.tenant,
            m.service,
            m.host,
            m.resource,
            m.comm,
            _i64(m.start_ns),
            _i64(m.duration_ns),
            now if received_ns is None else received_ns,
            rec.kernel_build_id,
            int(rec.kernel_pending),
            meta_to_text(m),
            profile,
            raw,
            size,
            m.trigger_kind,
            summary_to_text(m),
            m.unit,
            m.container_id,
            m.runtime,
        )
        statements: list[tuple[str, Sequence[Any]]] = [
            (
                """INSERT INTO sessions (id, tenant, service, host, resource, comm, start_ns, duration_ns,
                     ingested_ns, kernel_build_id, kernel_pending, meta, profile, raw, size_bytes,
                     trigger_kind, summary, unit, container_id, runtime)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (id) DO NOTHING""",
                row,
            )
        ]
        statements += [
            (INSERT_EXPORT, (m.session_id, endpoint, now, now + export_after_ns, size))
            for endpoint in export_to
        ]
        n = self._transaction(statements)
        return size if n else 0

    def _transaction(self, statements: list[tuple[str, Sequence[Any]]]) -> int:
        """Run statements in one transaction; the ones after the first only if the first changed a row.
        Returns the first one's row count."""
        if len(statements) == 1:
            return self._exec(*statements[0])
        with self._lock:
            conn = self._c()
            try:
                conn.execute("BEGIN IMMEDIATE" if not self.postgres else "BEGIN")
                n = int(conn.execute(self._sql(statements[0][0]), tuple(statements[0][1])).rowcount or 0)
                if n:
                    for q, params in statements[1:]:
                        conn.execute(self._sql(q), tuple(params))
                conn.execute("COMMIT")
                return n
            except BaseException as e:
                try:
                    conn.execute("ROLLBACK")
                except Exception:
                    pass
                if isinstance(e, self._operational_errors()):
                    if self.postgres:
                        self.close()
                    raise StoreError(f"database {self.display} unavailable: {e}".strip())
                raise

    def update_profile(self, session_id: str, profile: Profile, kernel_pending: bool) -> None:
        self._exec(
            "UPDATE sessions SET profile = ?, meta = ?, summary = ?, kernel_pending = ? WHERE id = ?",
            (
                profile_to_blob(profile),
                meta_to_text(profile.meta),
                summary_to_text(profile.meta),
                int(kernel_pending),
                session_id,
            ),
        )

    def put_kernel(self, build_id: str, kallsyms_gz: bytes) -> None:
        self._exec(
            """INSERT INTO kernels (build_id, kallsyms, uploaded_ns) VALUES (?, ?, ?)
               ON CONFLICT (build_id) DO UPDATE SET kallsyms = excluded.kallsyms,
                 uploaded_ns = excluded.uploaded_ns""",
            (build_id, kallsyms_gz, time.time_ns()),
        )

    # -- reads --------------------------------------------------------------

    def exists(self, session_id: str) -> bool:
        return bool(self._fetch("SELECT 1 FROM sessions WHERE id = ?", (session_id,)))

    def get_meta(self, session_id: str) -> SessionMeta | None:
        rows = self._fetch("SELECT meta FROM sessions WHERE id = ?", (session_id,))
        return meta_from_text(rows[0][0]) if rows else None

    def get_profile(self, session_id: str) -> Profile | None:
        rows = self._fetch("SELECT meta, profile FROM sessions WHERE id = ?", (session_id,))
        if not rows:
            return None
        return profile_from_blob(bytes(rows[0][1]), meta_from_text(rows[0][0]))

    def get_profile_rows(
        self, session_id: str
    ) -> tuple[SessionMeta, Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]]] | None:
        """A session's meta, frames and samples as rows (profile_rows), None if it is gone."""
        rows = self._fetch("SELECT meta, profile FROM sessions WHERE id = ?", (session_id,))
        if not rows:
            return None
        return (meta_from_text(rows[0][0]), *profile_rows(bytes(rows[0][1])))

    def get_raw(self, session_id: str) -> bytes | None:
        rows = self._fetch("SELECT raw FROM sessions WHERE id = ?", (session_id,))
        return zlib.decompress(bytes(rows[0][0])) if rows else None

    def get_kernel(self, build_id: str) -> bytes | None:
        rows = self._fetch("SELECT kallsyms FROM kernels WHERE build_id = ?", (build_id,))
        return bytes(rows[0][0]) if rows else None

    def has_kernel(self, build_id: str) -> bool:
        return bool(self._fetch("SELECT 1 FROM kernels WHERE build_id = ?", (build_id,)))

    def pending_for_kernel(self, build_id: str) -> list[str]:
        rows = self._fetch(
            "SELECT id FROM sessions WHERE kernel_build_id = ? AND kernel_pending = 1 ORDER BY start_ns",
            (build_id,),
        )
        return [r[0] for r in rows]

    def pending_kernel(self, session_id: str) -> str:
        """The kernel build id a session waits for, "" when it is fully symbolized."""
        rows = self._fetch(
            "SELECT kernel_build_id FROM sessions WHERE id = ? AND kernel_pending = 1", (session_id,)
        )
        return str(rows[0][0]) if rows else ""

    @staticmethod
    def _where(f: Filter) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        for col in ("service", "host", "resource", "comm", "tenant", "unit", "runtime"):
            v = getattr(f, col)
            if v:
                clauses.append(f"{col} = ?")
                params.append(v)
        if f.kind:
            clauses.append("trigger_kind = ?")
            params.append(f.kind)
        if f.container:
            if not all(c in "0123456789abcdef" for c in f.container):  # no LIKE wildcard gets in
                raise ValueError(f"container {f.container!r}: hex digits only")
            clauses.append("container_id LIKE ?")
            params.append(f.container + "%")
        if f.since_ns is not None:
            clauses.append("start_ns >= ?")
            params.append(_i64(max(f.since_ns, 0)))
        if f.until_ns is not None:
            clauses.append("start_ns <= ?")
            params.append(_i64(max(f.until_ns, 0)))
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), params

    def query(self, f: Filter, limit: int = 100, offset: int = 0) -> tuple[list[SessionMeta], int]:
        """Sessions matching `f`, newest first, and how many match in all: their summaries (no episode
        rows, see summary_to_text)."""
        where, params = self._where(f)
        total = self._fetch("SELECT COUNT(*) FROM sessions" + where, params)[0][0]
        rows = self._fetch(
            "SELECT summary, id FROM sessions" + where + " ORDER BY start_ns DESC, id DESC LIMIT ? OFFSET ?",
            [*params, limit, offset],
        )
        out = []
        for summary, sid in rows:
            if summary:
                out.append(meta_from_text(summary))
                continue
            meta = self.get_meta(sid)  # stored before summaries: one whole metadata at a time
            if meta is not None:
                meta.victims, meta.aggressors = [], []
                out.append(meta)
        return out, int(total)

    def profiles(self, f: Filter, limit: int) -> Iterator[Profile]:
        """The profiles of the newest `limit` sessions matching `f`, fetched in small pages.

        Pages follow a key, (start_ns, id), not an offset: a session stored meanwhile cannot
        shift the pages, so none is returned twice or skipped.
        """
        where, params = self._where(f)
        done = 0
        page = 50
        after: tuple[int, str] | None = None
        while done < limit:
            clause, args = where, list(params)
            if after is not None:
                clause += (" AND " if clause else " WHERE ") + "(start_ns < ? OR (start_ns = ? AND id < ?))"
                args += [after[0], after[0], after[1]]
            rows = self._fetch(
                "SELECT meta, profile, start_ns, id FROM sessions"
                + clause
                + " ORDER BY start_ns DESC, id DESC LIMIT ?",
                [*args, min(page, limit - done)],
            )
            if not rows:
                return
            for meta, blob, _, _ in rows:
                yield profile_from_blob(bytes(blob), meta_from_text(meta))
            done += len(rows)
            after = (int(rows[-1][2]), str(rows[-1][3]))

    def stats(self) -> tuple[int, int]:
        """(sessions, stored blob bytes)."""
        row = self._fetch("SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM sessions")[0]
        return int(row[0]), int(row[1])

    # -- retention ----------------------------------------------------------

    def enforce_retention(self, now_ns: int | None = None) -> dict[str, int]:
        """Delete sessions received more than retention_days ago, then the oldest received until
        under max_db_bytes. By the server's clock: an agent's clock cannot keep a session forever.

        Returns how many were deleted, by reason ("age", "size").
        """
        deleted = {"age": 0, "size": 0}
        now_ns = time.time_ns() if now_ns is None else now_ns
        if self.retention_days is not None:
            cutoff = now_ns - int(self.retention_days * 86400 * 1e9)
            deleted["age"] = self._exec("DELETE FROM sessions WHERE ingested_ns < ?", (cutoff,))
        if self.max_db_bytes is not None:
            used = self._used_bytes()
            while used > self.max_db_bytes:
                rows = self._fetch(
                    "SELECT id, size_bytes FROM sessions ORDER BY ingested_ns, id LIMIT ?",
                    (_RETENTION_BATCH,),
                )
                if not rows:
                    break
                ids: list[str] = []
                for sid, size in rows:
                    if used <= self.max_db_bytes:
                        break
                    ids.append(sid)
                    used -= int(size)
                marks = ", ".join("?" * len(ids))
                deleted["size"] += self._exec(f"DELETE FROM sessions WHERE id IN ({marks})", ids)
        if deleted["age"] or deleted["size"]:
            self._exec(
                "DELETE FROM pending_builds WHERE NOT EXISTS "
                "(SELECT 1 FROM sessions WHERE sessions.id = pending_builds.session_id)"
            )
        if (deleted["age"] or deleted["size"]) and not self.postgres:
            # Give freed pages back to the file system (auto_vacuum = INCREMENTAL).
            self._fetch("PRAGMA incremental_vacuum")
        return deleted

    def _used_bytes(self) -> int:
        """What counts in max_db_bytes: sessions, kallsyms and uploaded files."""
        return self.stats()[1] + self.kernel_bytes() + self.upload_bytes()

    def kernel_bytes(self) -> int:
        """Bytes of the uploaded kallsyms: they count in max_db_bytes."""
        return int(self._fetch("SELECT COALESCE(SUM(LENGTH(kallsyms)), 0) FROM kernels")[0][0])

    def expire_kernels(self, now_ns: int | None = None) -> list[str]:
        """Delete uploaded kallsyms no stored session refers to: those uploaded before the retention
        cutoff, then the oldest while the database is over max_db_bytes. Returns their build ids."""
        unused = "NOT EXISTS (SELECT 1 FROM sessions WHERE sessions.kernel_build_id = kernels.build_id)"
        expired: list[str] = []
        if self.retention_days is not None:
            now_ns = time.time_ns() if now_ns is None else now_ns
            cutoff = now_ns - int(self.retention_days * 86400 * 1e9)
            rows = self._fetch(f"SELECT build_id FROM kernels WHERE uploaded_ns < ? AND {unused}", (cutoff,))
            expired += [str(r[0]) for r in rows]
            for build_id in expired:
                self._exec("DELETE FROM kernels WHERE build_id = ?", (build_id,))
        if self.max_db_bytes is not None:
            used = self._used_bytes()
            query = f"SELECT build_id, LENGTH(kallsyms) FROM kernels WHERE {unused} ORDER BY uploaded_ns"
            for build_id, size in self._fetch(query) if used > self.max_db_bytes else []:
                if used <= self.max_db_bytes:
                    break
                self._exec("DELETE FROM kernels WHERE build_id = ?", (build_id,))
                expired.append(str(build_id))
                used -= int(size)
        return expired


def _redact(url: str) -> str:
    """A database URL without its password, for logs and errors."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cred, host = rest.rsplit("@", 1)
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else url

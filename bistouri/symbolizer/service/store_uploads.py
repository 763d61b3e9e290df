"""The store's rows of uploads (uploads.py owns the files; these, their state shared by every worker and
instance): claims, sizes and last uses per (tenant, build id, kind), the files' chunks on PostgreSQL, and
the sessions waiting for a build id. `tenant` is an upload scope (tenants.upload_scope). A mixin of Store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


class UploadRows:
    """Upload rows; Store provides the connection (`_exec`, `_fetch`) and the bounds."""

    retention_days: float | None
    max_db_bytes: int | None

    def _exec(self, q: str, params: Sequence[Any] = ()) -> int:
        raise NotImplementedError

    def _fetch(self, q: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _used_bytes(self) -> int:
        raise NotImplementedError

    def claim_upload(self, tenant: str, build_id: str, kind: str, lease_ns: int, claimant: str) -> str:
        """Claim the upload of a file: "claimed" (go ahead), "in_progress" (another claimant holds an
        unexpired claim) or "done". Atomic: of concurrent claimants one wins. A claim expires `lease_ns`
        after it was taken, whoever asks again meanwhile (its own claimant included): an expired claim may
        be taken by any other claimant at once, by its last holder only one lease later, so that a
        claimant that never finishes cannot hold it forever."""
        now = time.time_ns()
        key = (tenant, build_id, kind)
        if self._exec(
            """INSERT INTO upload_files (tenant, build_id, kind, state, claimant, changed_ns, expires_ns,
                 used_ns, size_bytes)
               VALUES (?, ?, ?, 'claimed', ?, ?, ?, ?, 0) ON CONFLICT (tenant, build_id, kind) DO NOTHING""",
            (*key, claimant, now, now + lease_ns, now),
        ):
            return "claimed"
        if self._exec(
            """UPDATE upload_files SET claimant = ?, changed_ns = ?, expires_ns = ?
               WHERE tenant = ? AND build_id = ? AND kind = ? AND state = 'claimed' AND expires_ns < ?
               AND (claimant != ? OR expires_ns < ?)""",
            (claimant, now, now + lease_ns, *key, now, claimant, now - lease_ns),
        ):
            return "claimed"  # the last claimant gave up (or died) without finishing
        rows = self._fetch(
            """SELECT state, claimant, expires_ns FROM upload_files
               WHERE tenant = ? AND build_id = ? AND kind = ?""",
            key,
        )
        if not rows:
            return "in_progress"  # released between the two statements: asked again later
        state, holder, expires_ns = rows[0]
        if state == "done":
            return "done"
        mine = claimant and holder == claimant and int(expires_ns) >= now
        return "claimed" if mine else "in_progress"

    def holds_claim(self, tenant: str, build_id: str, kind: str, claimant: str) -> bool:
        """Whether `claimant` holds the (unexpired) claim of this file."""
        rows = self._fetch(
            """SELECT 1 FROM upload_files WHERE tenant = ? AND build_id = ? AND kind = ? AND state = 'claimed'
               AND claimant = ? AND claimant != '' AND expires_ns >= ?""",
            (tenant, build_id, kind, claimant, time.time_ns()),
        )
        return bool(rows)

    def drop_expired_claims(self, now_ns: int | None = None) -> int:
        """Delete claims expired a lease ago or more (the holder may not take them back before: claim_upload)
        that nobody took: a claimant that gave up leaves no row behind. Returns how many."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        return self._exec(
            "DELETE FROM upload_files WHERE state = 'claimed' AND expires_ns < ? - (expires_ns - changed_ns)",
            (now_ns,),
        )

    def live_claims(self, tenant: str) -> int:
        rows = self._fetch(
            "SELECT COUNT(*) FROM upload_files WHERE tenant = ? AND state = 'claimed' AND expires_ns >= ?",
            (tenant, time.time_ns()),
        )
        return int(rows[0][0])

    def finish_upload(self, tenant: str, build_id: str, kind: str, claimant: str, size: int) -> bool:
        """Mark a file done, if `claimant` still holds its claim (expired but not taken over counts).
        False when another claimant took it meanwhile: the caller drops its copy."""
        now = time.time_ns()
        return bool(
            self._exec(
                """UPDATE upload_files SET state = 'done', claimant = '', changed_ns = ?, used_ns = ?,
                     size_bytes = ? WHERE tenant = ? AND build_id = ? AND kind = ? AND state = 'claimed'
                     AND claimant = ?""",
                (now, now, size, tenant, build_id, kind, claimant),
            )
        )

    def release_upload(self, tenant: str, build_id: str, kind: str, claimant: str) -> None:
        """Drop this claimant's unfinished claim (its upload was refused): another may try at once."""
        self._exec(
            """DELETE FROM upload_files WHERE tenant = ? AND build_id = ? AND kind = ? AND state = 'claimed'
               AND claimant = ?""",
            (tenant, build_id, kind, claimant),
        )

    def upload_done(self, tenant: str, build_id: str, kind: str) -> bool:
        rows = self._fetch(
            "SELECT 1 FROM upload_files WHERE tenant = ? AND build_id = ? AND kind = ? AND state = 'done'",
            (tenant, build_id, kind),
        )
        return bool(rows)

    def touch_upload(self, tenant: str, build_id: str, now_ns: int | None = None) -> None:
        """The files of a build id were used to symbolize: evicted last (least recently used first)."""
        self._exec(
            "UPDATE upload_files SET used_ns = ? WHERE tenant = ? AND build_id = ? AND state = 'done'",
            (time.time_ns() if now_ns is None else now_ns, tenant, build_id),
        )

    def upload_usage(self, tenant: str | None = None) -> tuple[int, int]:
        """(files, bytes) of the uploads done, of one tenant or of all."""
        where, params = (
            ("WHERE state = 'done'", [])
            if tenant is None
            else ("WHERE state = 'done' AND tenant = ?", [tenant])
        )
        row = self._fetch(f"SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM upload_files {where}", params)[
            0
        ]
        return int(row[0]), int(row[1])

    def upload_bytes(self) -> int:
        """Bytes of the uploaded files: they count in max_db_bytes."""
        return self.upload_usage()[1]

    def uploads_by_use(self, tenant: str | None = None) -> list[tuple[str, str, str, int]]:
        """(tenant, build id, kind, bytes) of the uploads done, least recently used first."""
        where, params = (
            ("WHERE state = 'done'", [])
            if tenant is None
            else ("WHERE state = 'done' AND tenant = ?", [tenant])
        )
        rows = self._fetch(
            f"SELECT tenant, build_id, kind, size_bytes FROM upload_files {where} ORDER BY used_ns, build_id",
            params,
        )
        return [(str(t), str(b), str(k), int(n)) for t, b, k, n in rows]

    def delete_upload(self, tenant: str, build_id: str, kind: str) -> None:
        """Forget an upload, its row and its shared copy (uploads.py removes the file)."""
        self._exec(
            "DELETE FROM upload_files WHERE tenant = ? AND build_id = ? AND kind = ?",
            (tenant, build_id, kind),
        )
        self.delete_upload_chunks(tenant, build_id, kind)

    def add_pending_builds(self, session_id: str, waits: dict[str, int]) -> None:
        """Note the build ids a session waits for, each with the kinds of upload present when it was
        symbolized (a bit mask: uploads.py)."""
        for build_id, have in waits.items():
            self._exec(
                """INSERT INTO pending_builds (session_id, build_id, have) VALUES (?, ?, ?)
                   ON CONFLICT (session_id, build_id) DO UPDATE SET have = excluded.have""",
                (session_id, build_id, have),
            )

    def pending_builds(self, session_id: str) -> dict[str, int]:
        rows = self._fetch("SELECT build_id, have FROM pending_builds WHERE session_id = ?", (session_id,))
        return {str(r[0]): int(r[1]) for r in rows}

    def pending_for_build(
        self, build_id: str, have: int, limit: int, in_scope: Callable[[str], bool] = lambda t: True
    ) -> list[str]:
        """Sessions waiting for this build id that were symbolized without some of the `have` kinds,
        of the tenants `in_scope` accepts (an upload serves its own tenant's sessions only)."""
        rows = self._fetch(
            """SELECT p.session_id, p.have, s.tenant FROM pending_builds p JOIN sessions s
               ON s.id = p.session_id WHERE p.build_id = ? ORDER BY p.session_id""",
            (build_id,),
        )
        return [str(sid) for sid, h, tenant in rows if have & ~int(h) and in_scope(str(tenant))][:limit]

    def clear_pending_build(self, session_id: str, build_id: str) -> None:
        self._exec("DELETE FROM pending_builds WHERE session_id = ? AND build_id = ?", (session_id, build_id))

    def put_upload_chunk(self, tenant: str, build_id: str, kind: str, seq: int, data: bytes) -> None:
        """One chunk of an uploaded file (PostgreSQL: shared by the instances)."""
        self._exec(
            "INSERT INTO upload_parts (tenant, build_id, kind, seq, data) VALUES (?, ?, ?, ?, ?)",
            (tenant, build_id, kind, seq, data),
        )

    def upload_chunks(self, tenant: str, build_id: str, kind: str) -> int:
        query = "SELECT COUNT(*) FROM upload_parts WHERE tenant = ? AND build_id = ? AND kind = ?"
        rows = self._fetch(query, (tenant, build_id, kind))
        return int(rows[0][0])

    def upload_chunk(self, tenant: str, build_id: str, kind: str, seq: int) -> bytes | None:
        """One chunk at a time: a file of hundreds of MB is never in memory whole."""
        query = "SELECT data FROM upload_parts WHERE tenant = ? AND build_id = ? AND kind = ? AND seq = ?"
        rows = self._fetch(query, (tenant, build_id, kind, seq))
        return bytes(rows[0][0]) if rows else None

    def delete_upload_chunks(self, tenant: str, build_id: str, kind: str) -> None:
        self._exec(
            "DELETE FROM upload_parts WHERE tenant = ? AND build_id = ? AND kind = ?",
            (tenant, build_id, kind),
        )

    def expire_uploads(self, now_ns: int | None = None) -> list[tuple[str, str, str, str]]:
        """Retention of uploads, run before the sessions': claims long expired go; uploads not used
        since the retention cutoff go; then the least recently used while the database is over
        max_db_bytes, before any session (an agent uploads a file again when asked; a session is
        gone for good). Returns (tenant, build id, kind, reason) of each file: uploads.py removes it."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        self.drop_expired_claims(now_ns)
        expired: list[tuple[str, str, str, str]] = []
        gone: set[tuple[str, str, str]] = set()
        if self.retention_days is not None:
            cutoff = now_ns - int(self.retention_days * 86400 * 1e9)
            rows = self._fetch(
                "SELECT tenant, build_id, kind FROM upload_files WHERE state = 'done' AND used_ns < ?",
                (cutoff,),
            )
            for t, b, k in rows:
                gone.add((str(t), str(b), str(k)))
                expired.append((str(t), str(b), str(k), "age"))
        if self.max_db_bytes is not None:
            used = self._used_bytes()
            for t, b, k, size in self.uploads_by_use() if used > self.max_db_bytes else []:
                if used <= self.max_db_bytes:
                    break
                if (t, b, k) not in gone:
                    gone.add((t, b, k))
                    expired.append((t, b, k, "size"))
                    used -= size
        for t, b, k, _ in expired:
            self.delete_upload(t, b, k)
        return expired

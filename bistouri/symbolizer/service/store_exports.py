"""The store's export queue (exports.py sends): a row per (session, endpoint) still to send, shared by
every worker and instance of one database. A mixin of Store.

A row is written in the transaction that stores its session (Store.insert), so a session stored is a
session queued, whatever stops afterwards. A sender claims rows with a lease: on PostgreSQL with
`FOR UPDATE SKIP LOCKED` (concurrent claimants skip each other's rows instead of waiting or taking
them too), on SQLite with one UPDATE (the database lock makes it atomic). A row sent is deleted by
its claimant; a row whose claimant died is claimed again once its lease is over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...compat import SLOTS

INSERT_EXPORT = """INSERT INTO export_queue (session_id, endpoint, enqueued_ns, next_ns, size_bytes,
                     attempts, lease_until_ns, claimant)
                   VALUES (?, ?, ?, ?, ?, 0, 0, '') ON CONFLICT (session_id, endpoint) DO NOTHING"""

_CLAIM = """UPDATE export_queue SET claimant = ?, lease_until_ns = ?
            WHERE (session_id, endpoint) IN (
              SELECT session_id, endpoint FROM export_queue
              WHERE endpoint = ? AND next_ns <= ? AND lease_until_ns <= ?
              ORDER BY next_ns, enqueued_ns, session_id LIMIT ?{lock})
            AND lease_until_ns <= ?
            RETURNING session_id, attempts, enqueued_ns"""


@dataclass(frozen=True, **SLOTS)
class Claimed:
    session_id: str
    attempts: int  # sends tried before this one
    enqueued_ns: int


@dataclass(frozen=True, **SLOTS)
class Backlog:
    """What waits for one endpoint: rows, the stored bytes of their sessions, the oldest's enqueue time."""

    rows: int
    bytes: int
    oldest_ns: int


class ExportRows:
    """Export queue rows; Store provides the connection (`_exec`, `_fetch`) and the dialect."""

    postgres: bool

    def _exec(self, q: str, params: Sequence[Any] = ()) -> int:
        raise NotImplementedError

    def _fetch(self, q: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def claim_exports(self, endpoint: str, claimant: str, lease_ns: int, limit: int) -> list[Claimed]:
        """Up to `limit` rows of `endpoint` due now and unclaimed (or whose lease is over), now held by
        `claimant` for `lease_ns`; the next due first. No row is held by two claimants at once."""
        now = time.time_ns()
        q = _CLAIM.format(lock=" FOR UPDATE SKIP LOCKED" if self.postgres else "")
        rows = self._fetch(q, (claimant, now + lease_ns, endpoint, now, now, limit, now))
        return sorted((Claimed(str(r[0]), int(r[1]), int(r[2])) for r in rows), key=lambda c: c.enqueued_ns)

    def finish_export(self, session_id: str, endpoint: str, claimant: str) -> bool:
        """Delete a row sent (or given up) by its claimant; False if the claim was lost meanwhile."""
        n = self._exec(
            "DELETE FROM export_queue WHERE session_id = ? AND endpoint = ? AND claimant = ?",
            (session_id, endpoint, claimant),
        )
        return bool(n)

    def finish_exports(self, session_ids: Sequence[str], endpoint: str, claimant: str) -> int:
        """Delete rows sent together (one request) by their claimant, in one statement; how many were
        still its own."""
        if not session_ids:
            return 0
        marks = ", ".join("?" * len(session_ids))
        return self._exec(
            f"DELETE FROM export_queue WHERE endpoint = ? AND claimant = ? AND session_id IN ({marks})",
            (endpoint, claimant, *session_ids),
        )

    def retry_export(self, session_id: str, endpoint: str, claimant: str, next_ns: int, failed: bool) -> None:
        """Give a claimed row back, due at `next_ns`; `failed` counts an attempt."""
        self._exec(
            """UPDATE export_queue SET lease_until_ns = 0, claimant = '', next_ns = ?, attempts = attempts + ?
               WHERE session_id = ? AND endpoint = ? AND claimant = ?""",
            (next_ns, int(failed), session_id, endpoint, claimant),
        )

    def export_backlog(self) -> dict[str, Backlog]:
        """Per endpoint: what waits to be sent."""
        rows = self._fetch(
            """SELECT endpoint, COUNT(*), COALESCE(SUM(size_bytes), 0), MIN(enqueued_ns)
               FROM export_queue GROUP BY endpoint"""
        )
        return {str(r[0]): Backlog(int(r[1]), int(r[2]), int(r[3] or 0)) for r in rows}

    def drop_exports(self, max_rows: int, max_bytes: int, max_age_ns: int) -> dict[str, int]:
        """Delete rows past the bounds, oldest first: enqueued longer than `max_age_ns` ago ("expired"),
        then while the queue holds over `max_rows` rows or `max_bytes` ("queue_full"). Returns, per
        endpoint and reason, how many. Several instances may run it at once: each counts what it deleted."""
        dropped: dict[str, int] = {}

        def count(endpoint: str, reason: str, n: int) -> None:
            if n:
                dropped[f"{endpoint}\n{reason}"] = dropped.get(f"{endpoint}\n{reason}", 0) + n

        cutoff = time.time_ns() - max_age_ns
        for endpoint, n in self._fetch(
            "SELECT endpoint, COUNT(*) FROM export_queue WHERE enqueued_ns < ? GROUP BY endpoint", (cutoff,)
        ):
            count(str(endpoint), "expired", self._delete_oldest(str(endpoint), int(n), cutoff))
        for endpoint, b in self.export_backlog().items():
            over_rows = b.rows - max_rows
            over = over_rows
            if b.bytes > max_bytes:
                # The oldest rows until the bytes fit: their sizes, oldest first, summed until enough.
                sizes = self._fetch(
                    "SELECT size_bytes FROM export_queue WHERE endpoint = ? ORDER BY enqueued_ns, session_id",
                    (endpoint,),
                )
                excess, n = b.bytes - max_bytes, 0
                for (size,) in sizes:
                    if excess <= 0:
                        break
                    excess -= int(size)
                    n += 1
                over = max(over, n)
            if over > 0:
                count(endpoint, "queue_full", self._delete_oldest(endpoint, over, None))
        return dropped

    def drop_exports_not_for(self, endpoints: Sequence[str]) -> dict[str, int]:
        """Delete the rows of every endpoint but `endpoints` (the ones configured): per endpoint, how
        many. Several instances may run it at once: each counts what it deleted."""
        keep = ", ".join("?" * len(endpoints))
        where = f"endpoint NOT IN ({keep})" if endpoints else "1 = 1"
        dropped: dict[str, int] = {}
        for (endpoint,) in self._fetch(
            f"SELECT DISTINCT endpoint FROM export_queue WHERE {where}", endpoints
        ):
            n = self._exec("DELETE FROM export_queue WHERE endpoint = ?", (endpoint,))
            if n:
                dropped[str(endpoint)] = n
        return dropped

    def _delete_oldest(self, endpoint: str, n: int, before_ns: int | None) -> int:
        age = " AND enqueued_ns < ?" if before_ns is not None else ""
        params: list[Any] = [endpoint] + ([before_ns] if before_ns is not None else []) + [n]
        return self._exec(
            f"""DELETE FROM export_queue WHERE (session_id, endpoint) IN (
                  SELECT session_id, endpoint FROM export_queue WHERE endpoint = ?{age}
                  ORDER BY enqueued_ns, session_id LIMIT ?)""",
            params,
        )

"""Forwarding of stored sessions to OTLP Profiles endpoints and to Pyroscope (docs/deployment.md).

Ingest queues a session for every configured endpoint in the transaction that stores it
(Store.insert); it never sends nor waits. One sender thread per worker process
(`bistouri-export`) claims due rows with a lease (store_exports.py), reads each session as
stored at that moment, as rows (a session symbolized again meanwhile goes out with its kernel
frames named; one sent is not sent again: the endpoints only append), once for all endpoints,
encodes it and posts it:

- OTLP: up to BATCH sessions in one ExportProfilesServiceRequest (otlp.Request: one dictionary,
  what the sessions share written once), OTLP/HTTP protobuf, gzip'd, to the URL given (the
  collector's `/v1development/profiles`, in full). A request refused is sent again a session a
  request: only the session refused is dropped.
- Pyroscope: the pprof (formats.pprof_rows, from the rows, with each frame's location built once per
  sender: formats.PprofIds), gzip'd, to `<url>/ingest?name=<service>{labels}&from&until&format=pprof`,
  a session a request (that API takes one profile); or, with the endpoint's api "push"
  (`--pyroscope-api push`), up to BATCH sessions in one `<url>/push.v1.PusherService/Push` (Pyroscope
  1.x's own push API, Connect protocol: a PushRequest of one series a session, its labels those
  /ingest would give it), batched as OTLP's.

Connections are kept alive when an answer says it has no body (Content-Length: 0, what OTLP's
and Pyroscope's successes send): its connection goes back to requests' pool. Any other body is
never read and its connection closed, so an endpoint cannot drip one to hold a sender.

A 2xx deletes the rows. A refusal that a retry cannot change (4xx but 408 and 429) drops it; any
other failure gives it back with a backoff per row and pauses the endpoint (its `disabled_until`,
doubling to MAX_BACKOFF_S, or the server's Retry-After). The queue is bounded in rows, bytes and
age: past them the oldest rows go. Every outcome is counted: `exports_sent_total`,
`exports_failed_total{reason}`, `exports_dropped_total{reason}`, and at scrape time the backlog
(`export_queue_sessions`, `export_queue_bytes`, `export_queue_oldest_seconds`). At start-up the
rows of endpoints no longer configured are dropped (`endpoint_removed`).

Once per endpoint and session: a row is held by one claimant at a time and deleted by it after
the endpoint took it. A sender that dies between the endpoint's answer and the delete leaves
the row to be sent again after its lease (at least once, as any sender without the endpoint's
help): LEASE_S is far above a request's timeout, so a live sender never overlaps another.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import requests

from ...compat import SLOTS
from .. import formats, otlp
from .. import protobuf as _pb
from ..model import Profile, SessionMeta
from .metrics import Metrics
from .store import Store, StoreError
from .store_exports import Claimed

log = logging.getLogger(__name__)

OTLP = "otlp"
PYROSCOPE = "pyroscope"

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0  # any one read of the answer
LEASE_S = 300.0  # a claimed row is another sender's after this: far above a request's timeouts
BATCH = 32  # rows claimed at once per endpoint: an OTLP request carries up to this many sessions
MAX_REQUEST_BYTES = 4 << 20  # an OTLP request takes no more sessions past about this many bytes, uncompressed
POLL_S = 1.0  # how often an idle sender looks for due rows (ingest in this process wakes it at once)
BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
BOUNDS_EVERY_S = 10.0
# A session stored without all its symbols (kernel or binaries missing) waits this long before it is
# sent: the agent uploads what is missing within seconds, and the session is symbolized again.
PENDING_DELAY_S = 30.0

DEFAULT_MAX_ROWS = 100_000
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_AGE_S = 86_400.0


INGEST = "ingest"  # Pyroscope's /ingest: a profile a request, every Pyroscope version
PUSH = "push"  # Pyroscope 1.x's /push.v1.PusherService/Push: many a request
PUSH_PATH = "/push.v1.PusherService/Push"


@dataclass(frozen=True, **SLOTS)
class Endpoint:
    kind: str  # OTLP | PYROSCOPE
    url: str
    headers: dict[str, str] = field(default_factory=dict)  # tokens: never logged
    api: str = INGEST  # Pyroscope's: INGEST | PUSH (the queue's rows stay the endpoint's either way)

    @property
    def key(self) -> str:
        """What the queue's rows name it by: stable across restarts while the URL stays."""
        return f"{self.kind} {self.url}"


@dataclass(frozen=True, **SLOTS)
class ExportConfig:
    endpoints: tuple[Endpoint, ...] = ()
    max_rows: int = DEFAULT_MAX_ROWS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_age_s: float = DEFAULT_MAX_AGE_S

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(e.key for e in self.endpoints)


def read_headers(path: str) -> dict[str, str]:
    """A headers file: `Name: value` a line (tokens kept off the command line); # comments."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z0-9-]+", name.strip()):
                raise ValueError(f"{path}:{n}: not a 'Name: value' header line")
            out[name.strip()] = value.strip()
    return out


# ---------------------------------------------------------------------------
# Payloads: pure functions of a profile

# A session as the sender reads it: its meta, frames and samples as rows (Store.get_profile_rows).
Stored = tuple[SessionMeta, Sequence[tuple[Any, ...]], Sequence[tuple[Any, ...]]]


def otlp_payload(sessions: list[Stored]) -> bytes:
    """Sessions in one ExportProfilesServiceRequest (one dictionary), gzip'd."""
    req = otlp.Request()
    for meta, frames, samples in sessions:
        req.add_rows(meta, frames, samples)
    return _gzip(req.encode())


def pyroscope_payload(session: Stored, ids: formats.PprofIds | None = None) -> bytes:
    """The session's pprof, from its rows (with the sender's pprof ids, kept between its profiles),
    gzip'd at the level of the OTLP requests (pprof's files use 6: a third of the cost of encoding
    here, for a few percent of bytes)."""
    return _gzip(formats.pprof_rows(*session, compress=False, ids=ids))


def pyroscope_push_payload(sessions: list[Stored], ids: formats.PprofIds | None = None) -> bytes:
    """Sessions in one push.v1.PushRequest (grafana/pyroscope api/push/v1/push.proto): a
    RawProfileSeries a session, its labels those Pyroscope's /ingest gives the same session
    (`__name__` process_cpu from the first sample type, `__delta__` false, service_name,
    pyroscope_spy, then pyroscope_labels), its one RawSample the session's gzip'd pprof (as /ingest
    takes it) with an id derived from the session id (the same on a retry). Not compressed again:
    its bulk is already gzip."""
    series = []
    for session in sessions:
        meta = session[0]
        labels = {
            **pyroscope_labels(meta),  # first: an agent's label cannot replace the four below
            "__name__": "process_cpu",
            "__delta__": "false",
            "service_name": _LABEL_VALUE_BAD.sub("_", meta.service or "bistouri"),
            "pyroscope_spy": "bistouri",
        }
        pairs = b"".join(
            _pb.bytes_field(1, _pb.bytes_field(1, k.encode()) + _pb.bytes_field(2, v.encode()))
            for k, v in sorted(labels.items())
        )
        sample_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"bistouri:{meta.session_id}")).encode()
        sample = _pb.bytes_field(1, pyroscope_payload(session, ids)) + _pb.bytes_field(2, sample_id)
        series.append(_pb.bytes_field(1, pairs + _pb.bytes_field(2, sample)))
    return b"".join(series)


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0)


# Pyroscope's name syntax `app{k=v,...}`: what a label may hold without breaking it.
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_./:@+-]")
_LABEL_KEY_BAD = re.compile(r"[^A-Za-z0-9_]")


def pyroscope_labels(session: Profile | SessionMeta) -> dict[str, str]:
    """The labels a session (a profile or its meta) is pushed with: host, cgroup, unit and container,
    trigger, tenant, the agent's labels."""
    m = session.meta if isinstance(session, Profile) else session
    labels = {
        "host": m.host,
        "cgroup": m.cgroup,
        "trigger_kind": m.trigger_kind,
        "resource": m.resource,
        "stall": m.stall,
        "tenant": m.tenant,
        "session_id": m.session_id,
        "systemd_unit": m.unit,
        "container_id": m.container_id,
        "container_runtime": m.runtime,
    }
    labels.update({_LABEL_KEY_BAD.sub("_", k): v for k, v in m.labels.items()})
    return {k: _LABEL_VALUE_BAD.sub("_", v) for k, v in labels.items() if v}


def pyroscope_query(session: Profile | SessionMeta) -> str:
    """The /ingest query: name=<service_name>{labels}, from/until (unix seconds), format=pprof."""
    m = session.meta if isinstance(session, Profile) else session
    service = _LABEL_VALUE_BAD.sub("_", m.service or "bistouri")
    labels = ",".join(f"{k}={v}" for k, v in sorted(pyroscope_labels(m).items()))
    start = m.start_ns // 10**9
    until = max(start + 1, (m.start_ns + m.duration_ns + 10**9 - 1) // 10**9)
    name = quote(f"{service}{{{labels}}}", safe="")
    return f"name={name}&from={start}&until={until}&format=pprof&spyName=bistouri"


# ---------------------------------------------------------------------------
# The sender


class _Refused(Exception):
    """The endpoint refused the payload in a way a retry cannot change."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Failed(Exception):
    """A failure worth retrying; `retry_after` is the server's Retry-After in seconds, if any."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def _retry_after(resp: requests.Response) -> float | None:
    text = resp.headers.get("Retry-After", "")
    return min(float(text), MAX_BACKOFF_S * 10) if text.isdigit() else None


def backoff_s(failures: int) -> float:
    """The pause after `failures` failures in a row: doubling from BASE_BACKOFF_S, jittered ±20 %."""
    base = min(BASE_BACKOFF_S * 2 ** max(failures - 1, 0), MAX_BACKOFF_S)
    return base * random.uniform(0.8, 1.2)


class Exporter:
    """A worker's sender thread. `wake()` after a session is queued; `close()` stops it."""

    def __init__(self, store: Store, config: ExportConfig, metrics: Metrics) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.claimant = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._http = requests.Session()
        # The environment's proxies and CA bundle, read once per endpoint: requests reads them (every
        # variable of the environment) on each request otherwise, a fifth of a send's CPU.
        self._env = {
            e.key: self._http.merge_environment_settings(e.url, {}, None, None, None)
            for e in config.endpoints
        }
        self._http.trust_env = False
        # Each endpoint's request prepared once (URL, headers: requests' merging of them is a third
        # of a post's CPU); a send copies it and sets its body (and Pyroscope's query).
        self._prepared = {e.key: self._prepare(e) for e in config.endpoints}
        self._disabled_until = {e.key: 0.0 for e in config.endpoints}
        self._failures = {e.key: 0 for e in config.endpoints}
        self._next_bounds = 0.0
        self._thread: threading.Thread | None = None
        # Each frame's pprof location built once for all the sessions this sender pushes (bounded).
        self._pprof_ids = formats.PprofIds()

    def start(self) -> None:
        self.forget_removed_endpoints()
        if self._thread is None and self.config.endpoints:
            self._thread = threading.Thread(target=self._run, name="bistouri-export", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._http.close()
        self.store.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the round: a session queued during it wakes the next at once
            try:
                busy = self.run_once()
            except StoreError as e:
                log.warning("export queue unavailable. error=%s", e)
                busy = False
            except Exception as e:  # the thread must outlive any one failure
                log.error("export round failed. error=%s: %s", type(e).__name__, e, exc_info=True)
                busy = False
            if not busy:
                self._wake.wait(POLL_S)

    def run_once(self) -> bool:
        """One round: the bounds when due, then a batch per endpoint not paused. True if it sent any."""
        now = time.monotonic()
        if now >= self._next_bounds:
            self._next_bounds = now + BOUNDS_EVERY_S
            self.enforce_bounds()
        busy = False
        # Sessions read in this round: the endpoints' rows name the same sessions, read once for all.
        sessions: dict[str, Stored | None] = {}
        for ep in self.config.endpoints:
            if self._stop.is_set():
                break
            if time.monotonic() < self._disabled_until[ep.key]:
                continue
            # An endpoint that failed is tried with one session until it answers again: an outage
            # costs one session's encoding per attempt, not a batch's (nor a batch's claim given back).
            limit = 1 if self._failures[ep.key] else BATCH
            claimed = self.store.claim_exports(ep.key, self.claimant, int(LEASE_S * 1e9), limit)
            if not claimed:
                continue
            busy = True
            per_request = 1 if ep.kind == PYROSCOPE and ep.api == INGEST else BATCH  # /ingest: one profile
            self._send(ep, claimed, sessions, per_request)
        return busy

    def _send(
        self, ep: Endpoint, rows: list[Claimed], sessions: dict[str, Stored | None], per_request: int
    ) -> bool:
        """Send claimed rows, up to `per_request` sessions a request (and about MAX_REQUEST_BYTES).
        False when the endpoint failed: it is paused, the rows not sent given back."""
        i = 0
        while i < len(rows):
            if self._stop.is_set():
                self._release(ep, rows[i:])
                return True
            batch: list[tuple[Claimed, Stored]] = []
            size = 0
            while i < len(rows) and len(batch) < per_request and size < MAX_REQUEST_BYTES:
                row = rows[i]
                i += 1
                sid = row.session_id
                if sid not in sessions:
                    sessions[sid] = self.store.get_profile_rows(sid)
                stored = sessions[sid]
                if stored is None:  # deleted by retention meanwhile
                    self._drop(ep, row, "session_gone")
                    continue
                batch.append((row, stored))
                size += sum(len(s[0]) for s in stored[2]) * 4  # its stacks and samples, about
            if not batch:
                continue
            try:
                body, query = self._payload(ep, [p for _, p in batch])
            except Exception as e:
                if len(batch) > 1:  # which session? each alone
                    if not self._send(ep, [r for r, _ in batch], sessions, 1):
                        self._release(ep, rows[i:])
                        return False
                    continue
                sid = batch[0][0].session_id
                log.error(
                    "cannot encode a session for export. session=%s error=%s: %s", sid, type(e).__name__, e
                )
                self._drop(ep, batch[0][0], "encode_failed")
                continue
            outcome = self._deliver(ep, [r for r, _ in batch], body, query)
            if outcome == "refused" and len(batch) > 1:
                # One session, or the request's size, may be what the endpoint refused: each alone.
                outcome = "sent" if self._send(ep, [r for r, _ in batch], sessions, 1) else "failed"
            if outcome == "failed":
                self._release(ep, rows[i:])  # the endpoint is paused: the others wait too
                return False
        return True

    def _payload(self, ep: Endpoint, sessions: list[Stored]) -> tuple[bytes, str]:
        """A request's body and, for Pyroscope, its query."""
        if ep.kind == OTLP:
            return otlp_payload(sessions), ""
        if ep.api == PUSH:
            return pyroscope_push_payload(sessions, self._pprof_ids), ""
        (session,) = sessions
        return pyroscope_payload(session, self._pprof_ids), pyroscope_query(session[0])

    def _deliver(self, ep: Endpoint, rows: list[Claimed], body: bytes, query: str) -> str:
        """Post one request of `rows` and act on the answer: "sent", "refused" (the rows dropped,
        if alone) or "failed" (retried later)."""
        started = time.monotonic()
        try:
            self._post(ep, body, query)
        except _Refused as e:
            self.metrics.exports_failed.labels(ep.kind, e.reason).inc()
            if len(rows) == 1:
                sid = rows[0].session_id
                log.warning(
                    "export refused: session dropped. endpoint=%s session=%s reason=%s", ep.url, sid, e
                )
                self._drop(ep, rows[0], "refused")
            return "refused"
        except _Failed as e:
            self.metrics.exports_failed.labels(ep.kind, e.reason).inc()
            n = self._failures[ep.key] = self._failures[ep.key] + 1
            pause = e.retry_after if e.retry_after is not None else backoff_s(n)
            self._disabled_until[ep.key] = time.monotonic() + pause
            if n == 1 or n % 10 == 0:
                log.warning(
                    "export failed; retrying. endpoint=%s reason=%s failures=%d pause_s=%.1f",
                    ep.url,
                    e.reason,
                    n,
                    pause,
                )
            for row in rows:
                next_ns = time.time_ns() + int(backoff_s(row.attempts + 1) * 1e9)
                self.store.retry_export(row.session_id, ep.key, self.claimant, next_ns, failed=True)
            return "failed"
        self.metrics.export_latency.labels(ep.kind).observe(time.monotonic() - started)
        self._failures[ep.key] = 0
        done = self.store.finish_exports([r.session_id for r in rows], ep.key, self.claimant)
        if done:
            self.metrics.exports_sent.labels(ep.kind).inc(done)
            self.metrics.exported_bytes.labels(ep.kind).inc(len(body))
        return "sent"

    def _release(self, ep: Endpoint, rows: list[Claimed]) -> None:
        """Give back rows claimed and not tried, as they were: due at once, no attempt counted."""
        for row in rows:
            self.store.retry_export(row.session_id, ep.key, self.claimant, 0, failed=False)

    def forget_removed_endpoints(self) -> None:
        """At start-up: the rows of endpoints no longer configured are dropped (counted by reason
        `endpoint_removed`) rather than kept until the age bound. Every instance on one database is
        configured with the same endpoints (the role does): one's rows are never another's."""
        try:
            dropped = self.store.drop_exports_not_for(self.config.keys)
        except Exception as e:  # never a reason not to start: the rows stay, the next start tries again
            log.warning("cannot drop the export rows of removed endpoints. error=%s: %s", type(e).__name__, e)
            return
        for endpoint, n in dropped.items():
            self.metrics.exports_dropped.labels(endpoint_kind(endpoint), "endpoint_removed").inc(n)
            log.warning(
                "export rows of an endpoint no longer configured dropped. endpoint=%s count=%d",
                endpoint.split(" ", 1)[-1],
                n,
            )

    def enforce_bounds(self) -> None:
        c = self.config
        dropped = self.store.drop_exports(c.max_rows, c.max_bytes, int(c.max_age_s * 1e9))
        for key, n in dropped.items():
            endpoint, reason = key.split("\n")
            self.metrics.exports_dropped.labels(endpoint_kind(endpoint), reason).inc(n)
            log.warning(
                "export queue over its bounds: sessions dropped. endpoint=%s reason=%s count=%d",
                endpoint,
                reason,
                n,
            )

    def _drop(self, ep: Endpoint, row: Claimed, reason: str) -> None:
        if self.store.finish_export(row.session_id, ep.key, self.claimant):
            self.metrics.exports_dropped.labels(ep.kind, reason).inc()

    def _prepare(self, ep: Endpoint) -> requests.PreparedRequest:
        headers = dict(ep.headers)
        if ep.kind == OTLP:
            url = ep.url
            headers.update({"Content-Type": otlp.CONTENT_TYPE, "Content-Encoding": "gzip"})
        elif ep.api == PUSH:
            url = ep.url.rstrip("/") + PUSH_PATH
            headers.update({"Content-Type": "application/proto", "Connect-Protocol-Version": "1"})
        else:
            url = f"{ep.url.rstrip('/')}/ingest"
            headers["Content-Type"] = "application/octet-stream"
        return self._http.prepare_request(requests.Request("POST", url, headers=headers))

    def _post(self, ep: Endpoint, body: bytes, query: str) -> None:
        request = self._prepared[ep.key].copy()
        if query:  # already quoted (pyroscope_query)
            request.url = f"{request.url}?{query}"
        request.body = body
        request.headers["Content-Length"] = str(len(body))
        env = self._env[ep.key]
        try:
            # Session.send: redirects, proxies, the CA bundle and timeouts as Session.post has them.
            resp = self._http.send(
                request,
                timeout=(CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S),
                proxies=env["proxies"],
                verify=env["verify"],
                cert=env["cert"],
                # The answer's status and headers are all we use: streamed, a body is never read
                # (_keep_alive), so an endpoint cannot hold a sender (or its memory) with one.
                stream=True,
            )
        except requests.Timeout:
            raise _Failed("timeout") from None
        except requests.RequestException:
            raise _Failed("connection") from None
        with resp:
            _keep_alive(resp)
            code = resp.status_code
            if 200 <= code < 300:
                return
            if code in (408, 429) or code >= 500:
                raise _Failed(
                    f"status_{code // 100}xx" if code >= 500 else f"status_{code}", _retry_after(resp)
                )
            raise _Refused(f"status_{code}")


def _keep_alive(resp: requests.Response) -> None:
    """Give an answer without a body (Content-Length: 0) its end, so that its connection goes back to
    the pool: a new connection a request costs a Pyroscope send a third of its CPU. An answer with a
    body (OTLP's partial success, an error page) is left unread and its connection closed with it:
    reading even a short body is a wait an endpoint could stretch a byte at a time."""
    if resp.headers.get("Content-Length") == "0":
        with contextlib.suppress(requests.RequestException):
            resp.content  # noqa: B018 (nothing to wait for: the body's end releases the connection)


def endpoint_kind(key: str) -> str:
    """OTLP or PYROSCOPE, from a queue row's endpoint key."""
    return key.split(" ", 1)[0]


__all__ = [
    "OTLP",
    "PYROSCOPE",
    "Endpoint",
    "ExportConfig",
    "Exporter",
    "pyroscope_labels",
    "pyroscope_query",
    "read_headers",
]

"""Ingest of agent sessions: decode → check → symbolize → meta → insert, the kernel registry, retention.

One `Ingest` per worker process, shared by its request threads. It owns the process's
single `KallsymsStore` (the resolver reads the same one), knows which kernels' kallsyms
are here, re-symbolizes stored sessions when what they waited for arrives (a kernel's
kallsyms, an uploaded binary: uploads.py), and runs retention. The HTTP layer
(server.py) parses requests, calls one method here and answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgpack

from ... import wire
from ...compat import SLOTS
from ...errors import WireError
from ..kallsyms import KallsymsError, KallsymsIndex, KallsymsStore, kernel_key
from ..model import Profile
from ..tenants import upload_scope
from .exports import PENDING_DELAY_S
from .metrics import Metrics
from .store import Store, StoredSession, StoreError
from .uploads import Uploads

log = logging.getLogger(__name__)

RETENTION_INTERVAL_S = 60.0
RESYMBOLIZE_PER_UPLOAD = 2000
# Work bounded per request: at these bounds a worker spends at most ~2 s and ~150 MB on the
# symbolization of one request (measured on a loaded 2-CPU machine). A session over them is
# refused (413), and sessions of a batch past them are put off to a next request.
MAX_FRAMES_PER_REQUEST = wire.MAX_FRAMES_PER_REQUEST
MAX_STACKS_PER_REQUEST = wire.MAX_STACKS_PER_REQUEST
MAX_STACK_ENTRIES_PER_REQUEST = wire.MAX_STACK_ENTRIES_PER_REQUEST
# Build ids asked for in one ingest answer, and looked at per session: what an agent can act on.
MAX_MISSING_BUILDS = 100
_HAVE_DEBUGINFO = 2  # Uploads.have
# Text from a request echoed in an answer (ids, details) is cut here: never a megabyte back.
MAX_ECHO_CHARS = 200


class ResolverLike(Protocol):
    def symbolize(self, session: wire.Session) -> Profile: ...


# Builds the worker's resolver on first use, reading kallsyms from the store it is given.
ResolverFactory = Callable[[KallsymsStore], ResolverLike]


def echo(text: object) -> str:
    """Text that came from a request, cut to MAX_ECHO_CHARS for answers and logs."""
    t = str(text)
    return t if len(t) <= MAX_ECHO_CHARS else t[:MAX_ECHO_CHARS] + f"... ({len(t)} chars)"


def log_failure(what: str, e: BaseException, **fields: object) -> None:
    """One line per failure with the exception's type and message; the traceback only at debug."""
    extra = "".join(f" {k}={echo(v)}" for k, v in fields.items())
    log.error("%s.%s error=%s: %s", what, extra, type(e).__name__, echo(e))
    log.debug("traceback of: %s", what, exc_info=e)


def _nul_problem(s: wire.Session) -> str:
    """Why a session's text cannot be stored (PostgreSQL text refuses NUL), or ""."""
    texts = [s.session_id, s.tenant, s.service, s.host, s.trigger.cgroup, s.kernel.release, s.unit]
    if s.container is not None:
        texts += (s.container.id, s.container.runtime, s.container.pod)
    texts += s.processes.values()
    texts += s.threads.values()
    for k, v in s.labels.items():
        texts += (k, v)
    if any("\x00" in t for t in texts):
        return f"session[{s.session_id!r}]: a text field contains a NUL character"
    return ""


MAX_FUTURE_NS = 86_400 * 10**9  # a session may start this far in the future of our clock (skew)


def _time_problem(s: wire.Session, now_ns: int) -> str:
    """Why a session's start cannot be right, or "": one dated years ahead would head every list."""
    if s.start_ns > now_ns + MAX_FUTURE_NS:
        ahead = (s.start_ns - now_ns) // 10**9
        return f"session[{s.session_id!r}]: start_ns is {ahead} s ahead of the server's clock"
    return ""


@dataclass(**SLOTS)
class _Work:
    """What symbolizing costs: distinct frames, stacks and the frames in them (of a session, or
    left to a request)."""

    frames: int
    stacks: int
    entries: int

    def fits(self, budget: _Work) -> bool:
        return (
            self.frames <= budget.frames and self.stacks <= budget.stacks and self.entries <= budget.entries
        )

    def take(self, work: _Work) -> bool:
        if not work.fits(self):
            return False
        self.frames -= work.frames
        self.stacks -= work.stacks
        self.entries -= work.entries
        return True


def _work(item: Any) -> _Work:
    """The work of an undecoded session map (what is malformed counts 0: decoding refuses it)."""
    return _Work(*wire.work_of(item))


_REQUEST_WORK = _Work(MAX_FRAMES_PER_REQUEST, MAX_STACKS_PER_REQUEST, MAX_STACK_ENTRIES_PER_REQUEST)


def user_build_ids(session: wire.Session) -> list[bytes]:
    """The distinct build ids of a session's user frames, in order of appearance."""
    seen: dict[bytes, None] = {}
    for t in session.traces:
        for f in t.user:
            if f.kind == wire.FRAME_RESOLVED and f.build_id:
                seen[f.build_id] = None
    return list(seen)


class Ingest:
    """Stores sessions symbolized, keeps the kernel registry and runs retention. Thread-safe."""

    def __init__(
        self,
        store: Store,
        kallsyms: KallsymsStore,
        resolver_factory: ResolverFactory,
        metrics: Metrics,
        *,
        retention: bool,
        uploads: Uploads | None = None,
        export_to: tuple[str, ...] = (),
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        # Export endpoints (exports.py) each stored session is queued for, and who to tell.
        self._export_to = export_to
        self._on_queued = on_queued
        self.kallsyms = kallsyms
        self.uploads = uploads
        self.metrics = metrics
        self._resolver_factory = resolver_factory
        self._resolver: ResolverLike | None = None
        self._resolver_lock = threading.Lock()
        # One batch symbolized at a time per worker: its memory is bounded per request
        # (MAX_FRAMES_PER_REQUEST), and the worker's by this; reads and /healthz go on meanwhile.
        self._slot = threading.Lock()
        self._known_kernels: set[str] = set()
        self._retention = retention
        self._last_retention = float("-inf")  # the first request runs it
        # Uploads this worker's resolver has looked at since they arrived: (tenant, build id, kinds present).
        self._refreshed: set[tuple[str, str, int]] = set()

    @property
    def resolver(self) -> ResolverLike:
        with self._resolver_lock:
            if self._resolver is None:
                self._resolver = self._resolver_factory(self.kallsyms)
            return self._resolver

    def close(self) -> None:
        """Release the resolver (its llvm-symbolizer processes)."""
        close = getattr(self._resolver, "close", None)
        if callable(close):
            close()
        self._resolver = None

    # -- sessions -----------------------------------------------------------

    def ingest(self, items: list[Any], tenant: str | None = None) -> dict[str, Any]:
        """Store each session: accepted, duplicate, rejected (its own fault) or failed (ours).

        `tenant`: the one tenant the request's token may write for (tokens.py); a session of another
        is rejected ("wrong_tenant"). None: any.
        """
        accepted: list[str] = []
        duplicates: list[str] = []
        rejected: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        missing: list[str] = []
        missing_builds: list[str] = []
        budget = replace(_REQUEST_WORK)  # what is left of this request
        with self._slot:
            for item in items:
                sid = item.get("id") if isinstance(item, dict) else None
                sid = echo(sid) if isinstance(sid, str) else None
                work = _work(item)
                if not work.fits(_REQUEST_WORK):
                    detail = (
                        f"{work.frames} distinct frames, {work.stacks} stacks of {work.entries} frames in "
                        f"one session; at most {MAX_FRAMES_PER_REQUEST}, {MAX_STACKS_PER_REQUEST} and "
                        f"{MAX_STACK_ENTRIES_PER_REQUEST} are symbolized per request: capture shorter "
                        "sessions or at a lower frequency"
                    )
                    rejected.append({"id": sid, "reason": "too_large", "detail": detail})
                    continue
                try:
                    session = wire.session_from_wire(item)
                except WireError as e:
                    rejected.append({"id": sid, "reason": e.reason, "detail": echo(e)})
                    continue
                except Exception as e:
                    rejected.append(
                        {"id": sid, "reason": "malformed", "detail": echo(f"{type(e).__name__}: {e}")}
                    )
                    continue
                problem = _nul_problem(session) or _time_problem(session, time.time_ns())
                if not problem and tenant is not None and upload_scope(session.tenant) != tenant:
                    rejected.append(
                        {
                            "id": sid,
                            "reason": "wrong_tenant",
                            "detail": f"this token writes for tenant {tenant} only",
                        }
                    )
                    continue
                if problem:
                    rejected.append({"id": sid, "reason": "malformed", "detail": echo(problem)})
                    continue
                outcome = self._store_one(session, item, work, budget)
                if isinstance(outcome, dict):
                    failed.append(outcome)
                    continue
                if outcome is None:
                    duplicates.append(session.session_id)
                    continue
                accepted.append(session.session_id)
                kernel_hex, waits = outcome
                if kernel_hex and kernel_hex not in missing:
                    missing.append(kernel_hex)
                for hexid in waits:
                    if hexid not in missing_builds and len(missing_builds) < MAX_MISSING_BUILDS:
                        missing_builds.append(hexid)
        self.metrics.ingested.inc(len(accepted))
        self.metrics.duplicates.inc(len(duplicates))
        for r in rejected:
            self.metrics.sessions_rejected.labels(r["reason"]).inc()
        for f in failed:
            self.metrics.sessions_failed.labels(f["reason"]).inc()
        result: dict[str, Any] = {
            "accepted": accepted,
            "duplicates": duplicates,
            "rejected": rejected,
            "missing_kernels": missing,
        }
        if missing_builds:  # only when there is something to ask for (docs/api.md)
            result["missing_builds"] = missing_builds
        if failed:
            result["failed"] = failed
        return result

    def missing_builds(self, session: wire.Session) -> dict[str, int]:
        """The build ids of a session's user frames that an agent's upload would name better (no file
        at all, or no DWARF for file:line and no debug file uploaded yet), each with the uploads
        present now (Uploads.have). Empty without uploads."""
        module = getattr(self.resolver, "module", None)
        if self.uploads is None or module is None:
            return {}
        out = {}
        for bid in user_build_ids(session)[:MAX_MISSING_BUILDS]:
            hexid = bid.hex()
            have = self._refresh(bid, session.tenant)
            mod = module(bid, session.tenant)
            if mod is None or (mod.dwarf_path is None and not have & _HAVE_DEBUGINFO):
                out[hexid] = have
        return out

    def _refresh(self, bid: bytes, tenant: str) -> int:
        """The uploads of a build id by this tenant (Uploads.have), noted as used; the resolver forgets
        what it knew of the build id when one arrived since it looked (maybe through another worker)."""
        if self.uploads is None:
            return 0
        hexid = bid.hex()
        scope = upload_scope(tenant)
        have = self.uploads.have(scope, hexid)
        if have:
            self.uploads.touch(scope, hexid)
            if (scope, hexid, have) not in self._refreshed:
                getattr(self.resolver, "forget", lambda b: None)(bid)
                self._refreshed.add((scope, hexid, have))
        return have

    def _waits_for(self, session: wire.Session) -> dict[str, int]:
        try:
            return self.missing_builds(session)
        except Exception as e:  # a question for the agent, never a reason to fail the session
            log_failure("cannot tell which build ids are missing", e, session=session.session_id)
            return {}

    def _store_one(
        self, session: wire.Session, item: Any, work: _Work, budget: _Work
    ) -> tuple[str, dict[str, int]] | dict[str, Any] | None:
        """Symbolize and store one valid session, if `budget` (left of this request) covers its `work`.

        Returns None for a duplicate; for a stored session, the hex build id of its kernel if its
        symbols are missing ("" if not) and the build ids it waits for (missing_builds); else the
        failure entry ({"id", "reason", "detail"}) when something on our side broke or the session
        is put off to a next request.
        """
        sid = session.session_id
        stage = "store_failed"
        try:
            if self.store.exists(sid):
                return None
            if not budget.take(work):
                detail = "the batch is over the work of one request; this session is taken in a next one"
                return {"id": sid, "reason": "deferred", "detail": detail}
            stage = "symbolize_failed"
            kernel_hex = kernel_key(session.kernel.build_id, session.kernel.boot_id)
            pending = (
                bool(kernel_hex)
                and any(t.kernel for t in session.traces)
                and not self.kernel_known(kernel_hex)
            )
            profile = self.symbolize(session)
            waits = self._waits_for(session)
            stage = "store_failed"
            stored = self.store.insert(
                StoredSession(
                    meta=profile.meta,
                    profile=profile,
                    # The map as received, packed again in C: cheaper than re-encoding the Session.
                    raw=msgpack.packb(item, use_bin_type=True),
                    kernel_build_id=kernel_hex,
                    kernel_pending=pending,
                ),
                export_to=self._export_to,
                # Missing symbols usually arrive within seconds: sent after, it goes out named.
                export_after_ns=int(PENDING_DELAY_S * 1e9) if pending or waits else 0,
            )
        except Exception as e:
            log_failure("session not stored", e, session=sid, reason=stage)
            # The database's path or URL stays in the log.
            detail = (
                "the database is unavailable" if isinstance(e, StoreError) else f"{type(e).__name__}: {e}"
            )
            return {"id": sid, "reason": stage, "detail": echo(detail)}
        if not stored:
            return None
        self.metrics.stored_bytes.inc(stored)
        if self._export_to and self._on_queued is not None:
            self._on_queued()
        if waits:
            try:
                self.store.add_pending_builds(sid, waits)
            except StoreError as e:  # stored: only a later re-symbolization is lost
                log.warning("cannot note the build ids a session waits for. session=%s error=%s", sid, e)
        return (kernel_hex if pending else "", waits)

    def symbolize(self, session: wire.Session) -> Profile:
        """The session's profile; its meta is the resolver's, built once from the wire session."""
        if self.uploads is not None:
            for bid in user_build_ids(session):
                self._refresh(bid, session.tenant)  # an upload another worker took is seen here too
        t0 = time.perf_counter()
        profile = self.resolver.symbolize(session)
        self.metrics.latency.observe(time.perf_counter() - t0)
        kinds: dict[str, int] = {}
        for f in profile.frames:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        for kind, n in kinds.items():
            self.metrics.frames.labels(kind).inc(n)
        return profile

    def resymbolize_one(self, sid: str) -> Profile | None:
        """Symbolize a stored session again from its raw form (what it waited for is here)."""
        raw = self.store.get_raw(sid)
        if raw is None:
            return None
        try:
            session = wire.decode_session(raw)
            profile = self.symbolize(session)
        except Exception as e:
            log_failure("re-symbolization failed", e, session=sid)
            return None
        self.store.update_profile(sid, profile, kernel_pending=self._kernel_pending(session))
        waits = self._waits_for(session)
        for hexid in self.store.pending_builds(sid):
            if hexid not in waits:
                self.store.clear_pending_build(sid, hexid)
        self.store.add_pending_builds(sid, waits)
        self.metrics.resymbolized.inc()
        return profile

    def _kernel_pending(self, session: wire.Session) -> bool:
        hexid = kernel_key(session.kernel.build_id, session.kernel.boot_id)
        return bool(hexid) and any(t.kernel for t in session.traces) and not self.kernel_known(hexid)

    def profile(self, sid: str) -> Profile | None:
        """A stored session's profile, symbolized again first if its kernel's symbols came after it
        did (maybe through another worker or instance)."""
        profile = self.store.get_profile(sid)
        if profile is None:
            return None
        kernel = self.store.pending_kernel(sid)
        uploads = self.uploads
        scope = upload_scope(profile.meta.tenant)
        uploaded = uploads is not None and any(
            uploads.have(scope, b) & ~have for b, have in self.store.pending_builds(sid).items()
        )
        if uploaded or (kernel and self.kernel_known(kernel)):
            profile = self.resymbolize_one(sid) or profile
        return profile

    def received(self, scope: str, build_id: str) -> int:
        """A tenant uploaded a file of this build id: re-symbolize its sessions that waited for it (up
        to RESYMBOLIZE_PER_UPLOAD now, the rest when read). Returns how many."""
        forget = getattr(self.resolver, "forget", None)
        if forget is not None:
            forget(bytes.fromhex(build_id))
        have = self.uploads.have(scope, build_id) if self.uploads is not None else 0
        done = 0

        def in_scope(tenant: str) -> bool:
            return upload_scope(tenant) == scope

        for sid in self.store.pending_for_build(build_id, have, RESYMBOLIZE_PER_UPLOAD, in_scope):
            if self.resymbolize_one(sid):
                done += 1
        return done

    # -- kernels ------------------------------------------------------------

    def kernel_known(self, build_id_hex: str) -> bool:
        """Whether these kallsyms (a kernel_key(): of a kernel, or of one boot of it) are here (or in the
        database, from another instance)."""
        if build_id_hex in self._known_kernels:
            return True
        if not self.kallsyms.has(build_id_hex):
            data = self.store.get_kernel(build_id_hex)
            if data is None:
                return False
            try:
                self.kallsyms.put(build_id_hex, data)
            except (KallsymsError, ValueError) as e:
                log.warning("unusable kallsyms in the database. build_id=%s error=%s", build_id_hex, e)
                return False
        self._known_kernels.add(build_id_hex)
        return True

    def kernel_loaded_code(self, build_id_hex: str) -> str:
        """The LoadedCodeDigest of the snapshot held for this kernel_key(), "" if unknown."""
        index = self.kallsyms.get(build_id_hex) if self.kernel_known(build_id_hex) else None
        return index.loaded_code if index is not None else ""

    def put_kernel(self, build_id: str, body: bytes) -> tuple[KallsymsIndex, int]:
        """Store an uploaded kallsyms snapshot (gzip) and re-symbolize the sessions that waited for it.

        Returns the parsed snapshot and how many sessions were re-symbolized; KallsymsError when the
        snapshot is unusable (KallsymsTooLarge over the limits, KallsymsConflict when another kernel's
        snapshot is held under this key: KallsymsStore.put).
        """
        self.kernel_known(build_id)  # one another instance received is here first: put() compares with it
        index = self.kallsyms.put(build_id, body)  # decompressed and parsed in bounded slices
        self.store.put_kernel(build_id, body)
        self._known_kernels.add(build_id)
        self.metrics.kernel_uploads.inc()
        done = 0
        for sid in self.store.pending_for_kernel(build_id)[:RESYMBOLIZE_PER_UPLOAD]:
            if self.resymbolize_one(sid):
                done += 1
        return index, done

    # -- retention ----------------------------------------------------------

    def maybe_retention(self) -> None:
        now = time.monotonic()
        if now - self._last_retention < RETENTION_INTERVAL_S:
            return
        self._last_retention = now
        # Partial files of workers killed while writing: swept whether retention is configured or not.
        if self.uploads is not None:
            self.uploads.sweep()
            self.store.drop_expired_claims()  # claim rows never outlive two leases, retention or not
        self.kallsyms.sweep()
        if self._retention:
            self.run_retention()

    def retention_now(self) -> None:
        """Retention at once, if configured (after an upload: it may put the database over its bound)."""
        if self._retention:
            self.run_retention()

    def run_retention(self) -> dict[str, int]:
        # What agents can send again goes first, under size pressure before any session: kernels no
        # session needs, then uploads, least recently used first.
        for build_id in self.store.expire_kernels():
            self.kallsyms.remove(build_id)
            self._known_kernels.discard(build_id)
            log.info("retention deleted a kernel's symbols. build_id=%s", build_id)
        for tenant, build_id, kind, why in self.store.expire_uploads():
            if self.uploads is not None:
                self.uploads.remove(tenant, build_id, kind)
            self.metrics.uploads_evicted.labels(why).inc()
            log.info(
                "retention deleted an uploaded file. tenant=%s build_id=%s kind=%s reason=%s",
                tenant,
                build_id,
                kind,
                why,
            )
        deleted = self.store.enforce_retention()
        for reason, n in deleted.items():
            if n:
                self.metrics.expired.labels(reason).inc(n)
                log.info("retention deleted sessions. reason=%s count=%d", reason, n)
        return deleted

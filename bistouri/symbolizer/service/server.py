"""The symbolizer HTTP service: ingest of agent sessions, kernel symbols, the read API and the UI.

A plain WSGI application (werkzeug routing, requests and responses) served by
gunicorn with several worker processes of several threads (worker.py). Each worker
builds its own resolver and database connection after the fork, and symbolizes one
batch at a time, bounded in work (MAX_*_PER_REQUEST). Untrusted input never reaches
a 500: every malformed, oversized or wrong-version payload gets a 4xx with a reason,
and is counted in `bistouri_symbolizer_requests_rejected_total{reason}`. A failure
on the server's side (disk, database) is a 503 with Retry-After: the client keeps
its data and sends it again. docs/api.md is the reference of the endpoints.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.security import safe_join
from werkzeug.wrappers import Request, Response

from ... import wire
from ...errors import GzipError, GzipTooLarge, WireError
from .. import formats
from ..gunzip import gunzip
from ..kallsyms import (
    MAX_UPLOAD_BYTES,
    KallsymsConflict,
    KallsymsError,
    KallsymsStore,
    KallsymsTooLarge,
    kernel_key,
)
from ..model import PARTS, STATES, Profile
from ..report import UI_DIR
from .exports import ExportConfig, Exporter
from .ingest import Ingest, ResolverFactory, echo, log_failure
from .metrics import Metrics
from .store import Filter, Store, StoreError
from .tokens import ADMIN, READ, STATE, WRITE, Grant, Tokens
from .uploads import (
    CLAIM_LEASE_S,
    DEFAULT_MAX_UPLOAD_BYTES,
    LEGACY_SCOPE,
    Quota,
    UploadRefused,
    Uploads,
    check_kind,
)

log = logging.getLogger(__name__)

MSGPACK_TYPES = ("application/x-msgpack", "application/msgpack")
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# Decompressed bodies may be this many times --max-request-bytes: the agent's gzip'd sessions shrink ~3-6
# times, and a worker holds the decompressed body while it decodes it (64 MiB by default).
DECOMPRESSION_RATIO = 4
MAX_SESSIONS_PER_BATCH = wire.MAX_SESSIONS_PER_BATCH
MAX_LIST_LIMIT = 1000
DEFAULT_MERGE_LIMIT = 500
# Seconds an agent waits after a failure on our side (database, disk): long enough for an
# operator or a restart to clear it, short enough that spools do not pile up.
RETRY_AFTER_S = 15
_BUILD_ID_RE = re.compile(r"[0-9a-f]{2,128}")  # fullmatch: "$" would let a trailing newline through
_HEX = re.compile(r"[0-9a-f]+")  # a container id's prefix (fullmatch)


@dataclass
class ServerConfig:
    state_dir: Path
    db: str = ""  # empty: SQLite in the state dir
    token: str | None = None  # --token-file: a shared write token, accepted on reads too
    read_token: bool = False  # require a token on reads
    tokens: Tokens | None = None  # every kind of token (tokens.py); None: `token` and `read_token` alone
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retention_days: float | None = None
    max_db_bytes: int | None = None
    metrics_port: int | None = None  # a listener that serves only /metrics
    merge_limit: int = DEFAULT_MERGE_LIMIT
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES  # an uploaded ELF file, uncompressed
    upload_quota: Quota = field(default_factory=Quota)
    claim_lease_s: float = CLAIM_LEASE_S
    ui_dir: Path = Path(UI_DIR)
    export: ExportConfig = field(default_factory=ExportConfig)  # OTLP and Pyroscope endpoints

    @property
    def max_decompressed_bytes(self) -> int:
        return self.max_request_bytes * DECOMPRESSION_RATIO

    @property
    def access(self) -> Tokens:
        if self.tokens is not None:
            return self.tokens
        return Tokens(legacy=self.token, reads_need_token=self.read_token)


class ApiError(Exception):
    """A request problem: becomes `{"error": reason, "detail": text}` with its HTTP status."""

    def __init__(self, status: int, reason: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = echo(detail)
        self.extra = extra


# ---------------------------------------------------------------------------
# Request helpers


def _parse_time(name: str, v: str) -> int:
    """Unix seconds (int or float) or ISO 8601, as unix nanoseconds; naive times are UTC."""
    try:
        return int(float(v) * 1e9)
    except (ValueError, OverflowError):  # "inf" overflows, "nan" and dates are ValueErrors
        pass
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, "bad_parameter", f"{name}={v!r} is neither unix seconds nor ISO 8601")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def _int_arg(args: Any, name: str, default: int, lo: int, hi: int) -> int:
    v = args.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ApiError(400, "bad_parameter", f"{name}={v!r} is not an integer")
    if not lo <= n <= hi:
        raise ApiError(400, "bad_parameter", f"{name}={n} is outside {lo}..{hi}")
    return n


def _filter(args: Any, prefix: str = "") -> Filter:
    def g(k: str) -> str:
        v = str(args.get(prefix + k, "") or "")
        if "\x00" in v:
            raise ApiError(400, "bad_parameter", f"{prefix + k} contains a NUL character")
        return v

    since = g("since")
    until = g("until")
    kind = g("kind")
    if kind and kind not in wire.TRIGGER_KINDS:
        kinds = ", ".join(wire.TRIGGER_KINDS)
        raise ApiError(400, "bad_parameter", f"{prefix}kind={kind!r} is not one of {kinds}")
    container = g("container")
    if container and not (len(container) <= wire.MAX_CONTAINER_ID_CHARS and _HEX.fullmatch(container)):
        raise ApiError(
            400,
            "bad_parameter",
            f"{prefix}container={container[:80]!r} is not a container id or its prefix (hex)",
        )
    return Filter(
        service=g("service"),
        host=g("host"),
        resource=g("resource"),
        comm=g("comm"),
        tenant=g("tenant"),
        kind=kind,
        unit=g("unit"),
        container=container,
        runtime=g("runtime"),
        since_ns=_parse_time(prefix + "since", since) if since else None,
        until_ns=_parse_time(prefix + "until", until) if until else None,
    )


def _check_id(sid: str) -> str:
    if not 0 < len(sid) <= 64 or "\x00" in sid:
        raise ApiError(404, "not_found", f"no session {sid[:80]!r}")
    return sid


def _value(args: Any) -> str:
    v = args.get("value", "on_cpu")
    if v not in formats.VALUES:
        raise ApiError(400, "bad_parameter", f"value={v!r} is not one of {', '.join(formats.VALUES)}")
    return str(v)


def _part(args: Any, name: str = "part") -> str:
    p = args.get(name, "all")
    if p not in PARTS:
        raise ApiError(400, "bad_parameter", f"{name}={p!r} is not one of {', '.join(PARTS)}")
    return str(p)


def _state(args: Any) -> str:
    state = args.get("state", "all")
    if state not in STATES:
        raise ApiError(400, "bad_parameter", f"state={state!r} is not one of {', '.join(STATES)}")
    return str(state)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        # Never a bare NaN: it is not JSON, and one would break the UI's session list for good.
        json.dumps(obj, separators=(",", ":"), allow_nan=False),
        status=status,
        mimetype="application/json",
        headers=headers,
    )


def _timed_reader(request: Request) -> Callable[[int], bytes]:
    """`read(n)` of the request body; a body that does not arrive in time (the worker's
    socket keeps its deadline, worker.py) is a 408, and the connection is closed."""
    stream = request.environ["wsgi.input"]

    def read(n: int) -> bytes:
        try:
            chunk: bytes = stream.read(n)
        except TimeoutError:
            raise ApiError(408, "slow_body", "the request body did not arrive in time")
        return chunk

    return read


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """A gzip'd request body inflated, refused over `limit` bytes (gzip bombs)."""
    try:
        return gunzip(data, limit)
    except GzipTooLarge:
        raise ApiError(413, "too_large", f"body decompresses to more than {limit} bytes")
    except GzipError as e:
        raise ApiError(400, "bad_encoding", f"the body {e}")


# ---------------------------------------------------------------------------
# The application


class SymbolizerApp:
    """The WSGI application. One instance per worker process, built after the fork."""

    def __init__(self, config: ServerConfig, resolver_factory: ResolverFactory) -> None:
        self.config = config
        self.store = Store.for_state_dir(
            config.db,
            config.state_dir,
            retention_days=config.retention_days,
            max_db_bytes=config.max_db_bytes,
        )
        self.metrics = Metrics(lambda: self.store)
        # The one kallsyms store of this process: the resolver reads what ingest puts in it.
        self.kallsyms = KallsymsStore(str(config.state_dir))
        self.access = config.access
        self.uploads = Uploads(
            config.state_dir,
            self.store,
            config.max_upload_bytes,
            quota=config.upload_quota,
            claim_lease_s=config.claim_lease_s,
            on_evict=lambda reason, n: self.metrics.uploads_evicted.labels(reason).inc(n),
        )
        # Forwarding: this worker's sender thread, fed by the queue ingest writes (exports.py).
        # Its own connection: a slow query of the sender never holds the lock of ingest's.
        export_store = Store.for_state_dir(config.db, config.state_dir)
        self.exporter = Exporter(export_store, config.export, self.metrics)
        self.metrics.exporters = tuple(sorted({e.kind for e in config.export.endpoints}))
        self.ingest = Ingest(
            self.store,
            self.kallsyms,
            resolver_factory,
            self.metrics,
            retention=config.retention_days is not None or config.max_db_bytes is not None,
            uploads=self.uploads,
            export_to=config.export.keys,
            on_queued=self.exporter.wake,
        )
        self.exporter.start()
        self.url_map = Map(
            [
                Rule("/", endpoint="root", methods=["GET"]),
                Rule("/healthz", endpoint="healthz", methods=["GET"]),
                Rule("/metrics", endpoint="metrics", methods=["GET"]),
                Rule("/v1/sessions", endpoint="sessions", methods=["GET", "POST"]),
                Rule("/v1/sessions/<sid>", endpoint="session", methods=["GET"]),
                Rule("/v1/sessions/<sid>/<fmt>", endpoint="session_profile", methods=["GET"]),
                Rule("/v1/profile/<fmt>", endpoint="merged_profile", methods=["GET"]),
                Rule("/v1/diff/flamegraph", endpoint="diff", methods=["GET"]),
                Rule("/v1/kernels/<build_id>", endpoint="kernel", methods=["GET", "PUT"]),
                Rule(
                    "/v1/uploads/<build_id>/<kind>",
                    endpoint="upload",
                    methods=["GET", "POST", "PUT", "DELETE"],
                ),
                Rule("/ui", endpoint="ui_root", methods=["GET"]),
                Rule("/ui/", endpoint="ui", defaults={"path": "index.html"}, methods=["GET"]),
                Rule("/ui/<path:path>", endpoint="ui", methods=["GET"]),
            ],
            strict_slashes=False,
        )

    def close(self) -> None:
        """Stop the sender, release the resolver (its llvm-symbolizer processes) and the database
        connection."""
        self.exporter.close()
        self.ingest.close()
        self.store.close()

    def run_retention(self) -> dict[str, int]:
        return self.ingest.run_retention()

    # -- WSGI ---------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        route = "unknown"
        try:
            adapter = self.url_map.bind_to_environ(environ)
            endpoint, args = adapter.match()
            route = str(endpoint)
            on_metrics_port = environ.get("SERVER_PORT") == str(self.config.metrics_port)
            if self.config.metrics_port and on_metrics_port and endpoint != "metrics":
                raise NotFound()
            response = getattr(self, "on_" + endpoint)(request, **args)
        except ApiError as e:
            if e.status in (400, 401, 403, 408, 409, 413, 415, 429):
                self.metrics.rejected.labels(e.reason).inc()
            body = {"error": e.reason, "detail": e.detail, **e.extra}
            headers = {"WWW-Authenticate": 'Bearer realm="bistouri"'} if e.status == 401 else None
            if e.status == 408:  # the rest of the body may still come: not a next request
                headers = {"Connection": "close"}
            response = _json(body, e.status, headers)
        except StoreError as e:
            # The database is down or locked: not the client's fault, worth a retry later. Its path
            # or URL is for the log, not for clients.
            log.warning("database unavailable. path=%s error=%s", request.path, e)
            response = _json(
                {"error": "unavailable", "detail": "the database is unavailable; retry later"},
                503,
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        except OSError as e:
            # The machine's fault (a full disk, too many open files): not the client's, worth a retry.
            log_failure("request failed on the server's side", e, method=request.method, path=request.path)
            response = _json(
                {
                    "error": "unavailable",
                    "detail": f"the server cannot do this now ({os.strerror(e.errno or 0)})",
                },
                503,
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        except NotFound:
            response = _json({"error": "not_found", "detail": f"no such endpoint {request.path}"}, 404)
        except MethodNotAllowed as e:
            allowed = ", ".join(e.valid_methods or [])
            response = _json(
                {
                    "error": "method_not_allowed",
                    "detail": f"{request.method} {request.path}; allowed: {allowed}",
                },
                405,
                {"Allow": allowed},
            )
        except HTTPException as e:
            response = e.get_response(environ)
        except Exception as e:
            log_failure("request failed", e, method=request.method, path=request.path)
            response = _json({"error": "internal", "detail": "internal error, see the service log"}, 500)
        self.metrics.http_requests.labels(route, str(response.status_code)).inc()
        return response(environ, start_response)

    # -- auth and bodies ----------------------------------------------------

    def _authorize(self, request: Request, need: str) -> Grant:
        """The grant of the request's token for `need` (tokens.READ, WRITE, STATE, ADMIN): 401 without a
        token that is ours, 403 with one of another kind (docs/api.md, "Tokens")."""
        access = self.access
        if not access.required(need):
            return Grant("none")
        got = request.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not value:
            if need == ADMIN and not access.admin:
                raise ApiError(403, "forbidden", "no admin token is configured (--admin-token-file)")
            raise ApiError(401, "unauthorized", "missing bearer token: send 'Authorization: Bearer <token>'")
        grant = access.match(value.strip())
        if grant is None:
            raise ApiError(401, "unauthorized", "bad bearer token")
        if not access.allows(grant, need):
            raise ApiError(403, "forbidden", f"this token may not be used for {need} requests")
        return grant

    def _read_body(self, request: Request, limit: int | None = None) -> bytes:
        limit = self.config.max_request_bytes if limit is None else limit
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(413, "too_large", f"body of {length} bytes, at most {limit} accepted")
        read = _timed_reader(request)
        want = length if length is not None else limit + 1
        chunks = []
        got = 0
        while got < want:
            chunk = read(min(65536, want - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if length is not None and got < length:
            raise ApiError(400, "malformed", f"body of {got} bytes, {length} announced")
        if got > limit:
            raise ApiError(413, "too_large", f"body over {limit} bytes")
        return b"".join(chunks)

    def _decoded_body(self, request: Request) -> tuple[bytes, int]:
        """The body, decompressed if it says gzip, and its size as received."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("gzip", "identity"):
            raise ApiError(415, "unsupported_encoding", f"Content-Encoding {encoding!r}: send gzip")
        body = self._read_body(request)
        if encoding == "gzip":
            return gunzip_limited(body, self.config.max_decompressed_bytes), len(body)
        return body, len(body)

    # -- basic endpoints ----------------------------------------------------

    def on_root(self, request: Request) -> Response:
        return Response(status=302, headers={"Location": "/ui/"})

    def on_ui_root(self, request: Request) -> Response:
        return Response(status=302, headers={"Location": "/ui/"})

    def on_healthz(self, request: Request) -> Response:
        return Response("ok\n", mimetype="text/plain")

    def on_metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def on_ui(self, request: Request, path: str) -> Response:
        full = safe_join(str(self.config.ui_dir), path)
        if full is None or not os.path.isfile(full):
            raise NotFound()
        with open(full, "rb") as f:
            data = f.read()
        mime = mimetypes.guess_type(full)[0] or "application/octet-stream"
        return Response(data, mimetype=mime, headers={"Cache-Control": "no-cache"})

    # -- ingest -------------------------------------------------------------

    def on_sessions(self, request: Request) -> Response:
        if request.method == "GET":
            return self._list_sessions(request)
        grant = self._authorize(request, WRITE)
        if request.mimetype not in MSGPACK_TYPES:
            raise ApiError(
                415,
                "unsupported_media_type",
                f"Content-Type {request.mimetype!r}: send application/x-msgpack",
            )
        data, received = self._decoded_body(request)
        try:
            items = wire.decode_batch(data, MAX_SESSIONS_PER_BATCH)
        except WireError as e:
            raise ApiError(413 if e.reason == "too_large" else 400, e.reason, str(e))
        except Exception as e:  # the decoder is the last line: nothing in a body may become a 500
            raise ApiError(400, "malformed", f"undecodable batch: {type(e).__name__}: {e}")
        result = self.ingest.ingest(items, grant.tenant)
        self.metrics.received_bytes.inc(received)
        failed = result.get("failed")
        if failed:
            # Our fault, not the sessions': the agent keeps them and sends them again (docs/api.md).
            self.ingest.maybe_retention()
            only_put_off = all(f["reason"] == "deferred" for f in failed)
            return _json(result, 503, {"Retry-After": "1" if only_put_off else str(RETRY_AFTER_S)})
        if items and not result["accepted"] and not result["duplicates"]:
            first = result["rejected"][0]["reason"]
            raise ApiError(
                413 if first == "too_large" else 400,
                first,
                f"all {len(items)} sessions of the batch were rejected",
                **result,
            )
        self.ingest.maybe_retention()
        return _json(result)

    # -- kernels ------------------------------------------------------------

    @staticmethod
    def _build_id(build_id: str) -> str:
        build_id = build_id.lower()
        if not _BUILD_ID_RE.fullmatch(build_id) or len(build_id) % 2:
            raise ApiError(400, "bad_parameter", f"build id {build_id!r} is not 1 to 64 bytes of hex")
        return build_id

    def on_kernel(self, request: Request, build_id: str) -> Response:
        build_id = self._build_id(build_id)
        boot = str(request.args.get("boot", "")).lower().replace("-", "")
        if boot:
            if not re.fullmatch(r"[0-9a-f]{32}", boot):
                raise ApiError(400, "bad_parameter", f"boot={echo(boot)!r} is not a boot id (32 hex digits)")
            build_id = kernel_key(build_id, bytes.fromhex(boot))  # this boot's snapshot
        if request.method == "GET":
            self._authorize(request, STATE)
            if self.ingest.kernel_known(build_id):
                loaded_code = self.ingest.kernel_loaded_code(build_id)
                return _json({"build_id": build_id, "present": True, "loaded_code": loaded_code})
            return _json({"error": "not_found", "detail": f"no kallsyms for kernel {build_id}"}, 404)
        self._authorize(request, WRITE)
        body = self._read_body(request, min(self.config.max_request_bytes, MAX_UPLOAD_BYTES))
        if body[:2] != b"\x1f\x8b":
            raise ApiError(400, "bad_encoding", "body must be gzip-compressed /proc/kallsyms text")
        try:
            index, n = self.ingest.put_kernel(build_id, body)
        except KallsymsConflict as e:
            self.metrics.kernel_uploads_refused.labels("conflict").inc()
            log.warning("kernel symbols refused. build_id=%s reason=conflict", build_id)
            raise ApiError(409, "conflict", str(e))
        except KallsymsTooLarge as e:
            raise ApiError(413, "too_large", f"kallsyms over the limits: {e}")
        except KallsymsError as e:
            raise ApiError(400, "malformed", f"unusable kallsyms: {e}")
        log.info(
            "kernel symbols uploaded. build_id=%s bytes=%d symbols=%d resymbolized=%d",
            build_id,
            len(body),
            len(index),
            n,
        )
        return Response(status=204)

    # -- uploads --------------------------------------------------------------

    def _scope(self, request: Request, grant: Grant) -> str:
        """The tenant an upload request is for: its bound token's, else the one the agent names
        (`tenant=`, the agent's --tenant-id), else the agents' default."""
        named = str(request.args.get("tenant", ""))
        if grant.tenant is not None:
            if named and named != grant.tenant:
                raise ApiError(403, "wrong_tenant", f"this token uploads for tenant {grant.tenant} only")
            return grant.tenant
        return named or LEGACY_SCOPE

    def on_upload(self, request: Request, build_id: str, kind: str) -> Response:
        build_id = self._build_id(build_id)
        try:
            check_kind(kind)
        except UploadRefused as e:
            raise ApiError(e.status, e.reason, str(e))
        need = {"GET": STATE, "DELETE": ADMIN}.get(request.method, WRITE)
        scope = self._scope(request, self._authorize(request, need))
        claimant = str(request.args.get("claimant", ""))  # an agent's own id: its claim, then its PUT
        try:
            if request.method == "GET":
                if self.uploads.has(scope, build_id, kind):
                    return _json({"build_id": build_id, "kind": kind, "tenant": scope, "state": "done"})
                return _json({"error": "not_found", "detail": f"no {kind} uploaded for {build_id}"}, 404)
            if request.method == "DELETE":
                found = self.uploads.delete(scope, build_id, kind)
                log.warning(
                    "upload deleted by an admin. tenant=%s build_id=%s kind=%s", scope, build_id, kind
                )
                return Response(status=204 if found else 404)
            if request.method == "POST":
                state = self.uploads.claim(scope, build_id, kind, claimant)
                return _json({"build_id": build_id, "kind": kind, "tenant": scope, "state": state})
            return self._receive_upload(request, scope, build_id, kind, claimant)
        except UploadRefused as e:
            self.metrics.uploads_refused.labels(e.reason).inc()
            log.warning(
                "upload refused. tenant=%s build_id=%s kind=%s reason=%s detail=%s",
                scope,
                build_id,
                kind,
                e.reason,
                e,
            )
            raise ApiError(e.status, e.reason, str(e))

    def _receive_upload(
        self, request: Request, scope: str, build_id: str, kind: str, claimant: str
    ) -> Response:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("gzip", "identity"):
            raise ApiError(415, "unsupported_encoding", f"Content-Encoding {encoding!r}: send gzip")
        length = request.content_length
        limit = self.config.max_upload_bytes
        if length is not None and length > limit + (limit >> 6) + 1024:  # gzip never grows it more
            self.uploads.release(scope, build_id, kind, claimant)  # another agent may try at once
            raise UploadRefused(413, "too_large", f"body of {length} bytes, over --max-upload-bytes {limit}")
        stream_read = _timed_reader(request)
        left = [length if length is not None else -1]

        def read(n: int) -> bytes:
            if left[0] == 0:
                return b""
            chunk: bytes = stream_read(n if left[0] < 0 else min(n, left[0]))
            if left[0] > 0:
                left[0] -= len(chunk)
            return chunk

        size = self.uploads.receive(scope, build_id, kind, claimant, read, encoding == "gzip")
        self.metrics.uploads.labels(kind).inc()
        self.metrics.uploaded_bytes.inc(size)
        n = self.ingest.received(scope, build_id)
        log.info(
            "file uploaded. tenant=%s build_id=%s kind=%s bytes=%d resymbolized=%d",
            scope,
            build_id,
            kind,
            size,
            n,
        )
        self.ingest.retention_now()  # an upload may put the database over --max-db-bytes: uploads go first
        return _json(
            {
                "build_id": build_id,
                "kind": kind,
                "tenant": scope,
                "state": "done",
                "bytes": size,
                "resymbolized": n,
            }
        )

    # -- read API -----------------------------------------------------------

    def _list_sessions(self, request: Request) -> Response:
        self._authorize(request, READ)
        flt = _filter(request.args)
        limit = _int_arg(request.args, "limit", 100, 1, MAX_LIST_LIMIT)
        offset = _int_arg(request.args, "offset", 0, 0, 1 << 31)
        metas, total = self.store.query(flt, limit, offset)
        return _json({"sessions": [m.to_json(episode_rows=False) for m in metas], "total": total})

    def _profile(self, sid: str) -> Profile:
        profile = self.ingest.profile(_check_id(sid))
        if profile is None:
            raise ApiError(404, "not_found", f"no session {sid!r}")
        return profile

    def on_session(self, request: Request, sid: str) -> Response:
        self._authorize(request, READ)
        meta = self.store.get_meta(_check_id(sid))
        if meta is None:
            raise ApiError(404, "not_found", f"no session {sid!r}")
        return _json(meta.to_json())

    def on_session_profile(self, request: Request, sid: str, fmt: str) -> Response:
        self._authorize(request, READ)
        render = self._renderer(fmt)
        part = _part(request.args)
        return render(request, self._profile(sid).part(part).in_state(_state(request.args)), sid)

    def on_merged_profile(self, request: Request, fmt: str) -> Response:
        self._authorize(request, READ)
        render = self._renderer(fmt)
        part = _part(request.args)
        profile, n = self._merged(request.args, "")
        response = render(request, profile.part(part), "merged")
        response.headers["X-Bistouri-Sessions"] = str(n)
        if profile.truncated:  # counted by _merged
            got = response.headers.get("X-Bistouri-Truncated")
            response.headers["X-Bistouri-Truncated"] = f"sessions,{got}" if got else "sessions"
        return response

    def _truncated(self, response: Response, reason: str) -> None:
        """Say in the answer and in a metric that a bound cut it (sessions, nodes)."""
        got = response.headers.get("X-Bistouri-Truncated")
        response.headers["X-Bistouri-Truncated"] = f"{got},{reason}" if got else reason
        self.metrics.reads_truncated.labels(reason).inc()

    def _merged(self, args: Any, prefix: str) -> tuple[Profile, int]:
        flt = _filter(args, prefix)
        count = 0

        def counted() -> Iterator[Profile]:
            nonlocal count
            for p in self.store.profiles(flt, self.config.merge_limit):
                count += 1
                yield p

        # Merged as they stream from the database: one page of profiles in memory at a time, and
        # no more than formats.MAX_MERGE_ENTRIES frames in the merged stacks.
        merged = formats.merge(counted(), formats.MAX_MERGE_ENTRIES)
        if merged.truncated:
            count -= 1  # the profile that did not fit was read, not merged
            self.metrics.reads_truncated.labels("sessions").inc()
        return merged, count

    def on_diff(self, request: Request) -> Response:
        self._authorize(request, READ)
        value = _value(request.args)
        sides = []
        for side in ("a", "b"):
            sid = request.args.get(side)
            part = _part(request.args, side + ".part")
            if sid:
                sides.append(self._profile(sid).part(part))
            elif any(k.startswith(side + ".") and k != side + ".part" for k in request.args):
                sides.append(self._merged(request.args, side + ".")[0].part(part))
            else:
                raise ApiError(
                    400,
                    "bad_parameter",
                    f"give {side}=<session id> or {side}.<filter>=… (e.g. {side}.service=)",
                )
        chunks, cut = formats.diff_json(sides[0], sides[1], value)
        response = Response(chunks, mimetype="application/json")
        if any(side.truncated for side in sides):
            response.headers["X-Bistouri-Truncated"] = "sessions"
        if cut:
            self._truncated(response, "nodes")
        return response

    def _renderer(self, fmt: str) -> Callable[[Request, Profile, str], Response]:
        renderers: dict[str, Callable[[Request, Profile, str], Response]] = {
            "pprof": self._render_pprof,
            "folded": self._render_folded,
            "speedscope": self._render_speedscope,
            "flamegraph": self._render_flamegraph,
        }
        if fmt not in renderers:
            raise ApiError(404, "not_found", f"unknown format {fmt!r}: one of {', '.join(renderers)}")
        return renderers[fmt]

    @staticmethod
    def _render_pprof(request: Request, profile: Profile, name: str) -> Response:
        return Response(
            formats.pprof(profile),
            mimetype="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{_safe_name(name)}.pb.gz"'},
        )

    @staticmethod
    def _render_folded(request: Request, profile: Profile, name: str) -> Response:
        return Response(formats.folded(profile, _value(request.args)), mimetype="text/plain")

    @staticmethod
    def _render_speedscope(request: Request, profile: Profile, name: str) -> Response:
        return _json(
            formats.speedscope(profile, name),
            headers={"Content-Disposition": f'inline; filename="{_safe_name(name)}.speedscope.json"'},
        )

    def _render_flamegraph(self, request: Request, profile: Profile, name: str) -> Response:
        # Written as it is sent, from a tree of at most formats.MAX_TREE_NODES nodes.
        chunks, cut = formats.flamegraph_json(profile, _value(request.args))
        response = Response(chunks, mimetype="application/json")
        if cut:
            self._truncated(response, "nodes")
        return response


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "profile"

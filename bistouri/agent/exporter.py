"""HTTP transport of spooled sessions to the symbolizer, on its own thread.

The capture side never waits on the network: it writes a session into the
spool and calls `notify()`. The `bistouri-exporter` thread sends the spool
oldest first, in batches bounded in count and bytes (`POST /v1/sessions`,
gzip-compressed msgpack), and deletes a session only once the symbolizer has
accepted it (or already had it). Before the first session of a kernel it makes
sure the symbolizer has that kernel's kallsyms (`GET`, then `PUT` on 404).

Failures back off exponentially with full jitter, capped at BACKOFF_MAX_S (`backoff_s`):
once the symbolizer is back, every agent sends within that cap, at a time of its own,
so that a fleet does not arrive at once. `Retry-After` is obeyed but never waits less
than that backoff (`Retry-After: 0` must not become a tight loop); 413
halves the batch; a 400 on a batch is bisected to find the one bad session.
The answers follow the ingest contract (docs/configuration.md): a 503 listing `failed`
sessions (the symbolizer broke on its own side) keeps those in the spool to be
sent again, while its `accepted` and `duplicates` are done. Only a session the
symbolizer refused for its own content goes to `rejected/`. Nothing is dropped
here: the spool's byte bound is the only place sessions go. Answers are read up
to MAX_RESPONSE_BYTES.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import requests
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from .. import __version__, threads
from ..compat import SLOTS
from ..wire import encode_batch
from .settings import AgentSettings
from .spool import Spool, SpoolEntry
from .uploader import Locate, NoUploader, Uploader

log = logging.getLogger(__name__)

KallsymsProvider = Callable[[bytes], "bytes | str | None"]

CONTENT_TYPE = "application/x-msgpack"


@dataclass(**SLOTS)
class _Outcome:
    """What one POST did; `retry_in` > 0 asks the loop to wait before the next try."""

    sent: int = 0
    retry_in: float = 0.0
    failed: bool = False
    progress: bool = False


@dataclass(**SLOTS)
class _Batch:
    entries: list[SpoolEntry] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    kernels: set[bytes] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self.data)


@dataclass(frozen=True, **SLOTS)
class _Reply:
    """An HTTP answer, its body read whole but bounded."""

    status_code: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.sent = Counter(
            "bistouri_export_sessions_sent",
            "Sessions delivered to the symbolizer (accepted or already there)",
            registry=registry,
        )
        self.failures = Counter(
            "bistouri_export_failures",
            "Failed exchanges with the symbolizer, by reason",
            ["reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "bistouri_export_sessions_rejected",
            "Sessions the symbolizer refused for good (kept in the spool's rejected/)",
            registry=registry,
        )
        self.kernel_uploads = Counter(
            "bistouri_export_kernel_uploads", "kallsyms uploads to the symbolizer", registry=registry
        )
        self.latency = Histogram(
            "bistouri_export_latency_seconds",
            "Duration of POST /v1/sessions requests",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )


def backoff_s(failures: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """The wait after `failures` failures in a row: "full jitter", uniform between `initial_s`
    and the exponential step (initial_s, twice that, ... capped at `max_s`).

    Drawn from the whole range, not around the step: agents that failed together (an
    outage) come back spread over the cap instead of at the same instant."""
    step = min(max_s, initial_s * 2 ** min(max(failures - 1, 0), 30))
    return rng.uniform(initial_s, max(initial_s, step))


def _retry_after(value: str | None, default: float, now_wall: float) -> float:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return default
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now_wall)
    except (TypeError, ValueError, IndexError, OverflowError):
        return default


class Exporter:
    """Ships the spool to the symbolizer from the `bistouri-exporter` thread."""

    MAX_BATCH_SESSIONS = 64
    MAX_BATCH_BYTES = 4 << 20  # uncompressed msgpack per request
    CONNECT_TIMEOUT_S = 5.0
    READ_TIMEOUT_S = 30.0
    BACKOFF_INITIAL_S = 1.0
    # The longest wait between two tries: after an outage the spool starts draining at most
    # this long after the symbolizer is back (it took minutes with a 300 s cap).
    BACKOFF_MAX_S = 60.0
    RETRY_AFTER_MAX_S = 3600.0
    MAX_RESPONSE_BYTES = 1 << 20  # our answers are small JSON; more is a broken or hostile server
    IDLE_RESCAN_S = 30.0  # look at the spool even without notify()
    REGROW_AFTER_POSTS = 16  # successful posts before a lowered batch limit doubles again
    KERNEL_RETRY_S = 600.0  # how long a refused kallsyms upload is not retried
    # How often the loaded modules and BPF programs are compared with the uploaded snapshot (reading
    # /proc/kallsyms takes ~0.1 s; hosts load BPF programs often): at most one new upload per period.
    KERNEL_RECHECK_S = 60.0

    def __init__(
        self,
        spool: Spool,
        settings: AgentSettings,
        registry: CollectorRegistry | None = REGISTRY,
        kallsyms_provider: KallsymsProvider | None = None,
        file_locator: Locate | None = None,
        kernel_boot: bytes = b"",
        loaded_code_digest: Callable[[], str] | None = None,
        *,
        backoff_initial_s: float | None = None,
        backoff_max_s: float | None = None,
        read_timeout_s: float | None = None,
        kernel_recheck_s: float | None = None,
    ) -> None:
        self.spool = spool
        self.endpoint = settings.symbolizer_endpoint
        self._token_file = settings.symbolizer_token_file
        self._kallsyms = kallsyms_provider
        self._backoff_initial = backoff_initial_s if backoff_initial_s is not None else self.BACKOFF_INITIAL_S
        self._backoff_max = backoff_max_s if backoff_max_s is not None else self.BACKOFF_MAX_S
        self._timeout = (self.CONNECT_TIMEOUT_S, read_timeout_s or self.READ_TIMEOUT_S)
        self._m = _Metrics(registry)
        self._http = requests.Session()
        self._http.headers["User-Agent"] = f"bistouri-agent/{__version__}"
        # Passed on every request, not set on the Session: requests lets REQUESTS_CA_BUNDLE /
        # CURL_CA_BUNDLE override Session.verify (psf/requests#3829), which would ignore our CA file.
        self._verify: str | bool = settings.symbolizer_ca_file or True
        self._cert: str | tuple[str, str] | None = None
        if settings.symbolizer_client_cert:
            self._cert = (
                (settings.symbolizer_client_cert, settings.symbolizer_client_key)
                if settings.symbolizer_client_key
                else settings.symbolizer_client_cert
            )
        self._token: str | None = None
        self._token_stat: tuple[int, int, int] | None = None
        self._wake = threading.Event()  # notify(): something new in the spool
        self._interrupt = threading.Event()  # stop() and flush(): cut a backoff short
        self._stop = threading.Event()
        self._idle = threading.Event()  # set while the thread has nothing it can send now
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._batch_limit = self.MAX_BATCH_SESSIONS
        self._good_posts = 0  # successful posts since the batch limit was last lowered
        self._backoff_until = 0.0  # monotonic; our own exponential backoff
        self._disabled_until = 0.0  # monotonic; the server's Retry-After, never cut short
        self._known_kernels: set[bytes] = set()
        # kallsyms are per boot; the digest of the modules and BPF programs in them changes when one is
        # loaded or unloaded, and the snapshot is then uploaded again before the next sessions.
        self._boot = kernel_boot
        self._digest = loaded_code_digest
        self._digest_sent: str | None = None
        self._recheck_s = self.KERNEL_RECHECK_S if kernel_recheck_s is None else kernel_recheck_s
        self._digest_checked = 0.0  # monotonic
        self._kernel_stale: set[bytes] = set()
        self._kernel_refused: dict[bytes, float] = {}
        self._rng = random.Random()
        # Files the symbolizer asks for, uploaded from their own thread and HTTP session (a session
        # opens no connection until used).
        self._upload_http = requests.Session()
        self._upload_http.headers["User-Agent"] = self._http.headers["User-Agent"]
        self.uploader: Uploader | NoUploader = NoUploader()
        if file_locator is not None and self.endpoint is not None and settings.upload_max_bytes:
            self.uploader = Uploader(settings, self._upload_send, file_locator, registry)

    # -- lifecycle

    def start(self) -> None:
        if self.endpoint is None:
            log.info("no symbolizer endpoint: sessions stay in the spool dir=%s", self.spool.directory)
            return
        if self._thread is not None:
            return
        self._thread = threads.start("exporter", self._run)
        self.uploader.start()

    def notify(self) -> None:
        """A session was spooled: wake the thread. Cheap, never blocks."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread; an in-flight request may take up to its own timeout. True if it ended."""
        self._stop.set()
        self._interrupt.set()
        self._wake.set()
        self.uploader.stop(timeout)
        self._upload_http.close()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("exporter thread still busy after %.1f s (a request in flight)", timeout)
                return False
        self._http.close()
        return True

    def flush(self, deadline: float) -> bool:
        """Try to send everything spooled now before `deadline` (a time.monotonic() value).

        True if the spool emptied. Returns early if the symbolizer asked us to wait past the deadline.
        """
        if self._thread is None or not self._thread.is_alive():
            return len(self.spool) == 0
        self._backoff_until = 0.0  # shutdown: skip our own backoff, but not the server's Retry-After
        self._idle.clear()
        self._interrupt.set()
        self._wake.set()
        while time.monotonic() < deadline:
            if len(self.spool) == 0:
                return True
            if self._disabled_until > deadline:
                return False
            self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return len(self.spool) == 0

    @property
    def disabled_until(self) -> float:
        """Monotonic time before which nothing is sent (backoff or the server's Retry-After)."""
        return max(self._backoff_until, self._disabled_until)

    # -- the thread

    def _run(self) -> None:
        log.info("exporter started endpoint=%s", self.endpoint)
        while not self._stop.is_set():
            wait = max(self._backoff_until, self._disabled_until) - time.monotonic()
            if wait > 0:
                self._idle.set()
                self._interrupt.wait(wait)
                self._interrupt.clear()
                continue
            self._wake.clear()
            try:
                outcome = self._send_next()
            except Exception:  # a bug must not kill the thread: log, count, back off
                log.exception("exporter: unexpected error")
                self._m.failures.labels("internal").inc()
                outcome = _Outcome(failed=True)
            if outcome.retry_in > 0:
                self._failures += 1
                # The server's wait, never cut short by flush(), and never below our own backoff.
                self._disabled_until = time.monotonic() + max(outcome.retry_in, self._backoff())
            elif outcome.failed:
                self._failures += 1
                self._backoff_until = time.monotonic() + self._backoff()
            elif outcome.progress:
                if self._failures:
                    log.info("symbolizer reachable again after failures=%d", self._failures)
                self._failures = 0
            else:
                self._idle.set()
                self._wake.wait(self.IDLE_RESCAN_S)
                self._idle.clear()
        log.info("exporter stopped pending=%d", len(self.spool))

    def _backoff(self) -> float:
        return backoff_s(self._failures, self._backoff_initial, self._backoff_max, self._rng)

    def _next_batch(self) -> _Batch:
        batch = _Batch()
        size = 0
        for e in self.spool.pending():
            if len(batch.entries) >= self._batch_limit:
                break
            if batch.entries and size + e.size > self.MAX_BATCH_BYTES:
                break
            data = self.spool.read(e.name)
            if data is None:
                continue  # evicted or quarantined meanwhile
            batch.entries.append(e)
            batch.data.append(data)
            size += len(data)
            if e.kernel_build_id:  # from the spool file's header: the session is never decoded
                batch.kernels.add(e.kernel_build_id)
        return batch

    def _send_next(self) -> _Outcome:
        batch = self._next_batch()
        if not batch.entries:
            return _Outcome()
        now = time.monotonic()
        due = now - self._digest_checked >= self._recheck_s
        if due and batch.kernels and self._digest is not None and self._digest_sent is not None:
            self._digest_checked = now
            if self._digest() != self._digest_sent:
                self._kernel_stale |= self._known_kernels
                self._known_kernels -= self._kernel_stale
        for bid in sorted(batch.kernels):
            stale = bid in self._kernel_stale
            outcome = self._ensure_kernel(bid)
            if outcome is not None and stale:
                # The symbolizer has an older snapshot of this boot: the sessions go now, the new one
                # is tried again after KERNEL_RETRY_S (still stale: sent without asking).
                self._kernel_refused[bid] = time.monotonic()
            elif outcome is not None:
                return outcome
        return self._post(batch)

    # -- HTTP

    def _headers(self) -> dict[str, str]:
        token = self._read_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _read_token(self) -> str | None:
        """The bearer token, re-read when the file changes (rotated secrets)."""
        if not self._token_file:
            return None
        try:
            st = os.stat(self._token_file)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._token_stat:
                with open(self._token_file) as f:
                    self._token = f.read().strip() or None
                self._token_stat = key
        except OSError as e:
            log.warning(
                "cannot read the symbolizer token file path=%s error=%s", self._token_file, e.strerror
            )
            self._token_stat = None
        return self._token

    def _upload_send(self, method: str, path: str, **kw: Any) -> _Reply | None:
        """A request of the uploader (uploader.Send), on its own connection."""
        reply = self._request(method, path, http=self._upload_http, **kw)
        return reply if isinstance(reply, _Reply) else None

    def _request(
        self, method: str, path: str, *, http: requests.Session | None = None, **kw: Any
    ) -> _Reply | _Outcome:
        """One request; a transport failure or an oversized answer becomes a failed _Outcome."""
        try:
            with (http or self._http).request(
                method,
                f"{self.endpoint}{path}",
                timeout=self._timeout,
                headers=self._merged(kw),
                verify=self._verify,
                cert=self._cert,
                stream=True,
                **kw,
            ) as resp:
                body = bytearray()
                for chunk in resp.iter_content(64 * 1024):
                    body += chunk
                    if len(body) > self.MAX_RESPONSE_BYTES:
                        self._m.failures.labels("response_too_large").inc()
                        log.warning(
                            "symbolizer answer too large, ignored status=%d max_bytes=%d url=%s",
                            resp.status_code,
                            self.MAX_RESPONSE_BYTES,
                            self.endpoint,
                        )
                        return _Outcome(failed=True)
                return _Reply(resp.status_code, resp.headers, bytes(body))
        except requests.Timeout:
            reason = "timeout"
        except requests.exceptions.SSLError:
            reason = "tls"
        except requests.ConnectionError:
            reason = "network"
        except requests.RequestException:
            reason = "network"
        self._m.failures.labels(reason).inc()
        if self._failures == 0:
            log.warning(
                "symbolizer unreachable, retrying with backoff reason=%s url=%s", reason, self.endpoint
            )
        return _Outcome(failed=True)

    def _merged(self, kw: dict[str, Any]) -> dict[str, str]:
        headers = self._headers()
        headers.update(kw.pop("headers", {}) or {})
        return headers

    def _http_failure(self, resp: _Reply, what: str) -> _Outcome:
        status = resp.status_code
        detail = _error_detail(resp)
        if status in (429, 503):
            # Without a Retry-After (a load balancer with no server up answers so), our own
            # backoff: a fixed default would bring a fleet back in step.
            header = resp.headers.get("Retry-After")
            wait = min(self.RETRY_AFTER_MAX_S, _retry_after(header, 0.0, time.time()))
            self._m.failures.labels("rate_limited" if status == 429 else "unavailable").inc()
            log.info("symbolizer asks to wait status=%d retry_after_s=%.1f", status, wait)
            # 0 (or a past date) still waits our own backoff: see _run.
            return _Outcome(retry_in=max(wait, 0.001))
        if status == 401 or status == 403:
            self._m.failures.labels("unauthorized").inc()
            self._token_stat = None  # re-read the token file next time
            log.error(
                "symbolizer refused our credentials status=%d detail=%s: check --symbolizer-token-file",
                status,
                detail,
            )
            return _Outcome(failed=True)
        reason = "server_error" if status >= 500 else f"http_{status}"
        self._m.failures.labels(reason).inc()
        log.warning("symbolizer error on %s status=%d detail=%s", what, status, detail)
        header = resp.headers.get("Retry-After")
        if header and (status >= 500 or status == 408):
            wait = min(self.RETRY_AFTER_MAX_S, _retry_after(header, 0.0, time.time()))
            return _Outcome(retry_in=max(wait, 0.001))
        return _Outcome(failed=True)

    def _ensure_kernel(self, bid: bytes) -> _Outcome | None:
        """Make sure the symbolizer has this kernel's kallsyms. None: go on with the sessions."""
        if bid in self._known_kernels:
            return None
        refused = self._kernel_refused.get(bid)
        if refused is not None and time.monotonic() - refused < self.KERNEL_RETRY_S:
            return None
        path = f"/v1/kernels/{bid.hex()}" + (f"?boot={self._boot.hex()}" if self._boot else "")
        digest = self._digest() if self._digest is not None else None
        if bid not in self._kernel_stale:  # a stale snapshot is replaced without asking
            resp = self._request("GET", path)
            if isinstance(resp, _Outcome):
                return resp
            held = (_json_body(resp) or {}).get("loaded_code") if resp.status_code == 200 else None
            if resp.status_code == 200 and not (digest and isinstance(held, str) and held and held != digest):
                self._known_kernels.add(bid)
                self._digest_sent = digest
                return None
            if resp.status_code == 200:
                # Its snapshot of this boot predates modules or BPF programs loaded since (say while this
                # agent was down): replace it.
                log.info(
                    "the symbolizer's kernel symbols are older than ours: uploading build_id=%s", bid.hex()
                )
            elif resp.status_code != 404:
                return self._http_failure(resp, "GET kernel")
        text = self._kallsyms(bid) if self._kallsyms is not None else None
        if not text:
            # Without kallsyms the symbolizer still stores the sessions; kernel frames stay raw.
            self._kernel_refused[bid] = time.monotonic()
            log.warning("no kallsyms to upload for kernel build_id=%s", bid.hex())
            return None
        raw = text.encode() if isinstance(text, str) else text
        # The provider may hand over the text or an already gzipped copy: never compress twice.
        body = raw if raw[:2] == b"\x1f\x8b" else gzip.compress(raw, compresslevel=6, mtime=0)
        headers = {"Content-Type": "text/plain", "Content-Encoding": "gzip"}
        resp = self._request("PUT", path, data=body, headers=headers)
        if isinstance(resp, _Outcome):
            return resp
        if resp.status_code in (200, 201, 204):
            self._known_kernels.add(bid)
            self._kernel_stale.discard(bid)
            self._digest_sent = digest
            self._m.kernel_uploads.inc()
            log.info("kernel symbols uploaded build_id=%s bytes=%d", bid.hex(), len(body))
            return None
        if resp.status_code in (401, 403, 429, 503) or resp.status_code >= 500:
            return self._http_failure(resp, "PUT kernel")
        # Refused for good (e.g. 400, 413): send the sessions anyway, try again much later.
        self._kernel_refused[bid] = time.monotonic()
        self._m.failures.labels("kernel_upload").inc()
        log.warning(
            "symbolizer refused our kallsyms build_id=%s status=%d detail=%s",
            bid.hex(),
            resp.status_code,
            _error_detail(resp),
        )
        return None

    def _post(self, batch: _Batch) -> _Outcome:
        body = gzip.compress(encode_batch(batch.data), compresslevel=6, mtime=0)
        t0 = time.perf_counter()
        resp = self._request(
            "POST",
            "/v1/sessions",
            data=body,
            headers={"Content-Type": CONTENT_TYPE, "Content-Encoding": "gzip"},
        )
        if isinstance(resp, _Outcome):
            return resp
        self._m.latency.observe(time.perf_counter() - t0)
        status = resp.status_code
        result = _json_body(resp)
        n = len(batch.entries)
        if status == 200 and result is not None:
            return self._apply_result(batch, result)
        if status == 503 and result is not None and "failed" in result:
            # The symbolizer broke on its own side for some sessions: what it stored is done,
            # the failed ones stay spooled and come again after the wait (never rejected/).
            self._apply_result(batch, result)
            self._log_failed(result)
            return self._http_failure(resp, "POST sessions")
        if status in (400, 413) and result is not None and result.get("rejected"):
            # The server said which sessions it refused: act on that rather than guess.
            return self._apply_result(batch, result)
        if status == 413:
            self._m.failures.labels("too_large").inc()
            if n > 1:
                self._lower_limit(n)
                log.info("symbolizer says the batch is too large, halving sessions=%d", self._batch_limit)
                return _Outcome(progress=True)
            self._reject(batch.entries[0], f"too_large: {_error_detail(resp)}")
            return _Outcome(progress=True)
        if status == 400:
            self._m.failures.labels("bad_request").inc()
            if n > 1:
                self._lower_limit(n)  # bisect down to the offending session
                return _Outcome(progress=True)
            self._reject(batch.entries[0], f"bad_request: {_error_detail(resp)}")
            return _Outcome(progress=True)
        if status == 200:
            self._m.failures.labels("bad_response").inc()
            log.warning("symbolizer answered 200 without a JSON result body=%r", resp.text[:200])
            return _Outcome(failed=True)
        return self._http_failure(resp, "POST sessions")

    def _log_failed(self, result: dict[str, Any]) -> None:
        failed = [f for f in result.get("failed") or [] if isinstance(f, dict)]
        reasons = sorted({str(f.get("reason", "?"))[:64] for f in failed})
        log.warning(
            "symbolizer failed on its side, sessions kept to send again failed=%d reasons=%s",
            len(failed),
            ",".join(reasons),
        )

    def _lower_limit(self, n: int) -> None:
        self._batch_limit = max(1, n // 2)
        self._good_posts = 0

    def _apply_result(self, batch: _Batch, result: dict[str, Any]) -> _Outcome:
        by_id = {e.session_id: e for e in batch.entries}
        done: set[str] = set()
        sent = 0
        for sid in _ids(result.get("accepted")) + _ids(result.get("duplicates")):
            e = by_id.get(sid)
            if e is not None and sid not in done:
                self.spool.ack(e.name)
                done.add(sid)
                sent += 1
        failed = {f.get("id") for f in result.get("failed") or [] if isinstance(f, dict)}
        for r in result.get("rejected") or []:
            rid = r.get("id") if isinstance(r, dict) else None
            rej = by_id.get(rid) if isinstance(rid, str) else None
            if rej is not None and r.get("reason") in _SERVER_SIDE_REASONS:
                failed.add(rej.session_id)  # an older symbolizer's own failure: not the session's fault
            elif rej is not None and rej.session_id not in done:
                self._reject(rej, f"{r.get('reason', 'rejected')}: {r.get('detail', '')}".rstrip(": "))
                done.add(rej.session_id)
        self.uploader.want(result.get("missing_builds"))
        for key in result.get("missing_kernels") or []:
            # "<build id>" or "<build id>-<boot id>": another boot's snapshot is not ours to send.
            hexid, _, boot = str(key).partition("-")
            if boot and boot != self._boot.hex():
                continue
            try:
                self._known_kernels.discard(bytes.fromhex(hexid))
            except (TypeError, ValueError):
                pass
        self._m.sent.inc(sent)
        if any(e.session_id in failed and e.session_id not in done for e in batch.entries):
            # Failed on the symbolizer's side: kept, sent again after a pause.
            return _Outcome(sent=sent, failed=True, progress=bool(done))
        if len(done) < len(batch.entries):
            # Sessions the answer did not mention stay spooled and are sent again after a pause.
            self._m.failures.labels("incomplete_response").inc()
            return _Outcome(sent=sent, failed=True, progress=bool(done))
        if self._batch_limit < self.MAX_BATCH_SESSIONS:
            # Grow back slowly after a 413/400: doubling at once would hit the same wall again.
            self._good_posts += 1
            if self._good_posts >= self.REGROW_AFTER_POSTS:
                self._good_posts = 0
                self._batch_limit = min(self.MAX_BATCH_SESSIONS, self._batch_limit * 2)
        return _Outcome(sent=sent, progress=True)

    def _reject(self, e: SpoolEntry, reason: str) -> None:
        self._m.rejected.inc()
        log.warning("symbolizer rejected a session session_id=%s reason=%s", e.session_id, reason)
        self.spool.reject(e.name, reason)


# Reasons that are the symbolizer's own failures; symbolizers before the ingest contract of
# docs/api.md sent them as "rejected" with a 400, and the session went to rejected/ for good.
_SERVER_SIDE_REASONS = frozenset({"symbolize_failed", "store_failed", "internal"})


def _ids(v: Any) -> list[str]:
    return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def _json_body(resp: _Reply) -> dict[str, Any] | None:
    try:
        obj = json.loads(resp.body)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _error_detail(resp: _Reply) -> str:
    body = _json_body(resp)
    if body is not None and ("error" in body or "detail" in body):
        return f"{body.get('error', '')}: {body.get('detail', '')}"
    return json.dumps(resp.text[:200])

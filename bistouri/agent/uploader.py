"""Uploads on demand: the files the symbolizer says it cannot find, from this host.

The symbolizer's ingest answer lists `missing_builds` (docs/api.md). The exporter hands
them to `Uploader.want()`, which queues each build id once for this agent (a bounded
queue: past it, asks are dropped and counted). The `bistouri-uploader` thread then, per
build id:

- opens the executable through the sampled process's own view,
  `/proc/PID/map_files/<range>` (deleted files, other mount namespaces), else its path
  inside `/proc/PID/root` (procmaps.MappedPath: no symlink, regular files only), and the
  separate debug file at `<upload-debug-dir>/.build-id/xx/rest.debug`; each is checked to
  carry the build id, and what is sent is read from that same descriptor (never the path
  again: the process may replace it meanwhile);
- claims each file (`POST /v1/uploads/<id>/<kind>?claimant=<this agent>&tenant=<its tenant>`):
  of several agents one gets "claimed", the others "in_progress" (asked again after a while)
  or "done"; uploads are kept per tenant, and serve that tenant's sessions only;
- sends it gzip-compressed as it reads it (`PUT`, same query: the symbolizer takes a PUT only
  from the claim's holder; chunked: never whole in memory), at most `upload_max_bytes` of file
  and `upload_rate_bytes` a second.

A transport failure or a 5xx is retried with backoff, a few times; a 4xx is final. Every
outcome is counted in `bistouri_upload_*`.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from .. import threads
from ..compat import SLOTS
from ..elf import read_build_id
from ..host import safeopen
from ..host.procmaps import MappedPath
from .settings import AgentSettings

log = logging.getLogger(__name__)

EXECUTABLE = "executable"
DEBUGINFO = "debuginfo"

# Sends one request: (method, path, keyword arguments of requests) -> an answer with
# `status_code` and `body`, or None when the symbolizer could not be reached.
Send = Callable[..., Any]
Locate = Callable[[bytes], "MappedPath | None"]


@dataclass(**SLOTS)
class _Want:
    build_id: bytes
    tries: int = 0
    not_before: float = 0.0  # monotonic


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.uploads = Counter(
            "bistouri_upload_files",
            "Files uploaded to the symbolizer on its demand, by kind",
            ["kind"],
            registry=registry,
        )
        self.bytes = Counter(
            "bistouri_upload_bytes", "Compressed bytes of the files uploaded", registry=registry
        )
        self.skipped = Counter(
            "bistouri_upload_skipped",
            "Files asked for and not uploaded by this agent, by reason (not_found, too_large, "
            "in_progress, done, queue_full, refused, gave_up)",
            ["reason"],
            registry=registry,
        )
        self.failures = Counter(
            "bistouri_upload_failures",
            "Uploads failed and retried later, by reason",
            ["reason"],
            registry=registry,
        )


class NoUploader:
    """Uploads off (no file locator, no endpoint or --upload-max-bytes 0): what the symbolizer
    asks for is not sent."""

    enabled = False

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass

    def want(self, build_ids: object) -> None:
        pass

    def wait_idle(self, timeout: float) -> bool:
        return True


class Uploader:
    """Uploads the files the symbolizer asks for from the `bistouri-uploader` thread."""

    QUEUE_MAX = 1024  # build ids waiting; each is a few dozen bytes
    SEEN_MAX = 1 << 16  # build ids this agent ever took on, then forgotten all at once
    MAX_TRIES = 5
    RETRY_INITIAL_S = 30.0
    RETRY_MAX_S = 1800.0
    IN_PROGRESS_RETRY_S = 300.0  # another agent's claim: look again (its lease may lapse)
    CHUNK = 1 << 16

    def __init__(
        self,
        settings: AgentSettings,
        send: Send,
        locate: Locate,
        registry: CollectorRegistry | None = None,
        *,
        retry_initial_s: float | None = None,
    ) -> None:
        self.max_bytes = settings.upload_max_bytes
        self.rate = settings.upload_rate_bytes
        self.debug_root = os.path.join(settings.upload_debug_dir, ".build-id")
        self._send = send
        self._locate = locate
        self._retry_initial = self.RETRY_INITIAL_S if retry_initial_s is None else retry_initial_s
        self._m = _Metrics(registry)
        self._queue: queue.Queue[_Want] = queue.Queue(self.QUEUE_MAX)
        self._seen: set[bytes] = set()
        self._claimant = secrets.token_hex(8)  # this agent, so that its retry keeps its own claim
        self._tenant = settings.tenant_id  # whose sessions the upload serves (with a shared token)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threads.start("uploader", self._run)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def want(self, build_ids: object) -> None:
        """The symbolizer asked for these (hex) build ids: queue each one not taken on before."""
        if not self.enabled or not isinstance(build_ids, list):
            return
        for hexid in build_ids:
            try:
                bid = bytes.fromhex(hexid) if isinstance(hexid, str) and len(hexid) <= 128 else b""
            except ValueError:
                bid = b""
            if not bid:
                continue
            with self._lock:
                if bid in self._seen:
                    continue
                if len(self._seen) >= self.SEEN_MAX:
                    self._seen.clear()
                self._seen.add(bid)
            self._put(_Want(bid))

    def _put(self, want: _Want) -> None:
        try:
            self._idle.clear()
            self._queue.put_nowait(want)
        except queue.Full:
            self._m.skipped.labels("queue_full").inc()
            with self._lock:
                self._seen.discard(want.build_id)  # may be asked for again

    def wait_idle(self, timeout: float) -> bool:
        """For tests and shutdown: True once nothing is queued or in flight."""
        return self._idle.wait(timeout)

    # -- the thread

    def _run(self) -> None:
        later: list[_Want] = []
        while not self._stop.is_set():
            now = time.monotonic()
            due = [w for w in later if w.not_before <= now]
            later = [w for w in later if w.not_before > now]
            for w in due:
                self._put(w)
            if self._queue.empty() and not later:
                self._idle.set()
            try:
                want = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            try:
                retry_in = self._upload(want.build_id)
            except Exception:  # a bug must not kill the thread
                log.exception("uploader: unexpected error build_id=%s", want.build_id.hex())
                retry_in = None
                self._m.skipped.labels("internal").inc()
            if retry_in is not None:
                want.tries += 1
                if want.tries >= self.MAX_TRIES:
                    self._m.skipped.labels("gave_up").inc()
                    log.warning("upload given up build_id=%s tries=%d", want.build_id.hex(), want.tries)
                else:
                    want.not_before = time.monotonic() + retry_in
                    later.append(want)

    def _backoff(self, tries: int) -> float:
        return min(self.RETRY_MAX_S, self._retry_initial * 2**tries)

    def _files(self, bid: bytes) -> list[tuple[str, int]]:
        """(kind, open descriptor) of the files of this build id found on this host, each checked
        to carry it; the caller closes them."""
        hexid = bid.hex()
        debug = os.path.join(self.debug_root, hexid[:2], hexid[2:] + ".debug")
        where = self._locate(bid)
        out: list[tuple[str, int]] = []
        for kind, opener in ((EXECUTABLE, _mapped_opener(where)), (DEBUGINFO, _opener(debug))):
            if opener is None:
                continue
            try:
                fd = opener()
            except OSError:  # absent, gone with its process, or refused (counted by safeopen)
                continue
            if read_build_id(safeopen.fd_path(fd)) == bid:
                out.append((kind, fd))
            else:
                os.close(fd)
        return out

    def _upload(self, bid: bytes) -> float | None:
        """Upload what this host has of a build id. Seconds before trying again, or None when done."""
        files = self._files(bid)
        if not files:
            self._m.skipped.labels("not_found").inc()
            log.info("asked for a file this host does not have build_id=%s", bid.hex())
            return None
        retry: float | None = None
        try:
            for kind, fd in files:
                wait = self._upload_one(bid, kind, fd)
                if wait is not None:
                    retry = wait if retry is None else min(retry, wait)
        finally:
            for _, fd in files:
                os.close(fd)
        return retry

    def _upload_one(self, bid: bytes, kind: str, fd: int) -> float | None:
        hexid = bid.hex()
        url = f"/v1/uploads/{hexid}/{kind}"
        size = os.fstat(fd).st_size
        if size > self.max_bytes:
            self._m.skipped.labels("too_large").inc()
            log.warning(
                "file too large to upload build_id=%s bytes=%d max_bytes=%d (--upload-max-bytes)",
                hexid,
                size,
                self.max_bytes,
            )
            return None
        url += f"?claimant={self._claimant}&tenant={self._tenant}"
        claim = self._send("POST", url)
        if claim is None or claim.status_code >= 500 or claim.status_code == 429:
            self._m.failures.labels("network" if claim is None else "server_error").inc()
            return self._backoff(0)
        state = _state(claim)
        if claim.status_code != 200 or state not in ("claimed", "in_progress", "done"):
            self._m.skipped.labels("refused").inc()
            log.warning("symbolizer refused an upload claim build_id=%s status=%d", hexid, claim.status_code)
            return None
        if state != "claimed":
            self._m.skipped.labels(state).inc()
            return self.IN_PROGRESS_RETRY_S if state == "in_progress" else None
        sent = [0]
        resp = self._send(
            "PUT",
            url,
            data=self._gzip_stream(fd, sent),
            headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        )
        if resp is None or resp.status_code >= 500 or resp.status_code == 429:
            self._m.failures.labels("network" if resp is None else "server_error").inc()
            return self._backoff(0)
        if resp.status_code not in (200, 201, 204):
            self._m.skipped.labels("refused").inc()
            log.warning(
                "symbolizer refused an upload build_id=%s kind=%s status=%d body=%s",
                hexid,
                kind,
                resp.status_code,
                resp.body[:200],
            )
            return None
        self._m.uploads.labels(kind).inc()
        self._m.bytes.inc(sent[0])
        log.info("file uploaded build_id=%s kind=%s bytes=%d sent=%d", hexid, kind, size, sent[0])
        return None

    def _gzip_stream(self, fd: int, sent: list[int]) -> Iterator[bytes]:
        """The file gzip'd chunk by chunk from its start, at most `rate` bytes a second."""
        gz = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        start = time.monotonic()
        at = 0
        while True:
            data = os.pread(fd, self.CHUNK, at)
            at += len(data)
            out = gz.compress(data) if data else gz.flush()
            if out:
                sent[0] += len(out)
                ahead = sent[0] / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    self._stop.wait(ahead)  # the rate limit; cut short only by stop()
                yield out
            if not data:
                return


def _mapped_opener(where: MappedPath | None) -> Callable[[], int] | None:
    """Opens the file a process mapped; once that process is gone (the symbolizer asks after a
    short-lived one ended, or a test stopped it), the same path on this host if root owns the file
    there (another tenant could have put a file with that build id at a path it can write): the
    caller uploads it only if it carries the build id asked for."""
    if where is None:
        return None

    def open_it() -> int:
        try:
            return where.open()
        except safeopen.Refused:
            raise
        except OSError:
            if os.path.exists(where.proc):
                raise  # alive: its own root did not have the file
        root = safeopen.open_root("/")
        try:
            return safeopen.open_in_root(root, where.name, owners=(0,))
        finally:
            os.close(root)

    return open_it


def _opener(path: str) -> Callable[[], int]:
    return lambda: safeopen.open_regular(path)


def _state(resp: Any) -> str:
    import json

    try:
        body = json.loads(resp.body)
    except (ValueError, RecursionError):
        return ""
    return str(body.get("state", "")) if isinstance(body, dict) else ""

"""On-disk spool of finished sessions, between the capture side and the exporter thread.

One file per session, named `<sequence>.<session_id>.bses`, so that a name sort
is oldest first and the order survives restarts. A file is written in `tmp/`,
fsynced and renamed into place, so a reader sees whole files only. The file
framing (header with magic, length, CRC32 and the kernel build id) belongs to
`wire.frame_session`: a file damaged on disk is spotted and moved aside into
`rejected/` instead of being sent, and `bistouri symbolize` reads the same files.

The spool is bounded in bytes: putting a session into a full spool drops the
oldest ones first, and every drop is counted with its reason. `rejected/`
(sessions the symbolizer refused, and corrupt files) is bounded too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from .. import atomicfile, wire
from ..compat import SLOTS
from ..errors import WireError

log = logging.getLogger(__name__)

SUFFIX = ".bses"
REASON_SUFFIX = ".reason"
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_NAME_RE = re.compile(r"^(\d{12})\.([A-Za-z0-9][A-Za-z0-9_-]{0,63})\.bses$")
_LOG_EVERY_S = 60.0

# Drop reasons (label values of bistouri_spool_dropped_total).
DROP_FULL = "spool_full"  # evicted, oldest first, to make room
DROP_TOO_LARGE = "too_large"  # one session larger than the whole spool
DROP_CORRUPT = "corrupt"  # bad header, length or checksum: quarantined in rejected/
DROP_PARTIAL = "partial"  # a tmp/ file left by a crash mid-write
DROP_WRITE_ERROR = "write_error"  # disk full, I/O error
DROP_REJECTED_EVICTED = "rejected_evicted"  # rejected/ over its own bound


@dataclass(frozen=True, **SLOTS)
class SpoolEntry:
    name: str
    session_id: str
    size: int  # bytes on disk, header included
    kernel_build_id: bytes = b""  # from the file's header: no need to decode the session


def _session_of(name: str) -> str:
    m = _NAME_RE.match(name)
    return m.group(2) if m else ""


def read_waiting(directory: str) -> list[wire.SessionFile]:
    """The sessions waiting in a spool directory, oldest first, read without changing anything.

    For a reader beside the agent that owns the directory (tools, tests): a `Spool` would
    recover it, removing the agent's half-written files and quarantining what it cannot read.
    Files that vanish or do not check out while being read are skipped.
    """
    out = []
    for name in sorted(os.listdir(directory)):
        if _NAME_RE.match(name) is None:
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                out.append(wire.unframe_session(f.read()))
        except (OSError, WireError):
            continue
    return out


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.dropped = Counter(
            "bistouri_spool_dropped",
            "Sessions removed from the spool without being delivered",
            ["reason"],
            registry=registry,
        )
        self.bytes = Gauge(
            "bistouri_spool_bytes", "Bytes of sessions waiting in the spool", registry=registry
        )
        self.sessions = Gauge("bistouri_spool_sessions", "Sessions waiting in the spool", registry=registry)
        self.capacity = Gauge(
            "bistouri_spool_capacity_bytes", "The spool's bound (--spool-max-bytes)", registry=registry
        )
        self.rejected = Counter(
            "bistouri_spool_rejected",
            "Sessions moved aside into rejected/ (refused by the symbolizer or corrupt)",
            registry=registry,
        )


class Spool:
    """A bounded directory of sessions. Thread-safe: the capture side puts, the exporter reads and acks."""

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        registry: CollectorRegistry | None = REGISTRY,
        max_rejected_bytes: int | None = None,
        kernel_build_id: bytes = b"",
    ) -> None:
        """`kernel_build_id`: the running kernel's, stamped on every session put here."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = directory
        self.kernel_build_id = kernel_build_id
        self.max_bytes = max_bytes
        self.max_rejected_bytes = (
            max_rejected_bytes if max_rejected_bytes is not None else max(1, max_bytes // 8)
        )
        self._tmp = os.path.join(directory, "tmp")
        self.rejected_dir = os.path.join(directory, "rejected")
        self._lock = threading.Lock()
        self._entries: dict[str, int] = {}  # name -> size, the names sort oldest first
        self._kernels: dict[str, bytes] = {}  # name -> kernel build id, when it has one
        self._bytes = 0
        self._seq = 0
        self._rejected: dict[str, int] = {}
        self._rejected_bytes = 0
        self._m = _Metrics(registry)
        self._m.capacity.set(max_bytes)  # the "spool near full" alert divides by it
        self._last_log: dict[str, float] = {}
        try:
            for d in (directory, self._tmp, self.rejected_dir):
                os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot create the spool directory {d}: {e.strerror} (check --spool-dir)", d
            ) from e
        self._recover()

    # -- start-up

    def _recover(self) -> None:
        for name in os.listdir(self._tmp):
            # Written but never renamed: the process died mid-put.
            self._unlink(os.path.join(self._tmp, name))
            self._m.dropped.labels(DROP_PARTIAL).inc()
            log.warning("spool: removed a partial file left by a crash name=%s", name)
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                continue
            m = _NAME_RE.match(name)
            if m is None:
                continue  # not ours; leave it alone
            self._seq = max(self._seq, int(m.group(1)))
            try:
                with open(path, "rb") as f:
                    head = f.read(wire.FILE_HEADER_MAX)
                size = os.path.getsize(path)
            except OSError:
                continue
            self._entries[name] = size
            self._bytes += size
            if bid := wire.framed_kernel_build_id(head):
                self._kernels[name] = bid
        for name in sorted(os.listdir(self.rejected_dir)):
            path = os.path.join(self.rejected_dir, name)
            if name.endswith(SUFFIX) and os.path.isfile(path):
                size = os.path.getsize(path)
                self._rejected[name] = size
                self._rejected_bytes += size
        with self._lock:
            self._evict_locked(0)
            self._trim_rejected_locked()
            self._publish_locked()
        if self._entries:
            log.info(
                "spool: sessions waiting from a previous run sessions=%d bytes=%d",
                len(self._entries),
                self._bytes,
            )

    # -- writing (capture side)

    def put(self, session_id: str, data: bytes) -> str | None:
        """Store one encoded session. Returns its spool name, or None if it was dropped (and counted).

        Never raises for disk problems: the capture side must keep going.
        """
        if not SESSION_ID_RE.match(session_id):
            raise ValueError(f"session id {session_id!r} must match {SESSION_ID_RE.pattern}")
        framed = wire.frame_session(wire.SessionFile(data, self.kernel_build_id))
        size = len(framed)
        if size > self.max_bytes:
            self._m.dropped.labels(DROP_TOO_LARGE).inc()
            self._log_limited(DROP_TOO_LARGE, "spool: session larger than the spool, dropped", size)
            return None
        with self._lock:
            self._seq += 1
            name = f"{self._seq:012d}.{session_id}{SUFFIX}"
        try:
            # Synced before the rename (the session must survive a power loss), outside the lock.
            with atomicfile.replacing(
                os.path.join(self.directory, name), fsync=True, tmp_dir=self._tmp
            ) as out:
                out.file.write(framed)
                out.finish()
                with self._lock:
                    self._evict_locked(size)
                    out.commit()
                    self._entries[name] = size
                    if self.kernel_build_id:
                        self._kernels[name] = self.kernel_build_id
                    self._bytes += size
                    self._publish_locked()
        except OSError as e:
            self._m.dropped.labels(DROP_WRITE_ERROR).inc()
            self._log_limited(
                DROP_WRITE_ERROR, f"spool: cannot write a session ({e.strerror}), dropped", size
            )
            return None
        try:
            atomicfile.fsync_dir(self.directory)  # the new name survives a power loss too
        except OSError as e:
            # The session is in place and will be sent; only its survival of a power loss is at risk.
            self._log_limited("fsync", f"spool: cannot fsync the directory ({e.strerror})", size)
        return name

    def _evict_locked(self, incoming: int) -> None:
        while self._entries and self._bytes + incoming > self.max_bytes:
            oldest = min(self._entries)
            size = self._entries.pop(oldest)
            self._kernels.pop(oldest, None)
            self._bytes -= size
            self._unlink(os.path.join(self.directory, oldest))
            self._m.dropped.labels(DROP_FULL).inc()
            self._log_limited(DROP_FULL, "spool: full, dropped the oldest session", size)

    # -- reading (exporter side)

    def pending(self) -> list[SpoolEntry]:
        """Waiting sessions, oldest first."""
        with self._lock:
            return [
                SpoolEntry(n, _session_of(n), s, self._kernels.get(n, b""))
                for n, s in sorted(self._entries.items())
            ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def read(self, name: str) -> bytes | None:
        """The session's bytes, or None if it is gone (evicted) or corrupt (then quarantined)."""
        path = os.path.join(self.directory, name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            self._quarantine(name, f"unreadable: {e.strerror}")
            return None
        try:
            return wire.unframe_session(raw).data
        except WireError as e:
            self._quarantine(name, str(e).removeprefix("corrupt: "))
            return None

    def ack(self, name: str) -> None:
        """Delivered: delete it. Unknown names are ignored (evicted meanwhile)."""
        with self._lock:
            size = self._entries.pop(name, None)
            if size is None:
                return
            self._kernels.pop(name, None)
            self._bytes -= size
            self._unlink(os.path.join(self.directory, name))
            self._publish_locked()

    def reject(self, name: str, reason: str) -> None:
        """Refused for good: move it into rejected/ with a .reason file, for a human to look at."""
        with self._lock:
            size = self._entries.pop(name, None)
            if size is None:
                return
            self._kernels.pop(name, None)
            self._bytes -= size
            try:
                os.rename(os.path.join(self.directory, name), os.path.join(self.rejected_dir, name))
            except OSError as e:
                log.warning("spool: cannot move a rejected session aside name=%s error=%s", name, e.strerror)
                self._unlink(os.path.join(self.directory, name))
            else:
                # Tracked from here on, so the rejected/ bound covers it even without its reason.
                self._rejected[name] = size
                self._rejected_bytes += size
                self._write_reason(name, reason)
                self._trim_rejected_locked()
            self._m.rejected.inc()
            self._publish_locked()

    def rejected(self) -> list[tuple[str, str]]:
        """(name, reason) of the sessions set aside, oldest first."""
        with self._lock:
            names = sorted(self._rejected)
        out = []
        for n in names:
            try:
                with open(os.path.join(self.rejected_dir, n + REASON_SUFFIX)) as f:
                    out.append((n, f.read().strip()))
            except OSError:
                out.append((n, ""))
        return out

    # -- internals

    def _quarantine(self, name: str, why: str) -> None:
        self._m.dropped.labels(DROP_CORRUPT).inc()
        log.warning("spool: corrupt session file moved to rejected/ name=%s problem=%s", name, why)
        self.reject(name, f"corrupt: {why}")

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._entries.pop(name, None)
            self._kernels.pop(name, None)
            if size is not None:
                self._bytes -= size
                self._publish_locked()

    def _write_reason(self, name: str, reason: str) -> None:
        path = os.path.join(self.rejected_dir, name + REASON_SUFFIX)
        try:
            with open(path, "w") as f:
                f.write(reason[:4096] + "\n")
        except OSError as e:
            log.warning(
                "spool: cannot write why a session was rejected name=%s reason=%s error=%s",
                name,
                reason[:200],
                e.strerror,
            )
            self._unlink(path)

    def _trim_rejected_locked(self) -> None:
        while self._rejected and self._rejected_bytes > self.max_rejected_bytes:
            oldest = min(self._rejected)
            self._rejected_bytes -= self._rejected.pop(oldest)
            self._unlink(os.path.join(self.rejected_dir, oldest))
            self._unlink(os.path.join(self.rejected_dir, oldest + REASON_SUFFIX))
            self._m.dropped.labels(DROP_REJECTED_EVICTED).inc()

    def _publish_locked(self) -> None:
        self._m.bytes.set(self._bytes)
        self._m.sessions.set(len(self._entries))

    def _log_limited(self, key: str, msg: str, size: int) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[key] = now
            log.warning("%s (logged at most once a minute) size=%d max_bytes=%d", msg, size, self.max_bytes)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("spool: cannot remove path=%s error=%s", path, e.strerror)

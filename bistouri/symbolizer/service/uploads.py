"""ELF files agents upload on demand: the binaries and debug files no operator source has.

The ingest answer lists the build ids the resolver cannot name (`missing_builds`,
docs/api.md). An agent claims one (`POST /v1/uploads/<build id>/<kind>?claimant=<its id>`:
of concurrent claimants one wins, the others hear "in_progress" or "done"; the claim
lives in the database, shared by every worker and instance) and sends it (`PUT`, gzip'd,
with the same claimant). The trust model (docs/deployment.md):

- **per tenant**: every upload belongs to the tenant of the token that sent it (a bound
  write token, tokens.py) or that the agent names (`tenant=`, with a shared token), and
  serves that tenant's sessions only: a file another tenant uploads under libc's build id
  never names this tenant's frames;
- **operator sources first**: --debug-dir, --binary-dir and debuginfod are looked at before
  any upload (sources.py);
- **proven**: the file must be ELF and carry the GNU build id it is uploaded under;
- **claimed, write-once**: a PUT needs the claim of its claimant; a claim expires
  CLAIM_LEASE_S after it was taken (then anyone may take it); a file done is never
  replaced (409), only evicted;
- **bounded**: at most --max-upload-bytes a file, checked while inflating, and quotas of
  files and bytes per tenant and in all; the least recently used uploads are evicted to make
  room, and by retention before any session.

The body is decompressed as it arrives into a temporary file (atomicfile.py; tempfiles.py sweeps
those of dead workers), never whole in memory. Accepted files are stored content-addressed under
`<state>/uploads/<tenant>/.build-id/xx/rest` (executable) and `xx/rest.debug` (debug info).
With PostgreSQL, claims, sizes and the files themselves are shared (in 1 MiB rows of
`upload_parts`, written before the upload is marked done): an instance asked about a file
another one received copies it into its own state dir first (see docs/api.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ... import atomicfile
from ...compat import SLOTS
from ...elf import ELF_MAGIC, read_build_id
from ...errors import BistouriError, GzipError, GzipTooLarge
from .. import tempfiles
from ..gunzip import inflate
from ..sources import DEBUGINFO, EXECUTABLE, KINDS, check_build_id
from ..tenants import DEFAULT_TENANT, TENANT_RE
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30  # an uncompressed ELF file; node's binary is ~98 MB
DEFAULT_QUOTA_BYTES = 10 << 30  # all uploads of an instance's database
DEFAULT_QUOTA_FILES = 10_000
CLAIM_LEASE_S = 600  # a claim not finished by then may be taken by another agent
MAX_LIVE_CLAIMS = 64  # unexpired claims of one tenant: a claim is a row, refused past this
LEGACY_SCOPE = DEFAULT_TENANT  # the tenant of uploads stored before they were per tenant
_TOUCH_EVERY_S = 600.0  # a use of an upload is written to the database at most this often per worker
_CHUNK = 1 << 16
_SHARED_CHUNK = 1 << 20  # rows of upload_parts (PostgreSQL): 1 MiB each


class UploadRefused(BistouriError):
    """An upload that is not kept: `status` and `reason` for the HTTP answer."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, **SLOTS)
class Quota:
    """What uploads may hold: in all (the database's), and per tenant."""

    total_bytes: int = DEFAULT_QUOTA_BYTES
    total_files: int = DEFAULT_QUOTA_FILES
    tenant_bytes: int | None = None  # None: the total's
    tenant_files: int | None = None

    @property
    def per_tenant(self) -> tuple[int, int]:
        return (
            self.total_bytes if self.tenant_bytes is None else self.tenant_bytes,
            self.total_files if self.tenant_files is None else self.tenant_files,
        )


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UploadRefused(400, "bad_parameter", f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def check_scope(scope: str) -> str:
    if not TENANT_RE.fullmatch(scope):
        raise UploadRefused(
            400, "bad_parameter", "tenant must be 1-64 characters of [A-Za-z0-9_.-], starting alphanumeric"
        )
    return scope


# Called with (reason, count) for uploads evicted to make room (quota) or by retention (age, size).
OnEvict = Callable[[str, int], None]


class Uploads:
    """Uploaded files of one state directory, with their shared state in the database. Thread-safe."""

    def __init__(
        self,
        state_dir: Path,
        store: Store,
        max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        *,
        quota: Quota | None = None,
        claim_lease_s: float = CLAIM_LEASE_S,
        on_evict: OnEvict | None = None,
    ) -> None:
        self.root = Path(state_dir) / "uploads"
        self.tmp = self.root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.max_bytes = max_bytes
        self.quota = quota or Quota()
        self.claim_lease_ns = int(claim_lease_s * 1e9)
        self._on_evict = on_evict or (lambda reason, n: None)
        self._touched: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._adopt_legacy_tree()
        self.sweep()

    def _adopt_legacy_tree(self) -> None:
        """Files of earlier releases (`uploads/.build-id`) were uploaded by agents of the default tenant."""
        legacy = self.root / ".build-id"
        if legacy.is_dir():
            (self.root / LEGACY_SCOPE).mkdir(exist_ok=True)
            try:
                os.rename(legacy, self.root / LEGACY_SCOPE / ".build-id")
            except OSError as e:  # another worker did it, or the default tenant uploaded since
                log.debug("uploads of an earlier release left in place. error=%s", e)

    def sweep(self) -> int:
        """Remove temporary files of workers that died while receiving (and of earlier releases)."""
        return tempfiles.sweep(self.tmp) + tempfiles.sweep(self.root)

    def tree(self, scope: str) -> Path:
        """The .build-id tree of a tenant's uploads (sources.py looks there last)."""
        return self.root / check_scope(scope) / ".build-id"

    def path(self, scope: str, build_id: str, kind: str) -> Path:
        hexid = check_build_id(build_id)
        name = hexid[2:] + (".debug" if kind == DEBUGINFO else "")
        return self.tree(scope) / hexid[:2] / name

    def has(self, scope: str, build_id: str, kind: str) -> bool:
        """Whether the file is here; on PostgreSQL, one another instance received is copied here first."""
        if not TENANT_RE.fullmatch(scope):
            return False  # sessions of no valid tenant: no upload serves them
        if self.path(scope, build_id, kind).is_file():
            return True
        return self.store.postgres and self._fetch_shared(scope, check_build_id(build_id), kind)

    def _fetch_shared(self, scope: str, hexid: str, kind: str) -> bool:
        """Copy a file stored in the shared database into the state dir, chunk by chunk."""
        if not self.store.upload_done(scope, hexid, kind):
            return False
        chunks = self.store.upload_chunks(scope, hexid, kind)
        if not chunks:
            return False
        dest = self.path(scope, hexid, kind)
        try:
            # Written in .tmp/ (swept if this worker dies), not synced: the database holds the file.
            with atomicfile.replacing(dest, tmp_dir=self.tmp) as out:
                for seq in range(chunks):
                    data = self.store.upload_chunk(scope, hexid, kind, seq)
                    if data is None:
                        raise FileNotFoundError(f"chunk {seq} of {hexid} ({kind}) is gone")
                    out.file.write(data)
                out.finish()
                if read_build_id(out.path) != bytes.fromhex(hexid):
                    raise ValueError(f"the stored {kind} of {hexid} is not that build id's")
                dest.parent.mkdir(parents=True, exist_ok=True)
            return True
        except (OSError, ValueError) as e:  # expired meanwhile, or damaged: an agent uploads it again
            log.warning(
                "Cannot copy an upload from the database. tenant=%s build_id=%s kind=%s: %s",
                scope,
                hexid,
                kind,
                e,
            )
            return False

    def have(self, scope: str, build_id: str) -> int:
        """The kinds present as a bit mask: 1 the executable, 2 the debug file."""
        return sum(1 << i for i, k in enumerate(KINDS[::-1]) if self.has(scope, build_id, k))

    def touch(self, scope: str, build_id: str) -> None:
        """The uploads of a build id served a session: noted (at most every _TOUCH_EVERY_S per worker),
        so that eviction takes the least recently used first."""
        key = (scope, build_id)
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(key, -1e18) < _TOUCH_EVERY_S:
                return
            if len(self._touched) > 100_000:
                self._touched.clear()
            self._touched[key] = now
        self.store.touch_upload(scope, build_id)

    def claim(self, scope: str, build_id: str, kind: str, claimant: str) -> str:
        """The claim's state: claimed, in_progress or done (see Store.claim_upload)."""
        hexid = check_build_id(build_id)
        check_kind(kind)
        check_scope(scope)
        if self.has(scope, hexid, kind):
            return "done"
        if self.store.live_claims(scope) >= MAX_LIVE_CLAIMS:
            raise UploadRefused(
                429,
                "too_many_claims",
                f"over {MAX_LIVE_CLAIMS} uploads of this tenant are claimed and unfinished",
            )
        state = self.store.claim_upload(scope, hexid, kind, self.claim_lease_ns, claimant[:64])
        if state == "done" and not self.has(scope, hexid, kind):
            # Done in the database but the file is in neither place (removed by hand, or its shared copy
            # is damaged): the row goes, and the file may be uploaded again.
            log.warning(
                "An upload marked done has no file; claimable again. tenant=%s build_id=%s", scope, hexid
            )
            self.store.delete_upload(scope, hexid, kind)
            state = self.store.claim_upload(scope, hexid, kind, self.claim_lease_ns, claimant[:64])
        return state

    def release(self, scope: str, build_id: str, kind: str, claimant: str) -> None:
        """Give up this claimant's claim (its upload was refused before it was read)."""
        self.store.release_upload(scope, check_build_id(build_id), kind, claimant[:64])

    def receive(
        self, scope: str, build_id: str, kind: str, claimant: str, read: Callable[[int], bytes], gzipped: bool
    ) -> int:
        """Store the file read from `read(n)` (b"" at the end), decompressing a gzip body as it comes.

        Returns its size. UploadRefused (nothing kept, the claim released) when the file is here already,
        the claimant holds no claim, it is over a limit, not ELF, or not of this build id.
        """
        hexid = check_build_id(build_id)
        check_kind(kind)
        check_scope(scope)
        if self.has(scope, hexid, kind):
            raise UploadRefused(
                409, "already_uploaded", f"the {kind} of {hexid} is here: uploads are never replaced"
            )
        if not claimant or not self.store.holds_claim(scope, hexid, kind, claimant[:64]):
            raise UploadRefused(
                409,
                "not_claimed",
                "claim the file first (POST with ?claimant=<id>), then PUT with the same claimant",
            )
        claimant = claimant[:64]
        tenant_bytes, _ = self.quota.per_tenant
        limit = min(self.max_bytes, tenant_bytes, self.quota.total_bytes)
        if self.store.max_db_bytes is not None:  # a file alone over the database's bound would go at once
            limit = min(limit, self.store.max_db_bytes)
        dest = self.path(scope, hexid, kind)
        shared = False
        try:
            # Written in .tmp/ (swept if this worker dies); not synced, as an agent uploads a lost file again.
            with atomicfile.replacing(dest, tmp_dir=self.tmp) as out:
                size = self._copy(read, out.file.write, gzipped, limit)
                out.finish()
                self._verify(out.path, size, hexid)
                self._make_room(scope, size)
                if self.store.postgres:  # before "done": another instance may fetch it at once
                    shared = True
                    self._share(out.path, scope, hexid, kind)
                dest.parent.mkdir(parents=True, exist_ok=True)
            if not self.store.finish_upload(scope, hexid, kind, claimant, size):
                _unlink(str(dest))
                shared = False  # the chunks are the new claimant's now
                raise UploadRefused(409, "claim_lost", "the claim expired and another agent took it")
        except BaseException:
            if shared:  # only what this request wrote: never a copy already done
                self.store.delete_upload_chunks(scope, hexid, kind)
            self.store.release_upload(scope, hexid, kind, claimant)
            raise
        return size

    @staticmethod
    def _verify(tmp: str, size: int, hexid: str) -> None:
        if size < 4:
            raise UploadRefused(400, "not_elf", f"the body is {size} bytes: not an ELF file")
        with open(tmp, "rb") as f:
            if f.read(4) != ELF_MAGIC:
                raise UploadRefused(400, "not_elf", "the body is not an ELF file (no ELF magic)")
        got = read_build_id(tmp)
        if got is None:
            raise UploadRefused(400, "no_build_id", "the ELF file carries no build id (GNU note, or Go's)")
        if got.hex() != hexid:
            raise UploadRefused(
                400, "build_id_mismatch", f"the ELF file's build id is {got.hex()}, not {hexid} as claimed"
            )

    def _make_room(self, scope: str, size: int) -> None:
        """Evict the least recently used uploads, of this tenant first, until `size` more bytes and one more
        file fit in its quota and in the total."""
        tenant_bytes, tenant_files = self.quota.per_tenant
        evicted = 0
        for owner, limit_bytes, limit_files in (
            (scope, tenant_bytes, tenant_files),
            (None, self.quota.total_bytes, self.quota.total_files),
        ):
            files, used = self.store.upload_usage(owner)
            for t, b, k, n in self.store.uploads_by_use(owner):
                if files + 1 <= limit_files and used + size <= limit_bytes:
                    break
                self.store.delete_upload(t, b, k)
                self.remove(t, b, k)
                files, used, evicted = files - 1, used - n, evicted + 1
        if evicted:
            log.info("uploads evicted to make room. tenant=%s count=%d", scope, evicted)
            self._on_evict("quota", evicted)

    def _share(self, path: str, scope: str, hexid: str, kind: str) -> None:
        """The verified file into the shared database, in chunks (a retry under the claim replaces them)."""
        self.store.delete_upload_chunks(scope, hexid, kind)
        with open(path, "rb") as f:
            seq = 0
            while chunk := f.read(_SHARED_CHUNK):
                self.store.put_upload_chunk(scope, hexid, kind, seq, chunk)
                seq += 1

    @staticmethod
    def _copy(
        read: Callable[[int], bytes], write: Callable[[bytes], object], gzipped: bool, limit: int
    ) -> int:
        """Copy the body, inflated if gzip'd; at most `limit` bytes of file, whatever the compression."""
        chunks = iter(lambda: read(_CHUNK), b"")
        size = 0
        try:
            # Bounded output per step: a small gzip bomb never lands in memory whole.
            for out in inflate(chunks, limit, _CHUNK) if gzipped else chunks:
                size += len(out)
                _check_size(size, limit)
                write(out)
        except GzipTooLarge:
            raise _too_large(limit) from None
        except GzipError as e:
            raise UploadRefused(400, "bad_encoding", f"the body {e}")
        return size

    def remove(self, scope: str, build_id: str, kind: str) -> None:
        """Forget a file (eviction; the database's row and copy go with Store.delete_upload)."""
        _unlink(str(self.path(scope, build_id, kind)))

    def delete(self, scope: str, build_id: str, kind: str) -> bool:
        """An operator's removal (DELETE, admin token): the row, the shared copy and the file."""
        found = self.has(scope, build_id, kind)
        self.store.delete_upload(scope, check_build_id(build_id), check_kind(kind))
        self.remove(scope, build_id, kind)
        return found


def _check_size(size: int, limit: int) -> None:
    if size > limit:
        raise _too_large(limit)


def _too_large(limit: int) -> UploadRefused:
    return UploadRefused(
        413,
        "too_large",
        f"the file is over {limit} bytes (--max-upload-bytes, an upload quota or --max-db-bytes); "
        "it is not kept",
    )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = [
    "CLAIM_LEASE_S",
    "DEFAULT_MAX_UPLOAD_BYTES",
    "EXECUTABLE",
    "Quota",
    "UploadRefused",
    "Uploads",
]

"""ELF files agents upload on demand: the binaries and debug files no source here has.

The ingest answer lists the build ids the resolver cannot name (`missing_builds`,
docs/api.md). An agent claims one (`POST /v1/uploads/<build id>/<kind>`: of
concurrent claimants one wins, the others hear "in_progress" or "done"; the claim
lives in the database, shared by every worker and instance) and sends it
(`PUT`, gzip'd). The body is decompressed as it arrives into a temporary file,
never whole in memory, and refused (nothing kept) when it grows past the limit,
is not ELF or does not carry the build id claimed. Accepted files are stored
content-addressed under `<state>/uploads/.build-id/xx/rest` (executable) and
`xx/rest.debug` (debug info): the layout of a `--debug-dir`, which is how the
resolver finds them. Their sizes count in `--max-db-bytes`.

With PostgreSQL, claims, sizes and the files themselves are shared (in 1 MiB rows of
`upload_chunks`, written before the upload is marked done): an instance asked about a
file another one received copies it into its own state dir first (see docs/api.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

from ..errors import BistouriError
from .elf import ELF_MAGIC, read_build_id
from .sources import DEBUGINFO, EXECUTABLE, KINDS, check_build_id
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30  # an uncompressed ELF file; node's binary is ~98 MB
CLAIM_LEASE_S = 600  # a claim not finished by then may be taken by another agent
_CHUNK = 1 << 16
_SHARED_CHUNK = 1 << 20  # rows of upload_chunks (PostgreSQL): 1 MiB each


class UploadRefused(BistouriError):
    """An upload that is not kept: `status` and `reason` for the HTTP answer."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UploadRefused(400, "bad_parameter", f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


class Uploads:
    """Uploaded files of one state directory, with their shared state in the database. Thread-safe."""

    def __init__(self, state_dir: Path, store: Store, max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> None:
        self.root = Path(state_dir) / "uploads"  # a --debug-dir: the resolver looks here
        self.tree = self.root / ".build-id"
        self.tree.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.max_bytes = max_bytes

    def path(self, build_id: str, kind: str) -> Path:
        hexid = check_build_id(build_id)
        name = hexid[2:] + (".debug" if kind == DEBUGINFO else "")
        return self.tree / hexid[:2] / name

    def has(self, build_id: str, kind: str) -> bool:
        """Whether the file is here; on PostgreSQL, one another instance received is copied here first."""
        if self.path(build_id, kind).is_file():
            return True
        return self.store.postgres and self._fetch_shared(check_build_id(build_id), kind)

    def _fetch_shared(self, hexid: str, kind: str) -> bool:
        """Copy a file stored in the shared database into the state dir, chunk by chunk."""
        if not self.store.upload_done(hexid, kind):
            return False
        chunks = self.store.upload_chunks(hexid, kind)
        if not chunks:
            return False
        fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                for seq in range(chunks):
                    data = self.store.upload_chunk(hexid, kind, seq)
                    if data is None:
                        raise FileNotFoundError(f"chunk {seq} of {hexid} ({kind}) is gone")
                    f.write(data)
            if read_build_id(tmp) != bytes.fromhex(hexid):
                raise ValueError(f"the stored {kind} of {hexid} is not that build id's")
            dest = self.path(hexid, kind)
            dest.parent.mkdir(exist_ok=True)
            os.replace(tmp, dest)
            return True
        except (OSError, ValueError) as e:  # expired meanwhile, or damaged: an agent uploads it again
            log.warning("Cannot copy an upload from the database. build_id=%s kind=%s: %s", hexid, kind, e)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            return False

    def has_any(self, build_id: str) -> bool:
        return any(self.has(build_id, k) for k in KINDS)

    def have(self, build_id: str) -> int:
        """The kinds present as a bit mask: 1 the executable, 2 the debug file."""
        return sum(1 << i for i, k in enumerate(KINDS[::-1]) if self.has(build_id, k))

    def claim(self, build_id: str, kind: str, claimant: str = "") -> str:
        """The claim's state: claimed, in_progress or done (see Store.claim_upload)."""
        if self.has(build_id, kind):
            return "done"
        lease = CLAIM_LEASE_S * 10**9
        state = self.store.claim_upload(check_build_id(build_id), check_kind(kind), lease, claimant[:64])
        # "done" elsewhere (another instance) but not here: this instance takes it too.
        return "claimed" if state == "done" else state

    def receive(self, build_id: str, kind: str, read: Callable[[int], bytes], gzipped: bool) -> int:
        """Store the file read from `read(n)` (b"" at the end), decompressing a gzip body as it comes.

        Returns its size. UploadRefused (nothing kept, the claim released) when it is over the limit,
        not ELF, or not of this build id.
        """
        hexid = check_build_id(build_id)
        check_kind(kind)
        fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                size = self._copy(read, f.write, gzipped)
            if size < 4:
                raise UploadRefused(400, "not_elf", f"the body is {size} bytes: not an ELF file")
            with open(tmp, "rb") as f:
                if f.read(4) != ELF_MAGIC:
                    raise UploadRefused(400, "not_elf", "the body is not an ELF file (no ELF magic)")
            got = read_build_id(tmp)
            if got is None:
                raise UploadRefused(400, "no_build_id", "the ELF file carries no GNU build id note")
            if got.hex() != hexid:
                raise UploadRefused(
                    400,
                    "build_id_mismatch",
                    f"the ELF file's build id is {got.hex()}, not {hexid} as claimed",
                )
            if self.store.postgres:  # before "done": another instance may fetch it at once
                self._share(tmp, hexid, kind)
            dest = self.path(hexid, kind)
            dest.parent.mkdir(exist_ok=True)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if self.store.postgres:
                self.store.delete_upload_chunks(hexid, kind)
            self.store.release_upload(hexid, kind)
            raise
        self.store.finish_upload(hexid, kind, size)
        return size

    def _share(self, path: str, hexid: str, kind: str) -> None:
        """The verified file into the shared database, in chunks (a retry replaces a partial one)."""
        self.store.delete_upload_chunks(hexid, kind)
        with open(path, "rb") as f:
            seq = 0
            while chunk := f.read(_SHARED_CHUNK):
                self.store.put_upload_chunk(hexid, kind, seq, chunk)
                seq += 1

    def _copy(self, read: Callable[[int], bytes], write: Callable[[bytes], object], gzipped: bool) -> int:
        """Copy the body, inflated if gzip'd; at most max_bytes of file, whatever the compression."""
        inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS) if gzipped else None
        size = 0
        while True:
            chunk = read(_CHUNK)
            if not chunk:
                break
            if inflate is not None:
                try:
                    # Bounded output per step: a small gzip bomb never lands in memory whole.
                    out = inflate.decompress(chunk, _CHUNK)
                    while True:
                        size += len(out)
                        self._check_size(size)
                        write(out)
                        if not inflate.unconsumed_tail:
                            break
                        out = inflate.decompress(inflate.unconsumed_tail, _CHUNK)
                except zlib.error as e:
                    raise UploadRefused(400, "bad_encoding", f"the body is not valid gzip: {e}")
            else:
                size += len(chunk)
                self._check_size(size)
                write(chunk)
        if inflate is not None and not inflate.eof:
            raise UploadRefused(400, "bad_encoding", "the gzip body is truncated")
        return size

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise UploadRefused(
                413,
                "too_large",
                f"the file is over {self.max_bytes} bytes (--max-upload-bytes); it is not kept",
            )

    def remove(self, build_id: str, kind: str) -> None:
        """Forget a file (retention; the database's copy went with its row)."""
        try:
            self.path(build_id, kind).unlink()
        except FileNotFoundError:
            pass


__all__ = ["CLAIM_LEASE_S", "DEFAULT_MAX_UPLOAD_BYTES", "EXECUTABLE", "UploadRefused", "Uploads"]

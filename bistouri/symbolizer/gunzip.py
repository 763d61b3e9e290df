"""The one bounded gunzip: what an agent sent compressed is inflated a piece at a time, never past a bound.

A few kilobytes of gzip can inflate to gigabytes, so nothing here calls `gzip.decompress`: the output is
counted as it comes, in pieces of at most `step` bytes, and GzipTooLarge is raised as soon as it passes
`limit`. Exactly one gzip member is accepted: a truncated one, or bytes after it, raise GzipError.
Callers turn both into their own answer (an HTTP status, a WireError, a KallsymsError).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

from ..errors import GzipError, GzipTooLarge

GZIP_MAGIC = b"\x1f\x8b"
STEP = 1 << 20


def inflate(chunks: Iterable[bytes], limit: int, step: int = STEP) -> Iterator[bytes]:
    """The inflated bytes of the gzip member given as `chunks`, in pieces of at most `step` bytes.

    Raises GzipTooLarge once more than `limit` bytes came out, GzipError if it is not valid gzip."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    total = 0
    try:
        for chunk in chunks:
            if d.eof:
                if chunk:
                    raise GzipError("has data after its gzip member")
                continue
            out = d.decompress(chunk, step)
            while True:
                total += len(out)
                if total > limit:
                    raise GzipTooLarge(f"inflates to more than {limit} bytes")
                if out:
                    yield out
                if d.eof:
                    break
                if d.unconsumed_tail:
                    out = d.decompress(d.unconsumed_tail, step)
                elif len(out) == step:  # the input is in, but output may still be pending
                    out = d.decompress(b"", step)
                else:
                    break
            if d.unused_data:
                raise GzipError("has data after its gzip member")
    except zlib.error as e:
        raise GzipError(f"is not valid gzip: {e}") from None
    if not d.eof:
        raise GzipError("is truncated gzip")


def gunzip(data: bytes, limit: int) -> bytes:
    """`data` inflated whole, at most `limit` bytes (see `inflate`)."""
    return b"".join(inflate((data,), limit))

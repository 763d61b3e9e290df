"""A session on disk: the one framing the spool writes and `bistouri symbolize` reads."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ..compat import SLOTS
from ..errors import WireError

# ---------------------------------------------------------------------------
# Session files: the one framing of a session on disk (the spool, `bistouri symbolize`).
#
# A file is a header, then the kernel build id, then the msgpack session. The
# CRC32 covers the build id and the session, so damage anywhere is spotted. The
# build id rides beside the session so that the exporter learns which kernel a
# session needs without decoding it. Files of format 1 (no build id) still read.

FILE_MAGIC = b"BSP2"
FILE_MAGIC_V1 = b"BSP1"
FILE_HEADER = struct.Struct("<4sIIB")  # magic, session length, crc32, build id length
_FILE_HEADER_V1 = struct.Struct("<4sII")  # magic, session length, crc32 of the session
FILE_HEADER_MAX = FILE_HEADER.size + 255  # enough to learn a file's build id


@dataclass(frozen=True, **SLOTS)
class SessionFile:
    """An encoded session as stored in a file, with the kernel build id it was captured on."""

    data: bytes  # the msgpack session (`encode_session`)
    kernel_build_id: bytes = b""


def frame_session(f: SessionFile) -> bytes:
    """The bytes of a session file."""
    if len(f.kernel_build_id) > 255:
        raise ValueError(f"a kernel build id has at most 255 bytes, got {len(f.kernel_build_id)}")
    crc = zlib.crc32(f.data, zlib.crc32(f.kernel_build_id))
    head = FILE_HEADER.pack(FILE_MAGIC, len(f.data), crc, len(f.kernel_build_id))
    return head + f.kernel_build_id + f.data


def is_framed(raw: bytes) -> bool:
    return raw[:4] in (FILE_MAGIC, FILE_MAGIC_V1)


def unframe_session(raw: bytes) -> SessionFile:
    """The session in a file's bytes, checked; WireError("corrupt", why) if it is damaged."""
    magic = raw[:4]
    if magic == FILE_MAGIC_V1:
        if len(raw) < _FILE_HEADER_V1.size:
            raise WireError("corrupt", "shorter than its header")
        _, length, crc = _FILE_HEADER_V1.unpack_from(raw)
        bid, data = b"", raw[_FILE_HEADER_V1.size :]
    elif magic == FILE_MAGIC:
        if len(raw) < FILE_HEADER.size:
            raise WireError("corrupt", "shorter than its header")
        _, length, crc, bid_len = FILE_HEADER.unpack_from(raw)
        start = FILE_HEADER.size + bid_len
        bid, data = raw[FILE_HEADER.size : start], raw[start:]
        if len(bid) != bid_len:
            raise WireError("corrupt", "shorter than its header")
    else:
        raise WireError("corrupt", f"bad magic {magic!r}: not a bistouri session file")
    if length != len(data):
        raise WireError("corrupt", f"truncated: {len(data)} of {length} bytes")
    if zlib.crc32(data, zlib.crc32(bid)) != crc:
        raise WireError("corrupt", "checksum mismatch")
    return SessionFile(data, bid)


def framed_kernel_build_id(head: bytes) -> bytes:
    """The kernel build id from the first FILE_HEADER_MAX bytes of a file (b"" if it has none)."""
    if head[:4] != FILE_MAGIC or len(head) < FILE_HEADER.size:
        return b""
    n = head[FILE_HEADER.size - 1]
    bid = head[FILE_HEADER.size : FILE_HEADER.size + n]
    return bid if len(bid) == n else b""

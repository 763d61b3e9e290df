"""Protocol buffers wire encoding, by hand: the few pieces pprof and OTLP profiles need.

Hand-written so that `bistouri record` (on the hosts, without the symbolizer's extras) writes
both formats, and because building a profile message by message through generated classes
costs more than joining bytes, even with protobuf's upb backend (measured with protobuf 7.36:
adding a Sample with its stack index, attributes and value 0.7-0.8 us, a Stack of 30 locations
0.9 us, against 0.3 us for the same Sample's bytes here; each field set is a call from Python
either way). Tests decode every output with the official generated classes (google/pprof's
profile.proto, opentelemetry-proto).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from ..compat import zip_strict

INT64_MAX = (1 << 63) - 1


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]
_CONTINUED = [bytes(((i & 0x7F) | 0x80,)) for i in range(0x80)]  # a low 7-bit group, more to follow
# Ids, string indexes and small counts dominate a profile: their encodings are precomputed, the
# two-byte ones joined from the two groups (encoding each in a loop took ~2.5 ms of every import).
SMALL_VARINTS = _ONE_BYTE + [low + high for high in _ONE_BYTE[1:] for low in _CONTINUED]


def _varint_slow(n: int) -> bytes:
    """Past the table (off-CPU nanoseconds, times): its low groups, then the rest from the table
    (twice as fast as a byte at a time)."""
    if n < 0:
        n &= (1 << 64) - 1  # int64 negatives are ten-byte two's complement varints
    out = b""
    while n >= 16384:
        out += _CONTINUED[n & 0x7F]
        n >>= 7
    return out + SMALL_VARINTS[n]


def varint(n: int) -> bytes:
    if 0 <= n < 16384:
        return SMALL_VARINTS[n]
    return _varint_slow(n)


def varints(ids: Sequence[int]) -> bytes:
    """Non-negative values (ids, indexes) as a packed run's body: a table lookup each (no call) while
    they are small, as they are in a profile."""
    try:
        return b"".join(map(SMALL_VARINTS.__getitem__, ids))
    except IndexError:
        return b"".join(map(varint, ids))


def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


# The keys of the fields profiles use (numbers below 32), by number: varint (0) and length-delimited (2).
_VARINT_KEYS = [key(f, 0) for f in range(32)]
_BYTES_KEYS = [key(f, 2) for f in range(32)]


def uint_field(field: int, n: int) -> bytes:
    """A varint field; zero is the proto3 default and is left out."""
    if not n:
        return b""
    # Inlined key() and varint(): a profile is mostly these fields, a few calls each saved.
    tag = _VARINT_KEYS[field] if field < 32 else key(field, 0)
    return tag + (SMALL_VARINTS[n] if 0 < n < 16384 else _varint_slow(n))


def bytes_field(field: int, data: bytes) -> bytes:
    """A length-delimited field: bytes, a string's UTF-8, or an embedded message."""
    n = len(data)
    tag = _BYTES_KEYS[field] if field < 32 else key(field, 2)
    return tag + (SMALL_VARINTS[n] if n < 16384 else _varint_slow(n)) + data


def fixed64_field(field: int, n: int) -> bytes:
    return key(field, 1) + struct.pack("<Q", n & ((1 << 64) - 1)) if n else b""


def double_field(field: int, x: float) -> bytes:
    return key(field, 1) + struct.pack("<d", x)


def packed(field: int, values: Sequence[int]) -> bytes:
    if not values:
        return b""
    body = varints(values) if min(values) >= 0 else b"".join(map(varint, values))
    return key(field, 2) + varint(len(body)) + body


def clamp(n: int) -> int:
    """n, at most int64's largest: counts past it would turn negative in the decoder."""
    return min(n, INT64_MAX)


class Strings:
    """A string table whose entry 0 is "", as pprof and OTLP want: string -> index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}
        self.table: list[str] = [""]

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.table)
            self.table.append(s)
        return i

    def extend(self, strings: Iterable[str]) -> None:
        """Add the strings not in the table yet, in order: in C, not a call each."""
        index = self.index
        new = [s for s in dict.fromkeys(strings) if s not in index]
        index.update(zip_strict(new, range(len(self.table), len(self.table) + len(new))))
        self.table += new

"""Hostile inputs shared by the unit and integration attack suites: each one broke the symbolizer once."""

from __future__ import annotations

import gzip
import zlib

_B62 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _base62(n: int) -> str:
    """A v0 base-62 number: "_" is 0, otherwise n - 1 in base 62 followed by "_"."""
    if n == 0:
        return "_"
    n -= 1
    digits = ""
    while True:
        digits = _B62[n % 62] + digits
        n //= 62
        if not n:
            return digits + "_"


def rust_v0_bomb(levels: int) -> str:
    """`a::f::<((u8, u8), (u8, u8))…>`: each tuple back-references the previous one twice.

    21 levels are 206 characters and printed 25 M characters in 13 s before the budget.
    """
    body = "INvC1a1f"
    prev = len(body)
    body += "h"
    for _ in range(levels):
        start = len(body)
        body += "T" + "B" + _base62(prev) + "B" + _base62(prev) + "E"
        prev = start
    return "_R" + body + "E"


def _substitution(i: int) -> str:
    """Itanium substitution i: S_ for -1, then S0_, S1_, … in base 36."""
    if i < 0:
        return "S_"
    digits = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = ""
    while True:
        out = digits[i % 36] + out
        i //= 36
        if not i:
            return "S" + out + "_"


def cxx_bomb(levels: int) -> str:
    """`f(A, A<A, A>, A<A<A, A>, A<A, A> >, …)`: 28 levels (284 characters) made libstdc++ print 3.5 GB."""
    name = "_Z1f1A"
    for i in range(levels):
        name += "S_I" + _substitution(i - 1) + _substitution(i - 1) + "E"
    return name


def msgpack_empty_arrays_bomb(count: int = 16 << 20) -> bytes:
    """gzip of a batch whose one session list holds `count` empty arrays: 72 KiB for 16 M objects."""
    head = b"\x82\xa1v\x01\xa8sessions\xdd" + count.to_bytes(4, "big")
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(head)]
    chunk = b"\x90" * (1 << 20)
    left = count
    while left:
        n = min(left, len(chunk))
        out.append(z.compress(chunk[:n]))
        left -= n
    out.append(z.flush())
    return b"".join(out)


def kallsyms_bomb(megabytes: int = 16) -> bytes:
    """gzip of `megabytes` MiB of one kallsyms line repeated: 16 MiB took a worker to 658 MB."""
    line = b"ffffffff81000000 T x\n"
    return gzip.compress(line * ((megabytes << 20) // len(line)), compresslevel=9, mtime=0)

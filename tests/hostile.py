"""Hostile inputs shared by the unit and integration attack suites: each one broke the symbolizer once."""

from __future__ import annotations

import contextlib
import gzip
import zlib
from pathlib import Path
from typing import Any

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


def deep_session(sid: str, user_frames: int, kernel_ips: tuple[int, ...], leaf: int = 0) -> Any:
    """A session of one trace whose stack is `user_frames` raw user IPs under `kernel_ips` (leaf first)."""
    from bistouri import wire

    user = tuple(
        wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x5555_0000_0000 + 16 * (i + leaf))
        for i in range(user_frames)
    )
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger("cpu"),
        kernel=wire.KernelInfo("6.18.0-test", bytes.fromhex("6b65726e656c2d666f722d74657374732d303031")),
        start_ns=1_763_000_000 * 10**9,
        duration_ns=10**9,
        period_ns=10**7,
        service="deep",
        processes={7: "deep"},
        threads={7: "deep"},
        traces=[wire.Trace(kernel_ips, user, 7, 7, on_cpu=5)],
    )


def gunicorn_workers(master_pid: int) -> list[int]:
    """The worker processes of a gunicorn master (its children)."""
    out: list[int] = []
    for task in Path(f"/proc/{master_pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size (VmHWM) since it started."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmHWM for pid {pid}")


def msgpack_budget_filler(values: int) -> bytes:
    """gzip of a batch of one valid session whose stacks table holds empty stacks up to `values` values.

    Just under the value budget it is the most memory a request can make a worker decode.
    """
    import msgpack

    from bistouri import wire

    s = wire.session_to_wire(deep_session("filler", 0, ()))
    rows = (values - 100) // 6  # [[], []] counts 6: a table entry, the row (1 + 2), its two lists
    s["stacks"] = [[[], []]] * rows
    return gzip.compress(msgpack.packb({"v": wire.VERSION, "sessions": [s]}, use_bin_type=True), 1)

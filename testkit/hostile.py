"""Hostile inputs shared by the unit and integration attack suites: each one broke the symbolizer once."""

from __future__ import annotations

import contextlib
import gzip
import os
import zlib
from collections.abc import Sequence
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


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) the process has used: what its work cost, however loaded the host."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


# --- crafted ELF files ------------------------------------------------------------------------------

_SHT_PROGBITS, _SHT_SYMTAB, _SHT_STRTAB, _SHT_NOTE, _SHT_NOBITS = 1, 2, 3, 7, 8
_SHF_ALLOC_EXEC = 0x2 | 0x4
_TEXT_ADDR = 0x1000


def elf64(
    sections: list[dict[str, Any]], extra_headers: Sequence[tuple[int, int]] = (), extra_first: bool = False
) -> bytes:
    """A little-endian ELF64 shared object, one PT_LOAD over the whole file at address 0.

    `sections`: dicts of name, type, and optionally flags, addr, data (its bytes), size (NOBITS),
    link, align, entsize. `extra_headers`: more SHT_NOTE headers as (offset, size), all pointing into
    the file (a crafted file repeats one area), after the others or, with `extra_first`, before them."""
    import struct

    names = bytearray(b"\0")
    name_off = []
    for s in [*sections, {"name": ".shstrtab"}]:
        name_off.append(len(names))
        names += s["name"].encode() + b"\0"
    body = bytearray(b"\0" * (64 + 56))
    placed = []
    for s in sections:
        while len(body) % 8:
            body.append(0)
        placed.append(len(body))
        body += s.get("data", b"")
    shstr_off = len(body)
    body += names
    while len(body) % 8:
        body.append(0)
    shoff = len(body)
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    notes = [
        struct.pack("<IIQQQQIIQQ", 0, _SHT_NOTE, 0, 0, off, size, 0, 0, 4, 0) for off, size in extra_headers
    ]
    if extra_first:
        headers += notes
    for s, off, n_off in zip(sections, placed, name_off):
        size = s.get("size", len(s.get("data", b"")))
        headers.append(
            struct.pack(
                "<IIQQQQIIQQ",
                n_off,
                s["type"],
                s.get("flags", 0),
                s.get("addr", 0),
                off,
                size,
                s.get("link", 0),
                0,
                s.get("align", 1),
                s.get("entsize", 0),
            )
        )
    shstrndx = len(headers)
    headers.append(
        struct.pack("<IIQQQQIIQQ", name_off[-1], _SHT_STRTAB, 0, 0, shstr_off, len(names), 0, 0, 1, 0)
    )
    if not extra_first:
        headers += notes
    body += b"".join(headers)
    shnum = len(headers)
    ehdr = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    ehdr += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, shoff, 0, 64, 56, 1, 64, shnum, shstrndx)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, len(body), len(body), 0x1000)
    body[0:120] = ehdr + phdr
    return bytes(body)


def build_id_note(build_id: bytes) -> dict[str, Any]:
    import struct

    data = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
    return {"name": ".note.gnu.build-id", "type": _SHT_NOTE, "flags": 0x2, "data": data, "align": 4}


def _text(nobits: bool = False) -> dict[str, Any]:
    if nobits:
        return {
            "name": ".text",
            "type": _SHT_NOBITS,
            "flags": _SHF_ALLOC_EXEC,
            "addr": _TEXT_ADDR,
            "size": 0x1000,
        }
    return {
        "name": ".text",
        "type": _SHT_PROGBITS,
        "flags": _SHF_ALLOC_EXEC,
        "addr": _TEXT_ADDR,
        "data": b"\xc3" * 0x1000,
    }


def elf_note_bomb(copies: int, area_bytes: int, build_id: bytes | None = None) -> bytes:
    """`copies` SHT_NOTE headers over one zero-filled area of `area_bytes`, then (if given) the build id.

    A reader that walks every note section, 12 bytes a step, does copies * area_bytes / 12 steps: one
    such upload of 5.7 KB gzip'd cost a worker 33 s of CPU (N1)."""
    sections = [_text(), {"name": ".note.zero", "type": _SHT_NOTE, "data": b"\0" * area_bytes, "align": 4}]
    image = elf64(sections)  # where the area lands, to point the copies at it
    area = image.index(b"\0" * area_bytes, 0x1000 + 120)
    if build_id is not None:
        sections.append(build_id_note(build_id))
    return elf64(sections, [(area, area_bytes)] * copies, extra_first=True)


def elf_debugdata_bomb(symbols: int, build_id: bytes) -> bytes:
    """A file whose `.gnu_debugdata` (xz) holds a `.symtab` of `symbols` identical function entries.

    8 M entries are 192 MiB inflated from ~30 KB: one tuple each took a worker to 2.5 GB (N2)."""
    import lzma
    import struct

    entry = struct.pack("<IBBHQQ", 1, 0x12, 0, 1, _TEXT_ADDR, 16)  # "f", GLOBAL FUNC in section 1
    image = bytearray(
        elf64(
            [
                _text(nobits=True),
                {"name": ".symtab", "type": _SHT_SYMTAB, "link": 3, "align": 8, "entsize": 24},
                {"name": ".strtab", "type": _SHT_STRTAB, "data": b"\0f\0"},
            ]
        )
    )
    while len(image) % 8:
        image.append(0)
    # The table goes after everything else: point its header (the third) there.
    shoff = struct.unpack_from("<Q", image, 40)[0]
    struct.pack_into("<QQ", image, shoff + 2 * 64 + 24, len(image), symbols * 24)
    xz = lzma.LZMACompressor(lzma.FORMAT_XZ, preset=1)
    parts = [xz.compress(bytes(image))]
    chunk = entry * 65536
    left = symbols
    while left:
        n = min(left, 65536)
        parts.append(xz.compress(chunk[: n * 24]))
        left -= n
    parts.append(xz.flush())
    mini = b"".join(parts)
    return elf64(
        [
            _text(),
            build_id_note(build_id),
            {"name": ".gnu_debugdata", "type": _SHT_PROGBITS, "data": mini},
        ]
    )


class FleetKernel:
    """This machine's kernel as a fleet of its hosts sends it (issue 26 N8): the same text symbols
    under a KASLR slide of its own per boot. Nothing hostile, and yet it exhausted every worker."""

    BUILD_ID = bytes.fromhex("4e38" * 10)

    def __init__(self, kallsyms: Path = Path("/proc/kallsyms")) -> None:
        self.lines: list[tuple[int, bytes]] = []
        for line in kallsyms.read_bytes().splitlines():
            addr, _, rest = line.partition(b" ")
            if rest[:1] in b"tTwW" and int(addr, 16):
                self.lines.append((int(addr, 16), rest))
        self.text = next(a for a, rest in self.lines if rest == b"T _text")

    def offset(self, name: str) -> int:
        """Where a text symbol is, relative to _text."""
        return next(a for a, rest in self.lines if rest == b"T " + name.encode()) - self.text

    @staticmethod
    def boot(host: int) -> tuple[int, bytes]:
        """(slide, boot id) of the fleet's host number `host`."""
        return host << 21, bytes([host + 1]) * 16

    def snapshot(self, slide: int) -> bytes:
        """The gzip'd kallsyms a host with this slide uploads."""
        return gzip.compress(b"".join(b"%016x %s\n" % (a + slide, rest) for a, rest in self.lines), 1)

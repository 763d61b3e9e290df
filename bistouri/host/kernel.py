"""Kernel metadata for symbolization: release, build id, runtime `_text`, kallsyms.

Pure parsers take their input (bytes, or a root directory) so tests can feed
fixtures; the readers default to the live system.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ..compat import SLOTS

NT_GNU_BUILD_ID = 3


def parse_elf_notes(data: bytes) -> list[tuple[str, int, bytes]]:
    """(name, type, desc) of each note in a raw notes blob such as /sys/kernel/notes."""
    notes = []
    off = 0
    while off + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, off)
        off += 12
        name = data[off : off + namesz].rstrip(b"\0").decode(errors="replace")
        off += (namesz + 3) & ~3
        desc = data[off : off + descsz]
        off += (descsz + 3) & ~3
        notes.append((name, ntype, desc))
    return notes


def build_id_from_notes(data: bytes) -> bytes | None:
    """The GNU build id among several notes (there are Xen and Linux notes too)."""
    for name, ntype, desc in parse_elf_notes(data):
        if name == "GNU" and ntype == NT_GNU_BUILD_ID and desc:
            return desc
    return None


def parse_text_address(kallsyms: bytes) -> int | None:
    """Runtime address of `_text`; 0 means the addresses are hidden (kptr_restrict)."""
    for line in kallsyms.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == b"_text" and parts[1] in (b"T", b"t"):
            return int(parts[0], 16)
    return None


@dataclass(frozen=True, **SLOTS)
class KernelMeta:
    """This host's kernel: release, build id, `_text` address and boot id."""

    release: str
    build_id: bytes  # empty when /sys/kernel/notes has none
    text_addr: int  # 0 when hidden
    boot_id: bytes = b""  # /proc/sys/kernel/random/boot_id, 16 bytes; empty when unreadable

    @property
    def build_id_hex(self) -> str:
        return self.build_id.hex()


def read_kernel_meta(sys_root: str = "/sys", proc_root: str = "/proc") -> KernelMeta:
    """Never fatal (the original aborted): missing pieces are left empty and reported by preflight."""
    try:
        build_id = build_id_from_notes(_read(f"{sys_root}/kernel/notes")) or b""
    except OSError:
        build_id = b""
    try:
        text = parse_text_address(_read(f"{proc_root}/kallsyms")) or 0
    except OSError:
        text = 0
    try:
        boot_id = bytes.fromhex(
            _read(f"{proc_root}/sys/kernel/random/boot_id").decode().strip().replace("-", "")
        )
    except (OSError, ValueError):
        boot_id = b""
    return KernelMeta(
        release=os.uname().release,
        build_id=build_id,
        text_addr=text,
        boot_id=boot_id if len(boot_id) == 16 else b"",
    )


def read_kallsyms(proc_root: str = "/proc") -> bytes:
    """A snapshot of /proc/kallsyms, to send to the symbolizer once per kernel build id."""
    return _read(f"{proc_root}/kallsyms")


def _read(path: str) -> bytes:
    # Not pathlib: it imports urllib.parse and ipaddress, ~3.5 ms of record's start.
    with open(path, "rb") as f:
        return f.read()

"""The order in which the unwind builder builds and publishes a process's tables."""

from __future__ import annotations

from bistouri.host.procmaps import MappedPath
from bistouri.unwind.tables import _PY_TRAMPOLINE_KEY, _build_order


def _mapping(start: int, size: int, name: str, key: bytes):
    return ((start, start + size), 0, MappedPath("/proc/1", f"{start:x}-{start + size:x}", name), key)


def test_the_executable_and_libc_first_then_the_smallest_code_first() -> None:
    """Every stack of a C program crosses the executable and libc to its entry; a large
    binary's table takes seconds: the small files' are published meanwhile."""
    exe = _mapping(0x55_0000_0000, 30 << 20, "/usr/lib/gcc/cc1plus", b"exe")
    big = _mapping(0x7F_0000_0000, 3 << 20, "/usr/lib/libisl.so.23", b"isl")
    small = _mapping(0x7F_1000_0000, 64 << 10, "/usr/lib/libz.so.1", b"z")
    libc = _mapping(0x7F_2000_0000, 1 << 20, "/usr/lib/x86_64-linux-gnu/libc.so.6", b"libc")
    ld = _mapping(0x7F_3000_0000, 128 << 10, "/usr/lib/ld-linux-x86-64.so.2", b"ld")
    trampoline = ((0x7F_4000_0000, 0x7F_4000_1000), 0, None, _PY_TRAMPOLINE_KEY)
    got = _build_order([exe, big, small, libc, ld, trampoline])
    assert [m[3] for m in got] == [b"libc", b"exe", _PY_TRAMPOLINE_KEY, b"z", b"ld", b"isl"]
    assert _build_order([]) == []

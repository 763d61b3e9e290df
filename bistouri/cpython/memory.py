"""Reading a live process's memory without trusting a byte of it.

`/proc/PID/mem` is opened once (it needs what ptrace-read needs: root or CAP_SYS_PTRACE, the agent's
case) and read with `pread`: no ptrace stop, nothing written. Every read is bounded (`MAX_READ`), and every
object decoded from it (a `str`, a `bytes`) is checked against its own bounds and its type's address before
its content is believed. A failed read (unmapped, the process gone) is `MemoryReadError`.
"""

from __future__ import annotations

import os
import struct

from ..errors import BistouriError

MAX_READ = 1 << 20  # one read; a line table or a bytecode larger than this is not read
MAX_NAME = 4096  # characters of a name or a file name (CPython has no limit; we keep this many)

_PAGE = 4096
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")

# PyASCIIObject.state (str): kind in bits 2-4, compact bit 5, ascii bit 6, on every version 3.8-3.13.
_STATE_KIND_SHIFT = 2
_STATE_COMPACT = 1 << 5
_STATE_ASCII = 1 << 6
_OB_TYPE = 8
_STR_LENGTH = 16
_STR_STATE = 32
_BYTES_SIZE = 16
_BYTES_DATA = 32


class MemoryReadError(BistouriError):
    """An address of the process that could not be read, or what it holds is not what was expected."""


class ProcessMemory:
    """Bounded reads of one process's memory. Use as a context manager, or call close()."""

    def __init__(self, pid: int, proc_root: str = "/proc") -> None:
        self.pid = pid
        self._fd = os.open(f"{proc_root}/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, addr: int, size: int) -> bytes:
        """Exactly `size` bytes at `addr`, or MemoryReadError."""
        if size < 0 or size > MAX_READ:
            raise MemoryReadError(f"read of {size} bytes at {addr:#x}: over the bound of {MAX_READ}")
        if addr <= 0 or addr + size > 1 << 47:
            raise MemoryReadError(f"{addr:#x} is not a user address")
        try:
            data = os.pread(self._fd, size, addr)
        except OSError as e:  # EIO: unmapped; ESRCH: gone
            why = e.strerror
            raise MemoryReadError(f"pid {self.pid}: cannot read {size} bytes at {addr:#x}: {why}") from e
        if len(data) != size:
            raise MemoryReadError(f"pid {self.pid}: short read of {len(data)}/{size} bytes at {addr:#x}")
        return data

    def read_prefix(self, addr: int, size: int) -> bytes:
        """Up to `size` bytes at `addr`: those of the pages that can be read, from the first (b"" when
        none can)."""
        out = b""
        while len(out) < size:
            at = addr + len(out)
            chunk = min(size - len(out), _PAGE - at % _PAGE)
            try:
                out += self.read(at, chunk)
            except MemoryReadError:
                break
        return out

    def u64(self, addr: int) -> int:
        return int(_U64.unpack(self.read(addr, 8))[0])

    def u32(self, addr: int) -> int:
        return int(_U32.unpack(self.read(addr, 4))[0])

    def check_type(self, obj: int, type_addr: int, what: str) -> None:
        """That the object at `obj` has `ob_type == type_addr` (0: not checked)."""
        if type_addr and self.u64(obj + _OB_TYPE) != type_addr:
            raise MemoryReadError(f"{obj:#x} is not a {what}")

    def str_object(self, obj: int, *, ascii_data: int, data: int, type_addr: int = 0) -> str:
        """A compact `str` at `obj` (the only kind CPython makes for names and file names), at most
        MAX_NAME characters of it. `ascii_data`/`data` are the version's offsets of the characters."""
        head = self.read(obj, _STR_STATE + 4)
        if type_addr and _U64.unpack_from(head, _OB_TYPE)[0] != type_addr:
            raise MemoryReadError(f"{obj:#x} is not a str")
        length = _I64.unpack_from(head, _STR_LENGTH)[0]
        state = _U32.unpack_from(head, _STR_STATE)[0]
        if length < 0 or not state & _STATE_COMPACT:
            raise MemoryReadError(f"{obj:#x}: not a compact str (length {length}, state {state:#x})")
        length = min(length, MAX_NAME)
        if state & _STATE_ASCII:
            return self.read(obj + ascii_data, length).decode("ascii", "replace")
        kind = (state >> _STATE_KIND_SHIFT) & 7
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}.get(kind)
        if codec is None:
            raise MemoryReadError(f"{obj:#x}: str of kind {kind}")
        return self.read(obj + data, length * kind).decode(codec, "replace")

    def bytes_object(self, obj: int, *, max_size: int = MAX_READ, type_addr: int = 0) -> bytes:
        """The content of a `bytes` at `obj`; MemoryReadError past `max_size`."""
        head = self.read(obj, _BYTES_DATA)
        if type_addr and _U64.unpack_from(head, _OB_TYPE)[0] != type_addr:
            raise MemoryReadError(f"{obj:#x} is not a bytes")
        size = _I64.unpack_from(head, _BYTES_SIZE)[0]
        if size < 0 or size > max_size:
            raise MemoryReadError(f"{obj:#x}: bytes of {size} bytes, over the bound of {max_size}")
        return self.read(obj + _BYTES_DATA, size)

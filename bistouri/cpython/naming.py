"""Code objects named: (code address, checksum) from a sample -> qualified name, file, lines.

A sample names a code object by its address. By the time user space reads it, that object may be freed
and its address given to another: the checksum BPF took at the sample (`layouts.checksum` of fields fixed
for a code object's life) tells them apart. A code object is read once (bounded) and kept under
(address, checksum) only when what is read now has the sample's checksum; a frame whose checksum no longer
matches is named `FREED` (its code was freed before it was read), never with another function's name.
Checksum 0 (BPF could not read the object: paged out) is read now, and named but not kept.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from ..compat import SLOTS
from .discover import Interpreter
from .layouts import STR_HASH, checksum
from .linetable import LineTable, kind_for
from .memory import MemoryReadError, ProcessMemory

MAX_LINETABLE = 256 << 10  # bytes of one line table (CPython's largest stdlib one is ~20 KiB)
MAX_CODES = 8192  # code objects kept per process, least recently used out first


@dataclass(frozen=True, **SLOTS)
class CodeName:
    """What a Python frame is named by: qualified name (3.11+; the name before), file, lines."""

    name: str
    filename: str
    firstlineno: int
    lines: LineTable

    def line(self, offset: int | None) -> int | None:
        """The line of the instruction `offset` code units in (None: unknown offset, the first line)."""
        return self.lines.line(offset)


UNKNOWN = CodeName("<unknown code>", "", 0, LineTable(kind_for((3, 11)), b"", 0))
FREED = CodeName("<freed code>", "", 0, LineTable(kind_for((3, 11)), b"", 0))


class CodeNamer:
    """Names the code objects of one interpreter process; owns its memory reader (`close()`)."""

    def __init__(self, interp: Interpreter, proc_root: str = "/proc") -> None:
        self.interp = interp
        self._mem = ProcessMemory(interp.pid, proc_root)
        self._codes: OrderedDict[tuple[int, int], CodeName] = OrderedDict()
        self.reads = 0  # code objects read (cache misses), for tests and stats
        self.freed = 0  # frames named FREED

    def close(self) -> None:
        self._mem.close()

    def __enter__(self) -> CodeNamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def name(self, code: int, want: int) -> CodeName:
        """The code object at `code` that had checksum `want` at the sample (0: unknown)."""
        key = (code, want)
        hit = self._codes.get(key)
        if hit is not None:
            self._codes.move_to_end(key)
            return hit
        try:
            named, have = self._read(code)
        except MemoryReadError:
            return UNKNOWN
        if want and have != want:
            self.freed += 1
            return FREED
        if want:
            self._codes[key] = named
            if len(self._codes) > MAX_CODES:
                self._codes.popitem(last=False)
        return named

    def checksum(self, code: int) -> int:
        """The checksum of the code object at `code` now (what BPF computes at a sample); 0 when it
        cannot be read."""
        try:
            return self._read(code)[1]
        except MemoryReadError:
            return 0

    def _read(self, code: int) -> tuple[CodeName, int]:
        """The code object at `code`, named, with its checksum now."""
        lay, interp, mem = self.interp.layout, self.interp, self._mem
        self.reads += 1
        head = mem.read(code, lay.code_read_size)
        if interp.code_type and struct.unpack_from("<Q", head, 8)[0] != interp.code_type:
            raise MemoryReadError(f"{code:#x} is not a code object")

        def ptr(off: int) -> int:
            return int(struct.unpack_from("<Q", head, off)[0])

        firstlineno = struct.unpack_from("<i", head, lay.code_firstlineno)[0]
        filename, name, table = ptr(lay.code_filename), ptr(lay.code_name), ptr(lay.code_linetable)
        version = struct.unpack_from("<I", head, lay.code_version)[0] if lay.code_version >= 0 else 0
        have = checksum(filename, name, table, firstlineno, version or mem.u64(name + STR_HASH))

        def text(obj: int) -> str:
            return mem.str_object(
                obj, ascii_data=lay.str_ascii_data, data=lay.str_data, type_addr=interp.str_type
            )

        qualname = ptr(lay.code_qualname) if lay.code_qualname >= 0 else name
        lines = mem.bytes_object(table, max_size=MAX_LINETABLE, type_addr=interp.bytes_type)
        named = CodeName(
            name=text(qualname),
            filename=text(filename),
            firstlineno=firstlineno,
            lines=LineTable(kind_for(lay.version), lines, firstlineno),
        )
        return named, have

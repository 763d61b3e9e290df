"""record's llvm-symbolizer pool, asked only what the in-process DWARF reader cannot answer.

llvm-symbolizer indexes a binary's whole DWARF to answer one address: ~70 MB and ~1 s on pyenv's
libpython, two such processes at once when two binaries miss, for the few dozen addresses a
`record` samples. `symbolizer/dwarf.py` reads only the compile units that hold them, from the
mapped file, and gives the same frames. The resolver takes this pool where it takes an
`LlvmPool` (the service keeps its own); llvm-symbolizer starts only for what the reader leaves
(split DWARF, DWARF before 4, dwz, zstd, a file over a bound), so most runs start none.

With the symbol cache, the line rows of each unit read and the ranges of its outermost
subroutines are kept (record/linefile.py): a later run's new address in a unit met before costs
the walk of its own function's DIEs, not the unit's line program and DIE walk again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..compat import zip_strict
from ..elf import ElfFile, ElfFormatError
from ..symbolizer.llvm import LlvmPool, SourceFrame

if TYPE_CHECKING:
    from ..symbolizer.dwarflines import LineTable
    from .symcache import SymbolCache


class CachedLines:
    """The DWARF reader's `UnitStore` for one DWARF file, in record's symbol cache: the file's
    build id and size (a debug file installed later is another file) name its units' files."""

    def __init__(self, cache: SymbolCache, prefix: str) -> None:
        self.cache = cache
        self.prefix = prefix
        self.hits = 0

    @classmethod
    def of(cls, cache: SymbolCache, path: str) -> CachedLines | None:
        """None for a file without a build id."""
        try:
            with ElfFile(path) as elf:
                build_id, size = elf.build_id, elf.size
        except (ElfFormatError, OSError):
            return None
        return cls(cache, f"{build_id.hex()}-{size:x}") if build_id else None

    def get(self, offset: int) -> LineTable | None:
        table = self.cache.line_table(f"{self.prefix}-{offset:x}.lines")
        self.hits += table is not None
        return table

    def put(self, offset: int, table: LineTable) -> None:
        self.cache.put_line_table(f"{self.prefix}-{offset:x}.lines", table)

    def outer(self, unit: int) -> list[tuple[int, int, int, int]] | None:
        got = self.cache.outer(f"{self.prefix}-u{unit:x}.outer")
        self.hits += got is not None
        return got

    def put_outer(self, unit: int, outer: list[tuple[int, int, int, int]]) -> None:
        self.cache.put_outer(f"{self.prefix}-u{unit:x}.outer", outer)

    def section(self, name: str) -> memoryview | None:
        return self.cache.section(f"{self.prefix}-{name.lstrip('.')}.inflated")

    def put_section(self, name: str, data: memoryview) -> None:
        self.cache.put_section(f"{self.prefix}-{name.lstrip('.')}.inflated", data)


class DwarfFirstPool(LlvmPool):
    """An `LlvmPool` (lazy) whose `symbolize` reads DWARF in process first."""

    def __init__(self, cache: SymbolCache | None = None, **kwargs: object) -> None:
        super().__init__(lazy=True, **kwargs)  # type: ignore[arg-type]
        self.cache = cache  # where units' line tables are kept between runs
        self.cached_units = 0  # units whose line rows came from it
        self.in_process = 0  # addresses answered without llvm-symbolizer
        self.through_llvm = 0

    @property
    def available(self) -> bool:
        """File:line and inlines can be given: the reader needs no llvm-symbolizer."""
        return True

    def symbolize(self, path: str, addrs: Sequence[int]) -> list[list[SourceFrame] | None]:
        # Here, not at import: a run whose binaries have no DWARF (Debian's python3.11) needs no
        # DWARF reader (~2 ms of its start).
        from ..symbolizer import dwarf

        lines = CachedLines.of(self.cache, path) if self.cache is not None else None
        got = dwarf.symbolize(path, addrs, lines)
        self.cached_units += lines.hits if lines is not None else 0
        left = [i for i, frames in enumerate(got) if frames is None]
        self.in_process += len(addrs) - len(left)
        if left and LlvmPool.available.fget(self):  # type: ignore[attr-defined]
            self.through_llvm += len(left)
            for i, frames in zip_strict(left, super().symbolize(path, [addrs[i] for i in left])):
                got[i] = frames
        return got

"""record's llvm-symbolizer pool, asked only what the in-process DWARF reader cannot answer.

llvm-symbolizer indexes a binary's whole DWARF to answer one address: ~70 MB and ~1 s on pyenv's
libpython, two such processes at once when two binaries miss, for the few dozen addresses a
`record` samples. `symbolizer/dwarf.py` reads only the compile units that hold them, from the
mapped file, and gives the same frames. The resolver takes this pool where it takes an
`LlvmPool` (the service keeps its own); llvm-symbolizer starts only for what the reader leaves
(split DWARF, DWARF before 4, dwz, zstd, a file over a bound), so most runs start none.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..symbolizer import dwarf
from ..symbolizer.llvm import LlvmPool, SourceFrame


class DwarfFirstPool(LlvmPool):
    """An `LlvmPool` (lazy) whose `symbolize` reads DWARF in process first."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(lazy=True, **kwargs)  # type: ignore[arg-type]
        self.in_process = 0  # addresses answered without llvm-symbolizer
        self.through_llvm = 0

    @property
    def available(self) -> bool:
        """File:line and inlines can be given: the reader needs no llvm-symbolizer."""
        return True

    def symbolize(self, path: str, addrs: Sequence[int]) -> list[list[SourceFrame] | None]:
        got = dwarf.symbolize(path, addrs)
        left = [i for i, frames in enumerate(got) if frames is None]
        self.in_process += len(addrs) - len(left)
        if left and LlvmPool.available.fget(self):  # type: ignore[attr-defined]
            self.through_llvm += len(left)
            for i, frames in zip(left, super().symbolize(path, [addrs[i] for i in left]), strict=True):
                got[i] = frames
        return got

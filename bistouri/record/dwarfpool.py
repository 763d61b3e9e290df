"""record's llvm-symbolizer pool, asked only what the in-process DWARF reader cannot answer.

llvm-symbolizer indexes a binary's whole DWARF to answer one address: ~70 MB and ~1 s on pyenv's
libpython, two such processes at once when two binaries miss, for the few dozen addresses a
`record` samples. `symbolizer/dwarf.py` reads only the compile units that hold them, from the
mapped file, and gives the same frames. The resolver takes this pool where it takes an
`LlvmPool` (the service keeps its own); llvm-symbolizer starts only for what the reader leaves
(split DWARF, DWARF before 4, dwz, zstd, a file over a bound), so most runs start none.

With the symbol cache, the reader's answers are kept by address range for every function a run
sampled (`DwarfFile.spans`, record/spanfile.py): a later run's new address in one of them is
answered from the cache, and the DWARF file (its units, libc's compressed sections) is not opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..elf import ElfFile, ElfFormatError
from ..symbolizer import dwarf
from ..symbolizer.llvm import LlvmPool, SourceFrame
from .symfile import CorruptFile

if TYPE_CHECKING:
    from .symcache import SymbolCache


def spans_key(path: str) -> str | None:
    """The cache key of a DWARF file's spans: its build id and size (a debug file installed later
    is another file); None without a build id."""
    try:
        with ElfFile(path) as elf:
            build_id = elf.build_id
            size = elf.size
    except (ElfFormatError, OSError):
        return None
    return f"{build_id.hex()}-{size:x}" if build_id else None


class DwarfFirstPool(LlvmPool):
    """An `LlvmPool` (lazy) whose `symbolize` reads DWARF in process first (from the cache's spans
    when `cache` is given)."""

    def __init__(self, cache: SymbolCache | None = None, **kwargs: object) -> None:
        super().__init__(lazy=True, **kwargs)  # type: ignore[arg-type]
        self.cache = cache
        self.in_process = 0  # addresses answered without llvm-symbolizer
        self.from_spans = 0  # of which from the cache's spans, without opening the DWARF file
        self.through_llvm = 0

    @property
    def available(self) -> bool:
        """File:line and inlines can be given: the reader needs no llvm-symbolizer."""
        return True

    def symbolize(self, path: str, addrs: Sequence[int]) -> list[list[SourceFrame] | None]:
        key = spans_key(path) if self.cache is not None else None
        got: list[list[SourceFrame] | None] = [None] * len(addrs)
        if key is not None:
            got = self._from_spans(key, addrs)
        todo = [i for i, frames in enumerate(got) if frames is None]
        self.from_spans += len(addrs) - len(todo)
        if todo:
            wanted = [addrs[i] for i in todo]
            if key is not None:
                answers, spans = dwarf.symbolize_spans(path, wanted)
                if spans:
                    assert self.cache is not None
                    self.cache.add_spans(key, spans)
            else:
                answers = dwarf.symbolize(path, wanted)
            for i, frames in zip(todo, answers, strict=True):
                got[i] = frames
        left = [i for i, frames in enumerate(got) if frames is None]
        self.in_process += len(addrs) - len(left)
        if left and LlvmPool.available.fget(self):  # type: ignore[attr-defined]
            self.through_llvm += len(left)
            for i, frames in zip(left, super().symbolize(path, [addrs[i] for i in left]), strict=True):
                got[i] = frames
        return got

    def _from_spans(self, key: str, addrs: Sequence[int]) -> list[list[SourceFrame] | None]:
        assert self.cache is not None
        table = self.cache.spans(key)
        if table is None:
            return [None] * len(addrs)
        try:
            return [table.get(a) for a in addrs]
        except CorruptFile as e:
            self.cache.discard(key + ".spans", e)
            return [None] * len(addrs)
        finally:
            table.close()

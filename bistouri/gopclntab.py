"""Go's own line table (`.gopclntab`): function names, file:line and inlined calls, with no DWARF.

Every Go binary keeps it, stripped (`-ldflags "-s -w"`) or not: the runtime needs it for tracebacks.
Layouts of Go 1.16 and later, told apart by the header's magic (the facts come from the Go runtime's
`symtab.go` and `runtime2.go`; this is our own reader):

| magic | Go | header (after 8 bytes) | function table entry | `_func` |
|---|---|---|---|---|
| 0xfffffffa | 1.16, 1.17 | nfunc, nfiles, 5 offsets | (entry PC, func off), u64 | 8-byte entry PC |
| 0xfffffff0 | 1.18, 1.19 | nfunc, nfiles, textStart, 5 offsets | (entry - textStart, off), u32 | 40 bytes |
| 0xfffffff1 | 1.20 and later | same | same | 44: a start line before funcID |

The offsets (function names, compilation-unit file indexes, file names, pc-value tables, function
table) are from the header. A pc-value table is a run of (value delta, pc delta) varints. Inlined
calls are found through the function's pcdata 2 (index in its inline tree) and funcdata 3 (the tree);
the tree is outside the pclntab (`go:func.*`), located from 1.18 on through `runtime.firstmoduledata`,
found by the pointers it holds to the pclntab. Without it (a PIE whose pointers are relocations) frames
keep their function's name and line, without inlined callers.

Files are untrusted (uploads, any watched process): every offset is checked against what holds it,
varint runs and inline chains are bounded, and nothing is read past a bound (`MAX_*`).
"""

from __future__ import annotations

import bisect
import struct
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

from .compat import SLOTS
from .elf import SHT_NOBITS, ElfFile, ElfFormatError, Section, SymbolIndex

MAGIC_116 = 0xFFFFFFFA
MAGIC_118 = 0xFFFFFFF0
MAGIC_120 = 0xFFFFFFF1
_MAGICS = {MAGIC_116: (1, 16), MAGIC_118: (1, 18), MAGIC_120: (1, 20)}

MAX_PCLNTAB_BYTES = 512 << 20  # Debian's prometheus (50 MB) has 13 MB
MAX_FUNCS = 2_000_000  # functions read from the table (kubelet has ~90 000)
MAX_NAME_BYTES = 1024  # a longer function or file name is cut
MAX_PCVALUE_STEPS = 1 << 16  # (value, pc) steps decoded of one table
MAX_INLINE_DEPTH = 64  # inlined calls unfolded for one address
MAX_MODULEDATA_SCAN = 64 << 20  # bytes of a data section searched for runtime.firstmoduledata
MAX_INLINE_ENTRIES = 1 << 20  # entries of one function's inline tree
# What lookups keep decoded, per binary: runs of pc-value tables (~69 bytes each with the records:
# two ints in a tuple; an array's were 25) and functions' records (~0.3 KB each, a name included).
# Past either bound, all of it is dropped (only speed is lost; a batch's addresses are looked up in
# address order, so within one batch nothing is decoded twice): at most ~40 MiB a binary whatever
# its tables hold (prometheus' have 1.1 M runs; cmd/go's 50 000 distinct addresses touch 374 000,
# which 2^18 did not hold: a second batch decoded them again, its lookups 2.5x slower).
# Answers are the caller's to keep (`key`).
MAX_HELD_RUNS = 1 << 19
MAX_HELD_FUNCS = 1 << 14
_BUCKET_SHIFT = 12  # PCs of 4 KiB a bucket of the function search (`_first`)

FLAG_TOPFRAME = 1  # funcFlag of Go 1.18 on (runtime/symtab.go)
FLAG_SPWRITE = 2
# Go 1.16 has no flags: its outermost frames by name. (Its SP writers go unmarked.)
_FLAGS_116 = {
    "runtime.goexit": FLAG_TOPFRAME,
    "runtime.mstart": FLAG_TOPFRAME,
    "runtime.rt0_go": FLAG_TOPFRAME,
}

T = TypeVar("T")

_PCDATA_INLTREE_INDEX = 2
_FUNCDATA_INLTREE = 3
_NO_FUNCDATA = 0xFFFFFFFF


class GoPclnError(ValueError):
    """The table is not one this reader understands, or it is damaged."""


class GoFrame(NamedTuple):
    """One frame of an address, innermost first in a list (as llvm.SourceFrame). A tuple: chains
    of them are dictionary keys (the resolver's answer per chain)."""

    function: str
    file: str
    line: int


def _go_frame(function: str, file: str, line: int, _inlined: bool) -> GoFrame:
    return GoFrame(function, file, line)


# A function's record, read once for all the lookups in it: a tuple (entry, name, CU, where its
# inline tree is or -1, runs, then lo, hi, vo of its file, line and inline-index tables). `runs` is
# one tuple holding each table decoded whole: its run starts at [lo, hi), where it ends at [hi], the
# runs' values from [lo + vo]; a table that is missing or damaged from its first run has lo == hi.
# Two tuples of ints and a str a function, which the collector stops tracking at its first look
# (an array of runs stayed tracked: two objects a function in every full collection, 16 600 on
# cmd/go's distinct addresses), and whose ints are read without boxing. ~2.7x an array's memory.
_Func = tuple[int, str, int, int, tuple[int, ...], int, int, int, int, int, int, int, int, int]
_NO_TABLE = (0, 0, 0)
_NO_RUNS: tuple[int, ...] = ()
# What the frames of one inlined call site hold whatever the line (GoPclnTab._chain): the function
# called, its callers' frames, whether they all have names.
_Chain = tuple[str, tuple[tuple[str, str, int, bool], ...], bool]


class GoPclnTab:
    """A copy of one binary's pclntab (and the inline trees it points to), looked up by address."""

    __slots__ = (
        "_chains",
        "_cutab",
        "_data",
        "_entries",
        "_files",
        "_filetab",
        "_first",
        "_ftab",
        "_funcdata_base",
        "_funcnames",
        "_funcs",
        "_held",
        "_inl",
        "_lock",
        "_nfunc",
        "_pcln",
        "_pctab",
        "_quantum",
        "_shift",
        "_text_start",
        "version",
    )

    def __init__(self, data: bytes, text_start: int = 0, inline: InlineTrees | None = None) -> None:
        """`data` starts at the header; `text_start`, the address of .text, stands in for a header's
        zero (a PIE's is a relocation); `inline` holds the bytes the inline trees live in."""
        if len(data) < 64:
            raise GoPclnError("too short for a header")
        magic, pad1, pad2, quantum, ptrsize = struct.unpack_from("<IBBBB", data, 0)
        if magic not in _MAGICS or pad1 or pad2 or ptrsize != 8 or quantum not in (1, 2, 4):
            raise GoPclnError(f"unknown header (magic 0x{magic:x}, pointer size {ptrsize})")
        self.version = _MAGICS[magic]
        self._data = data
        self._quantum = quantum
        if magic == MAGIC_116:
            nfunc, _nfiles, names, cu, files, pctab, pcln = struct.unpack_from("<7Q", data, 8)
            self._text_start = 0
        else:
            nfunc, _nfiles, text, names, cu, files, pctab, pcln = struct.unpack_from("<8Q", data, 8)
            self._text_start = text or text_start
        size = len(data)
        for off in (names, cu, files, pctab, pcln):
            if not 0 < off < size:
                raise GoPclnError(f"offset 0x{off:x} past the table (0x{size:x})")
        if nfunc > MAX_FUNCS:
            raise GoPclnError(f"{nfunc} functions, more than {MAX_FUNCS}")
        self._nfunc = nfunc
        self._funcnames = names
        self._cutab = cu
        self._filetab = files
        self._pctab = pctab
        self._pcln = pcln
        self._ftab = pcln  # the function table opens the pcln area
        self._inl = inline
        # Kept between lookups (bounded by MAX_HELD_*, dropped whole): each function's record and
        # tables, file names by CU slot.
        self._funcs: dict[int, _Func] = {}
        self._chains: dict[int, _Chain] = {}  # by function index | inline index << 21
        self._files: dict[int, str] = {}
        self._held = 0  # runs decoded into self._funcs' records
        # Lookups may be concurrent: a record is built whole and never changed (two threads may
        # build the same one: the last is kept); the lock guards the count and the drop.
        self._lock = threading.Lock()
        self._funcdata_base = inline.gofunc if inline is not None else 0
        # Entry PCs (nfunc + 1: the last is the end of the last function), in an array for bisect.
        entsize = 16 if magic == MAGIC_116 else 8
        if pcln + (nfunc + 1) * entsize > size:
            raise GoPclnError("function table past the end")
        if magic == MAGIC_116:
            pairs = array("Q", data[pcln : pcln + (nfunc + 1) * 16])
            entries = pairs[0::2]
        else:
            pairs32 = array("I", data[pcln : pcln + (nfunc + 1) * 8])
            base = self._text_start
            entries = array("Q", (base + e for e in pairs32[0::2]))
        if any(entries[i] > entries[i + 1] for i in range(len(entries) - 1)):
            raise GoPclnError("function table not sorted")
        self._entries = entries
        # Where a PC's search starts and ends (Go's own findfunctab, ours): bucket b (PCs from
        # entries[0] + b << shift) opens in function _first[b], so a PC's function is among
        # _first[b] .. _first[b + 1], a few: a search of the whole table was a tenth of a lookup.
        # Buckets of 4 KiB, wider when the table spans far more than its functions (at most one a
        # function and 1024, whatever a damaged table says).
        span = entries[-1] - entries[0]
        shift = _BUCKET_SHIFT
        while span >> shift > nfunc + 1024:
            shift += 1
        self._shift = shift
        self._first = array(
            "I",
            (bisect.bisect_right(entries, entries[0] + (b << shift)) - 1 for b in range((span >> shift) + 2)),
        )

    @property
    def nbytes(self) -> int:
        held = len(self._data) + self._entries.itemsize * len(self._entries) + 4 * len(self._first)
        return held + (len(self._inl.data) if self._inl is not None else 0) + 200

    def __len__(self) -> int:
        return self._nfunc

    # --- reading ---------------------------------------------------------------

    def _u32(self, off: int) -> int:
        if not 0 <= off <= len(self._data) - 4:
            raise GoPclnError(f"read at 0x{off:x} past the table")
        return int(struct.unpack_from("<I", self._data, off)[0])

    def _cstr(self, off: int) -> str:
        data = self._data
        if not 0 <= off < len(data):
            return ""
        end = data.find(b"\0", off, off + MAX_NAME_BYTES)
        return data[off : end if end >= 0 else min(len(data), off + MAX_NAME_BYTES)].decode(
            "utf-8", "replace"
        )

    def _func(self, i: int) -> int:
        """Offset of function i's `_func` in the table."""
        if self.version == (1, 16):
            foff = struct.unpack_from("<Q", self._data, self._ftab + i * 16 + 8)[0]
        else:
            foff = self._u32(self._ftab + i * 8 + 4)
        off = self._pcln + foff
        if not 0 < off <= len(self._data) - (40 if self.version == (1, 18) else 44):
            raise GoPclnError(f"function {i} at 0x{off:x} past the table")
        return int(off)

    def frame_rules(
        self, max_spans: int = MAX_PCVALUE_STEPS
    ) -> Iterator[tuple[int, int, int, list[tuple[int, int]]]]:
        """(start, end, flags, [(pc, SP delta from the entry), ...]) of every function, in address order:
        the unwinder's rules (the stack pointer table, `pcsp`; Go's own traceback reads it so).
        `flags` has FLAG_TOPFRAME (the outermost frame: runtime.goexit, mstart, rt0_go) and
        FLAG_SPWRITE (writes SP: stack switches, where only the frame pointer can go on)."""
        for i in range(self._nfunc):
            start, end = self._entries[i], self._entries[i + 1]
            try:
                fo = self._func(i)
                nameoff, _pcfile, _pcln, _npcdata, _cu, _nfd, fixed, entry = self._fields(fo)
                if self.version == (1, 16):
                    name = self._funcname(nameoff)
                    flags = _FLAGS_116.get(name, 0)
                else:
                    flags = self._data[fo + fixed - 3]  # `flag`, after funcID
                pcsp = self._u32(fo + (20 if self.version == (1, 16) else 16))
                spans = list(self._pcvalues(pcsp, entry, end, max_spans))
            except (GoPclnError, struct.error):
                continue
            yield start, end, flags, spans

    def _pcvalues(self, table: int, entry: int, end: int, max_steps: int) -> Iterator[tuple[int, int]]:
        """(pc, value) at each change of a pc-value table, from the entry up to `end`."""
        if not table:
            return
        for step, (pc, val, _nxt) in enumerate(self._runs(table, entry)):
            if pc >= end or step >= max_steps:
                return
            yield pc, val

    def _fields(self, fo: int) -> tuple[int, int, int, int, int, int, int, int]:
        """(nameoff, pcfile, pcln, npcdata, cu, nfuncdata, fixed size, entry PC) of the `_func` at `fo`.

        1.16 opens with an 8-byte entry PC, 1.18 with a 4-byte offset from textStart; 1.20 adds a
        start line after the CU offset. nfuncdata is the last byte of the fixed part."""
        d = self._data
        if self.version == (1, 16):
            entry, nameoff = struct.unpack_from("<Qi", d, fo)
            rest = fo + 12
        else:
            entry_off, nameoff = struct.unpack_from("<Ii", d, fo)
            entry = entry_off + self._text_start
            rest = fo + 8
        _args, _defer, _pcsp, pcfile, pcln, npcdata, cu = struct.unpack_from("<7I", d, rest)
        fixed = 40 if self.version == (1, 18) else 44
        return nameoff, pcfile, pcln, npcdata, cu, d[fo + fixed - 1], fixed, entry

    def _index(self, pc: int) -> int | None:
        entries = self._entries
        b = (pc - entries[0]) >> self._shift
        if pc < entries[0] or b + 1 >= len(self._first):
            return None
        i = bisect.bisect_right(entries, pc, self._first[b], self._first[b + 1] + 1) - 1
        if i >= self._nfunc or pc >= entries[i + 1]:
            return None
        return i

    def _pcvalue(self, table: int, entry: int, pc: int) -> int | None:
        """The value of a table at `pc`, decoded from the entry and not kept (tests: the reference)."""
        if not table:
            return None
        runs: list[int] = []
        lo, hi, vo = _decode(self._data, self._pctab + table, entry, self._quantum, runs)
        return _run_value(runs, lo, hi, vo, pc)

    def _runs(self, table: int, entry: int) -> Iterator[tuple[int, int, int]]:
        """(start, value, end) of each run of a pc-value table, at most MAX_PCVALUE_STEPS."""
        d = self._data
        pos = self._pctab + table
        end = len(d)
        val = -1
        cur = entry
        for step in range(MAX_PCVALUE_STEPS):
            uv, pos = _uvarint(d, pos, end)
            if uv == 0 and step:
                return
            val += -((uv >> 1) + 1) if uv & 1 else uv >> 1
            delta, pos = _uvarint(d, pos, end)
            yield cur, val, cur + delta * self._quantum
            cur += delta * self._quantum

    def _file(self, cu: int, fileno: int | None) -> str:
        """A file name, "" when unknown (no value at this PC: alignment padding past the code)."""
        if fileno is None or fileno < 0:
            return ""
        slot = cu + fileno
        got = self._files.get(slot)
        if got is None:
            off = self._u32(self._cutab + slot * 4)
            got = "" if off == 0xFFFFFFFF else self._cstr(self._filetab + off)
            if len(self._files) < MAX_HELD_FUNCS:
                self._files[slot] = got
        return got

    def _funcname(self, nameoff: int) -> str:
        return self._cstr(self._funcnames + nameoff) if nameoff >= 0 else ""

    # --- lookups ---------------------------------------------------------------

    def function(self, pc: int) -> tuple[str, int] | None:
        """(name, offset in the function) of the function holding `pc`, or None."""
        i = self._index(pc)
        if i is None:
            return None
        try:
            return self._funcname(self._fields(self._func(i))[0]), pc - self._entries[i]
        except (GoPclnError, struct.error):
            return None

    def frames(self, pc: int) -> list[GoFrame]:
        """The frames of `pc`, innermost first: inlined calls, then the function. [] if unknown."""
        return list(self.chain(pc))

    def chain(self, pc: int) -> tuple[GoFrame, ...]:
        """`frames` as a tuple (a dictionary key): () if unknown."""
        key = self.key(pc)
        return self.chain_at(key) if key is not None else ()

    def key(self, pc: int) -> int | None:
        """What the frames of `pc` depend on (function, file number, line, inline index: `_key`);
        None if `pc` is in no function or its function's record is damaged. Equal keys give equal
        chains: a caller keeps one answer per key (most addresses share a line with others)."""
        return next(self.keys((pc,)))

    def keys(self, pcs: Iterable[int | None]) -> Iterator[int | None]:
        """`key` of each PC (None for None), in one loop: a batch's per-address cost is a few
        bisections. A function's tables are decoded once for all its addresses (its record). One at
        a time: the record of a key's function is still held when its chain is asked next."""
        entries, nfunc, first, shift = self._entries, self._nfunc, self._first, self._shift
        low, nbuckets = entries[0], len(first) - 1
        bisect_right = bisect.bisect_right
        for pc in pcs:
            if pc is None or pc < low:
                yield None
                continue
            b = (pc - low) >> shift  # _index(pc), inline
            if b >= nbuckets:
                yield None
                continue
            i = bisect_right(entries, pc, first[b], first[b + 1] + 1) - 1
            if i >= nfunc or pc >= entries[i + 1]:
                yield None
                continue
            fn = self._funcs.get(i)
            if fn is None:
                try:
                    fn = self._func_record(i)
                except (GoPclnError, struct.error, IndexError):
                    yield None
                    continue
            # _run_value of each table, inline: three calls an address were a tenth of the path.
            _e, _n, _c, _t, runs, flo, fhi, fvo, llo, lhi, lvo, ilo, ihi, ivo = fn
            j = bisect_right(runs, pc, flo, fhi) - 1
            fileno = runs[j + fvo] if j >= flo and pc < runs[fhi] else -1
            j = bisect_right(runs, pc, llo, lhi) - 1
            line = runs[j + lvo] if j >= llo and pc < runs[lhi] else 0
            j = bisect_right(runs, pc, ilo, ihi) - 1
            ix = runs[j + ivo] if j >= ilo and pc < runs[ihi] else -1
            # _key(i, fileno, line, ix), inline
            yield i | (fileno + _OFFSET) << 21 | (ix + _OFFSET) << 85 | (line if line > 0 else 0) << 149

    def answers(
        self,
        pcs: Sequence[int | None],
        make: Callable[[str, str, int, bool], T],
        held: dict[int, tuple[T, ...]],
        max_held: int,
    ) -> tuple[list[tuple[T, ...] | None], list[int]]:
        """The frames of each PC (`frames_at` of its `key`, made by `make`), and the positions of
        those with a frame that has no name. One answer per key, shared by the PCs that give it:
        `held` (the caller's, by key) has those made before and gets the new ones with names, up to
        `max_held`. None for a PC in no function, or whose function cannot be read.

        `keys` and `frames_at` in one loop, for a batch: a key's frames are made from the values
        that make the key (no second look at its function), the callers of an inlined call once a
        batch. Per distinct address the Go path was ~3x the names-only one; this is most of it."""
        entries, nfunc, first, shift = self._entries, self._nfunc, self._first, self._shift
        low, nbuckets = entries[0], len(first) - 1
        bisect_right, held_get, files = bisect.bisect_right, held.get, self._files
        funcs_get = self._funcs.get
        made: dict[int, tuple[T, ...]] = {}  # callers' frames of an inlined call, by _frames' ckey
        out: list[tuple[T, ...] | None] = [None] * len(pcs)
        unnamed: list[int] = []
        # In address order: each function's record is then found, decoded and read once, in turn,
        # as are the table bytes it comes from, and a PC in the function of the one before needs no
        # search. (In the order given, the lookups in records already decoded took 1.6x as long on
        # cmd/go's 50 000 distinct addresses, the whole batch 1.3x: memory read all over.)
        at = cast(Callable[[int], int], pcs.__getitem__)  # only PCs that are not None are sorted
        order = sorted([k for k, pc in enumerate(pcs) if pc is not None], key=at)
        fn: _Func | None = None
        i = start = end = 0  # the function of the PC before: [start, end)
        name, cu, tree, runs = "", 0, -1, _NO_RUNS
        flo = fhi = fvo = llo = lhi = lvo = ilo = ihi = ivo = 0
        for k in order:
            pc = at(k)
            if not start <= pc < end:
                if pc < low:
                    continue
                b = (pc - low) >> shift  # _index(pc), inline
                if b >= nbuckets:
                    continue
                i = bisect_right(entries, pc, first[b], first[b + 1] + 1) - 1
                if i >= nfunc or pc >= entries[i + 1]:
                    continue
                fn = funcs_get(i)
                if fn is None:
                    try:
                        fn = self._func_record(i)
                    except (GoPclnError, struct.error, IndexError):
                        start = end = 0
                        continue
                    funcs_get = self._funcs.get  # a new dict past the bound
                start, end = entries[i], entries[i + 1]
                _e, name, cu, tree, runs, flo, fhi, fvo, llo, lhi, lvo, ilo, ihi, ivo = fn
            # As `keys`.
            j = bisect_right(runs, pc, flo, fhi) - 1
            fileno = runs[j + fvo] if j >= flo and pc < runs[fhi] else -1
            j = bisect_right(runs, pc, llo, lhi) - 1
            line = runs[j + lvo] if j >= llo and pc < runs[lhi] else 0
            if line < 0:
                line = 0
            j = bisect_right(runs, pc, ilo, ihi) - 1
            ix = runs[j + ivo] if j >= ilo and pc < runs[ihi] else -1
            key = i | (fileno + _OFFSET) << 21 | (ix + _OFFSET) << 85 | line << 149
            got = held_get(key)
            if got is None:
                # As `frames_at`.
                try:
                    if tree < 0 or ix < 0:  # most keys: no inlined call, one frame
                        file = files.get(cu + fileno) if fileno >= 0 else ""
                        got = (make(name, file if file is not None else self._file(cu, fileno), line, False),)
                        named = bool(name)
                    else:
                        assert fn is not None  # set with `start, end`
                        got, named = self._frames(fn, i, fileno, line, ix, make, made)
                except (GoPclnError, struct.error, IndexError):
                    continue
                if not named:
                    unnamed.append(k)
                elif len(held) < max_held:
                    held[key] = got
            out[k] = got
        unnamed.sort()
        return out, unnamed

    def chain_at(self, key: int) -> tuple[GoFrame, ...]:
        """The frames a `key` stands for, innermost first: () if they cannot be read."""
        return self.frames_at(key, _go_frame)[::-1]

    def frames_at(self, key: int, make: Callable[[str, str, int, bool], T]) -> tuple[T, ...]:
        """The frames a `key` stands for, root first (the function, then the calls inlined into it),
        each made by `make(function, file, line, inlined)` (a caller's own frames: no GoFrame
        made in between); () if they cannot be read."""
        i = key & 0x1FFFFF  # _unkey(key), inline
        try:
            fn = self._funcs.get(i)
            if fn is None:
                fn = self._func_record(i)
            name, cu, tree = fn[1], fn[2], fn[3]
            fileno, ix = (key >> 21 & _MASK64) - _OFFSET, (key >> 85 & _MASK64) - _OFFSET
            if tree < 0 or ix < 0:  # most keys: no inlined call, one frame
                file = self._files.get(cu + fileno) if fileno >= 0 else ""
                return (make(name, file if file is not None else self._file(cu, fileno), key >> 149, False),)
            return self._frames(fn, i, fileno, key >> 149, ix, make)[0]
        except (GoPclnError, struct.error, IndexError):
            return ()

    def _func_record(self, i: int) -> _Func:
        if len(self._funcs) >= MAX_HELD_FUNCS or self._held >= MAX_HELD_RUNS:
            with self._lock:  # a plain new dict for concurrent readers; the old goes with its last one
                self._funcs, self._chains, self._held = {}, {}, 0
        fo = self._func(i)
        nameoff, pcfile, pcln, npcdata, cu, nfuncdata, fixed, entry = self._fields(fo)
        tree = self._inline_tree(fo + fixed, npcdata, nfuncdata)
        inl = 0
        if tree >= 0 and npcdata > _PCDATA_INLTREE_INDEX:
            inl = self._u32(fo + fixed + _PCDATA_INLTREE_INDEX * 4)
        tree = tree if inl else -1
        # The three tables whole, into one tuple, for all the function's addresses whatever order
        # they come in: bounded (MAX_PCVALUE_STEPS runs each), and most are short (a file or
        # inline-index table has 6-9 runs on average, a line table 31; prometheus' longest 13 832).
        runs: list[int] = []
        d, base, quantum = self._data, self._pctab, self._quantum
        ft = _decode(d, base + pcfile, entry, quantum, runs) if pcfile else _NO_TABLE
        lt = _decode(d, base + pcln, entry, quantum, runs) if pcln else _NO_TABLE
        it = _decode(d, base + inl, entry, quantum, runs) if inl else _NO_TABLE
        fn: _Func = (entry, self._funcname(nameoff), cu, tree, tuple(runs), *ft, *lt, *it)
        with self._lock:
            self._held += len(runs) >> 1
        self._funcs[i] = fn
        return fn

    def _frames(
        self,
        fn: _Func,
        i: int,
        fileno: int,
        line: int,
        ix: int,
        make: Callable[[str, str, int, bool], T],
        made: dict[int, tuple[T, ...]] | None = None,
    ) -> tuple[tuple[T, ...], bool]:
        """The frames of an address of function `i` whose inline index is `ix` (>= 0), root first,
        and whether they all have names. `made` (one `make`'s) keeps each call site's callers."""
        ckey = i | ix << 21
        chain = self._chains.get(ckey)
        if chain is None:
            chain = self._chain(fn, ix)
            if len(self._chains) >= MAX_HELD_FUNCS:
                self._chains = {}  # only speed is lost
            self._chains[ckey] = chain
        called, callers, named = chain
        before = made.get(ckey) if made is not None else None
        if before is None:
            before = tuple([make(*c) for c in callers])
            if made is not None:
                made[ckey] = before
        return (*before, make(called, self._file(fn[2], fileno), line, True)), named

    def _chain(self, fn: _Func, ix: int) -> _Chain:
        """What the frames of inline index `ix` hold whatever the address's own file and line (those
        of the innermost call): the function called there, and its callers root first as
        (function, file, line, inlined), the outermost the function itself, and whether all have
        names: one walk of the inline tree for all the lines of that call."""
        entry, name, cu, tree, runs, flo, fhi, fvo, llo, lhi, lvo, ilo, ihi, ivo = fn
        called, parent, parent_pc = self._inline_call(tree, ix)
        callers: list[tuple[str, str, int, bool]] = []
        depth = 1
        while True:
            at = entry + parent_pc
            file = self._file(cu, _run_value(runs, flo, fhi, fvo, at))
            line = max(_run_value(runs, llo, lhi, lvo, at) or 0, 0)
            at_ix = parent if parent is not None else _run_value(runs, ilo, ihi, ivo, at)
            if at_ix is None or at_ix < 0 or depth >= MAX_INLINE_DEPTH:
                callers.append((name, file, line, False))
                break
            function, parent, parent_pc = self._inline_call(tree, at_ix)
            callers.append((function, file, line, True))
            depth += 1
        callers.reverse()
        return called, tuple(callers), bool(called) and all(c[0] for c in callers)

    def _inline_tree(self, pcdata: int, npcdata: int, nfuncdata: int) -> int:
        """Where a function's inline tree is in the inline trees' bytes; -1 if it has none."""
        if self._inl is None or nfuncdata <= _FUNCDATA_INLTREE or npcdata > 1024:
            return -1
        fd = pcdata + npcdata * 4
        if self.version == (1, 16):
            fd += fd & 4  # pointers, 8-aligned (the table starts 8-aligned)
            if fd + (_FUNCDATA_INLTREE + 1) * 8 > len(self._data):
                return -1
            addr = struct.unpack_from("<Q", self._data, fd + _FUNCDATA_INLTREE * 8)[0]
        else:
            off = self._u32(fd + _FUNCDATA_INLTREE * 4)
            if off == _NO_FUNCDATA:
                return -1
            addr = self._funcdata_base + off
        return int(addr - self._inl.vaddr) if addr else -1

    def _inline_call(self, tree: int, ix: int) -> tuple[str, int | None, int]:
        """Entry `ix` of the inline tree at `tree`: (called function, parent index or None to look it
        up at the call site, call-site pc offset). Entries of 20 bytes (1.16-1.19) or 16 (1.20 on)."""
        if ix >= MAX_INLINE_ENTRIES:
            raise GoPclnError("inline index out of bounds")
        assert self._inl is not None  # a tree is found through it
        d = self._inl.data
        if self.version >= (1, 20):
            off = tree + ix * 16
            if not 0 <= off <= len(d) - 16:
                raise GoPclnError("inline entry out of bounds")
            _fid, nameoff, parent_pc, _start = struct.unpack_from("<B3xiii", d, off)
            return self._funcname(nameoff), None, parent_pc
        off = tree + ix * 20
        if not 0 <= off <= len(d) - 20:
            raise GoPclnError("inline entry out of bounds")
        parent, _fid, _file, _line, nameoff, parent_pc = struct.unpack_from("<hBxiiii", d, off)
        if parent >= ix:
            raise GoPclnError("inline tree loops")  # parents come before their children
        return self._funcname(nameoff), parent, parent_pc

    def symbols(self) -> SymbolIndex:
        """Every function as a symbol index (names of a binary without .symtab)."""
        starts = array("Q")
        ends = array("Q")
        offs = array("I")
        names = bytearray()
        for i in range(self._nfunc):
            try:
                name = self._funcname(self._fields(self._func(i))[0])
            except (GoPclnError, struct.error):
                continue
            if starts and self._entries[i] == starts[-1]:
                continue
            starts.append(self._entries[i])
            ends.append(self._entries[i + 1])
            offs.append(len(names))
            names += name.encode()
        offs.append(len(names))
        return SymbolIndex(starts, ends, offs, bytes(names), ".gopclntab")


# A key packs (function index, file number, line, inline index) in one int: an int is no object the
# cyclic collector tracks, a tuple is (one per address; collections were a third of the Go path's
# time). The function index in 21 bits (MAX_FUNCS), file number and inline index in 64 each (int64
# values, -1 for none: offset by 2^63), the line (>= 0) on top.
_OFFSET = 1 << 63
_MASK64 = (1 << 64) - 1


def _key(i: int, fileno: int, line: int, ix: int) -> int:
    return i | (fileno + _OFFSET) << 21 | (ix + _OFFSET) << 85 | line << 149


def _unkey(key: int) -> tuple[int, int, int, int]:
    """(function index, file number, line, inline index) of a `_key`."""
    return key & 0x1FFFFF, (key >> 21 & _MASK64) - _OFFSET, key >> 149, (key >> 85 & _MASK64) - _OFFSET


@dataclass(frozen=True, **SLOTS)
class InlineTrees:
    """The bytes inline trees live in (a copy of a read-only segment) and where they start."""

    data: bytes
    vaddr: int  # address of data[0]
    gofunc: int  # 1.18 and later: the base of funcdata offsets (runtime.firstmoduledata.gofunc)


def _uvarint(d: bytes, pos: int, end: int) -> tuple[int, int]:
    v = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise GoPclnError("varint past the table")
        b = d[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


def _decode(d: bytes, pos: int, cur: int, quantum: int, runs: list[int]) -> tuple[int, int, int]:
    """Append the pc-value table at `pos` of a function at `cur` to `runs` (the record's layout:
    starts, end, values); its (lo, hi, vo). A table is pairs of varints (value delta, zigzag'd; pc
    delta) up to a value delta of 0 past the first pair. It ends early, keeping the runs before, at
    a damaged varint (past the data, or over 64 bits), at a value or start PC past 64 bits (its end
    is then that run's start, at most 2^63 - 1), or after MAX_PCVALUE_STEPS runs."""
    starts: list[int] = []  # lists while decoding: an append is cheaper than an array's
    values: list[int] = []
    add_start, add_value = starts.append, values.append
    val, size, wide = -1, len(d), False
    try:
        # Most varints are one byte, most others two: read inline, the function only for longer
        # ones; the end of the data is the IndexError of a read past it. (Cutting the varints out
        # with a regular expression or stretches of one-byte pairs with slices, in C, was slower:
        # a quarter of the pairs have a wider varint, at most a few pairs apart.) The first value
        # is read before the loop, each next one at the end of it: only those can be the end.
        uv = d[pos]
        pos += 1
        if uv >= 0x80:
            if d[pos] < 0x80:
                uv = (uv & 0x7F) | d[pos] << 7
                pos += 1
            else:
                uv, pos = _uvarint(d, pos - 1, size)
                wide = True
        for _ in range(MAX_PCVALUE_STEPS):
            val += (uv >> 1) ^ -(uv & 1)  # zigzag
            delta = d[pos]
            pos += 1
            if delta >= 0x80:
                if d[pos] < 0x80:
                    delta = (delta & 0x7F) | d[pos] << 7
                    pos += 1
                else:
                    delta, pos = _uvarint(d, pos - 1, size)
                    wide = True
            add_value(val)
            add_start(cur)
            cur += delta * quantum
            uv = d[pos]
            pos += 1
            if uv >= 0x80:
                if d[pos] < 0x80:
                    uv = (uv & 0x7F) | d[pos] << 7
                    pos += 1
                else:
                    uv, pos = _uvarint(d, pos - 1, size)
                    wide = True
                if not uv:  # a zero written long
                    break
            elif not uv:
                break
    except (GoPclnError, IndexError):  # damaged: the runs before it stay
        pass
    # Values and starts are int64 (the record's were an array's): only a varint of three bytes or
    # more can take one past that (from 1-2 byte ones, at most 2^16 runs of 14 bits), or an entry
    # past it (1.16's are 64-bit): then the table is cut before the first run past 64 bits, its end
    # at that run's start, at most 2^63 - 1 (rare: a damaged table).
    if wide or cur > _MAX64:
        cut = 0
        while cut < len(starts) and starts[cut] <= _MAX64 and _MIN64 <= values[cut] <= _MAX64:
            cut += 1
        if cut < len(starts):
            cur = starts[cut]
        del starts[cut:], values[cut:]
        cur = min(cur, _MAX64)
    lo = len(runs)
    runs += starts
    runs.append(cur)
    runs += values
    hi = lo + len(starts)
    return lo, hi, hi + 1 - lo


_MIN64, _MAX64 = -(1 << 63), (1 << 63) - 1


def _run_value(runs: Sequence[int], lo: int, hi: int, vo: int, pc: int) -> int | None:
    """The value a table of `runs` (at lo, hi, vo: _decode) gives `pc`; None before its first run,
    at or past its end, or when it has none."""
    j = bisect.bisect_right(runs, pc, lo, hi) - 1
    return runs[j + vo] if j >= lo and pc < runs[hi] else None


# --- from an ELF file --------------------------------------------------------


def read_pclntab(elf: ElfFile) -> GoPclnTab | None:
    """The pclntab of a Go binary, or None (not Go, or a table this reader does not understand)."""
    # A PIE built by Go's linker has it in its relocated read-only data.
    sec = elf.section(".gopclntab") or elf.section(".data.rel.ro.gopclntab")
    if sec is None or sec.type == SHT_NOBITS or sec.size < 64 or elf.endian != "<":
        return None
    if sec.size > MAX_PCLNTAB_BYTES:
        elf.bounds_hit.add("gopclntab")
        return None
    text = elf.section(".text")
    try:
        data = bytes(elf.section_data(sec))
        magic = struct.unpack_from("<I", data, 0)[0]
        inline = _inline_trees(elf, sec, magic)
        return GoPclnTab(data, text.addr if text is not None else 0, inline)
    except (GoPclnError, ElfFormatError, struct.error):
        return None


def _inline_trees(elf: ElfFile, pcln: Section, magic: int) -> InlineTrees | None:
    """Where the inline trees are: the read-only data after .text (`go:func.*` is in .rodata)."""
    ro = elf.section(".rodata")
    if ro is None or ro.type == SHT_NOBITS or ro.size > MAX_PCLNTAB_BYTES:
        return None
    if magic == MAGIC_116:  # funcdata are addresses: anywhere in .rodata
        return InlineTrees(bytes(elf.section_data(ro)), ro.addr, 0)
    gofunc = _gofunc(elf, pcln, ro)
    if not ro.addr <= gofunc < ro.addr + ro.size:
        return None
    # Only what follows gofunc (`go:func.*`, the funcdata): 4.5 of prometheus' 13 MB of .rodata.
    return InlineTrees(bytes(elf.section_data(ro)[gofunc - ro.addr :]), gofunc, gofunc)


# runtime.moduledata opens with the pcHeader pointer, 6 slices and 13 pointers (from findfunctab to
# enoptrbss: 256 bytes), then, after a few more pointers (1.20 adds 2), `types, etypes, rodata, gofunc`.
_RODATA_FROM = 256
_RODATA_TO = 256 + 16 * 8


def _gofunc(elf: ElfFile, pcln: Section, ro: Section) -> int:
    """runtime.firstmoduledata.gofunc: the moduledata is the data that points at the pclntab header,
    then (funcnametab slice) at its function names; gofunc ends its `types, etypes, rodata, gofunc`
    run, all in .rodata, `types` equal to `rodata` (the type data opens the read-only data; with an
    external linker, both are a little past the section's start). 0 when not found."""
    names_off = struct.unpack_from("<Q", elf.section_data(pcln)[:40], 32)[0]  # funcnameOffset
    want = struct.pack("<QQ", pcln.addr, pcln.addr + names_off)
    lo, hi = ro.addr, ro.addr + ro.size
    for name in (".noptrdata", ".data.rel.ro", ".data"):
        sec = elf.section(name)
        if sec is None or sec.type == SHT_NOBITS:
            continue
        data = elf.section_data(sec)[:MAX_MODULEDATA_SCAN]
        pos = data.find(want)
        while pos >= 0:
            if pos % 8 == 0 and pos + _RODATA_TO <= len(data):
                words = struct.unpack_from(f"<{(_RODATA_TO - _RODATA_FROM) // 8}Q", data, pos + _RODATA_FROM)
                for k in range(len(words) - 3):
                    types, etypes, rodata, gofunc = words[k : k + 4]
                    if types == rodata and lo <= types < etypes <= hi and lo <= gofunc < hi:
                        return int(gofunc)
            pos = data.find(want, pos + 1)
    return 0

"""symbolizer/dwarf.py: file:line and inlined frames read in process, equal to llvm-symbolizer's.

Small programs built here (C and C++, GCC and clang, DWARF 4 and 5, compressed sections) are
compared with llvm-symbolizer at every byte of their code; the real binaries of the host are
compared in tests/integration/test_dwarf_llvm.py. What the reader does not read (split DWARF,
DWARF 3) it says with None, and record's pool asks llvm-symbolizer for it. Damaged files are
answered or refused within a bound, never with an exception.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bistouri.elf import ElfFile
from bistouri.symbolizer import dwarf
from bistouri.symbolizer.llvm import SourceFrame
from testkit.llvmcompare import agreement, llvm_frames, needs_llvm

HEADER = """
static inline int leaf(int x) { return x * x + 3; }
"""
C_SOURCE = """
#include "inc/leaf.h"
static inline int mid(int x) { int s = 0; for (int i = 0; i < x; i++) s += leaf(i ^ x); return s; }
__attribute__((noinline)) int outer(int x) { return mid(x) + mid(x + 1); }
int main(int argc, char **argv) { (void)argv; return outer(argc * 1000) & 1; }
"""
CXX_SOURCE = """
#include <vector>
namespace ns {
template <typename T> struct Box {
    T v;
    T twice() const { return v + v; }
};
template <typename T> __attribute__((noinline)) T sum(const std::vector<Box<T>>& xs) {
    T s = 0;
    for (const auto& b : xs) s += b.twice();
    return s;
}
}
int main(int argc, char**) {
    std::vector<ns::Box<long>> xs(argc * 100, ns::Box<long>{3});
    return (int)ns::sum(xs) & 1;
}
"""


def build(tmp: Path, compiler: str, flags: list[str], cxx: bool = False) -> Path:
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    (tmp / "inc").mkdir(exist_ok=True)
    (tmp / "inc" / "leaf.h").write_text(HEADER)
    src = tmp / ("p.cc" if cxx else "p.c")
    src.write_text(CXX_SOURCE if cxx else C_SOURCE)
    out = tmp / f"p-{compiler}-{'-'.join(f.strip('-') for f in flags)}"
    # Relative source path and include dir, as build systems give them: file names are joined.
    subprocess.run([compiler, *flags, "-Iinc", "-o", out.name, src.name], cwd=tmp, check=True)
    return out


def code_addresses(path: Path, only: str = "") -> list[int]:
    """Every byte of the program's functions (or of the function `only`)."""
    with ElfFile(path) as elf:
        rows = [(s, e, n) for s, e, n in elf.symbol_index().items() if e > s and (n == only or not only)]
    return [a for s, e, _ in rows for a in range(s, e)]


@needs_llvm
@pytest.mark.parametrize(
    ("compiler", "flags", "cxx"),
    [
        ("gcc", ["-g", "-O2"], False),
        ("gcc", ["-gdwarf-4", "-O2"], False),
        ("gcc", ["-g", "-O2", "-gz=zlib"], False),
        ("clang", ["-g", "-O2"], False),
        ("clang", ["-gdwarf-4", "-O2"], False),
        ("g++", ["-g", "-O2"], True),
        ("clang++", ["-g", "-O2"], True),
    ],
)
def test_every_byte_of_a_program_is_named_as_llvm_names_it(
    tmp_path: Path, compiler: str, flags: list[str], cxx: bool
) -> None:
    exe = build(tmp_path, compiler, flags, cxx)
    addrs = code_addresses(exe)
    share, differ = agreement(str(exe), addrs)
    assert not differ, differ[:5]
    assert share == 1.0
    # Inlined frames were met, with the header's file joined to the unit's directory.
    chains = [f for f in dwarf.symbolize(str(exe), addrs) if f and len(f) > 1]
    assert chains
    if not cxx:
        assert any(f[0].function == "leaf" and f[0].file.endswith("inc/leaf.h") for f in chains)


@needs_llvm
def test_the_reader_leaves_split_dwarf_and_dwarf_3_to_llvm(tmp_path: Path) -> None:
    for flags in (["-g", "-O2", "-gsplit-dwarf"], ["-gdwarf-3", "-O2"]):
        exe = build(tmp_path, "gcc", flags)
        addrs = code_addresses(exe, "outer")
        assert dwarf.symbolize(str(exe), addrs) == [None] * len(addrs), flags


@needs_llvm
def test_record_asks_llvm_only_for_what_the_reader_leaves(tmp_path: Path) -> None:
    from bistouri.record.dwarfpool import DwarfFirstPool

    plain = build(tmp_path, "gcc", ["-g", "-O2"])
    split = build(tmp_path, "gcc", ["-g", "-O2", "-gsplit-dwarf"])
    with DwarfFirstPool(registry=None) as pool:
        addrs = code_addresses(plain, "outer")
        assert pool.symbolize(str(plain), addrs) == llvm_frames(str(plain), addrs)
        assert pool.in_process == len(addrs) and pool.through_llvm == 0 and not pool.pids()
        addrs = code_addresses(split, "outer")
        got = pool.symbolize(str(split), addrs)
        assert pool.through_llvm == len(addrs) and all(f and f[0].line for f in got)


@pytest.mark.parametrize(
    ("compiler", "flags", "cxx"),
    [("gcc", ["-g", "-O2"], False), ("clang", ["-gdwarf-4", "-O2"], False), ("g++", ["-g", "-O2"], True)],
)
def test_record_keeps_a_unit_s_line_rows_and_functions_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler: str, flags: list[str], cxx: bool
) -> None:
    """The line rows and outermost subroutines of each unit read are kept in record's cache; a
    later run's new addresses in those units (every byte of the program) get the same frames
    without running their line programs or walking them from their first DIE again."""
    from bistouri.record.dwarfpool import DwarfFirstPool
    from bistouri.record.symcache import SymbolCache
    from bistouri.symbolizer import dwarflines

    exe = build(tmp_path, compiler, flags, cxx)
    addrs = code_addresses(exe)
    want = dwarf.symbolize(str(exe), addrs)
    cache = SymbolCache(tmp_path / "cache")
    first = code_addresses(exe, "main")[:3]
    with DwarfFirstPool(cache, registry=None) as pool:
        assert pool.symbolize(str(exe), first) == dwarf.symbolize(str(exe), first)
        assert pool.cached_units == 0
    assert list((tmp_path / "cache").glob("*.lines")) and list((tmp_path / "cache").glob("*.outer"))

    def not_run(*_args: object) -> None:
        raise AssertionError("a line program was run again")

    monkeypatch.setattr(dwarflines, "parse", not_run)
    with DwarfFirstPool(cache, registry=None) as pool:
        assert pool.symbolize(str(exe), addrs) == want
        assert pool.cached_units >= 2


def test_a_file_without_dwarf_or_not_elf_is_refused(tmp_path: Path) -> None:
    exe = build(tmp_path, "gcc", ["-g0", "-O2"])
    assert dwarf.symbolize(str(exe), [0x1000]) == [None]
    (tmp_path / "junk").write_bytes(b"\x7fELF" + b"\0" * 100)
    assert dwarf.symbolize(str(tmp_path / "junk"), [1, 2]) == [None, None]
    assert dwarf.covered_ranges(str(tmp_path / "junk")) is None


def test_the_ranges_a_program_s_dwarf_describes(tmp_path: Path) -> None:
    exe = build(tmp_path, "gcc", ["-g", "-O2"])
    with ElfFile(exe) as elf:
        found = elf.find_symbols(["outer", "main"])
    ranges = dwarf.covered_ranges(str(exe))
    assert ranges is not None
    for start, size in found.values():
        assert any(lo <= start and start + size <= hi for lo, hi in ranges)


# --- hostile files ------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_SAMPLE: dict[str, tuple[bytes, list[tuple[int, int]], list[int]]] = {}


def _sample() -> tuple[bytes, list[tuple[int, int]], list[int]]:
    """A small program with DWARF 5 (built once): its bytes, its debug sections' (offset, size)
    and some of its code addresses."""
    if not _SAMPLE:
        tmp = Path(tempfile.mkdtemp(prefix="dwarf-fuzz-"))
        exe = build(tmp, "gcc", ["-g", "-O2"])
        with ElfFile(exe) as elf:
            secs = [(s.offset, s.size) for s in elf.sections if s.name.startswith(".debug_") and s.size]
        _SAMPLE["gcc"] = (exe.read_bytes(), secs, code_addresses(exe)[::7])
        shutil.rmtree(tmp)
    return _SAMPLE["gcc"]


def _survives(data: bytes, addrs: list[int]) -> None:
    with tempfile.NamedTemporaryFile(prefix="dwarf-fuzz-") as f:
        f.write(data)
        f.flush()
        t0 = time.process_time()
        got = dwarf.symbolize(f.name, addrs)
        dwarf.covered_ranges(f.name)
        assert time.process_time() - t0 < 2.0
    assert len(got) == len(addrs)
    for frames in got:
        assert frames is None or all(isinstance(fr, SourceFrame) for fr in frames)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=16))
def test_fuzz_damaged_debug_sections(edits: list[tuple[int, int]]) -> None:
    data, secs, addrs = _sample()
    buf = bytearray(data)
    for at, byte in edits:
        off, size = secs[at % len(secs)]
        buf[off + (at >> 4) % size] = byte
    _survives(bytes(buf), addrs)


@FUZZ
@given(st.integers(0, 7), st.binary(min_size=1, max_size=4096))
def test_fuzz_any_bytes_as_a_debug_section(which: int, tail: bytes) -> None:
    data, secs, addrs = _sample()
    off, size = secs[which % len(secs)]
    body = (tail * (size // len(tail) + 1))[:size]
    _survives(data[:off] + body + data[off + size :], addrs)


def test_a_compressed_section_is_inflated_only_within_its_bound(tmp_path: Path) -> None:
    exe = build(tmp_path, "gcc", ["-g", "-O2", "-gz=zlib"])
    data = bytearray(exe.read_bytes())
    with ElfFile(exe) as elf:
        info = next(s for s in elf.sections if s.name == ".debug_info")
    # Elf64_Chdr: type, reserved, size: claim more than the bound.
    struct.pack_into("<IIQ", data, info.offset, 1, 0, dwarf.MAX_INFLATED_BYTES + 1)
    (tmp_path / "big").write_bytes(bytes(data))
    assert dwarf.symbolize(str(tmp_path / "big"), [0x1000]) == [None]

"""The in-process DWARF reader against llvm-symbolizer on the host's real binaries.

pyenv's libpython 3.12 (DWARF 5, deep inlining), libc's debug file from libc6-dbg (zlib-compressed
sections, found by build id under /usr/lib/debug), the C fixture built with -g and node (DWARF for
a few files among 60 MB of code), and a Go program built here: addresses drawn at random inside
their functions must get the same frames (names, files, lines, inline chains) as llvm-symbolizer
gives for ≥ 99 % of them (measured: all of them).
"""

from __future__ import annotations

import glob
import random
from pathlib import Path

import pytest

from bistouri.elf import SHF_COMPRESSED, ElfFile, read_build_id
from testkit.llvmcompare import agreement, needs_llvm

ROOT = Path(__file__).resolve().parents[2]


def _libc_debug() -> tuple[str, str] | None:
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6").resolve()
    if not libc.is_file():
        return None
    bid = read_build_id(libc)
    if bid is None:
        return None
    debug = Path("/usr/lib/debug/.build-id", bid.hex()[:2], bid.hex()[2:] + ".debug")
    return (str(libc), str(debug)) if debug.is_file() else None


def _binaries() -> list[tuple[str, str, str]]:
    """(label, binary whose symbols give the addresses, file with the DWARF)."""
    out = []
    for lib in sorted(glob.glob("/root/.pyenv/versions/3.12*/lib/libpython3.12.so.1.0"))[:1]:
        out.append(("libpython3.12", lib, lib))
    libc = _libc_debug()
    if libc is not None:
        out.append(("libc (libc6-dbg)", *libc))
    shares = ROOT / "tests/fixtures/build/workloads/shares"
    if shares.is_file():
        out.append(("C fixture", str(shares), str(shares)))
    if Path("/usr/bin/node").is_file():
        out.append(("node", "/usr/bin/node", "/usr/bin/node"))
    return out


@needs_llvm
@pytest.mark.parametrize(("label", "binary", "debug"), _binaries(), ids=lambda v: str(v).split("/")[-1])
def test_a_real_binary_is_named_as_llvm_names_it(label: str, binary: str, debug: str) -> None:
    with ElfFile(binary) as elf:
        functions = [(s, e) for s, e, _ in elf.symbol_index().items() if e > s]
    rng = random.Random(27)
    addrs = sorted({rng.randrange(*rng.choice(functions)) for _ in range(2000)})
    share, differ = agreement(debug, addrs)
    print(f"{label}: {share:.2%} of {len(addrs)} addresses as llvm-symbolizer")
    assert share >= 0.99, differ[:5]


@pytest.mark.parametrize(("label", "binary", "debug"), _binaries(), ids=lambda v: str(v).split("/")[-1])
def test_a_real_binary_s_line_rows_kept_by_record_give_the_same_frames(
    label: str, binary: str, debug: str, tmp_path: Path
) -> None:
    """record keeps each unit's line rows in its cache (record/linefile.py): read back, they
    name 300 random addresses as the line programs run again do."""
    from bistouri.record.dwarfpool import CachedLines
    from bistouri.record.symcache import SymbolCache
    from bistouri.symbolizer import dwarf

    with ElfFile(binary) as elf:
        functions = [(s, e) for s, e, _ in elf.symbol_index().items() if e > s]
    rng = random.Random(21)
    addrs = sorted({rng.randrange(*rng.choice(functions)) for _ in range(300)})
    want = dwarf.symbolize(debug, addrs)
    cache = SymbolCache(tmp_path)
    keep = CachedLines.of(cache, debug)
    assert keep is not None
    assert dwarf.symbolize(debug, addrs, keep) == want and keep.hits == 0
    again = CachedLines.of(cache, debug)
    assert again is not None
    assert dwarf.symbolize(debug, addrs, again) == want
    # A compressed section (libc6-dbg's) is kept inflated: the second reading, from it, is the same.
    kept = sorted(p.name.split("-")[-1] for p in tmp_path.glob("*.inflated"))
    print(f"{label}: {again.hits} units from the cache, sections kept inflated: {kept}")
    assert again.hits > 0 or not any(want), label
    assert bool(kept) == _compressed(debug), label


def _compressed(path: str) -> bool:
    with ElfFile(path) as elf:
        return any(s.flags & SHF_COMPRESSED for s in elf.sections if s.name == ".debug_info")


@needs_llvm
def test_a_go_program_s_dwarf_is_named_as_llvm_names_it(tmp_path: Path) -> None:
    """Go writes DWARF 4 in zlib-compressed sections, its own way (the resolver reads it when
    llvm-symbolizer is installed, else Go's pclntab)."""
    from testkit.gobuild import go_build

    binary = go_build("gohot", tmp_path)
    with ElfFile(binary) as elf:
        functions = [(s, e) for s, e, _ in elf.symbol_index().items() if e > s]
    rng = random.Random(27)
    addrs = sorted({rng.randrange(*rng.choice(functions)) for _ in range(2000)})
    share, differ = agreement(str(binary), addrs)
    assert share >= 0.99, differ[:5]


def _shmem_kb() -> int:
    """The process's shared anonymous memory now: where an inflated section is held."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_a_section_inflated_for_record_is_read_from_its_kept_file(tmp_path: Path) -> None:
    """libc6-dbg's compressed sections (8.5 MB inflated), read with record's cache: inflated once,
    then read from the kept file, whose pages count only as the reader touches them, not held in
    anonymous memory while the file is open (they were, at a first run's peak)."""
    from bistouri.record.dwarfpool import CachedLines
    from bistouri.record.symcache import SymbolCache
    from bistouri.symbolizer import dwarf

    libc = _libc_debug()
    if libc is None or not _compressed(libc[1]):
        pytest.skip("no compressed debug file of libc (libc6-dbg)")
    with ElfFile(libc[0]) as elf:
        functions = [(s, e) for s, e, _ in elf.symbol_index().items() if e > s]
    rng = random.Random(5)
    addrs = sorted({rng.randrange(*rng.choice(functions)) for _ in range(50)})
    held = {}
    for how in ("anonymous", "kept"):
        lines = CachedLines.of(SymbolCache(tmp_path / how), libc[1]) if how == "kept" else None
        before = _shmem_kb()
        with dwarf.DwarfFile(libc[1], lines) as f:
            got = f.frames(addrs)
            held[how] = _shmem_kb() - before
        assert got == dwarf.symbolize(libc[1], addrs)
    assert held["anonymous"] > 4096 and held["kept"] < 1024, held

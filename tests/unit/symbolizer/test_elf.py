"""ELF reader against binaries built from tests/fixtures/symbolizer, checked with binutils."""

from __future__ import annotations

import lzma
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from bistouri.elf import ElfFile, ElfFormatError, read_build_id

from .helpers import build_id_hex, load_segments, nm


def _debug_file(symfix: Path) -> Path:
    (path,) = (symfix / "debug" / ".build-id").glob("*/*.debug")
    return path


def test_build_id_matches_readelf(symfix: Path) -> None:
    for name in ("cxx_app", "c_exported", "libfx.so", "bin/cxx_app", "bin/c_exported", "bin/libfx.so"):
        assert read_build_id(symfix / name) == bytes.fromhex(build_id_hex(symfix / name)), name
    dbg = _debug_file(symfix)
    assert read_build_id(dbg) == bytes.fromhex(build_id_hex(symfix / "cxx_app"))
    assert dbg.parent.name + dbg.stem == build_id_hex(symfix / "cxx_app")


def test_symtab_index_matches_nm(symfix: Path) -> None:
    funcs = {n: v for n, v in nm(symfix / "c_exported").items() if v[2] in "Tt" and v[1] > 0}
    assert {"exported_compute", "exported_die", "exported_fail_fast", "hidden_square", "main"} <= set(funcs)
    with ElfFile(symfix / "c_exported") as f:
        idx = f.symbol_index()
    assert idx.source == ".symtab"
    starts = sorted(v[0] for v in funcs.values())
    for name, (addr, size, _) in funcs.items():
        assert idx.lookup(addr) == (name, 0)
        assert idx.lookup(addr + size - 1) == (name, size - 1)
        nxt = min((s for s in starts if s > addr), default=None)
        if nxt is not None and nxt > addr + size:
            # Alignment padding between functions is not the previous function.
            assert idx.lookup(addr + size) is None, name


def test_stripped_binary_names_exports_only(symfix: Path) -> None:
    full = nm(symfix / "c_exported")
    with ElfFile(symfix / "bin" / "c_exported") as f:
        assert f.section(".symtab") is None
        idx = f.symbol_index()
    assert idx.source == ".dynsym"
    for name in ("exported_compute", "exported_die", "exported_fail_fast"):
        assert idx.lookup(full[name][0] + 3) == (name, 3)
    assert idx.lookup(full["hidden_square"][0]) is None


def test_non_pie_offsets_translate_through_pt_load(symfix: Path) -> None:
    path = symfix / "c_exported"
    text = [s for s in load_segments(path) if s[0] != s[1]]
    assert text, "the fixture is linked without PIE: offsets differ from addresses"
    addr = nm(path)["exported_compute"][0]
    with ElfFile(path) as f:
        assert f.type == 2  # ET_EXEC
        for off, va, size in load_segments(path):
            if va <= addr < va + size:
                assert f.offset_to_vaddr(addr - va + off) == addr
        assert f.offset_to_vaddr(f.size + 0x10000) is None


def test_split_debug_file(symfix: Path) -> None:
    dbg = _debug_file(symfix)
    with ElfFile(symfix / "bin" / "cxx_app") as exe, ElfFile(dbg) as d:
        assert exe.debuglink == dbg.name
        assert not exe.has_dwarf
        assert d.has_dwarf
        # objcopy --only-keep-debug zeroes p_filesz of the code segments.
        assert exe.loads_have_offsets and not d.loads_have_offsets
        run = nm(symfix / "cxx_app")
        addr = next(v[0] for n, v in run.items() if "Accumulator" in n and "run" in n)
        assert d.offset_to_vaddr(addr) is None
        # The GNU ld layout guess agrees with the executable's real headers.
        exe_off = next(
            a - s.vaddr + s.offset for s in exe.segments for a in [addr] if s.vaddr <= a < s.vaddr + s.filesz
        )
        approx = d.approx_segments()
        assert (
            next(exe_off - s.offset + s.vaddr for s in approx if s.offset <= exe_off < s.offset + s.filesz)
            == addr
        )
        idx = d.symbol_index()
    name, off = idx.lookup(addr + 2) or ("", 0)
    assert name.startswith("_ZN2fx11AccumulatorImLi3EE3run") and off == 2


def test_soname_and_shared_library(symfix: Path) -> None:
    with ElfFile(symfix / "bin" / "libfx.so") as f:
        assert f.soname is None  # built without -soname
        idx = f.symbol_index()
    syms = nm(symfix / "libfx.so")
    assert idx.lookup(syms["fx_public_hash"][0]) == ("fx_public_hash", 0)
    assert idx.lookup(syms["fx_internal_hash"][0]) is None
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    if libc.exists():
        with ElfFile(libc) as f:
            assert f.soname == "libc.so.6"


def test_mini_debuginfo(symfix: Path, tmp_path: Path) -> None:
    """Fedora's MiniDebugInfo: local function names in an xz-compressed ELF in .gnu_debugdata."""
    if not shutil.which("objcopy"):
        pytest.skip("objcopy (binutils) is not installed")
    mini = tmp_path / "mini"
    subprocess.run(["objcopy", "--strip-debug", str(symfix / "c_exported"), str(mini)], check=True)
    xz = tmp_path / "mini.xz"
    xz.write_bytes(lzma.compress(mini.read_bytes(), format=lzma.FORMAT_XZ))
    out = tmp_path / "c_exported"
    subprocess.run(
        ["objcopy", f"--add-section=.gnu_debugdata={xz}", str(symfix / "bin" / "c_exported"), str(out)],
        check=True,
    )
    syms = nm(symfix / "c_exported")
    with ElfFile(out) as f:
        idx = f.symbol_index()
    assert idx.source == ".dynsym+.gnu_debugdata"
    assert idx.lookup(syms["hidden_square"][0] + 1) == ("hidden_square", 1)
    assert idx.lookup(syms["exported_die"][0]) == ("exported_die", 0)


def test_find_symbol_includes_labels(symfix: Path) -> None:
    syms = nm(symfix / "cxx_app")
    with ElfFile(symfix / "cxx_app") as f:
        assert f.find_symbol("fx_mix_marker") == syms["fx_mix_marker"][0]
        assert f.find_symbol("no_such_symbol") is None
        # A NOTYPE label is not a function: the marker resolves to the enclosing function.
        name, _ = f.symbol_index().lookup(syms["fx_mix_marker"][0]) or ("", 0)
        assert "Accumulator" in name


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"#!/bin/sh\n" + b"x" * 100, "no ELF magic"),
        (b"\x7fELF\x01\x01\x01" + b"\0" * 100, "only 64-bit"),
        (b"\x7fELF", "too small"),
    ],
)
def test_bad_files_raise_clear_errors(tmp_path: Path, content: bytes, why: str) -> None:
    p = tmp_path / "bad"
    p.write_bytes(content)
    with pytest.raises(ElfFormatError, match=why) as e:
        ElfFile(p)
    assert str(p) in str(e.value)
    assert read_build_id(p) is None


def test_truncated_file(symfix: Path, tmp_path: Path) -> None:
    data = (symfix / "c_exported").read_bytes()
    p = tmp_path / "cut"
    p.write_bytes(data[:200])
    with pytest.raises(ElfFormatError, match="past the end"):
        ElfFile(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ElfFormatError, match="No such file"):
        ElfFile(tmp_path / "absent")


def test_symbol_versions_of_a_debug_symtab_are_left_out() -> None:
    """libc6-dbg's .symtab says `__libc_start_main@@GLIBC_2.34`; frames read `__libc_start_main`,
    as from the binary's .dynsym."""
    bid = read_build_id("/lib/x86_64-linux-gnu/libc.so.6")
    debug = Path(f"/usr/lib/debug/.build-id/{bid.hex()[:2]}/{bid.hex()[2:]}.debug") if bid else None
    if debug is None or not debug.exists():
        pytest.skip("libc6-dbg is not installed")
    with ElfFile(debug) as f:
        names = {n for _, _, n in f.symbol_index().items()}
    assert "__libc_start_main" in names and not any("@" in n for n in names)


@pytest.mark.parametrize("dynamic", [False, True])
def test_find_symbols_matches_nm_for_every_name(symfix: Path, dynamic: bool) -> None:
    # Every defined symbol at once, from .symtab (the fixture) and .dynsym (the C library: its
    # string table shares names' tails, `printf` inside `vprintf`): the addresses nm gives.
    path = "/lib/x86_64-linux-gnu/libc.so.6" if dynamic else symfix / "cxx_app"
    if not Path(path).exists():
        pytest.skip(f"{path} not on this host")
    out = subprocess.run(
        ["nm", "--defined-only", *(["-D"] if dynamic else []), str(path)], capture_output=True, text=True
    ).stdout
    rows = [line.split() for line in out.splitlines()]
    names = [(r[2].split("@")[0], int(r[0], 16)) for r in rows if len(r) == 3 and r[1] not in "Aa"]
    once = {n for n, k in Counter(n for n, _ in names).items() if k == 1}  # versions of one name: left out
    syms = {n: a for n, a in names if n in once}
    assert len(syms) > 20
    with ElfFile(path) as f:
        found = f.find_symbols(syms)
    assert {n: a for n, (a, _size) in found.items()} == syms

"""Resolver end to end on real binaries, real llvm-symbolizer, a real HTTP debuginfod and this kernel.

(a) C++ with templates, a namespace and an inlined helper, built -O2 -g, debug info split into a
    .build-id tree: demangled names, the inlined frame, file:line; cross-checked with binutils addr2line.
(b) stripped binaries without debug info: .dynsym names, the rest `module+0x…`.
(c) this machine's /proc/kallsyms as a snapshot: real kernel addresses.
(d) the same C++ binary fetched from a debuginfod server by build id.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.symbolizer import model
from bistouri.symbolizer.kallsyms import KallsymsError, KallsymsStore, parse_kallsyms
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.sources import DEBUGINFO, EXECUTABLE, DebugSources
from tests.unit.symbolizer.helpers import (
    FIXTURE_SRC,
    BuildIdServer,
    build_fixtures,
    build_id_hex,
    nm,
    vaddr_to_offset,
)

needs_llvm = pytest.mark.skipif(
    shutil.which("llvm-symbolizer-19") is None,
    reason="llvm-symbolizer-19 is not installed (apt-get install llvm-19)",
)
CPP = FIXTURE_SRC / "cxx_app.cpp"
RUN = "fx::Accumulator<unsigned long, 3>::run(unsigned long const*, unsigned long) [clone .isra.0]"
MIX = "unsigned long fx::detail::mix<unsigned long>(unsigned long, unsigned long)"


@pytest.fixture(scope="module")
def symfix() -> Path:
    return build_fixtures()


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(CPP.read_text().splitlines(), 1) if f"// MARK: {marker}" in line)


def _session(traces: list[wire.Trace], kernel: wire.KernelInfo | None = None) -> wire.Session:
    s = wire.Session("it", wire.Trigger("cpu"), kernel or wire.KernelInfo(), 0, 1, 1, traces=traces)
    return wire.decode_session(wire.encode_session(s))


def _stack(p: model.Profile, i: int = 0) -> list[model.Frame]:
    return [p.frames[x] for x in p.samples[i].stack]


def _cxx(symfix: Path) -> tuple[bytes, dict[str, int]]:
    syms = nm(symfix / "cxx_app")
    offs = {n: vaddr_to_offset(symfix / "cxx_app", v[0]) for n, v in syms.items() if v[2] in "Tt"}
    return bytes.fromhex(build_id_hex(symfix / "cxx_app")), offs


@needs_llvm
def test_cxx_split_debug_inlined_frames(symfix: Path) -> None:
    bid, off = _cxx(symfix)
    reg = CollectorRegistry()
    sources = DebugSources([str(symfix / "debug")], debuginfod_urls=[])
    user = (
        wire.UserFrame(wire.FRAME_RESOLVED, bid, off["fx_mix_marker"]),  # leaf, inside the inlined helper
        wire.UserFrame(wire.FRAME_RESOLVED, bid, off["fx_run_marker"] + 1),  # a return address
    )
    with Resolver(sources, registry=reg) as r:
        assert r.file_lines
        p = r.symbolize(_session([wire.Trace((), user, 1, 1, on_cpu=3)]))
    frames = _stack(p)
    assert [f.name for f in frames] == [RUN, RUN, MIX]
    assert [f.inlined for f in frames] == [False, False, True]
    assert {f.module for f in frames} == {"cxx_app"}
    assert all(Path(f.file).name == "cxx_app.cpp" for f in frames)
    assert frames[0].line == _line_of("run")
    assert frames[2].line == _line_of("mix")
    assert frames[1].line == _line_of("mix") + 12  # the call site of mix() in run()
    assert reg.get_sample_value("bistouri_symbolizer_module_loads_total", {"result": "dwarf"}) == 1


@needs_llvm
def test_cxx_lines_agree_with_binutils(symfix: Path) -> None:
    """Every address of run(): innermost file:line and inline depth as binutils addr2line -i sees them."""
    if shutil.which("addr2line") is None:
        pytest.skip("binutils addr2line is not installed")
    bid, off = _cxx(symfix)
    syms = nm(symfix / "cxx_app")
    (name,) = [n for n in syms if n.startswith("_ZN2fx11AccumulatorImLi3EE3run")]
    start, size, _ = syms[name]
    addrs = list(range(start, start + size))
    out = subprocess.run(
        ["addr2line", "-i", "-e", str(symfix / "cxx_app"), *[hex(a) for a in addrs]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    # addr2line -i prints one line per frame, innermost first: split its output with our depths.
    traces = [
        wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, bid, off[name] + i),), 1, i, on_cpu=1)
        for i in range(len(addrs))
    ]
    sources = DebugSources([str(symfix / "debug")], debuginfod_urls=[])
    with Resolver(sources, registry=CollectorRegistry()) as r:
        p = r.symbolize(_session(traces))
    pos = 0
    agree = 0
    for i in range(len(addrs)):
        chain = _stack(p, i)[::-1]  # innermost first, as addr2line prints
        ours = [(Path(f.file).name, f.line) for f in chain]
        theirs = []
        for line in out[pos : pos + len(chain)]:
            file, _, ln = line.rpartition(":")
            theirs.append((Path(file).name, int(ln.split()[0]) if ln.split()[0].isdigit() else 0))
        pos += len(chain)
        agree += ours == theirs
    assert pos == len(out), "inline depth differs somewhere"
    assert agree / len(addrs) > 0.95


@needs_llvm
def test_stripped_binaries_without_debug_info(symfix: Path) -> None:
    cbid = bytes.fromhex(build_id_hex(symfix / "c_exported"))
    lbid = bytes.fromhex(build_id_hex(symfix / "libfx.so"))
    c = {
        n: vaddr_to_offset(symfix / "c_exported", v[0])
        for n, v in nm(symfix / "c_exported").items()
        if v[2] in "Tt"
    }
    lib = {
        n: vaddr_to_offset(symfix / "libfx.so", v[0])
        for n, v in nm(symfix / "libfx.so").items()
        if v[2] in "Tt"
    }
    user = (
        wire.UserFrame(wire.FRAME_RESOLVED, lbid, lib["fx_internal_hash"] + 1),
        wire.UserFrame(wire.FRAME_RESOLVED, lbid, lib["fx_public_hash"] + 5),
        wire.UserFrame(wire.FRAME_RESOLVED, cbid, c["hidden_square"] + 3),
        wire.UserFrame(wire.FRAME_RESOLVED, cbid, c["exported_compute"] + 4),
        wire.UserFrame(wire.FRAME_RESOLVED, cbid, c["main"] + 9),
    )
    sources = DebugSources(binary_dirs=[str(symfix / "bin")], debuginfod_urls=[])
    with Resolver(sources, registry=CollectorRegistry()) as r:
        p = r.symbolize(_session([wire.Trace((), user, 1, 1, on_cpu=1)]))
    frames = _stack(p)
    assert [f.name for f in frames] == [
        "main",
        "exported_compute",
        f"c_exported+0x{c['hidden_square'] + 3:x}",  # non-leaf: shown as sent, looked up at -1
        "fx_public_hash",
        f"libfx.so+0x{lib['fx_internal_hash'] + 1:x}",
    ]
    assert all(f.file == "" and f.line == 0 and not f.inlined for f in frames)
    assert [f.module for f in frames] == ["c_exported"] * 3 + ["libfx.so"] * 2


@pytest.mark.root
def test_kernel_frames_from_this_machine() -> None:
    data = Path("/proc/kallsyms").read_bytes()
    try:
        idx = parse_kallsyms(data)
    except KallsymsError as e:
        pytest.skip(f"/proc/kallsyms has no usable addresses here: {e}")
    schedule = idx.address_of("schedule")
    do_sys_open = idx.address_of("do_sys_openat2") or idx.address_of("do_sys_open")
    etext = next(int(line.split()[0], 16) for line in data.splitlines() if line.endswith(b" _etext"))
    assert schedule is not None and do_sys_open is not None
    kbid = bytes.fromhex("ab" * 20)
    kernel = (schedule + 0x10, do_sys_open + 0x20, etext + 0x100)
    with tempfile.TemporaryDirectory() as state:
        store = KallsymsStore(state)
        store.put(kbid, data)
        with Resolver(DebugSources(debuginfod_urls=[]), store, registry=CollectorRegistry()) as r:
            p = r.symbolize(
                _session([wire.Trace(kernel, (), 1, 1, on_cpu=1)], wire.KernelInfo("x", kbid, idx.text_addr))
            )
    frames = _stack(p)
    assert [f.name for f in frames] == [
        f"[kernel]+0x{etext + 0x100:x}",
        idx.lookup(do_sys_open + 0x1F)[0],
        "schedule",
    ]
    assert all(f.kind == model.KIND_KERNEL for f in frames)
    assert frames[-1].module == "vmlinux"


@needs_llvm
def test_debuginfod_end_to_end(symfix: Path, tmp_path: Path) -> None:
    """No local files: the stripped binary and its debug info come from a debuginfod server by build id."""
    bid, off = _cxx(symfix)
    hexid = bid.hex()
    reg = CollectorRegistry()
    with BuildIdServer() as server:
        server.files[(hexid, DEBUGINFO)] = next((symfix / "debug" / ".build-id").glob("*/*.debug"))
        server.files[(hexid, EXECUTABLE)] = symfix / "bin" / "cxx_app"
        with Resolver.from_options(tmp_path / "state", debuginfod_urls=[server.url], registry=reg) as r:
            user = (wire.UserFrame(wire.FRAME_RESOLVED, bid, off["fx_mix_marker"]),)
            p = r.symbolize(_session([wire.Trace((), user, 1, 1, on_cpu=1)]))
        assert sorted(server.requests) == sorted(
            [f"/buildid/{hexid}/debuginfo", f"/buildid/{hexid}/executable"]
        )
    frames = _stack(p)
    assert [f.name for f in frames] == [RUN, MIX]
    assert frames[1].line == _line_of("mix") and frames[1].inlined
    # The executable's name is unknown to debuginfod: the build id's first 8 digits name the module.
    assert frames[0].module == hexid[:8]
    assert (tmp_path / "state" / "debuginfod" / hexid / "debuginfo").is_file()
    assert reg.get_sample_value("bistouri_symbolizer_sources_found_total", {"source": "debuginfod"}) == 2

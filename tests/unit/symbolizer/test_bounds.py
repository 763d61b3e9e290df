"""Issue 26: the symbolizer's parsers and caches bounded in bytes and time (N1, N2, N8).

Each input is crafted here (testkit/hostile.py) as an attacker would send it; each test failed on the
reader before its bound. Wall-clock limits are wide (the unbounded reader took 10-100 times longer).
"""

from __future__ import annotations

import gc
import gzip
import os
import shutil
import struct
import time
import tracemalloc
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import elf
from bistouri.elf import ElfFile, read_build_id
from bistouri.symbolizer.kallsyms import KallsymsStore, kernel_key, parse_kallsyms
from bistouri.symbolizer.llvm import LlvmPool
from testkit import hostile

BID = bytes.fromhex("aa" * 20)


def test_overlapping_note_sections_are_read_once(tmp_path: Path) -> None:
    """3 000 headers over one 64 KiB area, the build id after them: 16 M note steps unbounded (~8 s)."""
    path = tmp_path / "notes.so"
    path.write_bytes(hostile.elf_note_bomb(3000, 64 << 10, BID))
    started = time.process_time()
    got = read_build_id(path)
    took = time.process_time() - started
    assert took < 0.5, f"{took:.1f} s of CPU for the notes of one file"
    # The build id's own section is read first, whatever the order of the headers.
    assert got == BID


def test_note_walk_without_a_build_id_stops_at_its_bounds(tmp_path: Path) -> None:
    path = tmp_path / "notes.so"
    path.write_bytes(hostile.elf_note_bomb(3000, 64 << 10))
    started = time.process_time()
    assert read_build_id(path) is None
    assert time.process_time() - started < 0.5


def _peak_bytes(fn: object) -> tuple[object, int]:
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()  # type: ignore[operator]
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_gnu_debugdata_of_millions_of_symbols_is_bounded(tmp_path: Path) -> None:
    """1.2 M entries (28 MiB inflated, 10 KB on disk): a tuple per entry held ~230 MB."""
    path = tmp_path / "mini.so"
    path.write_bytes(hostile.elf_debugdata_bomb(1_200_000, BID))

    def index() -> elf.SymbolIndex:
        with ElfFile(path) as f:
            return f.symbol_index()

    idx, peak = _peak_bytes(index)
    assert peak < 120 << 20, f"peak {peak >> 20} MiB to index one file"
    # More than MAX_SYMBOLS candidates: the rest is left out, and said.
    assert _index_and_bounds(path)[1] == {"symbols"}
    assert idx.lookup(0x1004) == ("f", 4)  # type: ignore[attr-defined]
    assert idx.nbytes < 4096  # type: ignore[attr-defined]  # one symbol once aliases are merged: arrays, not objects


def test_gnu_debugdata_over_its_limit_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "big.so"
    path.write_bytes(hostile.elf_debugdata_bomb(elf.MAX_GNU_DEBUGDATA // 24 + 1000, BID))
    (got, peak) = _peak_bytes(lambda: _index_and_bounds(path))
    idx, hit = got  # type: ignore[misc]
    assert "gnu_debugdata" in hit and len(idx) == 0
    # Inflated to the limit (the decompressor's buffer doubles as it grows), then dropped.
    assert peak < 2 * elf.MAX_GNU_DEBUGDATA + (8 << 20)


def _index_and_bounds(path: Path) -> tuple[elf.SymbolIndex, set[str]]:
    with ElfFile(path) as f:
        return f.symbol_index(), f.bounds_hit


def _compressed_dwarf(tmp_path: Path, claimed: int) -> Path:
    """A -g binary with its DWARF zlib-compressed, .debug_info then claiming `claimed` bytes."""
    if not shutil.which("gcc") or not shutil.which("objcopy"):
        pytest.skip("gcc and objcopy build the DWARF fixture")
    src = tmp_path / "p.c"
    src.write_text("int f(int x) { return x * 3; }\nint main(void) { return f(2); }\n")
    out = tmp_path / "p"
    os.system(f"gcc -g -O0 -o {out} {src} && objcopy --compress-debug-sections=zlib {out}")
    with ElfFile(out) as f:
        sec = f.section(".debug_info")
        assert sec is not None and sec.flags & elf.SHF_COMPRESSED
        at = sec.offset + 8  # Elf64_Chdr.ch_size
    data = bytearray(out.read_bytes())
    struct.pack_into("<Q", data, at, claimed)
    out.write_bytes(bytes(data))
    return out


def test_compressed_dwarf_claiming_gigabytes_is_not_handed_to_llvm(tmp_path: Path) -> None:
    """A few KB of zlib that claims 5 GB: llvm-symbolizer would allocate the claim."""
    sane = _compressed_dwarf(tmp_path, 0)
    with ElfFile(sane) as f:
        real = struct.unpack_from("<Q", Path(sane).read_bytes(), f.section(".debug_info").offset + 8)  # type: ignore[union-attr]
    assert real == (0,)
    bomb = _compressed_dwarf(tmp_path, 5 << 30)
    with ElfFile(bomb) as f:
        assert not f.has_dwarf
        assert f.bounds_hit == {"dwarf"}


def test_llvm_runs_under_an_address_space_limit(tmp_path: Path) -> None:
    """The limit is set on the child (a libc lookup needs ~210 MB of address space): too low, it fails,
    and the file is quarantined instead of failing again at every session."""
    binary = shutil.which("llvm-symbolizer-19")
    if binary is None:
        pytest.skip("llvm-symbolizer-19 is not installed")
    libc = os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6")
    reg = CollectorRegistry()
    with LlvmPool(
        binary, workers=1, as_limit=48 << 20, quarantine_dir=str(tmp_path / "q"), registry=reg
    ) as pool:
        assert pool.symbolize(libc, [0x28000]) == [None]
        assert reg.get_sample_value("bistouri_symbolizer_llvm_quarantined_total", {"reason": "crash"}) == 1
        restarts = reg.get_sample_value("bistouri_symbolizer_llvm_restarts_total", {"reason": "crash"})
        assert pool.symbolize(libc, [0x28000]) == [None]
        # Quarantined: not sent again, no new crash.
        assert (
            reg.get_sample_value("bistouri_symbolizer_llvm_restarts_total", {"reason": "crash"}) == restarts
        )
        assert (
            reg.get_sample_value("bistouri_symbolizer_llvm_addresses_total", {"result": "quarantined"}) == 1
        )
    # Another process of the service reads the same quarantine; the default limit is enough for libc.
    reg2 = CollectorRegistry()
    with LlvmPool(binary, workers=1, quarantine_dir=str(tmp_path / "q"), registry=reg2) as pool:
        assert pool.symbolize(libc, [0x28000]) == [None]
        assert (
            reg2.get_sample_value("bistouri_symbolizer_llvm_addresses_total", {"result": "quarantined"}) == 1
        )
        for entry in (tmp_path / "q").iterdir():  # an operator lifts it by deleting the entry
            assert libc in entry.read_text()
            entry.unlink()
        got = pool.symbolize(libc, [0x28000])
        assert got[0], "libc's lookup fits the default limit"
        (pid,) = pool.pids()
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert f"Max address space         {1 << 30}" in limits


def test_quarantine_is_lifted_when_the_file_changes(tmp_path: Path) -> None:
    from bistouri.symbolizer.llvm import Quarantine

    f = tmp_path / "x.debug"
    f.write_bytes(b"one")
    q = Quarantine(str(tmp_path / "q"))
    q.add(str(f), "crash")
    assert q.holds(str(f))
    f.write_bytes(b"other content")
    assert not q.holds(str(f))
    q.add(str(f), "timeout")
    assert Quarantine(str(tmp_path / "q"), ttl_s=0).holds(str(f)) is False  # expired


def _kallsyms(slide: int, modules_at: int, n: int = 2000) -> bytes:
    """A boot's /proc/kallsyms: the kernel's n functions at _text + slide, a module elsewhere."""
    text = 0xFFFFFFFF81000000 + slide
    lines = [f"{text:016x} T _text"]
    lines += [f"{text + 0x100 + 0x40 * i:016x} T kernel_function_{i}" for i in range(n)]
    lines += [f"{modules_at + 0x20 * i:016x} t ext4_fn_{i}\t[ext4]" for i in range(200)]
    return ("\n".join(lines) + "\n").encode()


def test_boots_of_one_kernel_share_its_symbols(tmp_path: Path) -> None:
    """35 hosts on one kernel, each its own KASLR slide: one copy of the kernel's part (N8)."""
    store = KallsymsStore(str(tmp_path))
    indexes = []
    for host in range(35):
        slide = host << 21
        key = kernel_key(BID, bytes([host]) * 16)
        store.put(key, gzip.compress(_kallsyms(slide, 0xFFFFFFFFC0000000 + (host << 24))))
        idx = store.get(key)
        assert idx is not None
        indexes.append(idx)
        text = 0xFFFFFFFF81000000 + slide
        assert idx.lookup(text + 0x100 + 0x40 * 7 + 3) == ("kernel_function_7", "", 3)
        assert idx.lookup(0xFFFFFFFFC0000000 + (host << 24) + 0x21) == ("ext4_fn_1", "ext4", 1)
    assert len({i.core_id for i in indexes}) == 1
    one = indexes[0].core_nbytes + indexes[0].nbytes
    assert store.loaded_bytes() < one + 35 * indexes[0].nbytes


def test_the_store_lru_frees_what_it_drops(tmp_path: Path) -> None:
    """The resolver keeps no parsed snapshot alive: the store's bound is the memory bound (N8)."""
    from bistouri import wire
    from bistouri.symbolizer.resolve import Resolver

    store = KallsymsStore(str(tmp_path), max_loaded=1)
    resolver = Resolver(kernels=store, use_llvm=False, registry=CollectorRegistry())
    refs = []
    for boot in range(3):
        boot_id = bytes([boot + 1]) * 16
        # Distinct kernels (different layouts): nothing shared, each index its own.
        store.put(kernel_key(BID, boot_id), _kallsyms(0, 0xFFFFFFFFC0000000, n=1000 + boot))
        s = hostile.deep_session(f"k{boot}", 0, (0xFFFFFFFF81000100 + 0x40 * 3 + 1,))
        s = replace(s, kernel=wire.KernelInfo("6.18", BID, 0xFFFFFFFF81000000, boot_id))
        profile = resolver.symbolize(s)
        assert [f.name for f in profile.frames] == ["kernel_function_3"]
        refs.append(weakref.ref(store.get(kernel_key(BID, boot_id))))  # type: ignore[arg-type]
    gc.collect()
    assert [r() is None for r in refs] == [True, True, False]


def test_module_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    """Modules of many symbols: the cache keeps what fits its byte budget, not 128 of them."""
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.sources import DebugSources

    for i in range(4):
        bid = bytes([i + 1]) * 20
        (tmp_path / f"m{i}.so").write_bytes(_many_symbols(bid, 20_000 + i))
    sources = DebugSources([], [str(tmp_path)], debuginfod_urls=[])
    one = 20_000 * 20 + 20_000 * 8  # about: arrays and names of one module
    r = Resolver(sources, use_llvm=False, max_module_bytes=2 * one, registry=CollectorRegistry())
    for i in range(4):
        assert r.module(bytes([i + 1]) * 20) is not None
    assert 1 <= len(r._modules) <= 2
    assert r._module_bytes <= 2 * one


def _many_symbols(build_id: bytes, n: int) -> bytes:
    names = b"\0" + b"".join(b"fn_%07d\0" % i for i in range(n))
    syms = b"\0" * 24 + b"".join(
        struct.pack("<IBBHQQ", 1 + 11 * i, 0x12, 0, 1, 0x1000 + 16 * i, 16) for i in range(n)
    )
    return hostile.elf64(
        [
            {"name": ".text", "type": 1, "flags": 6, "addr": 0x1000, "data": b"\xc3" * (16 * n)},
            hostile.build_id_note(build_id),
            {"name": ".symtab", "type": 2, "data": syms, "link": 4, "align": 8, "entsize": 24},
            {"name": ".strtab", "type": 3, "data": names},
        ]
    )


def test_a_process_killed_while_reading_a_file_quarantines_it(tmp_path: Path) -> None:
    """A worker OOM-killed inside attempt() leaves its marker: the next process skips the file."""
    import signal
    import subprocess
    import sys

    from bistouri.symbolizer.llvm import Quarantine

    f = tmp_path / "x.debug"
    f.write_bytes(b"dwarf")
    q = str(tmp_path / "q")
    script = (
        "import os, signal, sys\n"
        "from bistouri.symbolizer.llvm import Quarantine\n"
        "with Quarantine(sys.argv[1]).attempt(sys.argv[2]):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, q, str(f)], check=False)
    assert proc.returncode == -signal.SIGKILL
    quarantine = Quarantine(q)
    assert quarantine.holds(str(f))
    (entry,) = (tmp_path / "q").iterdir()  # the marker became an entry an operator can read
    assert "worker_died" in entry.read_text()
    with quarantine.attempt(str(tmp_path / "other")):  # our own marker: work in progress, not a death
        assert not Quarantine(q).holds(str(tmp_path / "other"))
    assert not quarantine.holds(str(tmp_path / "other"))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_symbolize_run_stopped_mid_read_quarantines_nothing(tmp_path: Path, sig: str) -> None:
    """`timeout`, a closed terminal: the run unwinds as on Ctrl-C, its marker goes with it; only a death
    inside the work (the OOM killer: SIGKILL) quarantines. The build id was unnamed for 24 h before."""
    import signal
    import subprocess
    import sys

    from bistouri import wire
    from bistouri.symbolizer.llvm import Quarantine

    build_id = bytes(range(20))
    frame = wire.UserFrame(wire.FRAME_RESOLVED, build_id, 0x1234, "app")
    session = wire.Session(
        "stopped-1",
        wire.Trigger("cpu", cgroup="/"),
        wire.KernelInfo(),
        1_763_000_000 * 10**9,
        10**9,
        10**7,
        processes={1: "app"},
        traces=[wire.Trace((), (frame,), 1, 1, on_cpu=1)],
    )
    (tmp_path / "s.msgpack").write_bytes(wire.encode_session(session))
    state = tmp_path / "state"
    script = (
        "import os, signal, sys, time\n"
        "from bistouri.symbolizer import resolve\n"
        "from bistouri.symbolizer.service import cli\n"
        f"signal.signal(signal.{sig}, signal.SIG_DFL)  # as a shell leaves it (pytest may run under nohup)\n"
        "def read(*_args):\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "    time.sleep(30)\n"
        "resolve.Resolver._read_module = read\n"
        "sys.exit(cli.main(['symbolize', sys.argv[1], '--state-dir', sys.argv[2], '--format', 'folded']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s.msgpack"), str(state)],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert list((state / "quarantine").iterdir()) == []  # it said [<…>.busy-PID] before
    assert not Quarantine(str(state / "quarantine")).holds(f"module:{build_id.hex()}")


def test_section_names_are_read_within_bounds(tmp_path: Path) -> None:
    """2 000 headers naming offset 0 of an 8 MiB .shstrtab without a NUL: 16 GB decoded unbounded."""
    image = bytearray(hostile.elf_note_bomb(2000, 16))
    shoff, shstrndx = struct.unpack_from("<Q", image, 40)[0], struct.unpack_from("<H", image, 62)[0]
    # The string table becomes 8 MiB of "A" appended to the file.
    struct.pack_into("<QQ", image, shoff + shstrndx * 64 + 24, len(image), 8 << 20)
    path = tmp_path / "names.so"
    path.write_bytes(bytes(image) + b"A" * (8 << 20))
    started = time.process_time()
    with ElfFile(path) as f:
        took = time.process_time() - started
        assert took < 1.0, f"{took:.1f} s of CPU for the section headers"
        assert len(f.sections) == 2000 + 4
        assert f.bounds_hit == {"section_names"}
        assert all(len(s.name) <= elf.MAX_SECTION_NAME for s in f.sections)


def test_records_compact_kallsyms_still_names_kernel_frames() -> None:
    """`bistouri record` hands the resolver its KallsymsTable, which takes no weak reference."""
    from typing import cast

    from bistouri import wire
    from bistouri.record.symcache import CachedKallsyms
    from bistouri.record.symfile import KallsymsTable, encode_kallsyms, joined
    from bistouri.symbolizer.resolve import Resolver

    kernels = CachedKallsyms(BID, "k-test", None, "/proc")
    text = b"ffffffff81000000 T _text\nffffffff81000100 T foo\nffffffff81000200 T _etext\n"
    parsed = parse_kallsyms(text)
    kernels._index = KallsymsTable(joined(encode_kallsyms(parsed.rows(), parsed.text_addr)))
    r = Resolver(kernels=cast(KallsymsStore, kernels), use_llvm=False, registry=None)
    s = replace(
        hostile.deep_session("rec", 0, (0xFFFFFFFF81000104,)),
        kernel=wire.KernelInfo("6.18", BID, 0xFFFFFFFF81000000),
    )
    assert [f.name for f in r.symbolize(s).frames] == ["foo"]

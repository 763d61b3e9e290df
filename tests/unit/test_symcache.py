"""The persistent symbol cache of `bistouri record` (bistouri/record/symcache.py), on real files."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from bistouri.record import symcache, symfile
from bistouri.symbolizer.kallsyms import parse_kallsyms
from bistouri.symbolizer.model import Frame

KALLSYMS = b"""\
ffffffff81000000 T _text
ffffffff81000000 T startup_64
ffffffff81001000 T do_syscall_64
ffffffff81001000 t __pi_do_syscall_64
ffffffff81002000 T schedule
ffffffff81002800 T _etext
ffffffffc0000000 t ext4_sync_file\t[ext4]
ffffffffc0001000 t ext4_fsync\t[ext4]
"""


def frames(n: int) -> dict[tuple[int, bool], tuple[Frame, ...]]:
    return {
        (0x1000 + i, i % 2 == 0): (Frame(f"outer_{i}", "app", "a.c", i), Frame(f"f_{i}", "app", inlined=True))
        for i in range(n)
    }


def entry(cache: symcache.SymbolCache, key: str) -> tuple[dict, bool]:
    """What the cache holds for `key`, read whole: (answers, made with DWARF?)."""
    table = cache.frames(key)
    assert table is not None
    with table:
        return dict(table.items()), table.file_lines


def test_frames_round_trip_and_merge_across_instances(tmp_path: Path) -> None:
    a = symcache.SymbolCache(tmp_path / "c")
    a.add_frames("ab" * 20, frames(3), True)
    b = symcache.SymbolCache(tmp_path / "c")  # another run: what the first wrote is kept
    b.add_frames("ab" * 20, {(0x9999, False): (Frame("late", "app"),)}, True)
    assert entry(a, "ab" * 20) == ({**frames(3), (0x9999, False): (Frame("late", "app"),)}, True)
    assert a.frames("cd" * 20) is None
    # Names-only answers (no DWARF then) never replace answers with file:line; the reverse does.
    a.add_frames("ab" * 20, {(0x1, True): (Frame("names_only", "app"),)}, False)
    assert (0x1, True) not in entry(a, "ab" * 20)[0]
    a.add_frames("cd" * 20, {(0x1, True): (Frame("names_only", "app"),)}, False)
    a.add_frames("cd" * 20, {(0x2, True): (Frame("f", "app", "f.c", 3),)}, True)
    assert entry(a, "cd" * 20) == ({(0x2, True): (Frame("f", "app", "f.c", 3),)}, True)


def _writer(root: str, first: int) -> None:
    cache = symcache.SymbolCache(root)
    for i in range(first, first + 40):
        cache.add_frames("aa" * 20, {(i, True): (Frame(f"f_{i}", "m"),)}, False)


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Two processes adding to one entry at once: each merge runs under the lock, none is lost."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), first)) for first in (0, 1000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got, _ = entry(symcache.SymbolCache(tmp_path), "aa" * 20)
    assert sorted(got) == [(i, True) for i in [*range(40), *range(1000, 1040)]]
    assert got[(1039, True)] == (Frame("f_1039", "m"),)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


def _reader(root: str, rounds: int) -> None:
    """Reads while others write: every file it opens is whole, every answer right."""
    cache = symcache.SymbolCache(root)
    for _ in range(rounds):
        table = cache.frames("aa" * 20)
        if table is not None:
            with table:
                for (addr, _leaf), got in table.items():
                    assert got == (Frame(f"f_{addr}", "m"),)


def test_a_reader_during_two_writers_sees_whole_files(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), first)) for first in (0, 1000)]
    procs.append(ctx.Process(target=_reader, args=(str(tmp_path), 300)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(entry(symcache.SymbolCache(tmp_path), "aa" * 20)[0]) == 80


def test_an_open_file_stays_readable_when_another_run_replaces_it(tmp_path: Path) -> None:
    cache = symcache.SymbolCache(tmp_path)
    cache.add_frames("ab" * 20, frames(3), True)
    table = cache.frames("ab" * 20)
    assert table is not None
    symcache.SymbolCache(tmp_path).add_frames("ab" * 20, {(0x1, True): (Frame("new"),)}, True)
    with table:  # the mapping is of the file it opened, which the rename did not touch
        assert dict(table.items()) == frames(3)
    assert entry(cache, "ab" * 20)[0] == {**frames(3), (0x1, True): (Frame("new"),)}


def test_nothing_new_leaves_the_file_as_it_is(tmp_path: Path) -> None:
    # A warm run whose misses were all left to DWARF adds nothing from the symbols: the file is
    # not rewritten (it was re-encoded whole, ~20 ms for 4 000 entries).
    cache = symcache.SymbolCache(tmp_path)
    cache.add_frames("ab" * 20, frames(3), True)
    before = os.stat(tmp_path / ("ab" * 20 + ".frames")).st_ino
    cache.add_frames("ab" * 20, {}, True)
    assert os.stat(tmp_path / ("ab" * 20 + ".frames")).st_ino == before
    assert entry(cache, "ab" * 20) == (frames(3), True)


def test_a_corrupt_file_is_removed_and_never_trusted(tmp_path: Path) -> None:
    cache = symcache.SymbolCache(tmp_path)
    cache.add_frames("ab" * 20, frames(5), False)
    path = tmp_path / ("ab" * 20 + ".frames")
    good = path.read_bytes()
    data = bytearray(good)
    data[-3] ^= 0x20  # one flipped bit in a string: the entries that use it fail their checksum
    path.write_bytes(bytes(data))
    table = cache.frames("ab" * 20)
    assert table is not None
    with pytest.raises(symcache.CorruptFile), table:
        dict(table.items())
    path.write_bytes(good[:-1])  # truncated: refused when opened
    assert cache.frames("ab" * 20) is None and not path.exists()
    path.write_bytes(b"BSYM")  # an older format, or a header cut short
    assert cache.frames("ab" * 20) is None and not path.exists()


def test_bounded_in_bytes_least_recently_used_first(tmp_path: Path) -> None:
    cache = symcache.SymbolCache(tmp_path, max_bytes=1)
    cache.max_bytes = 10**9
    for i, key in enumerate(("aa" * 20, "bb" * 20, "cc" * 20)):
        cache.add_frames(key, frames(200), False)
        os.utime(tmp_path / f"{key}.frames", (1000 + i, 1000 + i))
    one = (tmp_path / ("aa" * 20 + ".frames")).stat().st_size
    assert cache.frames("aa" * 20) is not None  # a hit makes it the most recently used
    cache.max_bytes = 2 * one + one // 2
    assert cache.evict() == 1
    left = sorted(p.name for p in tmp_path.glob("*.frames"))
    assert left == ["aa" * 20 + ".frames", "cc" * 20 + ".frames"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= cache.max_bytes


def test_kallsyms_compact_form_answers_like_the_parsed_index(tmp_path: Path) -> None:
    parsed = parse_kallsyms(KALLSYMS)
    cache = symcache.SymbolCache(tmp_path)
    assert cache.put_kallsyms("k-1", symfile.encode_kallsyms(parsed.rows(), parsed.text_addr))
    loaded = cache.kallsyms("k-1")
    assert loaded is not None and loaded.text_addr == parsed.text_addr == 0xFFFFFFFF81000000
    ips = (0xFFFFFFFF80FFFFFF, 0xFFFFFFFF81000010, 0xFFFFFFFF81001234, 0xFFFFFFFF81002900)
    for ip in (*ips, 0xFFFFFFFFC0000010, 0xFFFFFFFFC0001002, 0xFFFFFFFFC1000000):
        assert loaded.lookup(ip) == parsed.lookup(ip), hex(ip)
    assert loaded.lookup(0xFFFFFFFFC0001002) == ("ext4_fsync", "ext4", 2)
    assert loaded.address_of("schedule") == 0xFFFFFFFF81002000


def test_kernel_key_changes_with_the_boot(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text("one\n")
    (proc / "modules").write_text("ext4 1 2 - Live 0xffffffffc0000000\n")
    first = symcache.kernel_boot_key(b"\x01" * 20, str(proc))
    (proc / "modules").write_text("ext4 1 5 - Live 0xffffffffc0000000\n")  # a use count: same symbols
    assert symcache.kernel_boot_key(b"\x01" * 20, str(proc)) == first
    (proc / "modules").write_text("ext4 1 5 - Live 0xffffffffc0100000\n")  # reloaded elsewhere
    assert symcache.kernel_boot_key(b"\x01" * 20, str(proc)) != first
    (proc / "sys/kernel/random/boot_id").write_text("two\n")
    assert symcache.kernel_boot_key(b"\x01" * 20, str(proc)) != first


def test_unsafe_directories_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(symcache.CacheUnusable, match="symlink"):
        symcache.SymbolCache(link)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(symcache.CacheUnusable, match="writable by others"):
        symcache.SymbolCache(shared)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(symcache.CacheUnusable, match="belongs to uid 65534"):
            symcache.SymbolCache(theirs)


def test_a_planted_link_in_the_cache_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    cache_dir = tmp_path / "c"
    cache = symcache.SymbolCache(cache_dir)
    (cache_dir / ("ab" * 20 + ".frames")).symlink_to(victim)
    assert cache.frames("ab" * 20) is None
    cache.add_frames("ab" * 20, frames(1), False)
    assert victim.read_bytes() == b"precious"
    assert not (cache_dir / ("ab" * 20 + ".frames")).is_symlink()
    assert cache.frames("ab" * 20) is not None


def test_kernel_frames_named_without_the_resolver_equal_the_resolvers(tmp_path: Path) -> None:
    """record names new kernel addresses from kallsyms itself (no resolver import): same answers."""
    from bistouri import wire
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver

    build_id = b"\x42" * 20
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "kallsyms").write_bytes(KALLSYMS)
    ips = [0xFFFFFFFF81001010, 0xFFFFFFFF81002000, 0xFFFFFFFF81002001, 0xFFFFFFFFC0001002, 0xFFFFFFFF70000000]
    keys = [(ip, leaf) for ip in ips for leaf in (True, False)]
    direct = symcache.CachedKallsyms(build_id, "k-test", symcache.SymbolCache(tmp_path / "c"), str(proc))
    got = direct.frames(keys)
    assert (tmp_path / "c" / "k-test.kallsyms").exists()  # parsed, then read back from the cache
    store = KallsymsStore(str(tmp_path / "state"))
    store.put(build_id, KALLSYMS)
    session = wire.Session(
        "s", wire.Trigger("cpu"), wire.KernelInfo("6.1", build_id, 0xFFFFFFFF81000000), 0, 1, 1
    )
    with Resolver(kernels=store, use_llvm=False, registry=None) as resolver:
        want = symcache._resolve(resolver, session, b"", keys)
    assert got == want
    assert got[(0xFFFFFFFF81002000, False)][0].name == "do_syscall_64"  # a call site: address - 1
    # The compact index went to the cache: the next run reads no /proc/kallsyms.
    (proc / "kallsyms").unlink()
    again = symcache.CachedKallsyms(build_id, "k-test", symcache.SymbolCache(tmp_path / "c"), str(proc))
    assert again.frames(keys) == got


@pytest.mark.parametrize("batch", [symcache.PROBE_BATCH, 3])
def test_symbolize_through_the_cache_equals_the_resolver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Probes, cache and stack assembly give the resolver's profile; a rerun needs no resolver.
    Named in batches of keys (3: every module in several), the same."""
    monkeypatch.setattr(symcache, "PROBE_BATCH", batch)
    from bistouri.symbolizer import formats
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.sources import DebugSources
    from tests.ui import data

    kernels = KallsymsStore(str(tmp_path / "state"))
    kernels.put(data.KERNEL_BUILD_ID, data.kallsyms_gz())

    def resolver(file_lines: bool = True, known_symbols: object = None) -> Resolver:
        return Resolver(DebugSources([], [str(data.WORKLOADS)], []), kernels, registry=None)

    def no_resolver(file_lines: bool, known_symbols: object = None) -> Resolver:
        raise AssertionError("everything should come from the cache")

    def render(p) -> list[str]:
        return [formats.folded(p, v) for v in ("on_cpu", "off_cpu", "off_cpu_ns")]

    sessions = data.ui_sessions()
    for session in sessions.values():
        with resolver() as r:
            want = render(r.symbolize(session))
        cache = symcache.SymbolCache(tmp_path / "cache")
        got, stats = symcache.symbolize(session, cache, resolver, "k-ui", [])
        assert render(got) == want
        assert got.meta == r.symbolize(session).meta
        again, stats = symcache.symbolize(
            session, symcache.SymbolCache(tmp_path / "cache"), no_resolver, "k-ui", []
        )
        assert render(again) == want and stats.cached == stats.addresses
        assert "main;" in want[0] and "_[k]" in want[0]  # user and kernel frames were named
    # Damaged files: their answers are asked again (and the files rebuilt), never used.
    files = sorted((tmp_path / "cache").glob("*.frames"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-2] ^= 0x20  # the last string of each: the entries that use it fail their checksum
        f.write_bytes(bytes(raw))
    for session in sessions.values():
        with resolver() as r:
            want = render(r.symbolize(session))
        got, stats = symcache.symbolize(
            session, symcache.SymbolCache(tmp_path / "cache"), resolver, "k-ui", []
        )
        assert render(got) == want
    for f in files:
        table = symcache.SymbolCache(tmp_path / "cache").frames(f.name.removesuffix(".frames"))
        assert table is not None
        with table:
            dict(table.items())  # whole again


def test_a_cache_that_cannot_be_written_costs_nothing_but_the_cache(tmp_path: Path) -> None:
    cache = symcache.SymbolCache(tmp_path)
    (tmp_path / ".lock").symlink_to(tmp_path / "elsewhere")  # a planted lock: O_NOFOLLOW refuses it
    cache.add_frames("ab" * 20, frames(2), False)  # logged, not raised
    parsed = parse_kallsyms(KALLSYMS)
    assert not cache.put_kallsyms("k-1", symfile.encode_kallsyms(parsed.rows(), parsed.text_addr))
    assert cache.frames("ab" * 20) is None and cache.kallsyms("k-1") is None
    assert not (tmp_path / "elsewhere").exists()


def test_bytes_around_a_new_leaf_are_cached_for_the_next_run(tmp_path: Path) -> None:
    """A loop's next samples land on neighbouring instructions: they need no resolver then."""
    import dataclasses

    from bistouri import wire
    from bistouri.symbolizer import formats
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.sources import DebugSources
    from tests.ui import data

    kernels = KallsymsStore(str(tmp_path / "state"))
    kernels.put(data.KERNEL_BUILD_ID, data.kallsyms_gz())

    def resolver(file_lines: bool = True, known_symbols: object = None) -> Resolver:
        return Resolver(DebugSources([], [str(data.WORKLOADS)], []), kernels, registry=None)

    def no_resolver(file_lines: bool, known_symbols: object = None) -> Resolver:
        raise AssertionError("the neighbours should come from the cache")

    session = next(iter(data.ui_sessions().values()))
    symcache.symbolize(session, symcache.SymbolCache(tmp_path / "c"), resolver, "k-ui", [])
    t = next(t for t in session.traces if t.user and t.user[0].kind == wire.FRAME_RESOLVED)
    for delta in (-symcache.NEIGHBOUR_BYTES, 1, symcache.NEIGHBOUR_BYTES):
        leaf = dataclasses.replace(t.user[0], address=t.user[0].address + delta)
        moved = dataclasses.replace(session, traces=[dataclasses.replace(t, user=(leaf, *t.user[1:]))])
        got, _ = symcache.symbolize(moved, symcache.SymbolCache(tmp_path / "c"), no_resolver, "k-ui", [])
        with resolver() as r:
            want = r.symbolize(moved)
        views = ("on_cpu", "off_cpu_ns")
        assert [formats.folded(got, v) for v in views] == [formats.folded(want, v) for v in views]
        assert "".join(formats.folded(got, v) for v in views).count("\n") == 1


def test_record_keeps_the_onset_and_the_wait_states_as_the_service_does(tmp_path: Path) -> None:
    """One stack assembler (symbolizer/stacks.py): record's profile carries each sample's
    before-the-trigger mark and off-CPU state (S, D, reclaim, runqueue) as the service's does.
    record once dropped the mark and labelled every wait D."""
    from bistouri import wire
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver

    build_id = b"\x42" * 20
    store = KallsymsStore(str(tmp_path / "state"))
    store.put(build_id, KALLSYMS)
    schedule, syscall, fsync = 0xFFFFFFFF81002010, 0xFFFFFFFF81001010, 0xFFFFFFFFC0001002
    user = (
        wire.UserFrame(wire.FRAME_VDSO, b"", 0x7FFF0010),
        wire.UserFrame(wire.FRAME_RESOLVED, b"\x07" * 20, 0x1234, "app"),  # a file nowhere to be found
        wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x55000000),
    )
    traces = [
        wire.Trace((syscall,), user, 1, 1, on_cpu=3, pre_trigger=True),
        wire.Trace((syscall,), user, 1, 1, on_cpu=4),
        *(
            wire.Trace(
                (schedule, fsync, syscall),
                user[1:],
                1,
                2,
                off_cpu=n,
                off_cpu_ns=n * 1000,
                wait=w,
                pre_trigger=pre,
            )
            for n, (w, pre) in enumerate(
                [
                    (wire.WAIT_S, True),
                    (wire.WAIT_D, False),
                    (wire.WAIT_RECLAIM, True),
                    (wire.WAIT_RUNQUEUE, False),
                ],
                1,
            )
        ),
    ]
    session = wire.Session(
        "s",
        wire.Trigger("memory"),
        wire.KernelInfo("6.1", build_id, 0xFFFFFFFF81000000),
        0,
        1,
        1,
        processes={1: "app"},
        threads={1: "main", 2: "io"},
        traces=traces,
        pre_trigger_ns=5,
    )

    def resolver(file_lines: bool = True, known_symbols: object = None) -> Resolver:
        return Resolver(kernels=store, use_llvm=False, registry=None)

    with resolver() as r:
        want = r.symbolize(session)
    got, _ = symcache.symbolize(session, symcache.SymbolCache(tmp_path / "c"), resolver, "k-test", [])

    def rows(p) -> list[tuple]:
        return [
            (
                [p.frames[i] for i in s.stack],
                s.thread,
                s.on_cpu,
                s.off_cpu,
                s.off_cpu_ns,
                s.pre_trigger,
                s.wait,
            )
            for s in p.samples
        ]

    assert rows(got) == rows(want) and got.frames == want.frames and got.meta == want.meta
    assert [(s.pre_trigger, s.wait) for s in got.samples[2:]] == [
        (True, wire.WAIT_S),
        (False, wire.WAIT_D),
        (True, wire.WAIT_RECLAIM),
        (False, wire.WAIT_RUNQUEUE),
    ]
    assert [s.pre_trigger for s in got.samples[:2]] == [True, False]
    assert [f.name for f in got.frames[: len(got.samples[0].stack)]][-1] == "do_syscall_64"


def test_record_names_python_frames_as_the_service_does(tmp_path: Path) -> None:
    """`bistouri record`'s outputs: a Python frame (wire v4) stays a python frame with its file and
    line, between the native frames around it, and reaches folded as `name (file:line)`."""
    from bistouri import wire
    from bistouri.symbolizer import formats
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver

    build_id = b"\x42" * 20
    store = KallsymsStore(str(tmp_path / "state"))
    store.put(build_id, KALLSYMS)
    user = (
        wire.UserFrame(wire.FRAME_RESOLVED, b"\x07" * 20, 0x1234, "_zlib.so"),  # a file nowhere to be found
        wire.UserFrame(wire.FRAME_PYTHON, b"", 6, "Worker.hot_loop", "w.py"),
        wire.UserFrame(wire.FRAME_PYTHON, b"", 12, "<module>", "w.py"),
        wire.UserFrame(wire.FRAME_RESOLVED, b"\x08" * 20, 0x99, "python3.11"),
    )
    session = wire.Session(
        "s",
        wire.Trigger("cpu"),
        wire.KernelInfo("6.1", build_id, 0xFFFFFFFF81000000),
        0,
        1,
        1,
        processes={1: "python3.11"},
        traces=[wire.Trace((0xFFFFFFFF81001010,), user, 1, 1, on_cpu=3)],
    )

    def resolver(file_lines: bool = True, known_symbols: object = None) -> Resolver:
        return Resolver(kernels=store, use_llvm=False, registry=None)

    with resolver() as r:
        want = r.symbolize(session)
    got, stats = symcache.symbolize(session, symcache.SymbolCache(tmp_path / "c"), resolver, "k-test", [])
    assert got.frames == want.frames and [s.stack for s in got.samples] == [s.stack for s in want.samples]
    assert stats.labels == 2  # the Python frames: named by the agent, nothing to look up
    assert formats.folded(got) == (
        "python3.11+0x99;<module> (w.py:12);Worker.hot_loop (w.py:6);_zlib.so+0x1234;do_syscall_64_[k] 3\n"
    )


def test_a_binary_without_dwarf_is_named_from_its_cached_symbols_as_the_resolver_names_it(
    tmp_path: Path,
) -> None:
    """Its symbols go to the cache with its first answers: its next new addresses need no resolver."""
    import shutil
    import subprocess

    from bistouri import wire
    from bistouri.elf import ElfFile
    from bistouri.symbolizer import formats
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.sources import DebugSources
    from tests.ui import data

    bins = tmp_path / "bins"
    bins.mkdir()
    stripped = bins / "shares"
    shutil.copy(data.WORKLOADS / "shares", stripped)
    subprocess.run(["objcopy", "--strip-debug", str(stripped)], check=True)
    with ElfFile(stripped) as elf:
        bid = elf.build_id
        assert bid and not elf.has_dwarf
        text = next(s for s in elf.segments if s.flags & 1)  # PF_X
    kernels = KallsymsStore(str(tmp_path / "state"))

    def resolver(file_lines: bool = True, known_symbols: object = None) -> Resolver:
        return Resolver(DebugSources([], [str(bins)], []), kernels, use_llvm=False, registry=None)

    def no_resolver(file_lines: bool, known_symbols: object = None) -> Resolver:
        raise AssertionError("the symbols should come from the cache")

    def session(offsets: range) -> wire.Session:
        traces = [
            wire.Trace(
                kernel=(),
                user=(
                    wire.UserFrame(wire.FRAME_RESOLVED, bid, off, "shares"),
                    wire.UserFrame(wire.FRAME_RESOLVED, bid, off + 5, "shares"),  # a call site
                ),
                pid=1,
                tid=1,
                on_cpu=1,
            )
            for off in offsets
        ]
        return wire.Session("s", wire.Trigger("cpu"), wire.KernelInfo(), 0, 1, 1, traces=traces)

    def render(p) -> str:
        return formats.folded(p, "on_cpu")

    first = session(range(text.offset, text.offset + 120, 40))
    (tmp_path / "c").mkdir(mode=0o700)
    planted = tmp_path / "c" / f"{bid.hex()}.symbols"
    planted.symlink_to(tmp_path / "elsewhere")  # replaced, never followed
    symcache.symbolize(first, symcache.SymbolCache(tmp_path / "c"), resolver, "k", [])
    assert planted.is_file() and not planted.is_symlink() and not (tmp_path / "elsewhere").exists()
    # Far from the first (beyond the neighbours cached with them), and past the end of the segment.
    later = session(range(text.offset + 200, text.offset + text.filesz + 100, 23))
    got, stats = symcache.symbolize(later, symcache.SymbolCache(tmp_path / "c"), no_resolver, "k", [])
    with resolver() as r:
        want = r.symbolize(later)
    assert render(got) == render(want) and stats.cached < stats.addresses
    assert "work_seventy" in render(got) or "main" in render(got)


def test_a_binary_with_some_dwarf_is_named_from_its_symbols_where_no_dwarf_describes_the_address(
    tmp_path: Path,
) -> None:
    """node's case: DWARF for a few files only. Its symbols go to the cache with the ranges its
    DWARF describes; a new address outside them needs no resolver, one inside goes to it."""
    import shutil
    import subprocess

    from bistouri import wire
    from bistouri.elf import ElfFile
    from bistouri.symbolizer import formats
    from bistouri.symbolizer.dwarf import covered_ranges
    from bistouri.symbolizer.kallsyms import KallsymsStore
    from bistouri.symbolizer.llvm import CANDIDATES
    from bistouri.symbolizer.resolve import Resolver
    from bistouri.symbolizer.sources import DebugSources

    bins = tmp_path / "bins"
    bins.mkdir()
    (tmp_path / "a.c").write_text("int with_dwarf(int x) { return x * 3 + 1; }\n")
    body = " ".join(f"s += with_dwarf(s + {i});" for i in range(40))
    (tmp_path / "b.c").write_text(f"int with_dwarf(int);\nint main(void) {{ int s = 0; {body} return s; }}\n")
    a, b, exe = tmp_path / "a.o", tmp_path / "b.o", bins / "partly"
    subprocess.run(["gcc", "-g", "-O1", "-c", "-o", str(a), str(tmp_path / "a.c")], check=True)
    subprocess.run(["gcc", "-g0", "-O1", "-c", "-o", str(b), str(tmp_path / "b.c")], check=True)
    subprocess.run(["gcc", "-Wl,--build-id", "-o", str(exe), str(a), str(b)], check=True)
    if not any(shutil.which(c) for c in CANDIDATES):
        pytest.skip("no llvm-symbolizer: a binary's frames carry no file:line")
    described = covered_ranges(str(exe))
    assert described is not None and len(described) == 1  # with_dwarf only
    with ElfFile(exe) as elf:
        bid = elf.build_id
        text = next(s for s in elf.segments if s.flags & 1)
        assert bid and elf.has_dwarf
        found = elf.find_symbols(["main", "with_dwarf"])  # name -> (address, size)
    main, with_dwarf = found["main"], found["with_dwarf"]

    def offset(vaddr: int) -> int:
        return vaddr - text.vaddr + text.offset

    kernels = KallsymsStore(str(tmp_path / "state"))
    asked: list[bool] = []
    given: list[str] = []  # where the resolver's names of the binary came from

    def resolver(file_lines: bool = True, known_symbols: Any = None) -> Resolver:
        asked.append(file_lines)

        def spy(build_id: bytes) -> Any:
            got = known_symbols(build_id) if known_symbols is not None else None
            given.append("cache" if got is not None else "file")
            return got

        return Resolver(DebugSources([], [str(bins)], []), kernels, registry=None, known_symbols=spy)

    def session(offsets: list[int]) -> wire.Session:
        traces = [
            wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, bid, off, "partly"),), 1, 1, on_cpu=1)
            for off in offsets
        ]
        return wire.Session("s", wire.Trigger("cpu"), wire.KernelInfo(), 0, 1, 1, traces=traces)

    cache_dir = tmp_path / "c"
    symcache.symbolize(session([offset(main[0]) + 200]), symcache.SymbolCache(cache_dir), resolver, "k", [])
    assert asked == [True] and (cache_dir / f"{bid.hex()}.symbols").is_file()
    later = session([offset(main[0]) + 60, offset(main[0]) + 100])  # past the neighbours cached
    got, _ = symcache.symbolize(later, symcache.SymbolCache(cache_dir), resolver, "k", [])
    assert asked == [True]  # no resolver
    with resolver() as r:
        want = r.symbolize(later)
    assert formats.folded(got, "on_cpu") == formats.folded(want, "on_cpu") and "main" in formats.folded(got)
    asked.clear()
    given.clear()
    inside = session([offset(with_dwarf[0]) + 2])
    got, _ = symcache.symbolize(inside, symcache.SymbolCache(cache_dir), resolver, "k", [])
    # DWARF describes it: the resolver's, named from the cached symbols (node's .symtab not read
    # again for a warm run's few addresses in libuv), as the resolver names it from the file.
    assert asked == [True] and given == ["cache"]
    with Resolver(DebugSources([], [str(bins)], []), kernels, registry=None) as r:
        want = r.symbolize(inside)
    assert formats.folded(got, "on_cpu") == formats.folded(want, "on_cpu") == "with_dwarf 1\n"
    assert got.frames == want.frames and got.frames[0].file.endswith("a.c") and got.frames[0].line == 1

    # A damaged cached symbol is never a name: the file is removed and the binary read again.
    symbols = cache_dir / f"{bid.hex()}.symbols"
    raw = bytearray(symbols.read_bytes())
    at = raw.index(b"with_dwarf")
    raw[at] ^= 0x20
    symbols.write_bytes(bytes(raw))
    (cache_dir / f"{bid.hex()}.frames").unlink()  # the address is new again
    given.clear()
    again = session([offset(with_dwarf[0]) + 2])
    got, _ = symcache.symbolize(again, symcache.SymbolCache(cache_dir), resolver, "k", [])
    with Resolver(DebugSources([], [str(bins)], []), kernels, registry=None) as r:
        want = r.symbolize(again)
    assert given == ["cache", "file"]
    assert formats.folded(got, "on_cpu") == formats.folded(want, "on_cpu") and got.frames == want.frames
    assert b"With_dwarf" not in symbols.read_bytes()  # rewritten from the file

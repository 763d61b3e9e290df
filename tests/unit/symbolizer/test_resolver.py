"""Resolver, names tier (no llvm): stack order, labels, return addresses, caches, kernels, files."""

from __future__ import annotations

import gzip
import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.symbolizer import model
from bistouri.symbolizer.kallsyms import KallsymsStore
from bistouri.symbolizer.resolve import Resolver, read_session_file, symbolize_file
from bistouri.symbolizer.sources import DebugSources

from .helpers import FIXTURE_SRC, build_id_hex, nm, vaddr_to_offset

KBID = bytes.fromhex("3b43fad5" * 5)
TEXT = 0xFFFFFFFF81000000
SCHEDULE = 0xFFFFFFFF81200000


def _resolver(symfix: Path, tmp_path: Path, reg: CollectorRegistry | None = None, **kw: object) -> Resolver:
    sources = DebugSources(binary_dirs=[str(symfix / "bin")], debuginfod_urls=[])
    kernels = KallsymsStore(str(tmp_path / "state"))
    kernels.put(KBID, (FIXTURE_SRC / "kallsyms.txt").read_bytes())
    return Resolver(sources, kernels, use_llvm=False, registry=reg, **kw)  # type: ignore[arg-type]


def _session(traces: list[wire.Trace], text: int = TEXT) -> wire.Session:
    s = wire.Session(
        "sess-1",
        wire.Trigger("cpu", threshold_us=100, cgroup="/app"),
        wire.KernelInfo("6.18.0", KBID, text),
        start_ns=10,
        duration_ns=20,
        period_ns=1000,
        service="api",
        processes={42: "c_exported"},
        threads={43: "worker"},
        traces=traces,
    )
    return wire.decode_session(wire.encode_session(s))  # as the service receives it


def _names(p: model.Profile, i: int = 0) -> list[str]:
    return [p.frames[x].name for x in p.samples[i].stack]


def _c(symfix: Path) -> tuple[bytes, dict[str, int]]:
    syms = nm(symfix / "c_exported")
    off = {n: vaddr_to_offset(symfix / "c_exported", v[0]) for n, v in syms.items() if v[2] in "Tt"}
    return bytes.fromhex(build_id_hex(symfix / "c_exported")), off


def U(bid: bytes, off: int) -> wire.UserFrame:
    return wire.UserFrame(wire.FRAME_RESOLVED, bid, off)


def test_stack_root_first_with_every_frame_kind(symfix: Path, tmp_path: Path) -> None:
    bid, off = _c(symfix)
    missing = bytes.fromhex("deadbeef" + "00" * 16)
    user = (
        U(bid, off["hidden_square"] + 2),  # leaf: a static function, nameless once stripped
        U(bid, off["exported_compute"] + 9),
        U(missing, 0x1234),
        wire.UserFrame(wire.FRAME_VDSO, b"", 0x7FFF0000),
        wire.UserFrame(wire.FRAME_UNKNOWN, b"", 0x55AA),
        U(bid, off["main"] + 5),
    )
    kernel = (SCHEDULE + 0x10, 0xFFFFFFFFA0000810, 0xFFFFFFFF81200310)
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(
            _session([wire.Trace(kernel, user, pid=42, tid=43, on_cpu=5, off_cpu=2, off_cpu_ns=7)])
        )
    assert _names(p) == [
        "main",
        "[unknown]+0x55aa",
        "[vdso]",
        "deadbeef+0x1234",
        "exported_compute",
        f"c_exported+0x{off['hidden_square'] + 2:x}",
        "kernel::sync::lock",  # a Rust-for-Linux v0 symbol, demangled
        "ext4_mount",
        "schedule",
    ]
    kinds = [p.frames[x].kind for x in p.samples[0].stack]
    assert kinds == ["user", "unknown", "vdso", "user", "user", "user", "kernel", "kernel", "kernel"]
    assert [p.frames[x].module for x in p.samples[0].stack][-3:] == ["vmlinux", "ext4", "vmlinux"]
    s = p.samples[0]
    assert (s.pid, s.tid, s.thread, s.on_cpu, s.off_cpu, s.off_cpu_ns) == (42, 43, "worker", 5, 2, 7)
    assert p.meta.session_id == "sess-1" and p.meta.comm == "c_exported" and p.meta.kernel_release == "6.18.0"
    assert (
        p.meta.resource == "cpu"
        and p.meta.cgroup == "/app"
        and p.meta.on_cpu == 5
        and p.meta.service == "api"
    )
    assert len(set(p.frames)) == len(p.frames)  # a frame table without duplicates


def test_frames_the_service_cannot_open_still_say_which_file_and_jit_frames_keep_their_name(
    symfix: Path, tmp_path: Path
) -> None:
    """The agent sends the mapped file's name beside its build id, and perf-map names of JIT code."""
    missing = bytes.fromhex("deadbeef" + "00" * 16)
    user = (
        wire.UserFrame(wire.FRAME_JIT, b"", 0x7F0000001234, "JS:*hotLoop /app/x.js:2:17"),
        wire.UserFrame(wire.FRAME_RESOLVED, missing, 0x2724A, "libc.so.6"),
        wire.UserFrame(wire.FRAME_RESOLVED, b"", 0x4242, "libplain.so"),  # a file without a build id
    )
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(_session([wire.Trace((), user, pid=42, tid=43, on_cpu=1)]))
    frames = [p.frames[x] for x in p.samples[0].stack]
    assert [(f.name, f.kind, f.module) for f in frames] == [
        ("libplain.so+0x4242", "user", "libplain.so"),
        ("libc.so.6+0x2724a", "user", "libc.so.6"),
        ("JS:*hotLoop /app/x.js:2:17", "jit", "[jit]"),
    ]


def test_python_frames_need_no_symbolization_and_keep_their_file_and_line(
    symfix: Path, tmp_path: Path
) -> None:
    """A Python frame (wire v4) was named by the agent: it stays a frame of its own kind, with its
    function's file and the line being run, between the native frames around it."""
    bid, off = _c(symfix)
    user = (
        U(bid, off["exported_die"]),  # a C function the Python code called
        wire.UserFrame(wire.FRAME_PYTHON, b"", 6, "Worker.hot_loop", "/srv/w.py"),
        wire.UserFrame(wire.FRAME_PYTHON, b"", 0, "<module>", "/srv/w.py"),  # line unknown
        U(bid, off["exported_fail_fast"] + 1),
    )
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(_session([wire.Trace((), user, pid=42, tid=43, on_cpu=1)]))
    frames = [p.frames[x] for x in p.samples[0].stack]
    assert [(f.name, f.kind, f.module, f.file, f.line) for f in frames[1:3]] == [
        ("<module>", "python", "[python]", "/srv/w.py", 0),
        ("Worker.hot_loop", "python", "[python]", "/srv/w.py", 6),
    ]
    assert frames[0].name == "exported_fail_fast" and frames[-1].name == "exported_die"


def test_return_addresses_are_looked_up_one_byte_back(symfix: Path, tmp_path: Path) -> None:
    """exported_fail_fast ends with a call to a noreturn function: its return address is past its end."""
    bid, off = _c(symfix)
    size = nm(symfix / "c_exported")["exported_fail_fast"][1]
    ret = off["exported_fail_fast"] + size
    leaf = U(bid, off["exported_die"] + 1)
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(_session([wire.Trace((), (leaf, U(bid, ret)), 1, 1, on_cpu=1)]))
        assert _names(p) == ["exported_fail_fast", "exported_die"]
        # The same address as a leaf (an exact IP) is not inside exported_fail_fast.
        p = r.symbolize(_session([wire.Trace((), (U(bid, ret),), 1, 1, on_cpu=1)]))
        assert _names(p) != ["exported_fail_fast"]


def test_shared_library_exports_and_labels(symfix: Path, tmp_path: Path) -> None:
    syms = nm(symfix / "libfx.so")
    bid = bytes.fromhex(build_id_hex(symfix / "libfx.so"))
    frames = tuple(
        U(bid, vaddr_to_offset(symfix / "libfx.so", syms[n][0]) + 1)
        for n in ("fx_internal_hash", "fx_public_hash")
    )
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(_session([wire.Trace((), frames, 1, 1, on_cpu=1)]))
    internal = vaddr_to_offset(symfix / "libfx.so", syms["fx_internal_hash"][0]) + 1
    assert _names(p) == ["fx_public_hash", f"libfx.so+0x{internal:x}"]


def test_result_cache_hits_and_bound(symfix: Path, tmp_path: Path) -> None:
    bid, off = _c(symfix)
    reg = CollectorRegistry()
    traces = [wire.Trace((SCHEDULE + i,), (U(bid, off["main"] + i),), 1, i, on_cpu=1) for i in range(1, 6)]
    with _resolver(symfix, tmp_path, reg, cache_entries=4) as r:
        first = r.symbolize(_session(traces))
        assert reg.get_sample_value("bistouri_symbolizer_cache_misses_total", {"space": "user"}) == 5
        assert reg.get_sample_value("bistouri_symbolizer_cache_misses_total", {"space": "kernel"}) == 5
        assert reg.get_sample_value("bistouri_symbolizer_cache_evictions_total") >= 6
        assert len(r._cache) <= 4
        second = r.symbolize(_session(traces))
        hits = sum(
            reg.get_sample_value("bistouri_symbolizer_cache_hits_total", {"space": sp}) or 0
            for sp in ("user", "kernel")
        )
        assert 0 < hits < 10  # the newest results survived the bound, the others were resolved again
    assert [_names(first, i) for i in range(5)] == [_names(second, i) for i in range(5)]
    assert reg.get_sample_value("bistouri_symbolizer_frame_lookups_total", {"kind": "user"}) == 10


def test_module_found_later_replaces_labels(symfix: Path, tmp_path: Path) -> None:
    bins = tmp_path / "bins"
    bins.mkdir()
    bid, off = _c(symfix)
    sources = DebugSources(binary_dirs=[str(bins)], debuginfod_urls=[], rescan_s=0)
    with Resolver(sources, use_llvm=False, retry_s=0) as r:
        session = _session([wire.Trace((), (U(bid, off["exported_compute"]),), 1, 1, on_cpu=1)])
        assert _names(r.symbolize(session)) == [f"{bid.hex()[:8]}+0x{off['exported_compute']:x}"]
        shutil.copy(symfix / "bin" / "c_exported", bins / "c_exported")
        assert _names(r.symbolize(session)) == ["exported_compute"]


def test_kernel_of_another_boot(symfix: Path, tmp_path: Path) -> None:
    """Same kernel build, another KASLR slide: core symbols shift with _text, modules cannot."""
    slide = 0x3600000
    kernel = (SCHEDULE + slide + 0x10, 0xFFFFFFFFA0000810)
    with _resolver(symfix, tmp_path) as r:
        p = r.symbolize(_session([wire.Trace(kernel, (), 1, 1, on_cpu=1)], text=TEXT + slide))
    assert _names(p) == ["[kernel]+0xffffffffa0000810", "schedule"]


def test_kallsyms_uploaded_later_is_used_at_once(tmp_path: Path) -> None:
    session = _session([wire.Trace((SCHEDULE + 4,), (), 1, 1, on_cpu=1)])
    with Resolver(DebugSources(debuginfod_urls=[]), KallsymsStore(str(tmp_path)), use_llvm=False) as r:
        assert not r.has_kallsyms(KBID)
        assert _names(r.symbolize(session)) == [f"[kernel]+0x{SCHEDULE + 4:x}"]
        r.put_kallsyms(KBID, gzip.compress((FIXTURE_SRC / "kallsyms.txt").read_bytes()))
        assert r.has_kallsyms(KBID)
        assert _names(r.symbolize(session)) == ["schedule"]


def test_symbolize_file_spool_and_batch(symfix: Path, tmp_path: Path) -> None:
    bid, off = _c(symfix)
    s = _session([wire.Trace((SCHEDULE,), (U(bid, off["main"]),), 1, 1, on_cpu=1)])
    spool = tmp_path / "s.msgpack"
    spool.write_bytes(wire.encode_session(s))
    body = tmp_path / "batch.gz"
    body.write_bytes(gzip.compress(wire.encode_batch([wire.encode_session(s)])))
    with _resolver(symfix, tmp_path) as r:
        assert _names(r.symbolize_file(spool)) == ["main", "schedule"]
        assert _names(r.symbolize_file(body)) == ["main", "schedule"]
    assert read_session_file(spool).session_id == "sess-1"
    two = tmp_path / "two"
    two.write_bytes(wire.encode_batch([wire.encode_session(s)] * 2))
    with pytest.raises(Exception, match="holds 2 sessions"):
        read_session_file(two)
    p = symbolize_file(
        spool, sources=DebugSources(binary_dirs=[str(symfix / "bin")], debuginfod_urls=[]), use_llvm=False
    )
    assert _names(p) == ["main", "[kernel]+0xffffffff81200000"]  # no kallsyms given: labelled


def test_concurrent_sessions_agree(symfix: Path, tmp_path: Path) -> None:
    bid, off = _c(symfix)
    traces = [
        wire.Trace(
            (SCHEDULE + i,), (U(bid, off["hidden_square"] + i % 7), U(bid, off["main"] + i)), 1, i, on_cpu=1
        )
        for i in range(300)
    ]
    session = _session(traces)
    with _resolver(symfix, tmp_path, cache_entries=100) as r:
        expected = [_names(r.symbolize(session), i) for i in range(300)]
        results: list[list[list[str]]] = []

        def work() -> None:
            p = r.symbolize(session)
            results.append([_names(p, i) for i in range(300)])

        threads = [threading.Thread(target=work, name=f"bistouri-test-{i}") for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 4 and all(res == expected for res in results)

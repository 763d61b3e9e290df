"""Finding ELF files by build id: .build-id trees, binary directories, debuginfod over real HTTP."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri.symbolizer.sources import DEBUGINFO, EXECUTABLE, DebugSources, NegativeCache, urls_from_env

from .helpers import BuildIdServer, build_id_hex


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_build_id_tree(symfix: Path) -> None:
    hexid = build_id_hex(symfix / "cxx_app")
    for root in (symfix / "debug", symfix / "debug" / ".build-id"):  # both spellings accepted
        src = DebugSources([str(root)], debuginfod_urls=[])
        dbg = src.find(bytes.fromhex(hexid), DEBUGINFO)
        exe = src.find(hexid, EXECUTABLE)
        assert dbg is not None and dbg.source == "debug-dir" and dbg.path.endswith(hexid[2:] + ".debug")
        assert exe is not None and Path(exe.path).resolve() == (symfix / "bin" / "cxx_app").resolve()
    assert src.find("00" * 20, DEBUGINFO) is None


def test_file_with_another_build_id_is_ignored(symfix: Path, tmp_path: Path) -> None:
    hexid = build_id_hex(symfix / "cxx_app")
    d = tmp_path / ".build-id" / hexid[:2]
    d.mkdir(parents=True)
    shutil.copy(symfix / "c_exported", d / (hexid[2:] + ".debug"))  # wrong content under the right name
    assert DebugSources([str(tmp_path)], debuginfod_urls=[]).find(hexid) is None


def test_binary_dir_index_and_rescan(symfix: Path, tmp_path: Path) -> None:
    bins = tmp_path / "bins"
    (bins / "sub").mkdir(parents=True)
    shutil.copy(symfix / "bin" / "libfx.so", bins / "sub" / "libfx.so")
    (bins / "notes.txt").write_text("not an ELF file")
    src = DebugSources(binary_dirs=[str(bins)], debuginfod_urls=[], rescan_s=0)
    libfx = build_id_hex(symfix / "libfx.so")
    found = src.find(libfx, EXECUTABLE)
    assert found is not None and found.source == "binary-dir" and found.path.endswith("sub/libfx.so")
    # A binary deployed later is found: the directory changed, so it is re-scanned.
    cexp = build_id_hex(symfix / "c_exported")
    assert src.find(cexp, EXECUTABLE) is None
    shutil.copy(symfix / "bin" / "c_exported", bins / "c_exported")
    found = src.find(cexp, DEBUGINFO)
    assert found is not None and found.path.endswith("/c_exported")
    assert src.binaries is not None and len(src.binaries) == 2


def test_negative_cache_ttl() -> None:
    now = [100.0]
    cache = NegativeCache(max_entries=2, clock=lambda: now[0])
    cache.add(("aa", DEBUGINFO), ttl_s=10)
    assert ("aa", DEBUGINFO) in cache and ("aa", EXECUTABLE) not in cache
    now[0] = 109.9
    assert ("aa", DEBUGINFO) in cache
    now[0] = 110.0
    assert ("aa", DEBUGINFO) not in cache and len(cache) == 0
    for k in ("bb", "cc", "dd"):
        cache.add((k, DEBUGINFO), ttl_s=10)
    assert len(cache) == 2 and ("bb", DEBUGINFO) not in cache  # bounded: oldest dropped


def test_urls_from_env() -> None:
    assert urls_from_env("http://a:1/ https://b/x  ftp://no  ") == ["http://a:1", "https://b/x"]
    assert urls_from_env("") == []


def test_debuginfod_download_and_cache(symfix: Path, tmp_path: Path) -> None:
    hexid = build_id_hex(symfix / "cxx_app")
    dbg = next((symfix / "debug" / ".build-id").glob("*/*.debug"))
    reg = CollectorRegistry()
    with BuildIdServer() as server:
        server.files[(hexid, DEBUGINFO)] = dbg
        server.files[(hexid, EXECUTABLE)] = symfix / "bin" / "cxx_app"
        src = DebugSources(debuginfod_urls=[server.url], cache_dir=str(tmp_path / "cache"), registry=reg)
        got = src.find(hexid, DEBUGINFO)
        assert got is not None and got.source == "debuginfod"
        # The elfutils client layout: <cache>/<build id>/<kind>.
        assert Path(got.path) == tmp_path / "cache" / hexid / "debuginfo"
        assert Path(got.path).read_bytes() == dbg.read_bytes()
        again = src.find(hexid, DEBUGINFO)
        assert again is not None and again.source == "cache"
        assert len(server.requests) == 1
        exe = src.find(hexid, EXECUTABLE)
        assert exe is not None and Path(exe.path).name == "executable"
        assert server.requests == [f"/buildid/{hexid}/debuginfo", f"/buildid/{hexid}/executable"]
    fetched = _value(reg, "bistouri_symbolizer_fetched_bytes_total")
    assert fetched == dbg.stat().st_size + (symfix / "bin" / "cxx_app").stat().st_size


def test_debuginfod_not_found_is_cached_negatively(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    with BuildIdServer() as server:
        src = DebugSources(debuginfod_urls=[server.url], cache_dir=str(tmp_path), registry=reg)
        assert src.find("ab" * 20) is None
        assert src.find("ab" * 20) is None
        assert len(server.requests) == 1  # the second miss never left the process
        assert _value(reg, "bistouri_symbolizer_sources_missing_total") == 2
        assert _value(reg, "bistouri_symbolizer_fetch_errors_total", reason="http_5xx") == 0


def test_debuginfod_several_servers_and_errors(symfix: Path, tmp_path: Path) -> None:
    hexid = build_id_hex(symfix / "libfx.so")
    reg = CollectorRegistry()
    with BuildIdServer() as broken, BuildIdServer() as empty, BuildIdServer() as good:
        broken.status[(hexid, EXECUTABLE)] = 503
        good.files[(hexid, EXECUTABLE)] = symfix / "bin" / "libfx.so"
        src = DebugSources(
            debuginfod_urls=[broken.url, empty.url, good.url], cache_dir=str(tmp_path), registry=reg
        )
        got = src.find(hexid, EXECUTABLE)
        assert got is not None and got.source == "debuginfod"
        assert len(broken.requests) == len(empty.requests) == len(good.requests) == 1
        assert _value(reg, "bistouri_symbolizer_fetch_errors_total", reason="http_5xx") == 1
        # A server error everywhere is remembered only briefly (error_ttl_s), then retried.
        other = "cd" * 20
        broken.status[(other, EXECUTABLE)] = 500
        src2 = DebugSources(
            debuginfod_urls=[broken.url], cache_dir=str(tmp_path), error_ttl_s=0, registry=None
        )
        assert src2.find(other, EXECUTABLE) is None
        assert src2.find(other, EXECUTABLE) is None
        assert broken.requests.count(f"/buildid/{other}/executable") == 2


def test_debuginfod_rejects_wrong_content_and_oversize(symfix: Path, tmp_path: Path) -> None:
    hexid = build_id_hex(symfix / "libfx.so")
    reg = CollectorRegistry()
    with BuildIdServer() as server:
        server.files[(hexid, EXECUTABLE)] = symfix / "bin" / "c_exported"  # another build id
        src = DebugSources(debuginfod_urls=[server.url], cache_dir=str(tmp_path), registry=reg)
        assert src.find(hexid, EXECUTABLE) is None
        assert _value(reg, "bistouri_symbolizer_fetch_errors_total", reason="bad_build_id") == 1
        server.files[(hexid, DEBUGINFO)] = symfix / "libfx.so"
        reg2 = CollectorRegistry()
        small = DebugSources(
            debuginfod_urls=[server.url], cache_dir=str(tmp_path), max_download=100, registry=reg2
        )
        assert small.find(hexid, DEBUGINFO) is None
        assert _value(reg2, "bistouri_symbolizer_fetch_errors_total", reason="too_large") == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no partial files left


def test_debuginfod_unreachable(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    with BuildIdServer() as server:
        url = server.url
    src = DebugSources(debuginfod_urls=[url], cache_dir=str(tmp_path), timeout_s=2, registry=reg)
    assert src.find("ef" * 20) is None
    assert _value(reg, "bistouri_symbolizer_fetch_errors_total", reason="connection") == 1


def test_single_flight(symfix: Path, tmp_path: Path) -> None:
    hexid = build_id_hex(symfix / "cxx_app")
    with BuildIdServer(delay_s=0.5) as server:
        server.files[(hexid, EXECUTABLE)] = symfix / "bin" / "cxx_app"
        src = DebugSources(debuginfod_urls=[server.url], cache_dir=str(tmp_path))
        results: list[object] = []
        threads = [
            threading.Thread(target=lambda: results.append(src.find(hexid, EXECUTABLE))) for _ in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(server.requests) == 1
        assert all(r is not None for r in results) and len(results) == 6


def test_remote_needs_a_cache_dir() -> None:
    with pytest.raises(ValueError, match="cache directory"):
        DebugSources(debuginfod_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="invalid build id"):
        DebugSources(debuginfod_urls=[]).find("../../x")

"""The llvm-symbolizer pool: answers, big requests, crashes, timeouts, memory recycling, absence."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri.symbolizer.llvm import LlvmPool, SourceFrame, parse_json_line

from .helpers import nm

needs_llvm = pytest.mark.skipif(
    shutil.which("llvm-symbolizer-19") is None,
    reason="llvm-symbolizer-19 is not installed (apt-get install llvm-19)",
)


def _debug(symfix: Path) -> str:
    return str(next((symfix / "debug" / ".build-id").glob("*/*.debug")))


def _fake(tmp_path: Path, body: str, version: str = "19.1.7") -> str:
    """A stand-in llvm-symbolizer: answers --version/--help, then runs `body`."""
    p = tmp_path / "llvm-symbolizer-fake"
    p.write_text(
        f'#!/bin/sh\ncase "$1" in --version) echo "LLVM version {version}"; exit 0;; '
        f"--help) echo --no-debuginfod; exit 0;; esac\n{body}\n"
    )
    p.chmod(0o755)
    return str(p)


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


@needs_llvm
def test_inlined_frames_and_lines(symfix: Path) -> None:
    syms = nm(symfix / "cxx_app")
    mix, run = syms["fx_mix_marker"][0], syms["fx_run_marker"][0]
    with LlvmPool(registry=CollectorRegistry()) as pool:
        assert pool.available and pool.version >= 14
        inner, outer = pool.symbolize(_debug(symfix), [mix, run])
    assert inner is not None and outer is not None
    assert inner[0].function == "_ZN2fx6detail3mixImEET_S2_S2_"
    assert inner[0].file.endswith("cxx_app.cpp") and inner[0].line == 13
    assert len(inner) == 2 and inner[1].line == 25  # the call site inside run()
    assert len(outer) == 1 and outer[0].line == 27


@needs_llvm
def test_large_request_does_not_deadlock(symfix: Path) -> None:
    """40k lines in one chunk: far more than both pipe buffers hold."""
    addrs = [nm(symfix / "cxx_app")["fx_mix_marker"][0]] * 40_000
    with LlvmPool(chunk=40_000, timeout_s=120, registry=CollectorRegistry()) as pool:
        out = pool.symbolize(_debug(symfix), addrs)
    assert len(out) == 40_000 and all(o is not None and len(o) == 2 for o in out)


@needs_llvm
def test_restart_after_crash_and_rss_recycle(symfix: Path) -> None:
    reg = CollectorRegistry()
    addr = nm(symfix / "cxx_app")["fx_run_marker"][0]
    with LlvmPool(workers=1, registry=reg) as pool:
        assert pool.symbolize(_debug(symfix), [addr])[0]
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        got = pool.symbolize(_debug(symfix), [addr])[0]  # retried once on a fresh process
        assert got and got[0].line == 27
        assert pool.pids() != [pid]
        assert _value(reg, "bistouri_symbolizer_llvm_restarts_total", reason="crash") == 1
    reg = CollectorRegistry()
    with LlvmPool(workers=1, rss_limit=1, registry=reg) as pool:
        assert pool.symbolize(_debug(symfix), [addr])[0]
        assert pool.pids() == []  # over budget: stopped after the request
        assert _value(reg, "bistouri_symbolizer_llvm_restarts_total", reason="rss") == 1
        assert pool.symbolize(_debug(symfix), [addr])[0]


def test_timeout_kills_the_worker(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    with LlvmPool(_fake(tmp_path, "exec sleep 60"), workers=1, timeout_s=0.5, registry=reg) as pool:
        assert pool.symbolize("/bin/true", [0x10, 0x20]) == [None, None]
        assert pool.pids() == []
    assert _value(reg, "bistouri_symbolizer_llvm_restarts_total", reason="timeout") == 1
    assert _value(reg, "bistouri_symbolizer_llvm_addresses_total", result="failed") == 2


def test_crash_loop_pauses_the_worker(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    with LlvmPool(_fake(tmp_path, "read line; exit 3"), workers=1, registry=reg) as pool:
        # A crash and one retry each, on three files; the fifth crash in a minute pauses the worker.
        for path in ("/bin/true", "/bin/false", "/bin/sh"):
            assert pool.symbolize(path, [0x10]) == [None]
        assert _value(reg, "bistouri_symbolizer_llvm_addresses_total", result="paused") == 0
        assert pool.symbolize("/bin/ls", [0x10]) == [None]  # paused: not even started
        assert _value(reg, "bistouri_symbolizer_llvm_addresses_total", result="paused") == 1
    assert _value(reg, "bistouri_symbolizer_llvm_restarts_total", reason="crash") == 5


def test_garbage_answers_are_errors(tmp_path: Path) -> None:
    with LlvmPool(
        _fake(tmp_path, 'while read l; do echo "{not json"; done'), registry=CollectorRegistry()
    ) as pool:
        assert pool.symbolize("/bin/true", [1, 2, 3]) == [None, None, None]


@pytest.mark.parametrize(
    ("binary", "why"), [("/nonexistent/llvm-symbolizer", "installed"), (None, "LLVM 12")]
)
def test_absent_or_too_old(tmp_path: Path, binary: str | None, why: str) -> None:
    reg = CollectorRegistry()
    pool = LlvmPool(binary or _fake(tmp_path, "exit 0", version="12.0.1"), registry=reg)
    assert not pool.available and why in pool.unavailable_reason
    assert pool.symbolize("/bin/true", [1, 2]) == [None, None]
    assert _value(reg, "bistouri_symbolizer_llvm_available") == 0
    assert _value(reg, "bistouri_symbolizer_llvm_addresses_total", result="unavailable") == 2


def test_parse_json_line() -> None:
    assert parse_json_line(b'{"Address":"0x1","Error":{"Message":"No such file"}}') is None
    assert parse_json_line(b"not json") is None
    empty = b'{"Address":"0x0","Symbol":[{"FileName":"","FunctionName":"","Line":0}]}'
    assert parse_json_line(empty) == []
    line = (
        b'{"Symbol":[{"FileName":"/a.c","FunctionName":"f","Line":3},'
        b'{"FileName":"/b.c","FunctionName":"g","Line":9}]}'
    )
    assert parse_json_line(line) == [SourceFrame("f", "/a.c", 3), SourceFrame("g", "/b.c", 9)]

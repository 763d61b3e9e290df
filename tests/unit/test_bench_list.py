"""`make bench` runs every benchmark: a bench added to bench/ and not to its list would never run."""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import BENCHES

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_module_is_in_make_bench() -> None:
    modules = {f"bench.{p.stem}" for p in BENCH_DIR.glob("bench_*.py")}
    assert modules, BENCH_DIR
    assert sorted(modules - set(BENCHES)) == []
    assert sorted(set(BENCHES) - modules) == []
    assert len(BENCHES) == len(set(BENCHES))

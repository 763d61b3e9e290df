"""Symbolizer throughput: names and file:line per second, cold and warm, against llvm-symbolizer alone.

    python -m bench.bench_symbolize [--elf PATH[:DEBUG_DIR]] [--addresses N] [--depth D]

Targets are real binaries found on this machine (skipped when absent):
  libc       /usr/lib/x86_64-linux-gnu/libc.so.6 with /usr/lib/debug (package libc6-dbg):
             C, split and compressed DWARF, found through the .build-id tree
  libLLVM    /usr/lib/llvm-19/lib/libLLVM.so.19.1: big stripped C++, names from .dynsym only
plus any `--elf` given (a path, optionally `:debug-dir`).

For each: a pool of N random addresses inside functions (weighted by size) is
turned into file offsets and packed into sessions of D-frame stacks:
  unique_*      every frame a different address (the per-address cost, worst case)
  zipf_*        a profile-like stream: --frames frames drawn with a Zipf law over the pool
  *_names_cold  a fresh result cache, the symbol index already loaded (module load timed apart)
  *_names_warm  the same session again: every lookup a cache hit
  *_lines_cold  a fresh Resolver with llvm-symbolizer: DWARF parsed on first touch
  llvm_alone    `llvm-symbolizer-19 --obj=… -i --no-demangle` on the pool, one batch
Sessions go through wire encode/decode first, as the service receives them.
Rates are per CPU-second of this process plus its children (one core), and wall.
Results go to bench/results/bench_symbolize-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.elf import PF_X, ElfFile
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.sources import DEBUGINFO, DebugSources

DEFAULT_TARGETS = (
    ("libc", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/debug"),
    ("libLLVM", "/usr/lib/llvm-19/lib/libLLVM.so.19.1", ""),
)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass
class Clock:
    """Wall time and CPU time of this process and its children between start and stop."""

    wall: float = 0.0
    cpu: float = 0.0
    _t: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))

    def __enter__(self) -> Clock:
        self._t = (time.perf_counter(), time.process_time(), _children_cpu())
        return self

    def __exit__(self, *exc: object) -> None:
        w, p, c = self._t
        self.wall = time.perf_counter() - w
        self.cpu = time.process_time() - p + _children_cpu() - c


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _pick(idx: Any, segments: list[Any], n: int, seed: int) -> tuple[list[int], list[int]]:
    """n distinct addresses inside functions, weighted by function size: (vaddrs, file offsets)."""
    rng = random.Random(seed)
    funcs = [(start, end) for start, end, _ in idx.items() if end > start]
    weights = [end - start for start, end in funcs]
    vaddrs: list[int] = []
    offsets: list[int] = []
    seen: set[int] = set()
    while len(vaddrs) < n:
        for start, end in rng.choices(funcs, weights, k=n):
            v = rng.randrange(start, end)
            seg = next((s for s in segments if s.vaddr <= v < s.vaddr + s.filesz), None)
            if seg is None or v in seen:
                continue
            seen.add(v)
            vaddrs.append(v)
            offsets.append(v - seg.vaddr + seg.offset)
            if len(vaddrs) == n:
                break
    return vaddrs, offsets


def unique_session(build_id: bytes, offsets: list[int], depth: int) -> wire.Session:
    """Every frame a different address (+1 on non-leaf frames, which the resolver looks up at -1)."""
    traces = []
    for i in range(0, len(offsets), depth):
        chunk = offsets[i : i + depth]
        user = tuple(
            wire.UserFrame(wire.FRAME_RESOLVED, build_id, off if j == 0 else off + 1)
            for j, off in enumerate(chunk)
        )
        traces.append(wire.Trace(kernel=(), user=user, pid=1, tid=1 + i // depth, on_cpu=1))
    return _round_trip(wire.Session("bench", wire.Trigger("cpu"), wire.KernelInfo(), 0, 1, 1, traces=traces))


def zipf_session(
    build_id: bytes, offsets: list[int], frames: int, depth: int, s: float, seed: int = 2
) -> wire.Session:
    """A profile-like stream: frames drawn with a Zipf law over the address pool."""
    rng = random.Random(seed)
    pool = offsets[:]
    rng.shuffle(pool)
    cum: list[float] = []
    total = 0.0
    for r in range(len(pool)):
        total += 1.0 / (r + 1) ** s
        cum.append(total)
    drawn = rng.choices(pool, cum_weights=cum, k=frames)
    traces = []
    for i in range(0, frames, depth):
        chunk = drawn[i : i + depth]
        user = tuple(
            wire.UserFrame(wire.FRAME_RESOLVED, build_id, off if j == 0 else off + 1)
            for j, off in enumerate(chunk)
        )
        traces.append(wire.Trace(kernel=(), user=user, pid=1, tid=1 + (i // depth) % 64, on_cpu=1))
    return _round_trip(wire.Session("bench", wire.Trigger("cpu"), wire.KernelInfo(), 0, 1, 1, traces=traces))


def _round_trip(s: wire.Session) -> wire.Session:
    # Through the wire format, as the service receives it (shared frame and stack objects).
    return wire.decode_session(wire.encode_session(s))


def bench_target(
    name: str, path: str, debug_dir: str, n: int, depth: int, stream: int, zipf: float
) -> dict[str, Any] | None:
    if not os.path.exists(path):
        print(f"# {name}: {path} is missing, skipped", file=sys.stderr)
        return None
    with ElfFile(path) as f:
        build_id = f.build_id
        segments = [s for s in f.segments if s.flags & PF_X and s.filesz]
    if not build_id:
        print(f"# {name}: {path} has no build id, skipped", file=sys.stderr)
        return None
    bin_dir = tempfile.mkdtemp(prefix="bench-sym-")
    os.symlink(os.path.realpath(path), os.path.join(bin_dir, os.path.basename(path)))
    debug_dirs = [debug_dir] if debug_dir else []
    dbg = DebugSources(debug_dirs, [bin_dir], debuginfod_urls=[]).find(build_id, DEBUGINFO)
    symfile = dbg.path if dbg else path
    with ElfFile(symfile) as f:
        idx = f.symbol_index()
        has_dwarf = f.has_dwarf
    vaddrs, offsets = _pick(idx, segments, n, 1)
    sessions = {
        "unique": unique_session(build_id, offsets, depth),
        "zipf": zipf_session(build_id, offsets, stream, depth, zipf),
    }
    out: dict[str, Any] = {
        "target": name,
        "path": path,
        "symbols_from": symfile,
        "symbols": len(idx),
        "dwarf": has_dwarf,
        "addresses": n,
        "depth": depth,
        "zipf_s": zipf,
    }
    for kind, sess in sessions.items():
        nframes = sum(len(t.user) for t in sess.traces)
        distinct = len({(f.address, j == 0) for t in sess.traces for j, f in enumerate(t.user)})
        out[f"{kind}_frames"] = nframes
        out[f"{kind}_distinct"] = distinct
        # Tier 1: names only; the module (symbol index) is loaded first and timed apart.
        r = Resolver(DebugSources(debug_dirs, [bin_dir], debuginfod_urls=[]), use_llvm=False)
        with Clock() as c:
            r.module(build_id)
        out["module_load_ms"] = round(c.wall * 1e3, 1)
        with Clock() as c:
            p1 = r.symbolize(sess)
        out[f"{kind}_names_cold"] = _rate(nframes, c, distinct)
        with Clock() as c:
            r.symbolize(sess)
        out[f"{kind}_names_warm"] = _rate(nframes, c, distinct)
        out[f"{kind}_named_fraction"] = round(sum("+0x" not in f.name for f in p1.frames) / len(p1.frames), 4)
        r.close()
        # Tier 2: file:line from new llvm-symbolizer processes (DWARF parsed on first touch).
        if has_dwarf and shutil.which("llvm-symbolizer-19"):
            r = Resolver(
                DebugSources(debug_dirs, [bin_dir], debuginfod_urls=[]), registry=CollectorRegistry()
            )
            r.module(build_id)
            with Clock() as c:
                p2 = r.symbolize(sess)
            out[f"{kind}_lines_cold"] = _rate(nframes, c, distinct)
            with Clock() as c:
                r.symbolize(sess)
            out[f"{kind}_lines_warm"] = _rate(nframes, c, distinct)
            out[f"{kind}_with_line_fraction"] = round(
                sum(bool(f.line) for f in p2.frames) / len(p2.frames), 4
            )
            out[f"{kind}_inlined_frames"] = sum(f.inlined for f in p2.frames)
            r.close()
    if has_dwarf and shutil.which("llvm-symbolizer-19"):
        # The unique addresses through llvm-symbolizer alone, one batch, same flags.
        data = "".join(f"0x{v:x}\n" for v in vaddrs).encode()
        argv = ["llvm-symbolizer-19", f"--obj={symfile}", "--output-style=JSON", "-i", "--no-demangle"]
        with Clock() as c:
            subprocess.run(argv, input=data, stdout=subprocess.DEVNULL, check=True)
        out["llvm_alone"] = _rate(n, c, n)
    return out


def _rate(count: int, c: Clock, distinct: int) -> dict[str, float]:
    return {
        "count": count,
        "distinct": distinct,
        "distinct_per_cpu_s": round(distinct / c.cpu) if c.cpu else 0,
        "wall_s": round(c.wall, 4),
        "cpu_s": round(c.cpu, 4),
        "per_s_wall": round(count / c.wall) if c.wall else 0,
        "per_cpu_s": round(count / c.cpu) if c.cpu else 0,
    }


def print_table(results: list[dict[str, Any]]) -> None:
    rows = [("target", "measure", "frames", "distinct", "wall s", "cpu s", "frames/cpu-s", "distinct/cpu-s")]
    keys = [
        f"{k}_{m}"
        for k in ("unique", "zipf")
        for m in ("names_cold", "names_warm", "lines_cold", "lines_warm")
    ]
    for r in results:
        for key in [*keys, "llvm_alone"]:
            if key in r:
                m = r[key]
                rows.append(
                    (
                        r["target"],
                        key,
                        str(m["count"]),
                        str(m["distinct"]),
                        f"{m['wall_s']:.3f}",
                        f"{m['cpu_s']:.3f}",
                        f"{m['per_cpu_s']:,}",
                        f"{m['distinct_per_cpu_s']:,}",
                    )
                )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(
                cell.rjust(w) if i >= 2 else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    for r in results:
        extra = {
            k: r[k]
            for k in ("symbols", "module_load_ms", "named_fraction", "frames_with_line_fraction")
            if k in r
        }
        print(f"# {r['target']}: {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elf", action="append", default=[], metavar="PATH[:DEBUG_DIR]", help="extra target")
    ap.add_argument("--addresses", type=int, default=50_000, help="address pool per target")
    ap.add_argument("--frames", type=int, default=500_000, help="frames in the Zipf stream")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the stream")
    ap.add_argument("--depth", type=int, default=20, help="frames per stack")
    ap.add_argument("--only", action="append", default=[], help="run only these targets (by name)")
    args = ap.parse_args(argv)
    targets = list(DEFAULT_TARGETS)
    for spec in args.elf:
        path, _, dbg = spec.partition(":")
        targets.append((os.path.basename(path), path, dbg))
    results = []
    for name, path, dbg in targets:
        if args.only and name not in args.only:
            continue
        res = bench_target(name, path, dbg, args.addresses, args.depth, args.frames, args.zipf)
        if res is not None:
            results.append(res)
    print_table(results)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    out = os.path.join(RESULTS_DIR, time.strftime("bench_symbolize-%Y%m%dT%H%M%S.json"))
    with open(out, "w") as f:
        json.dump({"host": os.uname().nodename, "cpus": os.cpu_count(), "results": results}, f, indent=2)
    print(f"# results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

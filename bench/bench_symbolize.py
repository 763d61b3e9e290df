"""Symbolizer throughput: names and file:line per second, cold and warm, against llvm-symbolizer alone.

    python -m bench.bench_symbolize [--elf PATH[:DEBUG_DIR]] [--addresses N] [--depth D] [--repeat R]

Targets are real binaries found on this machine (skipped when absent):
  libc       /usr/lib/x86_64-linux-gnu/libc.so.6 with /usr/lib/debug (package libc6-dbg):
             C, split and compressed DWARF, found through the .build-id tree
  libLLVM    /usr/lib/llvm-19/lib/libLLVM.so.19.1: big stripped C++, names from .dynsym only
plus any `--elf` given (a path, optionally `:debug-dir`), and Go binaries:
  go         `cmd/go` of the Go on PATH, built here (`go build`: .symtab, DWARF and .gopclntab,
             no GNU build id), or `--go PATH`
  prometheus /usr/bin/prometheus (Debian's: .gopclntab only, stripped to a debuglink)

For each: a pool of N random addresses inside functions (weighted by size) is
turned into file offsets and packed into sessions of D-frame stacks:
  unique_*      every frame a different address (the per-address cost, worst case)
  zipf_*        a profile-like stream: --frames frames drawn with a Zipf law over the pool
  *_names_cold  a fresh result cache, the symbol index already loaded (module load timed apart)
  *_names_warm  the same session again: every lookup a cache hit
  *_lines_cold  a fresh Resolver with llvm-symbolizer: DWARF parsed on first touch
  llvm_alone    `llvm-symbolizer-19 --obj=… -i --no-demangle` on the pool, one batch
A Go binary's same sessions go through each path the symbolizer has for it, in the same run:
  *_symtab_*    names only, from .symtab (the pclntab hidden: what any ELF file gets)
  *_pclntab_*   names, file:line and inlined calls from .gopclntab (no llvm)
  *_dwarf_*     the same from DWARF through llvm-symbolizer (what a Go binary with DWARF gets)
  --repeat R runs the in-process paths R rounds (llvm's once): each path's best rate, and the median
  of the rounds' pclntab/symtab ratios (`*_pclntab_vs_symtab`), each round's two back to back;
  `*_pclntab_vs_dwarf` is the first round's pclntab/DWARF ratio (the same answers both ways).
  --session FILE (with --go): a recorded session of that binary (msgpack, optionally gzip'd, as
  `bistouri symbolize` reads) through the pclntab and symtab paths, cold, alternating, --repeat
  rounds: what the user sees, beside the per-address figures (`session_pclntab_vs_symtab`).
Sessions go through wire encode/decode first, as the service receives them.
Rates are per CPU-second of this process plus its children (one core; the llvm-symbolizer pool's
time read from /proc while it runs), and wall.
Results go to bench/results/bench_symbolize-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.elf import PF_X, ElfFile
from bistouri.gopclntab import read_pclntab
from bistouri.symbolizer import resolve
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.sources import DEBUGINFO, DebugSources

DEFAULT_TARGETS = (
    ("libc", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/debug"),
    ("libLLVM", "/usr/lib/llvm-19/lib/libLLVM.so.19.1", ""),
)
GO_TARGETS = (("prometheus", "/usr/bin/prometheus"),)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GO_CACHE = os.path.join(os.path.dirname(RESULTS_DIR), "..", "tests", "fixtures", "build")


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
    """Children's CPU: those waited for, and those still running (the resolver's llvm-symbolizer
    pool lives on between sessions: its time is in no rusage until it exits)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime + _live_children_cpu()


def _live_children_cpu() -> float:
    me = os.getpid()
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid; then utime and stime, fields 14 and 15 of stat
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


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


def build_go_cmd(out_dir: str) -> str | None:
    """`cmd/go` built from the Go on PATH into out_dir (a plain build: .symtab and DWARF kept)."""
    go = shutil.which("go")
    if go is None:
        print("# go: no `go` on PATH, skipped", file=sys.stderr)
        return None
    out = os.path.join(out_dir, "go-cmd")
    env = {
        **os.environ,
        # The tests' build cache (testkit/gobuild.py): a cold build of cmd/go takes ~1 min.
        "GOCACHE": os.path.abspath(os.path.join(GO_CACHE, "gocache")),
        "GOPATH": os.path.abspath(os.path.join(GO_CACHE, "gopath")),
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }
    subprocess.run([go, "build", "-o", out, "cmd/go"], env=env, check=True, capture_output=True, timeout=600)
    return out


def bench_go(
    name: str, path: str, n: int, depth: int, stream: int, zipf: float, repeat: int = 1
) -> dict[str, Any] | None:
    """The same addresses of one Go binary through each path the symbolizer has for it; the
    in-process paths `repeat` times, one after the other (llvm's once): each path's best rate, and
    the median of the pclntab/symtab ratios of each round (one shot swung 1.9-2.5x under load)."""
    if not os.path.exists(path):
        print(f"# {name}: {path} is missing, skipped", file=sys.stderr)
        return None
    with ElfFile(path) as f:
        file_id = f.file_id
        segments = [s for s in f.segments if s.flags & PF_X and s.filesz]
        tab = read_pclntab(f)
        has_symtab = f.section(".symtab") is not None
        has_dwarf = f.has_dwarf
    if tab is None or not file_id:
        print(f"# {name}: {path} has no pclntab this reader knows, skipped", file=sys.stderr)
        return None
    bin_dir = tempfile.mkdtemp(prefix="bench-sym-")
    os.symlink(os.path.realpath(path), os.path.join(bin_dir, os.path.basename(path)))
    idx = tab.symbols()
    vaddrs, offsets = _pick(idx, segments, n, 1)
    sessions = {
        "unique": unique_session(file_id, offsets, depth),
        "zipf": zipf_session(file_id, offsets, stream, depth, zipf),
    }
    out: dict[str, Any] = {
        "target": name,
        "path": path,
        "go": ".".join(map(str, tab.version)) + "+",
        "symbols": len(idx),
        "symtab": has_symtab,
        "dwarf": has_dwarf,
        "addresses": n,
        "depth": depth,
        "zipf_s": zipf,
    }
    llvm = has_dwarf and shutil.which("llvm-symbolizer-19") is not None
    paths = [("pclntab", False, False)] + ([("symtab", False, True)] if has_symtab else [])
    paths += [("dwarf", True, False)] if llvm else []
    for kind, sess in sessions.items():
        nframes = sum(len(t.user) for t in sess.traces)
        distinct = len({(f.address, j == 0) for t in sess.traces for j, f in enumerate(t.user)})
        out[f"{kind}_frames"] = nframes
        out[f"{kind}_distinct"] = distinct
        ratios = []
        for rep in range(repeat):
            cpu: dict[str, float] = {}
            for label, use_llvm, hide_pclntab in paths if rep == 0 else [p for p in paths if not p[1]]:
                read = resolve.read_pclntab
                if hide_pclntab:  # the module loads as any ELF file's: names from .symtab
                    resolve.read_pclntab = lambda _f: None  # type: ignore[assignment]
                try:
                    r = Resolver(
                        DebugSources([], [bin_dir], debuginfod_urls=[]),
                        use_llvm=use_llvm,
                        registry=CollectorRegistry(),
                    )
                    with Clock() as c:
                        r.module(file_id)
                    out[f"{label}_module_load_ms"] = round(c.wall * 1e3, 1)
                    gc.collect()  # what the path before left is not collected on this one's time
                    with Clock() as c:
                        p = r.symbolize(sess)
                    cpu[label] = c.cpu
                    best = out.get(f"{kind}_{label}_cold")
                    if best is None or c.cpu < best["cpu_s"]:
                        out[f"{kind}_{label}_cold"] = _rate(nframes, c, distinct)
                    with Clock() as c:
                        r.symbolize(sess)
                    best = out.get(f"{kind}_{label}_warm")
                    if best is None or c.cpu < best["cpu_s"]:
                        out[f"{kind}_{label}_warm"] = _rate(nframes, c, distinct)
                    out[f"{kind}_{label}_with_line_fraction"] = round(
                        sum(bool(f.line) for f in p.frames) / len(p.frames), 4
                    )
                    out[f"{kind}_{label}_inlined_frames"] = sum(f.inlined for f in p.frames)
                    r.close()
                    del r, p
                finally:
                    resolve.read_pclntab = read
            if cpu.get("symtab"):
                ratios.append(cpu["pclntab"] / cpu["symtab"])
            if cpu.get("dwarf"):
                # The same answers (names, file:line, inlined calls) from DWARF through llvm-symbolizer,
                # its processes' CPU counted: the comparison of like with like, round 0 only.
                out[f"{kind}_pclntab_vs_dwarf"] = round(cpu["pclntab"] / cpu["dwarf"], 2)
        if ratios:
            # The figure: Go frames against the same binary's names from .symtab, per
            # CPU-second, each round's two paths back to back.
            out[f"{kind}_pclntab_vs_symtab"] = round(statistics.median(ratios), 2)
            out[f"{kind}_pclntab_vs_symtab_rounds"] = [round(x, 2) for x in ratios]
    if llvm:  # the unique addresses through llvm-symbolizer alone, one batch, as for ELF targets
        data = "".join(f"0x{v:x}\n" for v in vaddrs).encode()
        argv = ["llvm-symbolizer-19", f"--obj={path}", "--output-style=JSON", "-i", "--no-demangle"]
        with Clock() as c:
            subprocess.run(argv, input=data, stdout=subprocess.DEVNULL, check=True)
        out["llvm_alone"] = _rate(n, c, n)
    return out


def bench_session(path: str, session_file: str, repeat: int) -> dict[str, Any]:
    """A recorded session of the Go binary at `path` through the service's resolver, `.gopclntab`
    (names, file:line, inlined calls) then `.symtab` (names only) in each round, a new resolver each
    time (its module loaded apart): CPU medians and the median of the rounds' ratios."""
    bin_dir = tempfile.mkdtemp(prefix="bench-sym-")
    os.symlink(os.path.realpath(path), os.path.join(bin_dir, os.path.basename(path)))
    sess = resolve.read_session_file(session_file)
    build_ids = {f.build_id for t in sess.traces for f in t.user if f.build_id}
    cpu: dict[str, list[float]] = {"pclntab": [], "symtab": []}
    out: dict[str, Any] = {
        "target": f"session:{os.path.basename(session_file)}",
        "binary": path,
        "samples": len(sess.traces),
        "frames": sum(len(t.user) + len(t.kernel) for t in sess.traces),
        "distinct_user": len(
            {(f.build_id, f.address, j == 0) for t in sess.traces for j, f in enumerate(t.user)}
        ),
    }
    for _ in range(repeat):
        for label in cpu:
            read = resolve.read_pclntab
            if label == "symtab":  # the module loads as any ELF file's: names from .symtab
                resolve.read_pclntab = lambda _f: None  # type: ignore[assignment]
            try:
                r = Resolver(
                    DebugSources([], [bin_dir], debuginfod_urls=[]),
                    use_llvm=False,
                    registry=CollectorRegistry(),
                )
                for bid in build_ids:
                    r.module(bid)
                gc.collect()
                with Clock() as c:
                    p = r.symbolize(sess)
                cpu[label].append(c.cpu)
                out[f"{label}_frame_table"] = len(p.frames)
                r.close()
            finally:
                resolve.read_pclntab = read
    for label, times in cpu.items():
        out[f"{label}_cpu_ms"] = round(statistics.median(times) * 1e3, 1)
    ratios = [a / b for a, b in zip(cpu["pclntab"], cpu["symtab"], strict=True)]
    out["session_pclntab_vs_symtab"] = round(statistics.median(ratios), 2)
    out["session_pclntab_vs_symtab_rounds"] = [round(x, 2) for x in ratios]
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
        f"{k}_{m}_{t}"
        for k in ("unique", "zipf")
        for m in ("names", "lines", "symtab", "pclntab", "dwarf")
        for t in ("cold", "warm")
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
            for k in r
            if k in ("symbols", "go", "module_load_ms", "named_fraction", "frames_with_line_fraction")
            or k.endswith(
                ("_vs_symtab", "_vs_symtab_rounds", "_vs_dwarf", "_load_ms", "_cpu_ms", "_frame_table")
            )
            or k in ("samples", "frames", "distinct_user")
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
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of a Go binary's in-process paths (best rate, median ratio)",
    )
    ap.add_argument(
        "--go", action="append", default=[], metavar="PATH", help="a Go binary (instead of cmd/go)"
    )
    ap.add_argument(
        "--session",
        metavar="FILE",
        help="a recorded session of the (first) --go binary: its pclntab/symtab CPU ratio end to end",
    )
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
    go_targets = [(os.path.basename(p), p) for p in args.go] + list(GO_TARGETS)
    if not args.go and (not args.only or "go" in args.only):
        built = build_go_cmd(tempfile.mkdtemp(prefix="bench-sym-go-"))
        go_targets += [("go", built)] if built else []
    for name, path in go_targets:
        if args.only and name not in args.only:
            continue
        res = bench_go(name, path, args.addresses, args.depth, args.frames, args.zipf, args.repeat)
        if res is not None:
            results.append(res)
    if args.session and args.go:
        results.append(bench_session(args.go[0], args.session, args.repeat))
    print_table(results)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    out = os.path.join(RESULTS_DIR, time.strftime("bench_symbolize-%Y%m%dT%H%M%S.json"))
    with open(out, "w") as f:
        json.dump({"host": os.uname().nodename, "cpus": os.cpu_count(), "results": results}, f, indent=2)
    print(f"# results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

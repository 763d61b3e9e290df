"""A warm `record`'s new addresses in a binary with some DWARF (node: libuv and c-ares), named
through record's cache: the resolver reading the binary's symbol table (main before session 17)
against the symbols the cache holds (`Resolver(known_symbols=...)`).

A node process runs (its files linked into a .build-id tree as record links them); one
symbolization of a few addresses fills a cache (node's symbols, with the ranges its DWARF
describes); then, in interleaved pairs, a copy of that cache names N random addresses inside
those ranges (not cached: each goes to the resolver and the DWARF reader) both ways. Measured: the
CPU of `symcache.symbolize` (process time), medians; the frames are checked equal (file:line
included). No root needed.

    python -m bench.bench_warm_dwarf [--addresses 3] [--pairs 5] [--binary /usr/bin/node]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bistouri import wire
from bistouri.elf import ElfFile
from bistouri.record import symcache
from bistouri.record.dwarfpool import DwarfFirstPool
from bistouri.record.outputs import BuildIdTree
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.sources import DebugSources


def session(build_id: bytes, offsets: list[int]) -> wire.Session:
    traces = [
        wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, build_id, off, "node"),), 1, 1, on_cpu=1)
        for off in offsets
    ]
    return wire.Session("s", wire.Trigger("cpu"), wire.KernelInfo(), 0, 1, 1, traces=traces)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addresses", type=int, default=3, help="new addresses a warm run meets")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--binary", default="/usr/bin/node")
    args = ap.parse_args()
    with ElfFile(args.binary) as elf:
        build_id, segments = elf.build_id, elf.segments
    text = next(s for s in segments if s.flags & 1)
    proc = subprocess.Popen([args.binary, "-e", "setTimeout(() => 0, 600000)"])
    tree = BuildIdTree("/proc")
    try:
        time.sleep(0.5)
        tree.add([proc.pid])
        with tempfile.TemporaryDirectory(prefix="bench-warm-dwarf-") as tmp:
            filled = Path(tmp, "filled")

            def run(cache_dir: Path, offsets: list[int], known: bool) -> tuple[float, list]:
                cache = symcache.SymbolCache(cache_dir)

                def opener(file_lines: bool, known_symbols: object) -> Resolver:
                    pool = DwarfFirstPool(cache, debug_dirs=[], registry=None)
                    return Resolver(
                        DebugSources([tree.root], [], []),
                        None,
                        pool,
                        registry=None,
                        known_symbols=known_symbols if known else None,  # type: ignore[arg-type]
                    )

                t = time.process_time()
                profile, _ = symcache.symbolize(session(build_id, offsets), cache, opener, "k", [])
                took = time.process_time() - t
                return took, sorted(map(repr, profile.frames)), any(f.file for f in profile.frames)

            run(filled, [text.offset + 0x100], known=False)  # node's symbols and described ranges cached
            table = symcache.SymbolCache(filled).symbols(build_id.hex())
            if table is None or not table.described:
                print(f"{args.binary}: no symbols with DWARF ranges cached (no DWARF?)", file=sys.stderr)
                return 1
            described = table.described
            table.close()
            cpu: dict[bool, list[float]] = {False: [], True: []}
            rng = random.Random(17)
            for pair in range(args.pairs):
                offsets = []
                for _ in range(args.addresses):
                    lo, hi = rng.choice(described)
                    offsets.append(rng.randrange(lo, hi) - text.vaddr + text.offset)
                answers = []
                for known in (pair % 2 == 0, pair % 2 != 0):  # order alternated
                    copy = Path(tmp, f"run-{pair}-{known}")
                    shutil.copytree(filled, copy)
                    took, frames, with_lines = run(copy, offsets, known)
                    if not with_lines:
                        raise SystemExit("no frame with file:line: the DWARF reader answered nothing")
                    cpu[known].append(took)
                    answers.append(frames)
                if answers[0] != answers[1]:
                    print("the two ways named an address differently", file=sys.stderr)
                    return 1
    finally:
        proc.kill()
        proc.wait()
        tree.remove()
    med = statistics.median
    load = os.getloadavg()[0]
    print(
        f"{args.addresses} new addresses in {args.binary}'s DWARF ranges, {args.pairs} pairs, load {load:.1f}"
    )
    for known, label in ((False, "symbol table read again"), (True, "cached symbols")):
        runs = ", ".join(f"{x:.3f}" for x in cpu[known])
        print(f"  {label:>23}: CPU median {med(cpu[known]):.3f} s ({runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

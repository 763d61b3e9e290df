"""A process with tens of thousands of executable mappings that change all the time (issue 26, N10):
what a re-read may cost the agent is bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bistouri.host.procmaps import ProcMaps

# 30 000 one-page executable mappings of one file, each at offset 0: never merged into one VMA.
MAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
for _ in range(30000):
    assert libc.mmap(None, 4096, 5, 2, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # R|X, private
print("ready", flush=True)
sys.stdin.read()
"""


def test_many_churning_mappings_cost_a_bounded_number_of_reads(tmp_path: Path) -> None:
    page = tmp_path / "code"
    page.write_bytes(b"\xc3" * 4096)
    p = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(page)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        now = [0.0]
        maps = ProcMaps(clock=lambda: now[0])
        maps.track(p.pid)
        # At most max_mappings executable mappings of one process are kept, the rest counted.
        assert maps.stats.mappings_over_bound >= 30000 - maps.max_mappings
        t = maps._tables[p.pid]
        assert len(t.starts) == maps.max_mappings
        assert len(maps._files) <= 16  # one file id for the 30 000 mappings of one file
        # 10 s of samples, each with a new VMA count: the maps would be read 20 times a second.
        for i in range(200):
            now[0] += 0.05
            maps.generation(p.pid, 100000 + i)
        # A read of 30 000 lines costs 8 tokens (20 a second): about 25, not 200.
        assert maps.stats.reads <= 1 + 5 + 10 * 20 // 8 + 1, maps.stats.reads
    finally:
        p.kill()
        p.wait()

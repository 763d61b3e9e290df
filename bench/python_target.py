"""The process bench_python_frames profiles, run by each interpreter under test (3.8+; no newer syntax).

Usage: python_target.py COUNTER DEPTH [checksum | distinct]. COUNTER is an 8-byte file this process maps
shared and where it counts the rounds done so far (the bench reads it to tell how much work was done in a
window, without a pipe or a signal disturbing the loop). A round is `hot_loop`, then with `checksum` that
function (`zlib.crc32`, a call written over three lines), under `driver`, itself under `deep` recursed until
the Python stack is DEPTH frames deep at `hot_loop` (at least 4: `<module>`, `main`, `driver`, `hot_loop`).
With `distinct`, each level of that recursion is a code object of its own (`deep_0`, `deep_1`, ...): a stack
of different functions, as most are, where a walk can reuse nothing it read for the frame before.

Prints one JSON line first: the pid, the address of `hot_loop`'s code object, and for every code object
on that stack CPython's own line for each instruction offset (tests/fixtures/workloads/cpython_target.py's
`_describe`: `PyCode_Addr2Line`, what tracebacks and `f_lineno` use), the truth both profilers' lines are
held to.
"""

import json
import mmap
import os
import struct
import sys
import types
import zlib

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "workloads")
)

from cpython_target import _describe

_FIXED = 4  # <module>, main, driver, hot_loop


def hot_loop(n):
    total = 0
    for i in range(n):
        total += i * i
    return total


def checksum(data):
    # The call's own line is not its argument's: the CALL starts a new entry of the line table right after
    # the argument's, the boundary where a line lookup off by one unit names the argument's line. (The
    # trailing comma keeps the formatter from joining the lines.)
    return zlib.crc32(
        data,
    )


def driver(counter, with_checksum):
    blob = bytes(1 << 16)
    done = 0
    while True:
        hot_loop(2000)
        if with_checksum:
            checksum(blob)
        done += 1
        struct.pack_into("<Q", counter, 0, done)


def deep(n, counter, with_checksum):
    return driver(counter, with_checksum) if n == 0 else deep(n - 1, counter, with_checksum)


def deep_distinct(n, counter, with_checksum):
    return driver(counter, with_checksum) if n == 0 else _DISTINCT[n - 1](n - 1, counter, with_checksum)


_DISTINCT = []  # deep_distinct's code copied under another name for each level: one code object each


def main():
    with open(sys.argv[1], "r+b") as f:
        counter = mmap.mmap(f.fileno(), 8)
    depth = int(sys.argv[2])
    with_checksum = sys.argv[3:] == ["checksum"]
    levels = max(0, depth - _FIXED)
    if sys.argv[3:] == ["distinct"]:
        for i in range(levels):
            code = deep_distinct.__code__.replace(co_name=f"deep_{i}")
            _DISTINCT.append(types.FunctionType(code, globals(), code.co_name))
    module = sys._getframe().f_back.f_code
    codes = [module, main.__code__, deep.__code__, driver.__code__, hot_loop.__code__, checksum.__code__]
    out = {"pid": os.getpid(), "hot": id(hot_loop.__code__), "codes": [_describe(co) for co in codes]}
    print(json.dumps(out), flush=True)
    sys.setrecursionlimit(max(1000, depth + 100))
    if depth > _FIXED:
        (_DISTINCT[-1] if _DISTINCT else deep)(levels - 1, counter, with_checksum)
    driver(counter, with_checksum)


if __name__ == "__main__":
    main()

"""The BPF walk of CPython frames (bpf/python.bpf.h) on the real interpreters: pyenv's 3.8-3.13 and
Debian's static 3.11, each running a busy loop (`hot_loop` under `driver`) and a thread compressing
without the GIL (`z_inner` under `z_outer`), sampled on-CPU.

The walk's frames are checked against the process itself: the hot function's code address in nearly
every sample, the GIL-released thread's own function in its samples, every sampled frame on CPython's own
line, the checksum the one user space computes, the C activations marked where each version puts them,
and the mixed stacks (cpython/splice.py): every eval-loop frame takes its Python frames, libz under the
Python function that called zlib.compress.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from bistouri.bpf import abi
from bistouri.capture.events import StackSample, split_stacks
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.cpython import discover
from bistouri.cpython.naming import CodeNamer
from bistouri.cpython.splice import PyFrame, decode, splice
from bistouri.host.procmaps import FrameStatus, ProcMaps
from testkit.helpers import CPYTHON_TARGET, CPYTHONS, cpython, waits_on_futex

pytestmark = [pytest.mark.bpf, pytest.mark.slow]  # each interpreter sampled for seconds

FAST = ProfilerOptions(freq_hz=99, offcpu=False, unwind_nice=0, unwind_cpu_share=1.0)


def _frames(sample: StackSample) -> list[tuple[int, int, int]]:
    """(code address with its entry bit, offset, checksum), innermost first: the raw records."""
    return list(abi.PY_FRAME.iter_unpack(sample.python))


def _weight(samples: list[StackSample]) -> int:
    return sum(s.weight for s in samples)


@contextmanager
def _target(
    which: str, *args: str, flags: tuple[str, ...] = ()
) -> Iterator[tuple[subprocess.Popen[str], dict]]:
    """CPYTHON_TARGET run by `which` with `args` (the interpreter's `flags` before it), and the JSON
    line it printed first (its pid, code addresses, thread ids); killed on exit."""
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    proc = subprocess.Popen(
        [str(exe), *flags, str(CPYTHON_TARGET), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc, json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def _sample(
    pid: int,
    opts: ProfilerOptions,
    keep: Callable[[StackSample], bool],
    enough: Callable[[list[StackSample]], bool],
    flags: int = abi.FilterFlags.ON_CPU,
    tables: bool = True,
) -> tuple[list[StackSample], discover.Interpreter | None, ProcMaps]:
    """`pid`'s stack samples that `keep` keeps, until there are `enough` (at most 60 s: a busy host
    gives the target less CPU, so the samples come later, not fewer); with `tables`, only from when
    the unwind tables of its libraries are loaded (native stacks whole from then on). With the
    process's description and the profiler's maps (for file names)."""
    samples: list[StackSample] = []
    with Profiler(opts) as profiler:
        profiler.start()
        profiler.set_pid_filter(pid, flags)  # describes it, pushes its record
        interp = profiler.python.interpreter(pid)
        if tables:
            assert profiler.unwind.wait_idle(60)
            profiler.take()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not enough(samples):
            profiler.check_thread()
            samples += [e for e in profiler.take(timeout=0.1) if isinstance(e, StackSample) and keep(e)]
        return samples, interp, profiler.maps


def _hundred(samples: list[StackSample]) -> bool:
    return _weight(samples) >= 100


def _in_eval(maps: ProcMaps, interp: discover.Interpreter) -> Callable[[tuple[int, int, int]], bool]:
    """Whether a native frame is in the interpreter's eval loop (where splice puts Python frames)."""

    def in_eval(frame: tuple[int, int, int]) -> bool:
        status, file_id, offset = frame
        return (
            status == FrameStatus.FILE
            and maps.file(file_id).build_id == interp.build_id
            and any(lo <= offset < hi for lo, hi in interp.eval_ranges)
        )

    return in_eval


@pytest.fixture(params=CPYTHONS)
def hot_target(request) -> Iterator[tuple[str, subprocess.Popen[str], dict]]:
    with _target(request.param, "hot", "zlib") as (proc, dump):
        yield request.param, proc, dump


def test_python_frames_of_a_busy_loop_and_of_a_thread_without_the_gil(hot_target):
    which, proc, dump = hot_target
    interp = discover.describe(proc.pid)
    assert isinstance(interp, discover.Interpreter), interp
    # 200 samples of its main thread (the kernel counts repeats: a sample's weight).
    samples, described, maps = _sample(
        proc.pid,
        FAST,
        lambda e: e.pid == proc.pid,
        lambda got: _weight([s for s in got if s.tid == proc.pid]) >= 200,
    )
    assert described == interp
    main = [s for s in samples if s.tid == proc.pid]
    total = _weight(main)
    assert total >= 100, f"{total} samples of the busy loop"

    hot = dump["hot"]
    found = sum(s.weight for s in main if any(code & ~1 == hot for code, _, _ in _frames(s)))
    assert found >= 0.95 * total, f"{which}: hot_loop in {found} of {total} samples"
    # The thread that released the GIL is walked too: its own thread state, from its key slot.
    z = [s for s in samples if s.tid == dump["z_tid"]]
    z_total = _weight(z)
    z_found = sum(s.weight for s in z if any(code & ~1 == dump["z_inner"] for code, _, _ in _frames(s)))
    assert z_total >= 20 and z_found >= 0.95 * z_total, f"{which}: z_inner in {z_found} of {z_total} samples"

    # Every sampled frame of a dumped code object (hot_loop, driver) on CPython's own line for its offset.
    cpython_lines = {c["id"]: dict(map(tuple, c["lines"])) for c in dump["codes"]}
    checked = 0
    with CodeNamer(interp) as namer:
        for s in main:
            for code, offset, got in _frames(s):
                lines = cpython_lines.get(code & ~1)
                if lines is not None:
                    unit = -1 if offset == abi.PY_NO_OFFSET else offset
                    assert namer.name(code & ~1, got).line(unit) == lines[unit]
                    checked += 1
    assert checked >= total

    # Mixed stacks: every eval-loop frame of the native stack takes its Python frames; libz's frames
    # are under z_inner, the Python function that called zlib.compress.
    in_eval = _in_eval(maps, interp)
    # Of the samples whose native walk reached the outermost frame (the others stopped early: the
    # unwinder's business, their Python frames still go at the root end), every one spliced whole.
    complete = [s for s in main if s.walk[2] == abi.Counter.WALK_END]
    whole = sum(
        s.weight
        for s in complete
        if not splice(split_stacks(s.stacks, s.kernel_len)[1], decode(s.python), in_eval).leftover
    )
    assert whole >= 0.99 * _weight(complete) > 0.5 * total, f"{which}: spliced whole: {whole}"
    under = 0
    for s in z:
        mixed = splice(split_stacks(s.stacks, s.kernel_len)[1], decode(s.python), in_eval).frames
        at = next(
            (i for i, f in enumerate(mixed) if isinstance(f, PyFrame) and f.code == dump["z_inner"]), -1
        )
        under += s.weight * any(
            not isinstance(f, PyFrame) and f[0] == FrameStatus.FILE and "libz" in maps.file(f[1]).name
            for f in mixed[:at]
        )
    assert under >= 0.8 * z_total, f"{which}: libz under z_inner in {under} of {z_total} samples"

    with CodeNamer(interp) as namer:
        want = namer.checksum(hot)
        for s in main:
            frames = _frames(s)
            if not frames:
                continue
            code, offset, got = frames[0]
            if code & ~1 != hot:
                continue
            assert got == want, "BPF's checksum differs from user space's (layouts.checksum)"
            named = namer.name(hot, got)
            assert named.name == "hot_loop"
            line = named.line(None if offset == abi.PY_NO_OFFSET else offset)
            assert line in set(cpython_lines[hot].values())
            # The oldest frame (<module>) was called from C; on <= 3.10 every frame was.
            entries = [bool(c & abi.PY_FRAME_ENTRY) for c, _, _ in frames]
            assert entries[-1]
            if interp.version < (3, 11):
                assert all(entries)
            else:
                assert not entries[0]  # hot_loop was called by driver's bytecode, inline


@pytest.mark.parametrize("which", CPYTHONS)
def test_a_sleeping_threads_stack_names_its_python_caller(which):
    """The episode's interruptible-sleep stacks (taken at sched_switch, the sleeper current) carry the
    sleeping thread's own Python frames: `nap`, in time.sleep without the GIL, under `sleeper`."""
    with _target(which, "sleep") as (proc, dump):
        interp = discover.describe(proc.pid)
        assert isinstance(interp, discover.Interpreter), interp
        sleeps, _, _ = _sample(
            proc.pid,
            ProfilerOptions(freq_hz=49, unwind_nice=0, unwind_cpu_share=1.0),
            lambda e: e.kind == abi.EpisodeKind.SLEEP and e.tid == dump["nap_tid"],
            # Which of its waits the off-CPU rate limit captures is a matter of timing: wait for some
            # in time.sleep's system call.
            lambda got: (
                len(got) >= 10
                and sum(not waits_on_futex(split_stacks(s.stacks, s.kernel_len)[0]) for s in got) >= 3
            ),
            flags=int(abi.FilterFlags.ON_CPU | abi.EpisodeFilter.ON),
            tables=False,
        )
    assert len(sleeps) >= 10, f"{len(sleeps)} sleep stacks of the napping thread"
    nap, sleeper = dump["nap"], dump["sleeper"]
    # Sleeping in time.sleep's system call (clock_nanosleep; select before 3.11), the thread is in `nap`.
    # Its other sleeps wait for the GIL (a futex), at whichever frame gave it up: in time.sleep's return,
    # or at `sleeper`'s loop when the hot thread asked for the GIL while this one ran (a busy host).
    in_sleep = [s for s in sleeps if not waits_on_futex(split_stacks(s.stacks, s.kernel_len)[0])]
    assert in_sleep, f"{which}: every one of {len(sleeps)} sleep stacks waits for the GIL"
    named = [s for s in in_sleep if [f.code for f in decode(s.python)][:2] == [nap, sleeper]]
    assert len(named) == len(in_sleep), f"{which}: nap innermost in {len(named)} of {len(in_sleep)} sleeps"
    for s in sleeps:
        codes = [f.code for f in decode(s.python)]
        assert codes[:2] == [nap, sleeper] or codes[:1] == [sleeper], f"{which}: a GIL wait in {codes[:2]}"


@pytest.mark.parametrize("which", CPYTHONS)
def test_an_asyncio_coroutine_is_named_under_the_event_loop(which):
    """A running coroutine's frame is on its thread's chain: `hot_loop` under the coroutine `spin`, which the
    event loop (C: the Task's step, then coro.send) re-entered the eval loop to run; spliced whole."""
    with _target(which, "async") as (proc, dump):
        samples, interp, maps = _sample(proc.pid, FAST, lambda e: e.tid == proc.pid, _hundred)
    assert interp is not None
    total = _weight(samples)
    assert total >= 50, f"{total} samples"
    in_eval = _in_eval(maps, interp)
    both = whole = complete = 0
    for s in samples:
        codes = [f.code for f in decode(s.python)]
        if (
            dump["hot"] in codes
            and dump["spin"] in codes
            and codes.index(dump["hot"]) < codes.index(dump["spin"])
        ):
            both += s.weight
        if s.walk[2] == abi.Counter.WALK_END:
            complete += s.weight
            whole += s.weight * (
                splice(split_stacks(s.stacks, s.kernel_len)[1], decode(s.python), in_eval).leftover == 0
            )
    assert both >= 0.9 * total, f"{which}: hot_loop under spin in {both} of {total} samples"
    assert whole >= 0.99 * complete > 0.5 * total, (
        f"{which}: spliced whole in {whole} of {complete} complete walks"
    )


@pytest.mark.parametrize("which", ["3.12", "3.13"])
def test_perf_trampolines_do_not_double_the_python_frames(which):
    """A 3.12+ process started with `-X perf` runs each C entry of the eval loop through a trampoline the
    perf map names `py::<function>`: with the Python frames spliced in, those are left out (no double
    frames), and the Python frames are the same as without the flag."""
    mixed = []
    with _target(which, "hot", flags=("-X", "perf")) as (proc, dump):
        samples, interp, maps = _sample(proc.pid, FAST, lambda e: e.tid == proc.pid, _hundred)
        assert interp is not None

        def jit(frame: tuple[int, int, int]) -> str:
            status, _, ip = frame
            return (maps.jit_name(proc.pid, ip) or "") if status == FrameStatus.ANON else ""

        in_eval = _in_eval(maps, interp)
        trampolines = 0
        for s in samples:  # named while the process and its perf map live
            native = split_stacks(s.stacks, s.kernel_len)[1]
            trampolines += any(jit(f).startswith("py::") for f in native)
            out = splice(native, decode(s.python), in_eval, lambda f: jit(f).startswith("py::"))
            mixed.append((s, out.frames))
    assert trampolines >= len(samples) // 2, "the trampolines were not in the native stacks: nothing tested"
    total = sum(s.weight for s, _ in mixed)
    named = sum(
        s.weight
        for s, frames in mixed
        if any(isinstance(f, PyFrame) and f.code == dump["hot"] for f in frames)
    )
    assert total >= 50 and named >= 0.95 * total, f"{which}: hot_loop in {named} of {total} samples"
    doubled = [
        frames
        for _, frames in mixed
        if any(not isinstance(f, PyFrame) and f[0] == FrameStatus.ANON for f in frames)
    ]
    assert not doubled, f"{len(doubled)} spliced stacks still hold a trampoline frame"


@pytest.mark.parametrize("which", ["3.8", "3.11", "3.13"])
def test_a_deep_stack_keeps_its_innermost_frames_up_to_the_bound(which):
    """100 Python calls deep: the walk keeps the innermost abi.PY_MAX_DEPTH frames (hot_loop first)."""
    with _target(which, "deep") as (proc, dump):
        samples, _, _ = _sample(
            proc.pid,
            ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0),
            lambda e: e.tid == proc.pid,
            _hundred,
            tables=False,
        )
    total = _weight(samples)
    full = sum(s.weight for s in samples if len(decode(s.python)) == abi.PY_MAX_DEPTH)
    hot = sum(s.weight for s in samples if decode(s.python)[:1] and decode(s.python)[0].code == dump["hot"])
    assert total >= 50 and full >= 0.95 * total, f"{which}: {full} of {total} samples 64 frames deep"
    assert hot >= 0.8 * total, f"{which}: hot_loop innermost in {hot} of {total} samples"


_REMADE = """
import sys, time
names = {}
for i in range(int(sys.argv[1])):
    exec("def f_%d(t):\\n    end = t() + 0.15\\n    while t() < end:\\n        pass\\n" % i, names)
    f = names.pop("f_%d" % i)
    print(id(f.__code__), flush=True)
    sys.stdin.readline()  # the parent has its checksum
    f(time.monotonic)
    print("ran", flush=True)
    sys.stdin.readline()  # the parent has its samples
    del f  # the code object freed: the next one is often made at its address
"""


@pytest.mark.parametrize("which", CPYTHONS)
def test_a_checksum_kept_between_samples_is_never_a_freed_code_objects(which):
    """BPF keeps code objects' checksums from sample to sample while the process made no code object
    (3.12+: python.bpf.h, py_code_seen): functions made, run and dropped in turn, most at the address of
    the one before, and each one's samples carry its own checksum, never the one its address held."""
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    proc = subprocess.Popen(
        [str(exe), "-c", _REMADE, "12"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    checked = reused = 0
    seen: set[int] = set()
    try:
        with Profiler(ProfilerOptions(freq_hz=999, offcpu=False)) as profiler:
            profiler.start()
            addr = int(proc.stdout.readline())
            profiler.set_pid_filter(proc.pid, abi.FilterFlags.ON_CPU)
            interp = profiler.python.interpreter(proc.pid)
            assert isinstance(interp, discover.Interpreter), interp
            with CodeNamer(interp) as namer:
                for i in range(12):
                    if i:
                        addr = int(proc.stdout.readline())
                    reused += addr in seen
                    seen.add(addr)
                    have = namer.checksum(addr)
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                    assert proc.stdout.readline().strip() == "ran"
                    # Every sample of this run is in the ring, its repeats in the kernel's counts: both
                    # drained now, before the next function (late counts would carry this one's frames).
                    profiler.catch_up()
                    quiet = 0
                    while quiet < 2:
                        events = profiler.take(timeout=0.1)
                        quiet = 0 if events else quiet + 1
                        for e in events:
                            if not isinstance(e, StackSample) or e.pid != proc.pid:
                                continue
                            for code, _, checksum in _frames(e):
                                if code & ~abi.PY_FRAME_ENTRY == addr:
                                    assert checksum == have, f"{which}: f_{i} sampled with another's checksum"
                                    checked += e.weight
                    proc.stdin.write("\n")
                    proc.stdin.flush()
    finally:
        proc.kill()
        proc.wait()
    assert reused >= 3, f"{which}: only {reused} of 12 functions at an address used before"
    assert checked >= 100, f"{which}: {checked} samples of the functions"

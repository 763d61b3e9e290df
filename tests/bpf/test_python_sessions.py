"""Python frames in sessions, on the real interpreters: a `wire.Session` built as the agent builds it
(Profiler → SessionCapture: samples named as they arrive, traces keyed by their Python frames, spliced
when the session ends), from pyenv's 3.8-3.13 and Debian's static 3.11.

One target per interpreter runs `hot_loop` under `driver` on its main thread, a thread compressing without
the GIL (`z_inner` under `z_outer`) and a thread napping in `time.sleep` (`nap` under `sleeper`): the hot
function named on CPython's own lines, libz under its Python caller, the nap in its off-CPU (S) stacks,
the flight recorder's samples (pre_traces) named too, and the data-quality note. Waits are for counts of
what the kernel sent, never for a time.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.bpf import abi
from bistouri.capture.events import StackSample, split_stacks
from bistouri.capture.metrics import CaptureMetrics
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.capture.sessions import SessionCapture
from bistouri.host.kernel import KernelMeta
from testkit.helpers import CPYTHON_TARGET, CPYTHONS, cpython, waits_on_futex

pytestmark = [pytest.mark.bpf, pytest.mark.slow]  # each interpreter sampled for seconds

_ALL = int(abi.FilterFlags.ON_CPU | abi.FilterFlags.OFF_CPU | abi.EpisodeFilter.ON)


@contextmanager
def _target(
    which: str, *args: str, flags: tuple[str, ...] = (), cwd: Path | None = None
) -> Iterator[tuple[int, dict]]:
    exe = cpython(which)
    if exe is None:
        pytest.skip(f"CPython {which} is not installed")
    proc = subprocess.Popen(
        [str(exe), *flags, str(CPYTHON_TARGET), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    try:
        assert proc.stdout is not None
        yield proc.pid, json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def _capture(
    options: ProfilerOptions, filter_flags: int = _ALL
) -> Iterator[tuple[Profiler, SessionCapture, CollectorRegistry]]:
    reg = CollectorRegistry()
    with Profiler(options) as profiler:
        profiler.start()
        capture = SessionCapture(
            profiler,
            None,  # type: ignore[arg-type]  # finish_session: built, not spooled
            CaptureMetrics(registry=reg),
            KernelMeta("test", b"", 0),
            tenant="t",
            host="h",
            labels={},
            period_ns=1_000_000_000 // options.freq_hz,
            filter_flags=filter_flags,
            catch_up=profiler.catch_up,
        )
        yield profiler, capture, reg


def _feed(profiler: Profiler, capture: SessionCapture, done: Callable[[list[StackSample]], bool]) -> None:
    """Samples into the capture until `done` says enough arrived (at most 60 s: a busy host gives the
    target less CPU, so the samples come later, not fewer)."""
    seen: list[StackSample] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not done(seen):
        profiler.check_thread()
        batch = [e for e in profiler.take(timeout=0.1) if isinstance(e, StackSample)]
        capture.add_samples(batch)
        seen += batch
    assert done(seen), f"not enough samples in 60 s: {len(seen)} stack events"


def _tables_loaded(profiler: Profiler) -> None:
    """Wait for the unwind tables of the target's files (libpython, libz: native stacks whole from then
    on), and drop what was sampled before them (native walks that stopped early)."""
    assert profiler.unwind.wait_idle(60)
    profiler.catch_up()
    profiler.take()


def _weight(samples: list[StackSample], pid: int, tid: int, kind: int | None = None) -> int:
    return sum(
        s.weight for s in samples if s.pid == pid and s.tid == tid and (kind is None or s.kind == kind)
    )


def _sleeps_in_time_sleep(samples: list[StackSample], tid: int) -> int:
    """The napping thread's sleeps in time.sleep's system call, not waiting for the GIL (a futex): which of
    its waits the off-CPU rate limit captures is a matter of timing."""
    return sum(
        1
        for s in samples
        if s.tid == tid
        and s.kind == abi.EpisodeKind.SLEEP
        and not waits_on_futex(split_stacks(s.stacks, s.kernel_len)[0])
    )


def _python(trace: wire.Trace) -> list[wire.UserFrame]:
    return [f for f in trace.user if f.kind == wire.FRAME_PYTHON]


@pytest.mark.parametrize("which", CPYTHONS)
def test_a_session_names_the_python_frames_of_every_thread_in_place(which):
    with _target(which, "hot", "zlib", "sleep") as (pid, dump):
        hot_lines = {line for c in dump["codes"] if c["id"] == dump["hot"] for _, line in c["lines"] if line}
        with _capture(ProfilerOptions(freq_hz=99, unwind_nice=0, unwind_cpu_share=1.0)) as (
            profiler,
            capture,
            reg,
        ):
            capture.watch(pid, 60.0)  # the flight recorder: the session starts with its samples
            _tables_loaded(profiler)
            # On-CPU samples: a busy host also sends the thread's run-queue waits (weighted by the ones
            # the rate limit skipped), which would meet a count of every kind alone.
            _feed(profiler, capture, lambda seen: _weight(seen, pid, pid, abi.EventKind.ON_CPU) >= 30)
            sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {pid: "python"}, 60, recorder_secs=60)
            assert sid
            _feed(
                profiler,
                capture,
                lambda seen: (
                    _weight(seen, pid, pid, abi.EventKind.ON_CPU) >= 100
                    and _weight(seen, pid, dump["z_tid"], abi.EventKind.ON_CPU) >= 30
                    and _weight(seen, pid, dump["nap_tid"], abi.EpisodeKind.SLEEP) >= 10
                    and _sleeps_in_time_sleep(seen, dump["nap_tid"]) >= 3
                ),
            )
            session = capture.finish_session(sid)
            capture.unwatch(pid)
            spliced = reg.get_sample_value("bistouri_user_frames_total", {"kind": "python"}) or 0
            unspliced = reg.get_sample_value("bistouri_user_frames_total", {"kind": "python_unspliced"}) or 0

    # On-CPU counts (a busy host also puts run-queue waits on the same stacks, as off-CPU counts).
    main = [t for t in session.traces if t.tid == pid and t.on_cpu]
    total = sum(t.on_cpu for t in main)
    # The hot function innermost of the Python frames, named, with its file and one of its own lines.
    hot = [t for t in main if _python(t)[:1] and _python(t)[0].name == "hot_loop"]
    assert sum(t.on_cpu for t in hot) >= 0.95 * total > 0, f"{which}: hot_loop in {len(hot)} of {len(main)}"
    for t in hot:
        frame = _python(t)[0]
        assert frame.file == str(CPYTHON_TARGET) and frame.address in hot_lines
        assert [f.name for f in _python(t)][:3] == ["hot_loop", "driver", "main"]
        # In place: the eval loop's frames are gone, the interpreter's C caller below the Python frames.
        names = [f.name for f in t.user]
        assert "_PyEval_EvalFrameDefault" not in names
    # The recorder's samples, before the trigger, are named the same.
    pre = [t for t in main if t.pre_trigger]
    assert sum(t.on_cpu for t in pre if t in hot) >= 0.9 * sum(t.on_cpu for t in pre) > 0

    # libz's frames under z_inner, the Python function that called zlib.compress.
    z = [t for t in session.traces if t.tid == dump["z_tid"] and t.on_cpu]
    z_total = sum(t.on_cpu for t in z)

    def libz_under_z_inner(t: wire.Trace) -> bool:
        at = next(
            (i for i, f in enumerate(t.user) if f.kind == wire.FRAME_PYTHON and f.name == "z_inner"), -1
        )
        return at > 0 and any(f.kind == wire.FRAME_RESOLVED and "libz" in f.name for f in t.user[:at])

    under = sum(t.on_cpu for t in z if libz_under_z_inner(t))
    assert under >= 0.8 * z_total > 0, f"{which}: libz under z_inner in {under} of {z_total}"

    # The napping thread's interruptible-sleep stacks: its Python caller named, innermost.
    naps = [t for t in session.traces if t.tid == dump["nap_tid"] and t.wait == wire.WAIT_S and t.off_cpu]
    assert sum(t.off_cpu for t in naps) >= 10
    # In time.sleep's system call: `nap`. A GIL wait (a futex) may have given the GIL up at `sleeper`'s
    # loop instead (test_python_frames' sleeping-thread test says why).
    in_sleep = [t for t in naps if not waits_on_futex(t.kernel)]
    assert in_sleep, f"{which}: every one of {len(naps)} sleep stacks waits for the GIL"
    named = [t for t in in_sleep if [f.name for f in _python(t)][:2] == ["nap", "sleeper"]]
    assert len(named) == len(in_sleep), f"{which}: nap named in {len(named)} of {len(in_sleep)} sleeps"
    for t in naps:
        names = [f.name for f in _python(t)]
        assert names[:2] == ["nap", "sleeper"] or names[:1] == ["sleeper"], f"{which}: a GIL wait in {names}"

    # The note: nearly every sample of the process named; every Python frame placed or counted.
    note = session.unwind.python
    assert note.get("named", 0) >= 0.95 * sum(note.values()), note
    in_traces = sum(len(_python(t)) for t in session.traces)
    assert spliced + unspliced == in_traces and spliced >= 0.95 * in_traces


@pytest.mark.parametrize("which", CPYTHONS)
def test_a_thread_waiting_for_the_disk_is_named_in_its_d_stacks(which, tmp_path):
    """os.fsync without the GIL: the thread's uninterruptible (D) off-CPU stacks name `f_sync` under
    `syncer`, its own Python frames (no unwind tables here: names only, not their place)."""
    opts = ProfilerOptions(freq_hz=19, unwind_rows=0)
    d_only = int(abi.FilterFlags.OFF_CPU)
    with (
        _target(which, "fsync", cwd=tmp_path) as (pid, dump),
        _capture(opts, d_only) as (profiler, capture, _),
    ):
        sid = capture.start_session(wire.Trigger("io"), "svc", {}, {pid: "python"}, 60)
        assert sid
        _feed(
            profiler, capture, lambda seen: _weight(seen, pid, dump["sync_tid"], abi.EventKind.OFF_CPU) >= 5
        )
        session = capture.finish_session(sid)
    waits = [t for t in session.traces if t.tid == dump["sync_tid"] and t.wait == wire.WAIT_D and t.off_cpu]
    assert sum(t.off_cpu for t in waits) >= 5
    named = [t for t in waits if [f.name for f in _python(t)][:2] == ["f_sync", "syncer"]]
    assert len(named) == len(waits), f"{which}: f_sync named in {len(named)} of {len(waits)} D stacks"


@pytest.mark.parametrize("which", CPYTHONS)
def test_an_asyncio_coroutine_is_named_in_the_session(which):
    with _target(which, "async") as (pid, _):
        opts = ProfilerOptions(freq_hz=99, offcpu=False, unwind_nice=0, unwind_cpu_share=1.0)
        with _capture(opts) as (profiler, capture, _reg):
            sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {pid: "python"}, 60)
            assert sid
            _tables_loaded(profiler)
            _feed(profiler, capture, lambda seen: _weight(seen, pid, pid) >= 100)
            session = capture.finish_session(sid)
    main = [t for t in session.traces if t.tid == pid]
    total = sum(t.on_cpu for t in main)
    both = sum(t.on_cpu for t in main if [f.name for f in _python(t)][:2] == ["hot_loop", "spin"])
    assert both >= 0.9 * total > 0, f"{which}: hot_loop under the coroutine spin in {both} of {total}"


@pytest.mark.parametrize("which", ["3.12", "3.13"])
def test_perf_trampolines_are_not_doubled_in_the_session(which):
    """-X perf: each Python call also runs through a trampoline the perf map names `py::…`; with the
    Python frames in place, those are left out."""
    with _target(which, "hot", flags=("-X", "perf")) as (pid, _):
        opts = ProfilerOptions(freq_hz=99, offcpu=False, unwind_nice=0, unwind_cpu_share=1.0)
        with _capture(opts) as (profiler, capture, reg):
            sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {pid: "python"}, 60)
            assert sid
            _tables_loaded(profiler)
            _feed(profiler, capture, lambda seen: _weight(seen, pid, pid) >= 100)
            session = capture.finish_session(sid)
            jit = reg.get_sample_value("bistouri_user_frames_total", {"kind": "jit"}) or 0
    main = [t for t in session.traces if t.tid == pid]
    total = sum(t.on_cpu for t in main)
    named = sum(t.on_cpu for t in main if _python(t)[:1] and _python(t)[0].name == "hot_loop")
    assert named >= 0.95 * total > 0, f"{which}: hot_loop in {named} of {total}"
    assert jit > 0, "no trampoline in the native stacks: nothing tested"
    doubled = [t for t in main if _python(t) and any(f.kind == wire.FRAME_JIT for f in t.user)]
    assert not doubled, f"{len(doubled)} traces hold both Python frames and a trampoline"


@pytest.mark.parametrize("which", ["3.11", "debian-3.11"])
def test_python_frames_no_eval_frame_took_are_kept_and_counted(which):
    """Without unwind tables the native walk stops inside the interpreter (no frame pointers): the Python
    frames no eval frame took go at the root end, counted, and none is lost."""
    opts = ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0)
    with _target(which, "hot") as (pid, _), _capture(opts) as (profiler, capture, reg):
        sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {pid: "python"}, 60)
        assert sid
        _feed(profiler, capture, lambda seen: _weight(seen, pid, pid) >= 50)
        session = capture.finish_session(sid)
        spliced = reg.get_sample_value("bistouri_user_frames_total", {"kind": "python"}) or 0
        unspliced = reg.get_sample_value("bistouri_user_frames_total", {"kind": "python_unspliced"}) or 0
    main = [t for t in session.traces if t.tid == pid]
    assert [f.name for f in _python(main[0])][:3] == ["hot_loop", "driver", "main"]
    assert all(_python(t)[-1].name == "<module>" for t in main if _python(t))  # the oldest kept
    assert unspliced > 0, "the native walks were whole: nothing tested"
    assert spliced + unspliced == sum(len(_python(t)) for t in session.traces)


def test_a_target_that_execs_into_python_is_described_again():
    """A shell made a target (not CPython: no walk), which then execs an interpreter: its mappings change,
    it is described again as the program it now is, and its samples are named from then on."""
    exe = cpython("3.12")
    if exe is None:
        pytest.skip("CPython 3.12 is not installed")
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f'read go; exec "{exe}" "{CPYTHON_TARGET}" hot'],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        opts = ProfilerOptions(freq_hz=99, offcpu=False, unwind_rows=0)
        with _capture(opts) as (profiler, capture, _reg):
            sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {proc.pid: "sh"}, 60)
            assert sid
            assert profiler.python.stats.not_walked["not_python"] == 1
            proc.stdin.write("go\n")
            proc.stdin.flush()
            dump = json.loads(proc.stdout.readline())
            assert dump["pid"] == proc.pid
            _feed(
                profiler,
                capture,
                lambda seen: (
                    sum(s.weight for s in seen if s.py.frames and s.py.frames[0].name == "hot_loop") >= 20
                ),
            )
            session = capture.finish_session(sid)
            assert profiler.python.stats.walked == 1
    finally:
        proc.kill()
        proc.wait()
    # On-CPU and run-queue samples (the loop preempted) alike.
    hot = sum(
        t.on_cpu + t.off_cpu for t in session.traces if _python(t)[:1] and _python(t)[0].name == "hot_loop"
    )
    assert hot >= 20 and session.unwind.python.get("named", 0) >= 20

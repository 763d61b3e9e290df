"""Python frames in the capture (docs/python-frames.md): traces keyed by native + named Python frames,
spliced in place of the eval-loop frames when the session is built, counted in the byte bounds and in the
session's data-quality note. Samples are built by hand: the burner's text stands for an interpreter whose
eval loop is at file offsets [0x1100, 0x1200)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.metrics import AgentMetrics
from bistouri.bpf import abi
from bistouri.capture.events import PY_FRAME_BYTES, StackSample
from bistouri.capture.flight import ENTRY_OVERHEAD_BYTES
from bistouri.capture.sessions import TRACE_OVERHEAD_BYTES, SessionCapture
from bistouri.cpython.processes import NAMED, PythonFrame, PythonStack
from bistouri.cpython.splice import EvalLoop
from bistouri.host.kernel import KernelMeta
from bistouri.host.procmaps import ProcMaps
from testkit.helpers import build_id

from .test_capture import _Filter, burner_maps, decode, fake_proc, record

EVAL = 0x400180  # burner text at 0x400000 from file offset 0x1000: file offset 0x1180, in the loop
CALLER = 0x401300  # file offset 0x2300: the interpreter's C code calling the loop (PyRun, main)
LIBZ = 0x400050  # file offset 0x1050: before the loop, stands for a C extension's frame


def _setup(tmp_path: Path, workloads: Path, perf_map: str = "") -> tuple[SessionCapture, CollectorRegistry]:
    fake_proc(tmp_path, 7, burner_maps(workloads))
    if perf_map:
        (tmp_path / "7" / "root").unlink()
        (tmp_path / "7" / "root" / "tmp").mkdir(parents=True)
        (tmp_path / "7" / "root" / "tmp" / "perf-7.map").write_text(perf_map)
    reg = CollectorRegistry()
    capture = SessionCapture(
        _Filter(ProcMaps(str(tmp_path))),
        None,  # type: ignore[arg-type]  # finish_session: nothing spooled
        AgentMetrics(reg),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
    )
    return capture, reg


def _loop(workloads: Path) -> EvalLoop:
    return EvalLoop(bytes.fromhex(build_id(workloads / "burner")), "burner", ((0x1100, 0x1200),))


def _sample(
    capture: SessionCapture,
    user: list[int],
    frames: tuple[PythonFrame, ...],
    loop: EvalLoop | None,
    note: str = NAMED,
    kind: int = abi.EventKind.ON_CPU,
) -> StackSample:
    s = decode(record(7, 7, [0xFFFFFFFF81000010], user, kind, blocked_ns=1000), capture._filter.maps)
    return dataclasses.replace(s, py=PythonStack(frames, note, loop))


def _py(name: str, line: int, entry: bool) -> PythonFrame:
    return PythonFrame(name, "/srv/app.py", line, entry)


def test_two_python_stacks_over_one_native_stack_are_two_traces(tmp_path, workloads):
    capture, _ = _setup(tmp_path, workloads)
    loop = _loop(workloads)
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60)
    assert sid
    a = (_py("hot", 3, False), _py("<module>", 9, True))
    b = (_py("cold", 5, False), _py("<module>", 9, True))
    native = [EVAL, CALLER]
    # Two raw samples naming the same frames (another instruction of the same line): one trace.
    capture.add_samples([_sample(capture, native, a, loop), _sample(capture, native, a, loop)])
    capture.add_samples([_sample(capture, native, b, loop)])
    session = capture.finish_session(sid)
    named = sorted(([f.name for f in t.user], t.on_cpu) for t in session.traces)
    assert named == [(["cold", "<module>", "burner"], 1), (["hot", "<module>", "burner"], 2)]


def test_each_eval_frame_takes_its_python_frames_and_c_frames_stay_under_their_caller(tmp_path, workloads):
    capture, reg = _setup(tmp_path, workloads)
    loop = _loop(workloads)
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60)
    assert sid
    # 3.11+: z_inner (called from C: its own activation) under z_outer <- <module> (one activation).
    frames = (_py("z_inner", 2, True), _py("z_outer", 6, False), _py("<module>", 9, True))
    capture.add_samples([_sample(capture, [LIBZ, EVAL, CALLER, EVAL, CALLER], frames, loop)])
    session = capture.finish_session(sid)
    (trace,) = session.traces
    assert [(f.kind, f.name, f.address) for f in trace.user] == [
        (wire.FRAME_RESOLVED, "burner", 0x1050),  # zlib's C code, under the Python function calling it
        (wire.FRAME_PYTHON, "z_inner", 2),
        (wire.FRAME_RESOLVED, "burner", 0x2300),
        (wire.FRAME_PYTHON, "z_outer", 6),
        (wire.FRAME_PYTHON, "<module>", 9),
        (wire.FRAME_RESOLVED, "burner", 0x2300),
    ]
    assert trace.user[1] == wire.UserFrame(wire.FRAME_PYTHON, b"", 2, "z_inner", "/srv/app.py")
    assert trace.kernel == (0xFFFFFFFF81000010,)  # kernel frames stay on top, apart
    assert reg.get_sample_value("bistouri_user_frames_total", {"kind": "python"}) == 3
    assert not reg.get_sample_value("bistouri_user_frames_total", {"kind": "python_unspliced"})
    assert session.unwind.python == {NAMED: 1}


def test_python_frames_no_eval_frame_took_go_at_the_root_end_counted(tmp_path, workloads):
    capture, reg = _setup(tmp_path, workloads)
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60)
    assert sid
    frames = (_py("hot", 3, True), _py("<module>", 9, True))
    # The native walk stopped after one eval frame: <module> has no eval frame left to take it.
    capture.add_samples([_sample(capture, [EVAL], frames, _loop(workloads))])
    (trace,) = capture.finish_session(sid).traces
    assert [f.name for f in trace.user] == ["hot", "<module>"]
    assert reg.get_sample_value("bistouri_user_frames_total", {"kind": "python_unspliced"}) == 1


def test_perf_trampolines_are_left_out_when_python_frames_are_there(tmp_path, workloads):
    capture, _ = _setup(tmp_path, workloads, perf_map="7f0000000100 40 py::hot:/srv/app.py\n")
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60)
    assert sid
    trampoline = 0x7F0000000110
    frames = (_py("hot", 3, True),)
    # The process's root holds only its perf map: the interpreter's file has no build id here, and is
    # known by its name.
    loop = EvalLoop(b"", "burner", ((0x1100, 0x1200),))
    capture.add_samples([_sample(capture, [EVAL, trampoline + 1, CALLER], frames, loop)])
    # No Python frames (a thread without a thread state): the trampoline is all there is, kept.
    capture.add_samples([_sample(capture, [EVAL, trampoline + 1], (), loop, "no_thread_state")])
    session = capture.finish_session(sid)
    stacks = sorted([(f.kind, f.name) for f in t.user] for t in session.traces)
    assert stacks == [
        [(wire.FRAME_RESOLVED, "burner"), (wire.FRAME_JIT, "py::hot:/srv/app.py")],
        [(wire.FRAME_PYTHON, "hot"), (wire.FRAME_RESOLVED, "burner")],
    ]
    assert session.unwind.python == {NAMED: 1, "no_thread_state": 1}


def test_the_note_counts_samples_of_cpython_processes_only(tmp_path, workloads):
    """named, why the walk gave nothing, or the process's reason (version_unknown); a process that is not
    CPython is not in the note. Off-CPU waits and recorded samples are counted like the rest."""
    capture, _ = _setup(tmp_path, workloads)
    loop = _loop(workloads)
    capture.watch(7, 60.0)
    hot = (_py("hot", 3, True),)
    capture.add_samples([_sample(capture, [EVAL], hot, loop)])  # recorded, before the trigger
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60, recorder_secs=60)
    assert sid
    capture.add_samples(
        [
            dataclasses.replace(_sample(capture, [EVAL], hot, loop), weight=4),
            _sample(capture, [EVAL], hot, loop, kind=abi.EventKind.OFF_CPU),
            _sample(capture, [CALLER], (), loop, "no_thread_state"),
            _sample(capture, [CALLER], (), None, "version_unknown"),
            _sample(capture, [CALLER], (), None, ""),
        ]
    )
    session = capture.finish_session(sid)
    assert session.unwind.python == {NAMED: 6, "no_thread_state": 1, "version_unknown": 1}
    pre = [t for t in session.traces if t.pre_trigger]
    assert [[f.name for f in t.user] for t in pre] == [["hot"]]
    off = [t for t in session.traces if t.off_cpu]
    assert [[f.name for f in t.user] for t in off] == [["hot"]]
    capture.unwatch(7)


def test_byte_bounds_count_the_python_frames(tmp_path, workloads):
    capture, _ = _setup(tmp_path, workloads)
    loop = _loop(workloads)
    capture.watch(7, 60.0)
    frames = tuple(_py(f"f{i}", i, i == 9) for i in range(10))
    sample = _sample(capture, [EVAL], frames, loop)
    raw = abi.PY_FRAME.pack(0x1000, 0, 1) * 10
    sample = dataclasses.replace(sample, python=raw)
    capture.add_samples([sample])
    held = len(sample.stacks) + len(raw) + 10 * PY_FRAME_BYTES
    assert capture.recorder.nbytes == held + ENTRY_OVERHEAD_BYTES
    sid = capture.start_session(wire.Trigger("cpu"), "svc", {}, {7: "python3"}, 60)
    assert sid
    capture.add_samples([sample])
    assert capture.nbytes == len(sample.stacks) + 10 * PY_FRAME_BYTES + TRACE_OVERHEAD_BYTES
    capture.finish_session(sid)
    capture.unwatch(7)

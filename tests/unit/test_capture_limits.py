"""Capture memory bounded in bytes across sessions, and what a dropped spool put does."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.metrics import AgentMetrics
from bistouri.agent.spool import Spool
from bistouri.bpf import abi
from bistouri.capture.events import ResolvedStacks, decode_stack
from bistouri.capture.sessions import TRACE_OVERHEAD_BYTES, SessionCapture
from bistouri.host.kernel import KernelMeta
from bistouri.host.procmaps import ProcMaps

from .test_capture import copy, record

# No /proc here: user frames map as addresses of a gone process, which is all these bounds need.
_NO_PROC = ProcMaps("/nonexistent-proc")


class _Filter:
    def __init__(self) -> None:
        self.pids: dict[int, int] = {}
        self.maps = _NO_PROC

    def set_pid_filter(self, pid: int, flags: int) -> None:
        if flags:
            self.pids[pid] = flags
        else:
            self.pids.pop(pid, None)


def _orch(sink, reg: CollectorRegistry, tmp_path, **kw) -> SessionCapture:
    return SessionCapture(
        _Filter(),
        sink,
        AgentMetrics(reg),
        KernelMeta("6.18", b"\x01" * 20, 0xFFFFFFFF81000000),
        tenant="t",
        host="h",
        labels={},
        period_ns=1_000_000,
        proc_root=str(tmp_path),
        **kw,
    )


def _deep(tid: int):
    """A sample with the deepest stacks the BPF side sends: the costly case of the bound."""
    return decode_stack(
        copy(record(7, tid, [0xFFFFFFFF81000000 + tid] * abi.MAX_DEPTH, [0x1000 + tid] * 100)),
        _NO_PROC,
        ResolvedStacks(),
    )


def test_capture_memory_is_bounded_in_bytes_across_sessions(tmp_path):
    reg = CollectorRegistry()
    spool = Spool(str(tmp_path / "spool"), 64 << 20, registry=reg)
    cost = len(_deep(1).stacks) + TRACE_OVERHEAD_BYTES
    orch = _orch(spool, reg, tmp_path, max_bytes=10 * cost)
    a = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    b = orch.start_session(wire.Trigger("io"), "svc", {}, {7: "burner"}, 60)
    assert a and b
    orch.add_samples([_deep(tid) for tid in range(1, 9)])  # 8 stacks, held by both sessions: 16
    assert orch.nbytes <= orch.max_bytes
    held = sum(len(s.traces) for s in orch.sessions.values())
    assert held == 10 and orch.nbytes == 10 * cost
    assert reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "memory"}) == 6
    assert reg.get_sample_value("bistouri_capture_bytes") == 10 * cost
    # Stacks already held keep counting.
    orch.add_samples([_deep(1)] * 3)
    assert all(next(iter(s.traces.values())).on_cpu == 4 for s in orch.sessions.values())
    orch.flush_all()
    assert orch.nbytes == 0 and reg.get_sample_value("bistouri_capture_bytes") == 0
    # Memory given back: a new session holds stacks again.
    c = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    orch.add_samples([_deep(20)])
    assert c and len(orch.sessions[c].traces) == 1


def test_the_trace_count_limit_is_counted_under_its_own_reason(tmp_path):
    reg = CollectorRegistry()
    orch = _orch(Spool(str(tmp_path / "spool"), 64 << 20, registry=reg), reg, tmp_path)
    orch.MAX_TRACES = 2
    assert orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    orch.add_samples([_deep(tid) for tid in range(1, 5)])
    assert reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "session_full"}) == 2


def test_a_session_the_spool_drops_is_not_logged_as_spooled(tmp_path, caplog):
    reg = CollectorRegistry()
    spool = Spool(str(tmp_path / "spool"), 64, registry=reg)  # smaller than any session: dropped
    notified: list[bool] = []
    orch = _orch(spool, reg, tmp_path, on_spooled=lambda: notified.append(True))
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    orch.add_samples([_deep(1)])
    with caplog.at_level(logging.INFO, logger="bistouri.capture.sessions"):
        orch.flush_all()
    assert len(spool) == 0
    assert reg.get_sample_value("bistouri_spool_dropped_total", {"reason": "too_large"}) == 1
    assert (
        "Capture spooled" not in caplog.text
        and f"Capture not spooled: dropped by the spool. session={sid}" in caplog.text
    )
    assert not notified  # nothing to send
    assert not reg.get_sample_value("bistouri_sessions_completed_total", {"resource": "cpu"})


def test_recorded_samples_over_the_trace_limit_are_counted_as_a_full_session(tmp_path):
    """The flight recorder's samples join a session as live ones do: a session at MAX_TRACES
    drops them as `session_full` (it once counted them as `memory`), and memory stays `memory`."""
    reg = CollectorRegistry()
    orch = _orch(Spool(str(tmp_path / "spool"), 64 << 20, registry=reg), reg, tmp_path)
    orch.MAX_TRACES = 2
    orch.watch(7, 60.0)
    orch.add_samples([_deep(tid) for tid in range(1, 5)])  # recorded: no session yet
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60, recorder_secs=60)
    assert sid and len(orch.sessions[sid].traces) == 2
    assert reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "session_full"}) == 2
    assert not reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "memory"})
    orch.flush_all()

    cost = len(_deep(1).stacks) + TRACE_OVERHEAD_BYTES
    reg = CollectorRegistry()
    orch = _orch(Spool(str(tmp_path / "spool2"), 64 << 20, registry=reg), reg, tmp_path, max_bytes=3 * cost)
    orch.watch(7, 60.0)
    orch.add_samples([_deep(tid) for tid in range(1, 5)])
    assert orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60, recorder_secs=60)
    assert reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "memory"}) == 1
    assert not reg.get_sample_value("bistouri_traces_dropped_total", {"reason": "session_full"})


def test_finish_session_hands_the_built_session_to_the_caller(tmp_path):
    """`record`'s way out: the session ends (filter released, memory given back) and comes back
    built, with nothing spooled."""
    reg = CollectorRegistry()
    spool = Spool(str(tmp_path / "spool"), 64 << 20, registry=reg)
    orch = _orch(spool, reg, tmp_path)
    sid = orch.start_session(wire.Trigger("cpu"), "svc", {}, {7: "burner"}, 60)
    assert sid
    orch.add_samples([_deep(1), _deep(1), _deep(2)])
    session = orch.finish_session(sid)
    assert session.session_id == sid and sorted(t.on_cpu for t in session.traces) == [1, 2]
    assert not orch.sessions and orch.nbytes == 0 and not orch._filter.pids  # type: ignore[attr-defined]
    assert len(spool) == 0

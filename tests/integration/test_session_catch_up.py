"""A session ends with everything the kernel sampled for it, however long the drain interval:
the agent drains the ring as sessions start and end (SessionCapture's catch_up)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.bpf import abi
from bistouri.capture.events import StackSample
from bistouri.capture.profiler import Profiler, ProfilerOptions
from testkit.agent_harness import SessionSink, capture_in_process
from testkit.helpers import wait_until

pytestmark = pytest.mark.bpf


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_session_ends_with_the_samples_still_in_the_kernel(workloads):
    burner = subprocess.Popen(
        [str(workloads / "burner"), "60"], env={**os.environ, "BURNER_READY": "1"}, stdout=subprocess.PIPE
    )
    sink = SessionSink()
    # The drain timer never fires within the test: only wakeups and catch_up read the ring.
    options = ProfilerOptions(freq_hz=99, offcpu=False, episode=False, unwind_rows=0, drain_interval_s=600)
    try:
        assert burner.stdout is not None and burner.stdout.readline() == b"ready\n"
        with Profiler(options) as agent:
            agent.start()

            def catch_up(release: Collection[int]) -> None:
                agent.catch_up(release)
                orch.add_samples([e for e in agent.take() if type(e) is StackSample])

            orch = capture_in_process(agent, sink, 99, filter_flags=abi.FilterFlags.ON_CPU, catch_up=catch_up)
            sid = orch.start_session(
                wire.Trigger("cpu", time_ns=time.time_ns()), "s", {}, {burner.pid: "b"}, 60
            )
            assert sid is not None
            assert wait_until(lambda: agent.counters()[abi.Counter.ON_CPU_SAMPLES] >= 100, 30)
            burner.send_signal(signal.SIGSTOP)
            assert wait_until(lambda: _state(burner.pid) == "T", 10)
            kept = agent.counters()[abi.Counter.ON_CPU_SAMPLES]
            assert orch.tick(time.monotonic() + 120) == [sid]
    finally:
        burner.kill()
        burner.wait()
    [session] = sink.sessions
    assert sum(t.on_cpu for t in session.traces) == kept

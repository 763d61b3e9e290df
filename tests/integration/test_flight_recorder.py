"""Issue 13 end to end: the flight recorder, targets by cgroup or unit, capture now.

Real agent, real BPF, real PSI in child cgroups of the cgroup2 mount. Every wait
is for a condition the kernel reports (a process's CPU time, a metric, a spooled
session), with a generous deadline; never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.compat import pairwise
from testkit.agent_harness import AgentProcess
from testkit.helpers import Cgroup, cgroup2_mount, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    fields = data[data.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _own_burner(workloads: Path, tmp_path: Path) -> Path:
    """The burner under a comm of this test's own: other tests on the host run `burner` too."""
    path = tmp_path / f"rb{uuid.uuid4().hex[:8]}"
    shutil.copy(workloads / "burner", path)
    return path


def _pre(s: wire.Session) -> list[wire.Trace]:
    return [t for t in s.traces if t.pre_trigger]


def _capture_now(agent: AgentProcess, service: str, host: str = "127.0.0.1") -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://{host}:{agent.metrics_port}/v1/capture?service={service}", data=b"", method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_session_starts_with_the_seconds_before_the_stall(tmp_path, workloads):
    """One burner runs alone (no stall: one task, two CPUs), then four more join and the
    cgroup stalls: the session holds the first burner's samples from before the trigger."""
    burner = _own_burner(workloads, tmp_path)
    cfg = (
        "targets:\n"
        f"  - rule: {{type: Exact, comm: {burner.name}}}\n"
        "    service_id: burner_svc\n"
        "    resources: [{resource: cpu, threshold: 40, window_ms: 2000}]\n"
        "    capture_duration_secs: 2\n"
        "    recorder_secs: 5\n"
    )
    with AgentProcess(tmp_path, cfg) as agent, Cgroup.create() as cg:
        first = cg.spawn([str(burner), "60"])
        matched = f"pid={first.pid} comm={burner.name}"
        assert wait_until(lambda: matched in agent.log(), 15), agent.log()[-2000:]
        # Alone long enough that the recorder holds seconds of it: 6 s of its own CPU time.
        # (Other work on the host may stall it already: such a session has only `first`.)
        assert wait_until(lambda: _cpu_seconds(first.pid) >= 6.0, 60)
        for _ in range(4):
            cg.spawn([str(burner), "30"])

        def stalled(s: wire.Session) -> bool:
            return s.trigger.cgroup == cg.rel and len(s.processes) == 5

        s = agent.wait_session(stalled, 30)
        assert s is not None, f"no session of the stall\n{agent.log()[-3000:]}"
        assert s.trigger.kind == wire.TRIGGER_PSI and s.pre_trigger_ns >= 1_000_000_000, s.pre_trigger_ns
        pre = _pre(s)
        assert pre and sum(t.on_cpu for t in pre if t.pid == first.pid) > 0, pre
        assert all(t.pid in s.processes for t in s.traces)
        # The episode starts before the trigger, by what the recorder held.
        assert s.start_ns <= s.trigger.time_ns - 1_000_000_000
        assert s.start_ns + s.pre_trigger_ns <= s.trigger.time_ns + 500_000_000
        assert any(not t.pre_trigger and t.on_cpu for t in s.traces), "samples after the trigger too"
        m = agent.metrics()
        assert m["bistouri_recorder_bytes"] <= 16 << 20


def _unit_cgroup(unit: str) -> Cgroup:
    """<mount>/bistouri-test-<x>.slice/<unit>: a unit in its slice, as systemd lays them out."""
    slice_dir = cgroup2_mount() / f"bistouri-test-{uuid.uuid4().hex[:8]}.slice"
    slice_dir.mkdir()
    (slice_dir / unit).mkdir()
    return Cgroup(slice_dir / unit)


@pytest.mark.parametrize("by", ["cgroup", "unit"])
def test_cgroup_or_unit_target_catches_a_process_no_rule_names(tmp_path, workloads, by):
    unit = f"bistouri-{uuid.uuid4().hex[:8]}.service"
    cg = _unit_cgroup(unit)
    try:
        selector = f"unit: {unit}" if by == "unit" else f"cgroup: {cg.rel}"
        cfg = (
            "targets:\n"
            "  - rule: {type: Exact, comm: nothing-named}\n"
            "    service_id: by_comm\n"
            "    resources: [{resource: cpu, threshold: 10}]\n"
            f"  - {selector}\n"
            "    service_id: by_cgroup\n"
            "    resources: [{resource: cpu, threshold: 5}]\n"
            "    capture_duration_secs: 2\n"
        )
        # The walk finds cgroup members (no exec event names them): walk every second.
        with AgentProcess(tmp_path, cfg, walk_interval=1.0) as agent:
            procs = [cg.spawn([str(workloads / "burner"), "30"]) for _ in range(3)]
            s = agent.wait_session(lambda s: s.service == "by_cgroup" and s.total_samples > 0, 30)
            assert s is not None, f"no session of the {by} target\n{agent.log()[-3000:]}"
            assert s.trigger.cgroup == cg.rel, (s.trigger.cgroup, cg.rel)
            assert {p.pid for p in procs} <= set(s.processes), s.processes
            assert set(s.processes.values()) == {"burner"}  # a comm no rule names
            assert f"PSI watch added. path={cg.path}/cpu.pressure" in agent.log()
    finally:
        cg.remove()
        cg.path.parent.rmdir()


def test_capture_now_yields_a_manual_session_without_pressure(tmp_path, workloads):
    # Memory pressure over 90 % will not happen here: only capture now can start a session.
    burner = _own_burner(workloads, tmp_path)
    cfg = (
        "targets:\n"
        f"  - rule: {{type: Exact, comm: {burner.name}}}\n"
        "    service_id: burner_svc\n"
        "    resources: [{resource: memory, threshold: 90}]\n"
        "    capture_duration_secs: 1\n"
    )
    with AgentProcess(tmp_path, cfg) as agent, Cgroup.create() as cg:
        p = cg.spawn([str(burner), "30"])
        assert wait_until(lambda: f"pid={p.pid} comm={burner.name}" in agent.log(), 15), agent.log()[-2000:]
        status, body = _capture_now(agent, "nope")
        assert status == 404 and "burner_svc" in body["known"], body
        status, body = _capture_now(agent, "burner_svc")
        assert status == 202, body
        s = agent.wait_session(lambda s: s.session_id == body["session_id"], 20)
        assert s is not None, f"no manual session\n{agent.log()[-3000:]}"
        assert s.trigger.kind == wire.TRIGGER_MANUAL and s.trigger.resource == "memory"
        assert s.service == "burner_svc" and s.processes == {p.pid: burner.name}
        assert s.total_samples > 0 and s.trigger.cgroup == cg.rel
        assert agent.metrics().get('bistouri_psi_events_total{resource="memory"}', 0) == 0


def test_capture_now_is_refused_from_another_host_address(tmp_path, workloads):
    """The endpoint listens on every address, but a capture needs a loopback peer."""
    addrs = [a for a in _host_addresses() if not a.startswith("127.")]
    if not addrs:
        pytest.skip("no non-loopback IPv4 address to connect from")
    cfg = (
        "targets:\n"
        "  - rule: {type: Exact, comm: burner}\n"
        "    service_id: svc\n"
        "    resources: [{resource: memory, threshold: 90}]\n"
    )
    agent = AgentProcess(tmp_path, cfg)
    i = agent.argv.index("--metrics-addr")
    agent.argv[i + 1] = "0.0.0.0"
    with agent:
        status, body = _capture_now(agent, "svc", host=addrs[0])
        assert status == 403, body
        status, _ = _capture_now(agent, "svc")
        assert status == 202


def _host_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces, from /proc/net/fib_trie (LOCAL entries)."""
    out: list[str] = []
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    for prev, line in pairwise(lines):
        if "/32 host LOCAL" in line:
            ip = prev.split()[-1]
            if ip not in out:
                out.append(ip)
    return out


def test_recorder_stays_within_its_bound_under_an_exec_storm(tmp_path, workloads):
    """Short Python fsync loops exec'd in a loop, each watched: their off-CPU waits carry Python
    frames, so they come through the ring (named as they arrive) rather than being counted in the
    kernel, and the ring fills; it must let the oldest go rather than grow past its bound."""
    bound = 1 << 20
    cfg = (
        "targets:\n"
        "  - rule: {type: Exact, comm: pystorm}\n"
        "    service_id: storm\n"
        "    resources: [{resource: memory, threshold: 90}]\n"
        "    recorder_secs: 60\n"
    )
    # A name of its own (the comm of a link is its name): other tenants' python3 stay unwatched.
    python = tmp_path / "pystorm"
    python.symlink_to(os.path.realpath(sys.base_prefix + "/bin/python3"))
    loop = (
        "import os, time\n"
        "f, t = open(os.environ['F'], 'w'), time.monotonic()\n"
        "while time.monotonic() - t < 0.3:\n"
        "    f.write('x'); f.flush(); os.fsync(f.fileno())\n"
    )
    (tmp_path / "loop.py").write_text(loop)
    storm = (
        f'for i in $(seq 400); do F="{tmp_path}/f$(( i % 4 ))" "{python}" "{tmp_path}/loop.py" & '
        "[ $(( i % 4 )) -eq 0 ] && wait; done; wait"
    )
    agent = AgentProcess(tmp_path, cfg, "--recorder-max-bytes", str(bound), walk_interval=1.0)
    with agent, Cgroup.create() as cg:
        cg.spawn(["sh", "-c", storm])
        seen: list[float] = []

        def full() -> bool:
            m = agent.metrics()
            seen.append(m["bistouri_recorder_bytes"])
            return m.get('bistouri_recorder_dropped_total{reason="memory"}', 0) > 0

        assert wait_until(full, 120, step=0.2), f"bound never reached: {max(seen)}\n{agent.log()[-2000:]}"
        assert max(seen) <= bound, max(seen)
        assert max(seen) > bound // 2, max(seen)  # it did fill up to near the bound
        assert agent.metrics()["bistouri_recorder_bytes"] <= bound


def test_the_symbolizer_shows_a_manual_trigger_and_the_seconds_before_it(
    symbolizer_server, tmp_path, demo_binary
):
    import dataclasses

    import requests

    from tests.integration.conftest import make_session, post_sessions

    s = make_session("sess-pre", demo_binary)
    s.traces.append(dataclasses.replace(s.traces[0], on_cpu=7, pre_trigger=True))
    s.pre_trigger_ns = 4_800_000_000
    s.trigger = dataclasses.replace(s.trigger, kind=wire.TRIGGER_MANUAL)
    url = symbolizer_server(tmp_path, binary_dir=demo_binary.dir)
    r = post_sessions(url, [s, make_session("sess-psi", demo_binary)])
    assert r.status_code == 200 and r.json()["accepted"] == ["sess-pre", "sess-psi"], r.text
    meta = requests.get(f"{url}/v1/sessions/sess-pre", timeout=10).json()
    assert meta["trigger"]["kind"] == "manual" and meta["episode"]["pre_trigger_s"] == 4.8
    assert meta["samples"]["on_cpu"] == 53 + 7  # the samples before the trigger are in the profile
    assert meta["episode"]["before_trigger"]["on_cpu"] == 7
    assert meta["episode"]["after_trigger"]["on_cpu"] == 53
    old = requests.get(f"{url}/v1/sessions/sess-psi", timeout=10).json()
    assert old["trigger"]["kind"] == "psi" and old["episode"]["pre_trigger_s"] == 0.0
    assert old["episode"]["before_trigger"] == {"on_cpu": 0, "off_cpu": 0, "off_cpu_ns": 0}

"""Issue 24 point 5 end to end: a real agent names the target's systemd unit and container.

Real agent, real BPF, cgroups named as systemd and docker name theirs, made under the cgroup2 mount;
capture now starts the sessions, so no pressure is needed.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
import uuid

import pytest

from bistouri import wire
from testkit.agent_harness import AgentProcess
from testkit.helpers import Cgroup, cgroup2_mount, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def _capture_now(agent: AgentProcess, service: str) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{agent.metrics_port}/v1/capture?service={service}", data=b"", method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 202
        return str(json.loads(r.read())["session_id"])


def test_sessions_carry_the_unit_and_the_container_of_their_cgroup(tmp_path, workloads):
    container_id = secrets.token_hex(32)  # 64 hex digits, as docker's
    slice_dir = cgroup2_mount() / f"bistouri-test-{uuid.uuid4().hex[:8]}.slice"
    unit = f"bistouri-{uuid.uuid4().hex[:8]}.service"
    slice_dir.mkdir()
    service, scope = Cgroup(slice_dir / unit), Cgroup(slice_dir / f"docker-{container_id}.scope")
    for cg in (service, scope):
        cg.path.mkdir()
    try:
        cfg = "targets:\n" + "".join(
            f"  - cgroup: {cg.rel}\n"
            f"    service_id: {name}\n"
            "    resources: [{resource: memory, threshold: 90}]\n"
            "    capture_duration_secs: 1\n"
            for cg, name in ((service, "by_unit"), (scope, "in_docker"))
        )
        with AgentProcess(tmp_path, cfg, walk_interval=1.0) as agent:
            procs = [cg.spawn([str(workloads / "burner"), "30"]) for cg in (service, scope)]
            assert wait_until(lambda: all(f"pid={p.pid} " in agent.log() for p in procs), 15), agent.log()[
                -2000:
            ]
            ids = {name: _capture_now(agent, name) for name in ("by_unit", "in_docker")}
            got = {
                name: agent.wait_session(lambda s, sid=sid: s.session_id == sid, 20)
                for name, sid in ids.items()
            }
            by_unit, in_docker = got["by_unit"], got["in_docker"]
            assert by_unit is not None and in_docker is not None, agent.log()[-3000:]
            assert by_unit.trigger.cgroup == service.rel
            assert (by_unit.unit, by_unit.container) == (unit, None)
            assert in_docker.trigger.cgroup == scope.rel
            assert in_docker.unit == f"docker-{container_id}.scope"
            assert in_docker.container == wire.Container(container_id, "docker")
    finally:
        for cg in (service, scope):
            cg.remove()
        slice_dir.rmdir()

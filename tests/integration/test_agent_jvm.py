"""The agent and a JVM nobody prepared: no -XX:+PreserveFramePointer, nobody running jcmd. The agent
asks for the perf map itself when it starts watching the process, and its session names the JIT leaf."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from bistouri import wire
from testkit.agent_harness import AgentProcess
from testkit.helpers import Cgroup, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

JAVA = Path("/usr/lib/jvm/temurin-25-jdk-amd64/bin/java")
HOT = Path(__file__).resolve().parents[1] / "fixtures" / "workloads" / "Hot.java"


@pytest.mark.skipif(not JAVA.exists(), reason=f"{JAVA} is not installed")
def test_a_watched_jvm_gets_its_perf_map_and_its_session_names_the_jit_leaf(tmp_path):
    with Cgroup.create() as cg:
        jvm = cg.spawn([str(JAVA), "-XX:+PrintCompilation", str(HOT), "120"], stdout=subprocess.PIPE)
        perf_map = Path(f"/tmp/perf-{jvm.pid}.map")
        try:
            compiled = threading.Event()

            def read() -> None:
                assert jvm.stdout is not None
                for line in jvm.stdout:  # to the end: a full pipe would stop the JVM
                    if re.search(rb"\s4\s+Hot::hotLoop \(", line):
                        compiled.set()

            threading.Thread(target=read, daemon=True).start()
            assert compiled.wait(90), "Hot.hotLoop compiled at tier 4"
            cfg = (
                "targets:\n"
                f"  - cgroup: {cg.rel}\n"
                "    service_id: jvm_svc\n"
                "    resources: [{resource: memory, threshold: 90}]\n"  # only capture now starts one
                "    capture_duration_secs: 2\n"
            )
            # The walk finds the cgroup's members: every second.
            with AgentProcess(tmp_path, cfg, walk_interval=1.0) as agent:
                # Written by the JVM when the agent, watching it, asked: nobody else does here.
                assert wait_until(lambda: "Hot.hotLoop" in _text(perf_map), 60), agent.log()[-3000:]
                req = urllib.request.Request(
                    f"http://127.0.0.1:{agent.metrics_port}/v1/capture?service=jvm_svc",
                    data=b"",
                    method="POST",
                )
                with urllib.request.urlopen(req, timeout=5) as r:
                    sid = json.loads(r.read())["session_id"]
                s = agent.wait_session(lambda s: s.session_id == sid, 30)
                assert s is not None, agent.log()[-3000:]
                assert agent.metrics().get('bistouri_jvm_perf_maps_total{reason="ok"}', 0) >= 1
            assert jvm.poll() is None
        finally:
            jvm.terminate()  # not SIGKILL: the JVM removes its attach socket
            try:
                jvm.wait(10)
            except subprocess.TimeoutExpired:
                jvm.kill()
                jvm.wait()
            perf_map.unlink(missing_ok=True)
    on_cpu = named = 0
    for t in s.traces:
        if t.pid == jvm.pid and t.on_cpu and t.user:
            on_cpu += t.on_cpu
            leaf = t.user[0]
            named += t.on_cpu * (leaf.kind == wire.FRAME_JIT and "Hot.hotLoop" in leaf.name)
    assert on_cpu and named / on_cpu >= 0.85, (named, on_cpu)
    assert s.unwind.jit.get("jvm_ok") == 1, s.unwind


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""

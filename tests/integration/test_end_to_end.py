"""Agent and symbolizer as separate processes over real HTTP on 127.0.0.1."""

from __future__ import annotations

import re
import time

import pytest
import requests

from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import Cgroup, wait_until
from testkit.symbolizer import stop

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def _sessions(url: str) -> list[dict]:
    try:
        r = requests.get(f"{url}/v1/sessions", params={"limit": 100}, timeout=5)
    except requests.RequestException:
        return []
    return r.json()["sessions"] if r.status_code == 200 else []


def test_a_pressure_session_is_stored_and_named(tmp_path, workloads, symbolizer_server):
    url = symbolizer_server(tmp_path, token="s3cret", binary_dir=[workloads])
    token_file = tmp_path / "agent-token"
    token_file.write_text("s3cret\n")
    # The fsync loop spends its CPU time in the kernel: its session must show named kernel frames.
    cfg = burner_config(capture=4) + burner_config(comm="fsyncer", capture=4).replace("targets:\n", "")
    with (
        AgentProcess(
            tmp_path,
            cfg,
            "--symbolizer-endpoint",
            url,
            "--symbolizer-token-file",
            str(token_file),
            "--freq",
            "99",
        ) as agent,
        Cgroup.create() as cg,
    ):
        for _ in range(3):
            cg.spawn([str(workloads / "burner"), "30"])
        cg.spawn([str(workloads / "fsyncer"), str(tmp_path / "fsync.dat"), "30"])

        def both() -> bool:
            return {"burner_svc", "fsyncer_svc"} <= {m["service"] for m in _sessions(url)}

        assert wait_until(both, 40), f"{agent.log()[-3000:]}\n{url.log_tail()}"
    meta = next(m for m in _sessions(url) if m["service"] == "burner_svc")
    assert meta["service"] == "burner_svc" and meta["trigger"]["resource"] == "cpu"
    folded = requests.get(f"{url}/v1/sessions/{meta['id']}/folded", timeout=10).text
    counts: dict[str, int] = {}
    total = 0
    for line in folded.splitlines():
        stack, _, n = line.rpartition(" ")
        total += int(n)
        counts[stack] = counts.get(stack, 0) + int(n)
    chain = sum(n for s, n in counts.items() if re.search(r"main;level1;level2;hot_spin(;|$)", s))
    assert total > 0 and chain / total > 0.8, folded[:2000]
    # Kernel frames are named from the agent's kallsyms snapshot, not left as addresses.
    fs = next(m for m in _sessions(url) if m["service"] == "fsyncer_svc")
    fs_folded = requests.get(f"{url}/v1/sessions/{fs['id']}/folded", timeout=10).text
    kernel = [line for line in fs_folded.splitlines() if "_[k]" in line]
    assert kernel, fs_folded[:2000]
    assert not any(re.search(r"\[kernel\]\+0x", line) for line in kernel), kernel[:5]
    assert any(re.search(r"(fsync|sys_fsync)_\[k\]", line) for line in kernel), kernel[:5]
    # The agent uploaded this boot's snapshot (kallsyms are per boot: docs/api.md).
    info = requests.get(
        f"{url}/v1/kernels/{_kernel_snapshot()}", headers={"Authorization": "Bearer s3cret"}, timeout=5
    )
    assert info.status_code == 200


def _kernel_snapshot() -> str:
    from bistouri.host.kernel import read_kernel_meta

    kernel = read_kernel_meta()
    return f"{kernel.build_id_hex}?boot={kernel.boot_id.hex()}"


def test_nothing_is_lost_while_the_symbolizer_is_down(tmp_path, workloads, symbolizer_server):
    url = symbolizer_server(tmp_path)
    port = url.rsplit(":", 1)[1]
    state = url.state_dir
    cfg = burner_config(capture=2).replace(
        "capture_duration_secs: 2\n", "capture_duration_secs: 2\n    cooldown_secs: 0.5\n"
    )
    with AgentProcess(tmp_path, cfg, "--symbolizer-endpoint", url) as agent, Cgroup.create() as cg:
        stop(url)
        down_at = time.monotonic()
        for _ in range(3):
            cg.spawn([str(workloads / "burner"), "90"])
        # Only ours: another burner on the machine (another test run) matches the target too.
        ours = lambda: {s.session_id for s in agent.sessions() if s.trigger.cgroup == cg.rel}  # noqa: E731
        assert wait_until(lambda: len(ours()) >= 5, 60), agent.log()[-3000:]
        cg.kill_all()
        # Let the session running when the burners died finish: then the set is final.
        assert wait_until(lambda: agent.metrics()["bistouri_sessions_active"] == 0, 10)
        spooled = ours()
        assert len(spooled) >= 5
        time.sleep(max(0.0, 60 - (time.monotonic() - down_at)))
        url2 = symbolizer_server(tmp_path, port=port, state_dir=state)
        assert wait_until(lambda: {m["id"] for m in _sessions(url2)} >= spooled, 120), (
            f"missing {spooled - {m['id'] for m in _sessions(url2)}}\n{agent.log()[-3000:]}"
        )
        assert wait_until(lambda: not ours(), 30), "acknowledged sessions leave the spool"
    ids = [m["id"] for m in _sessions(url2)]
    assert len(ids) == len(set(ids)), "a session was stored twice"
    assert spooled <= set(ids)

"""Symbolization fails on the server's side, and nothing is lost (issue 14, M2).

The real agent profiles real burners and sends to a real symbolizer whose database
sits on a full file system (a small tmpfs, filled up): every session fails to be
stored, the symbolizer answers 503 + Retry-After with a "failed" list, and the agent
keeps the session files in its spool, none in rejected/. Once the disk has room again
(the filler deleted), every spooled session is delivered, stored once, and leaves the
spool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import Cgroup, wait_until
from testkit.symbolizer import metric_value
from tests.integration.fullfs import fill, small_tmpfs

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def _stored_ids(url: str) -> set[str]:
    r = requests.get(f"{url}/v1/sessions", params={"limit": 1000}, timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["sessions"]}


def _failed(url: str) -> float:
    return metric_value(
        requests.get(url + "/metrics", timeout=10).text, "bistouri_symbolizer_sessions_failed_total"
    )


def test_nothing_is_lost_while_symbolization_fails_on_the_server(
    tmp_path: Path, workloads: Path, symbolizer_server: Any
) -> None:
    with small_tmpfs(tmp_path / "dbfs", 32 << 20) as fs:
        # One worker: its database connection is open before the disk fills (as in a service that ran).
        url = symbolizer_server(tmp_path, db=fs / "bistouri.db", workers=1, binary_dir=[workloads])
        cfg = burner_config(capture=2).replace(
            "capture_duration_secs: 2\n", "capture_duration_secs: 2\n    cooldown_secs: 0.5\n"
        )
        with AgentProcess(tmp_path, cfg, "--symbolizer-endpoint", url) as agent, Cgroup.create() as cg:
            for _ in range(3):
                cg.spawn([str(workloads / "burner"), "90"])
            # Normal service first (the kernel's symbols go in too), then the disk is full.
            assert wait_until(lambda: _stored_ids(url), 90), agent.log()[-3000:]
            filler = fill(fs)
            # The server refused to store sessions, for its own reason, more than once.
            assert wait_until(lambda: _failed(url) >= 2, 90), agent.log()[-3000:]
            cg.kill_all()
            assert wait_until(lambda: agent.metrics()["bistouri_sessions_active"] == 0, 10)
            ours = {s.session_id for s in agent.sessions() if s.trigger.cgroup == cg.rel}
            assert ours, agent.log()[-3000:]
            assert not _stored_ids(url) & ours
            assert not list((agent.spool_dir / "rejected").glob("*")), "a failed session is not rejected"
            # Still spooled after a Retry-After came and went: the agent keeps them.
            failed_before = _failed(url)
            assert wait_until(lambda: _failed(url) > failed_before, 60), agent.log()[-3000:]
            assert ours <= {s.session_id for s in agent.sessions()}

            filler.unlink()
            assert wait_until(lambda: ours <= _stored_ids(url), 120), (
                f"missing {ours - _stored_ids(url)}\n{agent.log()[-3000:]}"
            )
            assert wait_until(lambda: not ours & {s.session_id for s in agent.sessions()}, 30)
            assert not list((agent.spool_dir / "rejected").glob("*"))
        r = requests.get(f"{url}/v1/sessions", params={"limit": 1000}, timeout=10)
        ids = [m["id"] for m in r.json()["sessions"]]
        assert len(ids) == len(set(ids)), "a session was stored twice"

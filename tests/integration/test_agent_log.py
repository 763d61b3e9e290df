"""The agent's log against what watched processes choose: their comms, and how often they exec."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.integration.agent_harness import AgentProcess, burner_config

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory `nobody` may use, outside the checkout (it may not traverse it)."""
    d = Path(tempfile.mkdtemp(prefix="bistouri-log-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_a_comm_with_a_newline_stays_on_its_line(tmp_path, nobody_dir):
    evil = nobody_dir / "evil\nFAKE inj"  # the comm: 13 bytes, under the kernel's 15
    evil.symlink_to("/bin/sleep")
    with AgentProcess(
        tmp_path, burner_config(comm="evil").replace("Exact", "Prefix"), walk_interval=2
    ) as agent:
        p = subprocess.Popen([*NOBODY, str(evil), "30"])
        try:
            assert wait_until(lambda: f"pid={p.pid} " in agent.log(), 20), agent.log()[-2000:]
        finally:
            p.kill()
            p.wait()
    lines = agent.log().splitlines()
    assert not [line for line in lines if line.startswith("FAKE")], lines[-20:]
    assert any(f"pid={p.pid} comm=evil\\nFAKE inj " in line for line in lines), lines[-20:]


def test_an_exec_storm_is_summarised(tmp_path, nobody_dir):
    storm = nobody_dir / "evilstorm"
    storm.symlink_to("/bin/true")
    n = 2000
    with AgentProcess(tmp_path, burner_config(comm="evilstorm"), walk_interval=2) as agent:
        subprocess.run(
            [*NOBODY, "sh", "-c", f'i=0; while [ $i -lt {n} ]; do "$0"; i=$((i+1)); done', str(storm)]
        )
        # The walk tells what was held back once the interval (10 s) is over.
        summary = re.compile(r"Processes matched: more not logged one by one\. count=(\d+)")
        assert wait_until(lambda: summary.search(agent.log()), 30), agent.log()[-2000:]
        matched = [line for line in agent.log().splitlines() if "Process matched." in line]
        held = sum(int(m) for m in summary.findall(agent.log()))
    assert len(matched) <= 2 * 20, len(matched)
    assert held >= n // 2, held  # the execs the hook saw, counted (a few may end before their match)

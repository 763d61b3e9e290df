"""The agent's log against what watched processes choose: their comms, and how often they exec."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import wait_until

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
    summary = re.compile(r"Processes matched: more not logged one by one\. count=(\d+)")

    def told() -> tuple[int, int]:
        """(lines logged one by one, execs told in summaries) so far."""
        log = agent.log()
        return sum("Process matched." in line for line in log.splitlines()), sum(
            int(m) for m in summary.findall(log)
        )

    with AgentProcess(tmp_path, burner_config(comm="evilstorm"), walk_interval=2) as agent:
        t0 = time.monotonic()
        subprocess.run(
            [*NOBODY, "sh", "-c", f'i=0; while [ $i -lt {n} ]; do "$0"; i=$((i+1)); done', str(storm)]
        )

        # The storm is over. Every exec the agent matched is told, one by one or in a summary (the walk,
        # every 2 s, tells what was held back once its 10 s interval is over): as many as the hook
        # reported, less the stale ones and those whose process had already exited (how many that is
        # depends on the machine's load, so it is counted, not guessed). The walk may tell a few more.
        def matched() -> int:
            m = agent.metrics()
            return int(
                m["bistouri_exec_events_total"]
                - m["bistouri_stale_events_total"]
                - m["bistouri_exec_events_gone_total"]
            )

        assert wait_until(lambda: told()[1] > 0 and sum(told()) >= matched() > 20, 40), (
            matched(),
            told(),
            agent.log()[-2000:],
        )
        lines, held = told()
        intervals = int((time.monotonic() - t0) // 10) + 1
    # 20 lines an interval, however long the storm lasted.
    assert lines <= 20 * (intervals + 1), (lines, intervals, held)

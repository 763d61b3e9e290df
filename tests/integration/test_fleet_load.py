"""A fleet's ordinary load and a crash (issue 26, deliverable 5).

Two `bistouri symbolizer` instances on one PostgreSQL, behind a real HAProxy, each in a
1 GiB memory cgroup as its unit ships; 200 simulated agents (the agent's real spool and
exporter) on 50 boots of one kernel post real-sized sessions and their boot's kallsyms.
One instance is `kill -9`ed mid-load. Every session spooled must be acknowledged (the
agents send again what was not), and stored exactly once: the ids in PostgreSQL are the
ids spooled, no more, no fewer. No instance is OOM-killed, and the memory peaks stay
under the unit's limit. bench/bench_fleet.py measures the same setup's throughput.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from testkit.fleet import UNIT_MEMORY_BYTES, Fleet, Instance, code_offsets
from testkit.helpers import wait_until
from testkit.loadbalancer import HAProxy
from testkit.pg import PgServer

psycopg = pytest.importorskip("psycopg", reason="psycopg (3) is the PostgreSQL driver")

pytestmark = pytest.mark.slow

AGENTS = 200
BOOTS = 50
SESSIONS_PER_AGENT = 4  # 800 sessions
LOAD_S = 20.0  # spooled evenly over this time: 40 sessions/s
KILL_AT = 0.3  # of the sessions acknowledged


def _stored(db: str) -> list[str]:
    with psycopg.connect(db) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM sessions")]


def test_two_instances_200_agents_one_killed_nothing_lost_nothing_twice(
    tmp_path: Path, postgres: PgServer, demo_binary: Any
) -> None:
    instances = [Instance(tmp_path, name, postgres.url, demo_binary.dir, workers=1) for name in ("a", "b")]
    lb = HAProxy(tmp_path, [i.port for i in instances])
    fleet = Fleet(tmp_path, lb.url, AGENTS, BOOTS, demo_binary.build_id, code_offsets(demo_binary.path))
    try:
        assert wait_until(lambda: lb.up_servers() == 2, timeout=10)
        fleet.start(SESSIONS_PER_AGENT, LOAD_S)
        total = AGENTS * SESSIONS_PER_AGENT
        assert wait_until(lambda: fleet.acknowledged() >= KILL_AT * total, timeout=LOAD_S * 3)
        killed = instances[0]
        killed.kill9()
        assert wait_until(fleet.done, timeout=LOAD_S * 3), (
            f"{fleet.pending()} sessions not acknowledged; {fleet.acknowledged()} were"
        )
        assert lb.up_servers() == 1
        units = {i.name: (i.cgroups.memory_peak(), i.cgroups.oom_kills()) for i in instances}
    finally:
        fleet.stop()
        lb.close()
        for i in instances:
            i.close()

    spooled = fleet.spooled()
    stored = _stored(postgres.url)
    assert len(spooled) == total and len(set(spooled)) == total
    twice = [sid for sid, n in Counter(stored).items() if n > 1]
    assert not twice, twice[:5]
    assert sorted(stored) == sorted(spooled)
    assert sum(a.metric("bistouri_spool_rejected_total") for a in fleet.agents) == 0
    failed = sum(a.metric("bistouri_export_failures_total") for a in fleet.agents)
    print(f"{total} sessions, {failed:.0f} failed requests sent again after the crash; memory peaks {units}")
    for name, (peak, oom_kills) in units.items():
        assert oom_kills == 0, f"instance {name} OOM-killed"
        assert peak < UNIT_MEMORY_BYTES

"""After an outage, the agent's spool starts draining soon after the symbolizer is back.

The agent's real spool and exporter send to a real `bistouri symbolizer` behind a real
HAProxy. During the outage no instance is up, and HAProxy answers 503 without a
Retry-After, as a load balancer does. Once the exporter's backoff has grown to its cap,
the instance starts; the spool must be empty within the cap (plus the time to store the
sessions) of HAProxy seeing it up. Time is scaled down a hundredfold: backoff from 10 ms,
capped at BACKOFF_MAX_S / 100. Before, a 503 without Retry-After waited a fixed 60 s
(whatever the scale), and the cap was 300 s: sessions arrived minutes after the fix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.exporter import Exporter
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from testkit.helpers import wait_until
from testkit.loadbalancer import HAProxy
from testkit.symbolizer import KALLSYMS, KERNEL_BUILD_ID, free_port
from tests.integration.conftest import make_session

SCALE = 100  # 1 s of the real schedule is 10 ms here
CAP_S = Exporter.BACKOFF_MAX_S / SCALE
SESSIONS = 20
# Sending 20 sessions and their kernel through HAProxy, symbolized by one worker.
STORE_MARGIN_S = 2.0


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[tuple[HAProxy, int]]:
    port = free_port()  # the instance's, not started yet: the outage
    lb = HAProxy(tmp_path, [port])
    yield lb, port
    lb.close()


def _failures(reg: CollectorRegistry) -> float:
    return sum(
        s.value
        for m in reg.collect()
        if m.name == "bistouri_export_failures"
        for s in m.samples
        if s.name.endswith("_total")
    )


def test_the_spool_drains_within_the_backoff_cap_of_the_symbolizer_coming_back(
    tmp_path: Path, balancer: tuple[HAProxy, int], symbolizer_server: Any, demo_binary: Any
) -> None:
    lb, port = balancer
    reg = CollectorRegistry()
    spool = Spool(str(tmp_path / "spool"), 64 << 20, registry=reg, kernel_build_id=KERNEL_BUILD_ID)
    ids = [f"recover-{i:03d}" for i in range(SESSIONS)]
    for sid in ids:
        assert spool.put(sid, wire.encode_session(make_session(sid, demo_binary)))
    exporter = Exporter(
        spool,
        AgentSettings(symbolizer_endpoint=lb.url),
        registry=reg,
        kallsyms_provider=lambda bid: KALLSYMS.decode(),
        backoff_initial_s=Exporter.BACKOFF_INITIAL_S / SCALE,
        backoff_max_s=CAP_S,
    )
    exporter.start()
    try:
        # Tries until the backoff's step is at its cap: 10 ms doubled 7 times is over 0.6 s.
        assert wait_until(lambda: _failures(reg) >= 10, timeout=30), "no retry within the cap in the outage"
        assert len(spool) == SESSIONS
        url = symbolizer_server(tmp_path, port=port, workers=1)
        assert wait_until(lambda: lb.up_servers() == 1, timeout=10, step=0.01)
        back = time.monotonic()
        wait_until(lambda: len(spool) == 0, timeout=CAP_S + STORE_MARGIN_S, step=0.01)
        assert len(spool) == 0, f"{len(spool)} sessions still spooled {CAP_S + STORE_MARGIN_S} s after"
        drained_in = time.monotonic() - back
        print(f"drained {SESSIONS} sessions {drained_in:.2f} s after the instance was up")
    finally:
        assert exporter.stop(10)
    r = requests.get(url + "/v1/sessions", params={"limit": 1000}, timeout=10)
    assert sorted(m["id"] for m in r.json()["sessions"]) == ids
    assert drained_in <= CAP_S + STORE_MARGIN_S

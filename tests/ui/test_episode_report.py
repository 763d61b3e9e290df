"""The episode report on the session page (issue 12), in Chromium: victims' time by state as
stacked bars, the aggressor table, and a flamegraph per state."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from bistouri import wire
from tests.ui import data
from tests.ui.conftest import _ingest

pytestmark = pytest.mark.slow

VICTIMS = (
    # on-CPU, run-queue, D, S, reclaim
    wire.Victim(5150, 5150, "fsyncer", 1_000_000_000, 500_000_000, 6_000_000_000, 0, 0),
    wire.Victim(5150, 5151, "fs-helper", 250_000_000, 0, 0, 2_000_000_000, 100_000_000),
)
AGGRESSORS = (
    wire.Aggressor("/system.slice/backup.service", 2_000_000_000, 3 << 30, 90_000, 0, 0),
    wire.Aggressor("/system.slice/storage.service", 1_250_000_000, 1 << 20, 300, 0, 0),
)


@pytest.fixture(scope="module")
def episode_sid(symbolizer_url: str) -> str:
    """fsyncer's I/O session with an episode, and its journal waits also seen as S sleeps and as
    run-queue waits (woken, then waiting for a CPU)."""
    tag = f"{os.getpid():x}{time.time_ns() & 0xFFFFFF:06x}"
    s = data.fsyncer_session(f"ui-report-{tag}", time.time_ns() - 600_000_000_000)
    s.service = "storage_report"  # the list tests of the same symbolizer count `storage`'s sessions
    journal = s.traces[0]
    s.traces.append(dataclasses.replace(journal, off_cpu=40, off_cpu_ns=2_000_000_000, wait=wire.WAIT_S))
    s.traces.append(dataclasses.replace(journal, off_cpu=12, off_cpu_ns=500_000_000, wait=wire.WAIT_RUNQUEUE))
    s.episode = wire.Episode(VICTIMS, AGGRESSORS)
    return _ingest(symbolizer_url, {"report": s})["report"]


OFF_CPU_COUNT = (
    "(n) => document.querySelector('#flame .seg-btn[data-view=\"off_cpu\"] .seg-count')?.textContent === n"
)


def _widths(page, tid: int) -> dict[str, float]:
    return page.eval_on_selector_all(
        f'#ep-victims tr[data-tid="{tid}"] .ep-seg',
        "ns => Object.fromEntries(ns.map(n => [n.dataset.state, parseFloat(n.style.width)]))",
    )


def test_victims_by_state_aggressors_and_a_flamegraph_per_state(
    page, symbolizer_url, episode_sid, screenshots: Path
):
    page.goto(f"{symbolizer_url}/ui/session.html?id={episode_sid}")
    page.locator("#ep-victims").wait_for()
    # Stacked bars scaled to the longest thread (7.5 s): each state its share.
    assert _widths(page, 5150) == pytest.approx({"on_cpu": 13.333, "runqueue": 6.667, "D": 80.0}, abs=0.01)
    assert _widths(page, 5151) == pytest.approx({"on_cpu": 3.333, "S": 26.667}, abs=0.01)
    rows = page.locator("#ep-victims tbody tr")
    assert rows.count() == 2 and "fsyncer" in rows.nth(0).inner_text()
    # The aggressors in the agent's order, the noisy neighbour first.
    cgroups = page.locator("#ep-aggressors tbody tr td.ep-cgroup").all_inner_texts()
    assert cgroups == ["/system.slice/backup.service", "/system.slice/storage.service"]
    assert "3.0 GiB" in page.locator("#ep-aggressors tbody tr").nth(0).inner_text()
    page.locator("#episode-report").screenshot(path=str(screenshots / "session-episode-report.png"))

    # The S state alone: the sleeps on the journal, 40 waits, nothing on-CPU.
    page.click("#state-S")
    page.wait_for_function(OFF_CPU_COUNT, arg="40")
    assert page.locator('#flame .seg-btn[data-view="on_cpu"]').is_disabled()
    assert "state=S" in page.url
    page.locator('#flame g.frame[name="jbd2_log_wait_commit"]').first.wait_for()
    # The run-queue wait: where the threads waited for a CPU, 12 waits.
    page.click("#state-runqueue")
    page.wait_for_function(OFF_CPU_COUNT, arg="12")
    assert "state=runqueue" in page.url
    # D: the 240 uninterruptible waits of the session; the URL alone restores the state.
    page.goto(f"{symbolizer_url}/ui/session.html?id={episode_sid}&state=D")
    page.wait_for_function(OFF_CPU_COUNT, arg="240")
    assert page.locator("#state-D").get_attribute("aria-selected") == "true"

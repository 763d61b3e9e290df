"""docs/metrics.csv lists every metric the agent exposes, with the naming rules."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry

from bistouri.agent.exporter import Exporter
from bistouri.agent.metrics import (
    EPISODE_COUNTER_FAMILIES,
    RECORDER_COUNTER_FAMILIES,
    AgentMetrics,
    BpfCountersCollector,
    MapCountersCollector,
)
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from bistouri.bpf import abi
from bistouri.host.procmaps import ProcMapsStats
from bistouri.host.psi import PsiLoop

CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "metrics.csv"


def _exposed_agent_metrics() -> dict[str, str]:
    r = CollectorRegistry()
    AgentMetrics(r)
    r.register(BpfCountersCollector(lambda: dict.fromkeys(abi.Counter, 0), lambda: (ProcMapsStats(), 0)))
    r.register(
        MapCountersCollector(
            "episode", lambda: dict.fromkeys(abi.EpisodeCounter, 0), EPISODE_COUNTER_FAMILIES
        )
    )
    r.register(
        MapCountersCollector(
            "recorder", lambda: dict.fromkeys(abi.RecorderCounter, 0), RECORDER_COUNTER_FAMILIES
        )
    )
    PsiLoop(registry=r)
    spool = Spool(tempfile.mkdtemp(), 1 << 20, registry=r)
    s = AgentSettings(symbolizer_endpoint="http://127.0.0.1:1")
    Exporter(spool, s, registry=r, file_locator=lambda build_id: None)  # as the agent builds it
    out = {}
    for m in r.collect():
        name = m.name + "_total" if m.type == "counter" else m.name
        out[name] = m.type
    return out


def _catalogue(component: str) -> dict[str, dict[str, str]]:
    with CATALOGUE.open() as f:
        return {row["name"]: row for row in csv.DictReader(f) if row["component"] == component}


def test_every_agent_metric_is_catalogued_and_nothing_else():
    exposed = _exposed_agent_metrics()
    listed = _catalogue("agent")
    assert set(exposed) == set(listed), (set(exposed) - set(listed), set(listed) - set(exposed))
    for name, typ in exposed.items():
        assert listed[name]["type"] == typ, name


def test_naming_rules():
    with CATALOGUE.open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        name = row["name"]
        assert name.startswith("bistouri_"), name
        assert (row["type"] == "counter") == name.endswith("_total"), name
        assert not {"pid", "comm", "tid"} & set(filter(None, row["labels"].split(";"))), name
        assert row["description"], name


def test_every_symbolizer_metric_is_catalogued():
    from bistouri.symbolizer import llvm, resolve, sources
    from bistouri.symbolizer.service import metrics

    regs = [metrics.Metrics(lambda: None).registry]  # type: ignore[arg-type,return-value]
    r = CollectorRegistry()
    resolve._Metrics(r)
    sources._Metrics(r)
    llvm._Metrics(r)
    regs.append(r)
    exposed = {}
    for reg in regs:
        for m in reg.collect():
            exposed[m.name + "_total" if m.type == "counter" else m.name] = m.type
    listed = _catalogue("symbolizer")
    # The database gauges come from a collector that needs a store: listed, checked by name only.
    scraped = {"bistouri_symbolizer_db_sessions", "bistouri_symbolizer_db_bytes"}
    scraped |= {f"bistouri_symbolizer_export_queue_{x}" for x in ("sessions", "bytes", "oldest_seconds")}
    assert set(exposed) == set(listed) - scraped
    for name, typ in exposed.items():
        assert listed[name]["type"] == typ, name

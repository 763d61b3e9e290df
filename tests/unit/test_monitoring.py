"""The shipped Prometheus alert rules and Grafana dashboard (packaging/monitoring/)."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "packaging" / "monitoring"
RULES = MONITORING / "bistouri-alerts.yml"
DASHBOARD = MONITORING / "bistouri-dashboard.json"
_NAME = re.compile(r"\b(bistouri_[a-z0-9_]+)")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool missing: apt-get install prometheus (make deps installs it)")
    return path


def _catalogued() -> set[str]:
    with open(REPO / "docs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names = {r["name"] for r in rows}
    # A histogram's series.
    for r in rows:
        if r["type"] == "histogram":
            names |= {r["name"] + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_alert_rules_pass_promtool_check() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 10 rules found" in out.stdout


def test_alert_rules_fire_as_their_unit_tests_say() -> None:
    test_file = MONITORING / "bistouri-alerts.test.yml"
    out = subprocess.run(
        [_promtool(), "test", "rules", test_file.name], capture_output=True, text=True, cwd=MONITORING
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_and_dashboard_use_only_catalogued_metrics() -> None:
    catalogue = _catalogued()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = set(_NAME.findall(RULES.read_text())) | {n for e in exprs for n in _NAME.findall(e)}
    assert used, "no metric found: the pattern is wrong"
    assert used <= catalogue, sorted(used - catalogue)
    # Every alert the issue asks for is there.
    alerts = set(re.findall(r"alert: (\w+)", RULES.read_text()))
    assert {
        "BistouriAgentDown",
        "BistouriNoActiveWatchers",
        "BistouriExporterFailing",
        "BistouriSpoolNearFull",
        "BistouriSymbolizerErrors",
        "BistouriSymbolizerUploadsRefused",
    } <= alerts


def test_dashboard_is_importable() -> None:
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["title"]
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]

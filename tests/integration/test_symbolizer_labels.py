"""Issue 24 point 5: the symbolizer stores a session's unit and container, lists and filters sessions by
them over real HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from bistouri import wire
from tests.integration.conftest import DemoBinary, make_session, post_sessions

ID = "4f1b9c2e7a6d5038b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e"
ID2 = "4f1b0000000000000000000000000000000000000000000000000000000000ff"
POD = "8d9a4c2b-5e6f-4a1b-9c3d-2e1f0a9b8c7d"


def _labelled(
    sid: str, binary: DemoBinary, start_ns: int, unit: str, container: wire.Container | None
) -> Any:
    s = make_session(sid, binary, start_ns=start_ns)
    s.unit, s.container = unit, container
    return s


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return ""
    pytest.importorskip("psycopg", reason="psycopg (3) is the PostgreSQL driver")
    return str(request.getfixturevalue("postgres").url)


def test_sessions_are_listed_and_filtered_by_unit_and_container(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary, db: str
) -> None:
    flags = {"db": db} if db else {}
    url = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir, **flags)
    t0 = 1_763_000_000 * 10**9
    sessions = [
        _labelled("plain", demo_binary, t0, "", None),  # as agents before them send it
        _labelled("nginx", demo_binary, t0 + 1, "nginx.service", None),
        _labelled("docker", demo_binary, t0 + 2, f"docker-{ID}.scope", wire.Container(ID, "docker")),
        _labelled("k8s", demo_binary, t0 + 3, "", wire.Container(ID2, "containerd", POD)),
    ]
    r = post_sessions(url, sessions)
    assert r.status_code == 200 and sorted(r.json()["accepted"]) == sorted(s.session_id for s in sessions)

    def ids(**params: str) -> list[str]:
        r = requests.get(url + "/v1/sessions", params=params, timeout=10)
        assert r.status_code == 200, r.text
        return [x["id"] for x in r.json()["sessions"]]

    assert ids() == ["k8s", "docker", "nginx", "plain"]
    assert ids(unit="nginx.service") == ["nginx"]
    assert ids(unit=f"docker-{ID}.scope") == ["docker"]
    assert ids(container=ID) == ["docker"]
    assert ids(container=ID[:12]) == ["docker"]  # the short id `docker ps` shows
    assert ids(container="4f1b") == ["k8s", "docker"]
    assert ids(runtime="containerd") == ["k8s"]
    assert ids(runtime="docker", container="4f1b") == ["docker"]
    assert ids(unit="nope.service") == []
    for bad in ("4F1B", "4f1b%", "_", "x" * 10, "a" * 129):
        r = requests.get(url + "/v1/sessions", params={"container": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"] == "bad_parameter", (bad, r.text)

    listing = {x["id"]: x for x in requests.get(url + "/v1/sessions", timeout=10).json()["sessions"]}
    assert listing["plain"]["unit"] == "" and listing["plain"]["container"] is None
    assert listing["k8s"]["container"] == {"id": ID2, "runtime": "containerd", "pod": POD}
    one = requests.get(url + "/v1/sessions/docker", timeout=10).json()
    assert one["unit"] == f"docker-{ID}.scope"
    assert one["container"] == {"id": ID, "runtime": "docker", "pod": ""}
    # PostgreSQL text refuses NUL: such a unit or container is refused alone (a 4xx, never a 500).
    for i, (unit, container) in enumerate(
        [("a\x00.service", None), ("", wire.Container("ab\x00", "docker")), ("", wire.Container(ID, "x\x00"))]
    ):
        r = post_sessions(url, [_labelled(f"nul-{i}", demo_binary, t0 + 10 + i, unit, container)])
        assert r.status_code == 400 and r.json()["rejected"][0]["reason"] == "malformed", r.text
    assert requests.get(url + "/v1/sessions", params={"unit": "x\x00"}, timeout=10).status_code == 400
    assert "Traceback" not in url.log_path.read_text()
    # The merged profile takes the same filters.
    merged = requests.get(url + "/v1/profile/folded", params={"container": ID[:12]}, timeout=10)
    assert merged.status_code == 200 and merged.text

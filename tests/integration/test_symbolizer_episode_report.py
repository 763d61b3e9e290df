"""Issue 12 through the symbolizer service: the episode report in GET /v1/sessions/{id} and a
profile per wait state. A real `bistouri symbolizer` process (gunicorn, SQLite)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import requests

from bistouri import wire

from .conftest import DemoBinary, make_session, post_sessions, put_kernel

VICTIMS = (
    wire.Victim(100, 101, "worker", 200_000_000, 900_000_000, 0, 1_500_000_000, 0),
    wire.Victim(100, 100, "bistouri-demo", 800_000_000, 300_000_000, 50_000_000, 0, 20_000_000),
)
AGGRESSORS = (
    wire.Aggressor("/hogs", 7_900_000_000, 0, 0, 0, 0),
    wire.Aggressor("/test.slice", 1_000_000_000, 8192, 2, 1 << 20, 4096),
)


def episode_session(sid: str, binary: DemoBinary) -> wire.Session:
    """make_session with an episode, and its off-CPU trace also seen as an S, a reclaim and a
    run-queue wait."""
    s = make_session(sid, binary)
    [off] = [t for t in s.traces if t.off_cpu]
    s.traces += [
        dataclasses.replace(off, off_cpu=7, off_cpu_ns=70_000_000, wait=wire.WAIT_S),
        dataclasses.replace(off, off_cpu=2, off_cpu_ns=20_000_000, wait=wire.WAIT_RECLAIM),
        dataclasses.replace(off, off_cpu=3, off_cpu_ns=30_000_000, wait=wire.WAIT_RUNQUEUE),
    ]
    s.episode = wire.Episode(VICTIMS, AGGRESSORS)
    return s


def folded(url: str, path: str, **params: str) -> dict[str, int]:
    r = requests.get(url + path, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return {stack: int(n) for stack, _, n in (line.rpartition(" ") for line in r.text.splitlines())}


def test_episode_in_the_session_and_a_profile_per_state(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    url = symbolizer_server(tmp_path, workers=2, binary_dir=demo_binary.dir)
    assert put_kernel(url).status_code == 204
    r = post_sessions(url, [episode_session("ep-1", demo_binary), make_session("old-1", demo_binary)])
    assert r.status_code == 200 and sorted(r.json()["accepted"]) == ["ep-1", "old-1"], r.text

    ep = requests.get(f"{url}/v1/sessions/ep-1", timeout=10).json()["episode"]
    assert [v["tid"] for v in ep["victims"]] == [101, 100]  # as ranked by the agent
    assert ep["victims"][0] == {
        "pid": 100,
        "tid": 101,
        "comm": "worker",
        "on_cpu_ns": 200_000_000,
        "runqueue_ns": 900_000_000,
        "blocked_ns": {"D": 0, "S": 1_500_000_000},
        "reclaim_ns": 0,
        "stall_ns": 900_000_000,
    }
    assert [a["cgroup"] for a in ep["aggressors"]] == ["/hogs", "/test.slice"]
    assert ep["aggressors"][1] == {
        "cgroup": "/test.slice",
        "cpu_ns": 1_000_000_000,
        "io_bytes": 8192,
        "io_ops": 2,
        "memory_bytes": 1 << 20,
        "reclaim_bytes": 4096,
    }
    # A session without an episode (an older agent) has empty rows; lists leave rows out.
    old = requests.get(f"{url}/v1/sessions/old-1", timeout=10).json()["episode"]
    assert old["victims"] == [] and old["aggressors"] == []
    listed = requests.get(f"{url}/v1/sessions", timeout=10).json()["sessions"]
    assert listed and all("victims" not in s["episode"] for s in listed)

    # One profile per state: the same stack's waits are kept apart by what they waited in.
    by_state = {
        st: folded(url, "/v1/sessions/ep-1/folded", state=st, value="off_cpu")
        for st in ("D", "S", "reclaim", "runqueue")
    }
    assert [sum(f.values()) for f in by_state.values()] == [5, 7, 2, 3]
    assert all(f.keys() == by_state["D"].keys() for f in by_state.values())
    rq_ns = folded(url, "/v1/sessions/ep-1/folded", state="runqueue", value="off_cpu_ns")
    assert sum(rq_ns.values()) == 30_000_000
    on = folded(url, "/v1/sessions/ep-1/folded", state="on_cpu")
    assert sum(on.values()) == 53 and not any("io_schedule" in k for k in on)
    bad = requests.get(f"{url}/v1/sessions/ep-1/folded", params={"state": "R"}, timeout=10)
    assert bad.status_code == 400 and "state='R' is not one of" in bad.text

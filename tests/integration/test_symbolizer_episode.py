"""The flight recorder's samples through the symbolizer service: stored apart, split, filtered, rendered.

A real `bistouri symbolizer` (gunicorn, SQLite) gets sessions whose traces are
marked before or after the trigger (`pre_traces` on the wire) and manual
captures; the read API splits the totals, renders each part, and filters the
list by trigger kind.
"""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests

from bistouri import wire
from bistouri.symbolizer.model import Frame, Profile, SessionMeta
from bistouri.symbolizer.service import store
from tests.pprof_proto import compile_profile_proto

from .conftest import DemoBinary, make_session, post_sessions, put_kernel

PRE_NS = 4_000_000_000


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


def onset_session(sid: str, binary: DemoBinary, **kw: Any) -> wire.Session:
    """make_session's traces; its first two (on-CPU) also sampled before the trigger, 1/4 as much."""
    s = make_session(sid, binary, **kw)
    pre = [dataclasses.replace(t, on_cpu=t.on_cpu // 4, pre_trigger=True) for t in s.traces[:2]]
    s.traces = [*pre, *s.traces]
    s.pre_trigger_ns = PRE_NS
    s.start_ns -= PRE_NS
    s.duration_ns += PRE_NS
    return s


def manual_session(sid: str, binary: DemoBinary, **kw: Any) -> wire.Session:
    s = make_session(sid, binary, **kw)
    s.trigger = dataclasses.replace(s.trigger, kind=wire.TRIGGER_MANUAL)
    return s


def folded(url: str, path: str, **params: str) -> dict[str, int]:
    r = requests.get(url + path, params=params, timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        stack, _, n = line.rpartition(" ")
        out[stack] = int(n)
    return out


def test_before_and_after_the_trigger_are_kept_apart(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary, profile_pb2: ModuleType
) -> None:
    url = symbolizer_server(tmp_path, workers=2, binary_dir=demo_binary.dir)
    assert put_kernel(url).status_code == 204
    onset = onset_session("onset-1", demo_binary)
    r = post_sessions(url, [onset])
    assert r.status_code == 200 and r.json()["accepted"] == ["onset-1"], r.text

    # The session JSON splits the totals at the trigger.
    meta = requests.get(f"{url}/v1/sessions/onset-1", timeout=10).json()
    pre_on = sum(t.on_cpu for t in onset.traces if t.pre_trigger)
    post_on = sum(t.on_cpu for t in onset.traces if not t.pre_trigger)
    assert pre_on == 12 and post_on == 53
    ep = meta["episode"]
    assert ep["pre_trigger_s"] == PRE_NS / 1e9
    assert ep["before_trigger"] == {"on_cpu": pre_on, "off_cpu": 0, "off_cpu_ns": 0}
    assert ep["after_trigger"] == {"on_cpu": post_on, "off_cpu": 5, "off_cpu_ns": 7_000_000}
    assert meta["samples"]["on_cpu"] == pre_on + post_on

    # Each part renders alone; the parts add up to the whole.
    path = "/v1/sessions/onset-1/folded"
    whole, before, after = (folded(url, path, **p) for p in ({}, {"part": "before"}, {"part": "after"}))
    assert sum(before.values()) == pre_on and sum(after.values()) == post_on
    assert len(before) == 2 and all(k.endswith("middle_step") or "leaf_work" in k for k in before)
    assert {k: before.get(k, 0) + after.get(k, 0) for k in whole} == whole
    tree = requests.get(f"{url}/v1/sessions/onset-1/flamegraph", params={"part": "before"}, timeout=30).json()
    assert tree["value"] == pre_on
    scope = requests.get(f"{url}/v1/sessions/onset-1/speedscope", params={"part": "after"}, timeout=30)
    assert scope.status_code == 200

    # pprof labels the onset's samples, so `-tagfocus trigger=before` selects them.
    r = requests.get(f"{url}/v1/sessions/onset-1/pprof", timeout=30)
    prof = profile_pb2.Profile()
    prof.ParseFromString(gzip.decompress(r.content))

    def trigger_label(sample: Any) -> str:
        labels = {prof.string_table[x.key]: prof.string_table[x.str] for x in sample.label if x.str}
        return labels.get("trigger", "")

    tagged = [s.value[0] for s in prof.sample if trigger_label(s) == "before"]
    assert sorted(tagged) == sorted(t.on_cpu for t in onset.traces if t.pre_trigger)
    prof_after = profile_pb2.Profile()
    r = requests.get(f"{url}/v1/sessions/onset-1/pprof", params={"part": "after"}, timeout=30)
    prof_after.ParseFromString(gzip.decompress(r.content))
    assert sum(s.value[0] for s in prof_after.sample) == post_on
    assert "trigger" not in prof_after.string_table

    # The onset against what followed, in one diff: A is the part before, B the part after.
    both = {"a": "onset-1", "a.part": "before", "b": "onset-1", "b.part": "after"}
    diff = requests.get(f"{url}/v1/diff/flamegraph", params=both, timeout=30).json()
    assert (diff["value"], diff["base"]) == (post_on, pre_on)
    r = requests.get(f"{url}/v1/diff/flamegraph", params={**both, "b.part": "later"}, timeout=30)
    assert r.status_code == 400 and "b.part='later'" in r.json()["detail"]

    # A merge keeps the parts apart too.
    post_sessions(url, [onset_session("onset-2", demo_binary, start_ns=onset.start_ns + 10**12)])
    merged = folded(url, "/v1/profile/folded", part="before")
    assert sum(merged.values()) == 2 * pre_on

    bad = requests.get(f"{url}/v1/sessions/onset-1/flamegraph", params={"part": "onset"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"] == "bad_parameter"
    assert "part='onset'" in bad.json()["detail"]


def test_flag_survives_resymbolization(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    """Stored before its kernel's symbols, symbolized again from the raw session: the split stays."""
    url = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir)
    r = post_sessions(url, [onset_session("late-1", demo_binary)])
    assert r.json()["missing_kernels"], r.text
    before = folded(url, "/v1/sessions/late-1/folded", part="before")
    assert put_kernel(url).status_code == 204
    again = folded(url, "/v1/sessions/late-1/folded", part="before")
    assert sum(again.values()) == sum(before.values()) == 12
    meta = requests.get(f"{url}/v1/sessions/late-1", timeout=10).json()
    assert meta["episode"]["before_trigger"]["on_cpu"] == 12


def test_list_filters_by_trigger_kind(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    url = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir)
    # A PSI session whose label holds the text the filter looks for: escaped in the JSON, it must not match.
    decoy = make_session("psi-1", demo_binary)
    decoy.labels = {"note": '"trigger_kind":"manual"'}
    sessions = [decoy, manual_session("manual-1", demo_binary, start_ns=decoy.start_ns + 10**9)]
    assert post_sessions(url, sessions).status_code == 200

    def ids(**params: str) -> list[str]:
        r = requests.get(f"{url}/v1/sessions", params=params, timeout=10)
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["sessions"]]

    assert ids() == ["manual-1", "psi-1"]
    assert ids(kind="manual") == ["manual-1"]
    assert ids(kind="psi") == ["psi-1"]
    assert requests.get(f"{url}/v1/sessions/manual-1", timeout=10).json()["trigger"]["kind"] == "manual"
    r = requests.get(f"{url}/v1/profile/folded", params={"kind": "manual"}, timeout=10)
    assert r.headers["X-Bistouri-Sessions"] == "1"
    r = requests.get(f"{url}/v1/sessions", params={"kind": "cron"}, timeout=10)
    assert r.status_code == 400 and "kind='cron'" in r.json()["detail"]


def test_blobs_stored_before_the_flag_read_as_after_the_trigger() -> None:
    """A profile blob of 7-value samples (written before the flag existed) reads with pre_trigger False."""
    import zlib

    import msgpack

    body = {"f": [["main", "demo", "", 0, "user", False]], "s": [[[0], 1, 1, "t", 5, 0, 0]]}
    blob = zlib.compress(msgpack.packb(body, use_bin_type=True))
    p = store.profile_from_blob(blob, SessionMeta("old"))
    assert [(s.on_cpu, s.pre_trigger) for s in p.samples] == [(5, False)]
    # And the flag round-trips in the current blob.
    p.samples[0].pre_trigger = True
    again = store.profile_from_blob(store.profile_to_blob(p), SessionMeta("old"))
    assert again.samples[0].pre_trigger is True
    assert again.frames == [Frame("main", "demo")]
    assert isinstance(again, Profile) and again.totals("before") == (5, 0, 0)

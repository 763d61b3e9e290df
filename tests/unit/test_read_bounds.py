"""Issue 26 N7/N9: answers bounded (merges, trees), written as they are sent, never with NaN."""

from __future__ import annotations

import json
import math

import pytest

from bistouri import wire
from bistouri.errors import WireError
from bistouri.pressure import PressureFigures
from bistouri.symbolizer import formats
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from testkit import hostile


def _profile(sid: str, stacks: int, depth: int, base: int = 0) -> Profile:
    frames = [Frame(f"f{base + i}", "m", "/a.c", i) for i in range(stacks * depth)]
    samples = [
        Sample(tuple(range(j * depth, (j + 1) * depth)), on_cpu=1 + j % 3, off_cpu=j % 2, off_cpu_ns=7 * j)
        for j in range(stacks)
    ]
    return Profile(SessionMeta(sid, start_ns=10**18), frames, samples)


def test_flamegraph_json_is_tree_json_of_the_tree() -> None:
    p = _profile("a", 50, 6)
    p.samples.append(Sample((0, 1, 99), on_cpu=5, pre_trigger=True))  # shares a path, then its own
    for value in formats.VALUES:
        chunks, cut = formats.flamegraph_json(p, value)
        assert not cut
        assert "".join(chunks) == formats.tree_json(formats.flamegraph(p, value))
    b = _profile("b", 40, 6)
    chunks, cut = formats.diff_json(p, b)
    assert "".join(chunks) == formats.tree_json(formats.diff(p, b))


def test_tree_nodes_are_bounded_and_values_stay_consistent() -> None:
    p = _profile("a", 1000, 20)  # 20 000 nodes
    chunks, cut = formats.flamegraph_json(p, max_nodes=5000)
    assert cut
    tree = json.loads("".join(chunks))
    nodes, todo = 0, [tree]
    while todo:
        n = todo.pop()
        nodes += 1
        assert n["value"] >= sum(c["value"] for c in n["children"])
        todo.extend(n["children"])
    assert nodes == 5000 + 1  # and the root
    assert tree["value"] == sum(s.on_cpu for s in p.samples)  # every sample counted, at some depth


def test_merge_stops_at_its_budget_and_says_so() -> None:
    profiles = [_profile(f"s{i}", 100, 10, base=1000 * i) for i in range(5)]  # 1000 entries each
    merged = formats.merge(iter(profiles), max_entries=2500)
    assert merged.truncated
    assert len(merged.samples) == 200  # two profiles: the third would pass 2500
    whole = formats.merge(iter(profiles))
    assert not whole.truncated and len(whole.samples) == 500
    assert merged.part("before").truncated and merged.in_state("on_cpu").truncated


def test_non_finite_psi_averages_are_refused_at_decode() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        s = hostile.deep_session("nan", 0, ())
        s.trigger = wire.Trigger("cpu", pressure=PressureFigures(avg10=bad))
        with pytest.raises(WireError, match="finite"):
            wire.decode_session(wire.encode_session(s))


def test_stored_nan_reads_as_null() -> None:
    meta = SessionMeta("old", pressure=PressureFigures(math.nan, math.inf, 1.5))
    got = meta.to_json()["trigger"]
    assert (got["avg10"], got["avg60"], got["avg300"]) == (None, None, 1.5)
    json.dumps(meta.to_json(), allow_nan=False)

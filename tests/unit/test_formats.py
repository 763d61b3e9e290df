"""Profile renderings: golden folded/speedscope, pprof parsed with the real schema, trees, merge, diff."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bistouri.symbolizer import formats
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from tests.pprof_proto import compile_profile_proto

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "symbolizer"
SPEEDSCOPE_SCHEMA = ROOT / "fixtures" / "speedscope" / "file-format-schema.json"
UPDATE = os.environ.get("BISTOURI_UPDATE_GOLDEN") == "1"


def sample_profile() -> Profile:
    """Two processes; kernel, vDSO, unknown and inlined frames; one stack seen by two threads."""
    frames = [
        Frame("main", "app", "app.c", 40),  # 0
        Frame("handle_request", "app", "app.c", 22),  # 1
        Frame("parse_header", "app", "parse.h", 7, inlined=True),  # 2 inlined into 1
        Frame("read", "libc.so.6"),  # 3
        Frame("entry_SYSCALL_64", "vmlinux", kind="kernel"),  # 4
        Frame("ksys_read", "vmlinux", kind="kernel"),  # 5
        Frame("io_schedule", "vmlinux", kind="kernel"),  # 6
        Frame("__vdso_clock_gettime", "[vdso]", kind="vdso"),  # 7
        Frame("app+0x1234", "app", kind="unknown"),  # 8
        Frame("std::vector<int>::push_back;weird", "app", "vector.h", 99, inlined=True),  # 9 inlined into 1
    ]
    samples = [
        Sample((0, 1, 2), pid=10, tid=10, thread="app", on_cpu=7),
        Sample((0, 1, 3, 4, 5, 6), pid=10, tid=11, thread="worker", off_cpu=3, off_cpu_ns=4_500_000),
        Sample((0, 1, 3, 4, 5, 6), pid=10, tid=12, thread="worker", on_cpu=1, off_cpu=2, off_cpu_ns=500_000),
        Sample((0, 7), pid=10, tid=10, thread="app", on_cpu=2),
        Sample((8,), pid=20, tid=20, thread="other", on_cpu=5),
        Sample((0, 1, 9), pid=10, tid=10, thread="app", on_cpu=1),
        Sample((), pid=20, tid=20, on_cpu=1),
    ]
    meta = SessionMeta(
        session_id="golden-1",
        service="api",
        host="h1",
        processes={10: "app", 20: "other"},
        resource="io",
        start_ns=1_700_000_000_000_000_000,
        duration_ns=10_000_000_000,
        period_ns=52_631_578,
    )
    return Profile(meta=meta, frames=frames, samples=samples)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with BISTOURI_UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text()


# ---------------------------------------------------------------------------
# folded


@pytest.mark.parametrize("value", formats.VALUES)
def test_folded_matches_golden(value: str) -> None:
    check_golden(f"folded_{value}.txt", formats.folded(sample_profile(), value))


def test_folded_marks_kinds_and_sums_identical_stacks() -> None:
    text = formats.folded(sample_profile(), "off_cpu")
    assert text == "main;handle_request;read;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k] 5\n"
    on = formats.folded(sample_profile(), "on_cpu")
    assert "main;__vdso_clock_gettime_[v] 2\n" in on
    assert "main;handle_request;parse_header_[i] 7\n" in on
    # `;` inside a name would split the frame: it is replaced.
    assert "main;handle_request;std::vector<int>::push_back:weird_[i] 1\n" in on
    assert "[no frames] 1\n" in on
    assert sum(int(line.rsplit(" ", 1)[1]) for line in on.splitlines()) == sample_profile().totals()[0]


def test_unknown_value_is_refused() -> None:
    with pytest.raises(ValueError, match="on_cpu"):
        formats.folded(sample_profile(), "cycles")


# ---------------------------------------------------------------------------
# speedscope


def test_speedscope_matches_golden_and_schema() -> None:
    doc = formats.speedscope(sample_profile())
    check_golden("speedscope.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads(SPEEDSCOPE_SCHEMA.read_text()))


def test_speedscope_profiles_carry_each_value() -> None:
    p = sample_profile()
    doc = formats.speedscope(p)
    by_name = {x["name"].rsplit(" ", 1)[1]: x for x in doc["profiles"]}
    assert set(by_name) == set(formats.VALUES)
    on, off, off_ns = p.totals()
    assert sum(by_name["on_cpu"]["weights"]) == on == by_name["on_cpu"]["endValue"]
    assert sum(by_name["off_cpu"]["weights"]) == off
    assert sum(by_name["off_cpu_ns"]["weights"]) == off_ns
    assert by_name["off_cpu_ns"]["unit"] == "nanoseconds"
    names = [f["name"] for f in doc["shared"]["frames"]]
    # Root first: each stack starts at main (or is the lone unknown frame).
    first = by_name["off_cpu"]["samples"][0]
    assert names[first[0]] == "main"
    assert names[first[-1]] == "io_schedule_[k]"


# ---------------------------------------------------------------------------
# flamegraph, diff, merge


def _find(node: dict[str, Any], *path: str) -> dict[str, Any]:
    for name in path:
        node = next(c for c in node["children"] if c["name"] == name)
    return node


def test_flamegraph_tree() -> None:
    tree = formats.flamegraph(sample_profile(), "on_cpu")
    assert tree["name"] == "all" and tree["kind"] == "root"
    assert tree["value"] == sample_profile().totals()[0] - 1 + 1  # the empty stack counts at the root only
    main = _find(tree, "main")
    assert main["value"] == 7 + 1 + 2 + 1
    assert main["file"] == "app.c" and main["line"] == 40 and main["kind"] == "user"
    inl = _find(tree, "main", "handle_request", "parse_header")
    assert inl["inlined"] is True and inl["value"] == 7
    leaf = _find(tree, "main", "handle_request", "read", "entry_SYSCALL_64", "ksys_read", "io_schedule")
    assert leaf["kind"] == "kernel" and leaf["value"] == 1 and leaf["children"] == []
    for node in (tree, main):
        assert node["value"] >= sum(c["value"] for c in node["children"])


def test_diff_normalises_by_total() -> None:
    a = sample_profile()
    b = sample_profile()
    for s in b.samples:  # B is twice as long with the same shape: no delta anywhere
        s.on_cpu *= 2
    tree = formats.diff(a, b, "on_cpu")
    assert tree["base"] == 17 and tree["value"] == 34

    def walk(n: dict[str, Any]) -> None:
        assert n["delta"] == 0
        for c in n["children"]:
            walk(c)

    walk(tree)
    # Now B spends its time in a new stack as well: that node's delta is all of its value.
    b.frames.append(Frame("new_fn", "app"))
    b.samples.append(Sample((0, len(b.frames) - 1), on_cpu=34))
    tree = formats.diff(a, b, "on_cpu")
    new = _find(tree, "main", "new_fn")
    assert new["base"] == 0 and new["delta"] == 34
    # main had 11/17 of A; B's main is 22+34=56 of 68: delta = 56 - 11*68/17 = 12
    assert _find(tree, "main")["delta"] == pytest.approx(12.0)


def test_merge_sums_and_dedups() -> None:
    a, b = sample_profile(), sample_profile()
    b.meta.start_ns += 60_000_000_000
    m = formats.merge([a, b])
    assert m.totals() == tuple(2 * x for x in a.totals())
    assert len(m.frames) == len(a.frames)
    # Identical stacks of different threads collapse into one sample.
    assert len(m.samples) == len({s.stack for s in a.samples})
    assert m.meta.session_id == "golden-1"
    assert m.meta.duration_ns == 70_000_000_000
    assert (m.meta.on_cpu, m.meta.off_cpu, m.meta.off_cpu_ns) == m.totals()
    assert formats.folded(m, "on_cpu").count("\n") == formats.folded(a, "on_cpu").count("\n")
    assert formats.merge([]).samples == []


# ---------------------------------------------------------------------------
# pprof, parsed with the vendored profile.proto


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


def parse_pprof(pb2: ModuleType, data: bytes) -> Any:
    msg = pb2.Profile()
    msg.ParseFromString(gzip.decompress(data))
    return msg


def test_pprof_parses_and_totals_match(profile_pb2: ModuleType) -> None:
    p = sample_profile()
    msg = parse_pprof(profile_pb2, formats.pprof(p))
    s = msg.string_table
    assert s[0] == ""
    assert [(s[t.type], s[t.unit]) for t in msg.sample_type] == [
        ("on_cpu", "count"),
        ("off_cpu", "count"),
        ("off_cpu_time", "nanoseconds"),
    ]
    totals = [sum(x.value[i] for x in msg.sample) for i in range(3)]
    assert tuple(totals) == p.totals()
    assert msg.period == p.meta.period_ns and msg.time_nanos == p.meta.start_ns
    assert (s[msg.period_type.type], s[msg.period_type.unit]) == ("cpu", "nanoseconds")
    assert s[msg.default_sample_type] == "on_cpu"

    funcs = {f.id: f for f in msg.function}
    locs = {loc.id: loc for loc in msg.location}
    maps = {m.id: s[m.filename] for m in msg.mapping}
    assert "[kernel]" in maps.values() and "[vdso]" in maps.values()

    def names(sample: Any) -> list[list[str]]:
        return [[s[funcs[ln.function_id].name] for ln in locs[i].line] for i in sample.location_id]

    # Leaf first; the inlined frame shares its caller's location, innermost line first.
    first = msg.sample[0]
    assert names(first) == [["parse_header", "handle_request"], ["main"]]
    assert [ln.line for ln in locs[first.location_id[0]].line] == [7, 22]
    kernel_sample = msg.sample[1]
    leaf = locs[kernel_sample.location_id[0]]
    assert maps[leaf.mapping_id] == "[kernel]"
    assert s[funcs[leaf.line[0].function_id].name] == "io_schedule"
    labels = {s[lb.key]: (lb.num or s[lb.str]) for lb in kernel_sample.label}
    assert labels == {"pid": 10, "comm": "app", "tid": 11, "thread_name": "worker"}
    assert all(len(x.value) == 3 for x in msg.sample)


def test_pprof_is_deterministic_and_clamps_huge_counts(profile_pb2: ModuleType) -> None:
    p = sample_profile()
    assert formats.pprof(p) == formats.pprof(sample_profile())
    p.samples[0].on_cpu = (1 << 64) - 1  # u64 on the wire, int64 in pprof
    msg = parse_pprof(profile_pb2, formats.pprof(p))
    assert msg.sample[0].value[0] == (1 << 63) - 1


_frames = st.lists(
    st.builds(
        Frame,
        name=st.text(min_size=0, max_size=12),
        module=st.sampled_from(["app", "libc.so.6", "vmlinux", ""]),
        file=st.sampled_from(["", "a.c", "b.h"]),
        line=st.integers(0, 5000),
        kind=st.sampled_from(["user", "kernel", "vdso", "unknown", "jit", "python"]),
        inlined=st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@st.composite
def profiles(draw: Any) -> Profile:
    frames = draw(_frames)
    idx = st.integers(0, len(frames) - 1)
    count = st.integers(0, 10**6)
    samples = draw(
        st.lists(
            st.builds(
                Sample,
                stack=st.lists(idx, max_size=8).map(tuple),
                pid=st.integers(0, 1 << 22),
                tid=st.integers(0, 1 << 22),
                thread=st.text(max_size=5),
                on_cpu=count,
                off_cpu=count,
                off_cpu_ns=st.integers(0, 10**12),
            ),
            max_size=12,
        )
    )
    return Profile(meta=SessionMeta("h", processes={1: "x"}), frames=frames, samples=samples)


@settings(max_examples=150, deadline=None)
@given(profiles())
def test_every_format_keeps_the_totals(profile_pb2: ModuleType, p: Profile) -> None:
    totals = p.totals()
    msg = parse_pprof(profile_pb2, formats.pprof(p))
    assert tuple(sum(x.value[i] for x in msg.sample) for i in range(3)) == totals
    for i, value in enumerate(formats.VALUES):
        assert formats.flamegraph(p, value)["value"] == totals[i]
        folded = formats.folded(p, value)
        assert sum(int(line.rsplit(" ", 1)[1]) for line in folded.split("\n") if line) == totals[i]
        assert all(line.count(" ") >= 1 for line in folded.split("\n") if line)
    assert formats.merge([p, p]).totals() == tuple(2 * t for t in totals)
    json.dumps(formats.speedscope(p))
    json.dumps(formats.profile_json(p))


def _jit_profile() -> Profile:
    p = sample_profile()
    jit = Frame("JS:*hotLoop /app/x.js:2:17", "[jit]", kind="jit")
    p.frames.append(jit)
    p.samples = [Sample((0, len(p.frames) - 1), pid=10, tid=10, thread="app", on_cpu=3)]
    return p


def test_jit_frames_keep_their_names_in_every_format(profile_pb2: ModuleType) -> None:
    """A JIT frame named by a perf map is its own kind: `_[j]` in folded (as perf's scripts mark
    it), its own `[jit]` mapping in pprof, its name in speedscope and the flamegraph tree."""
    p = _jit_profile()
    assert formats.folded(p, "on_cpu") == "main;JS:*hotLoop /app/x.js:2:17_[j] 3\n"
    msg = parse_pprof(profile_pb2, formats.pprof(p))
    s = msg.string_table
    leaf = next(loc for loc in msg.location if loc.id == msg.sample[0].location_id[0])
    assert {m.id: s[m.filename] for m in msg.mapping}[leaf.mapping_id] == "[jit]"
    assert s[next(f for f in msg.function if f.id == leaf.line[0].function_id).name].startswith("JS:*hotLoop")
    names = [f["name"] for f in formats.speedscope(p)["shared"]["frames"]]
    assert any(n.startswith("JS:*hotLoop") for n in names)
    tree = formats.flamegraph(p, "on_cpu")
    assert tree["children"][0]["children"][0]["name"].startswith("JS:*hotLoop")
    assert tree["children"][0]["children"][0]["kind"] == "jit"


def python_profile() -> Profile:
    """A CPython process's stacks as the resolver makes them (wire v4): native frames, then the Python
    functions where the eval loop was (one frame per line being run), then a C function they called."""
    meta = SessionMeta("py-1", processes={30: "python3.11"}, period_ns=10_101_010)
    frames = [
        Frame("Py_RunMain", "libpython3.11.so.1.0", "Modules/main.c", 700),  # 0
        Frame("<module>", "[python]", "w.py", 12, kind="python"),  # 1
        Frame("driver", "[python]", "w.py", 9, kind="python"),  # 2
        Frame("Worker.hot_loop", "[python]", "w.py", 6, kind="python"),  # 3
        Frame("Worker.hot_loop", "[python]", "w.py", 7, kind="python"),  # 4: the same function, next line
        Frame("compress", "[python]", "/usr/lib/python3.11/gzip.py", 0, kind="python"),  # 5: line unknown
        Frame("deflate", "libz.so.1"),  # 6
        Frame("run;x", "[python]", "a b.py", 3, kind="python"),  # 7: a name that would split a stack
    ]
    samples = [
        Sample((0, 1, 2, 3), pid=30, tid=30, thread="python3.11", on_cpu=5),
        Sample((0, 1, 2, 4), pid=30, tid=30, thread="python3.11", on_cpu=2),
        Sample((0, 1, 2, 5, 6), pid=30, tid=31, thread="gz", on_cpu=3),
        Sample((0, 7), pid=30, tid=30, thread="python3.11", on_cpu=1),
    ]
    return Profile(meta=meta, frames=frames, samples=samples)


def test_python_frames_carry_their_file_and_line_in_every_format(profile_pb2: ModuleType) -> None:
    """folded: `name (file:line)` as py-spy writes it; pprof: Function name and filename, Line.line;
    speedscope: name, file, line; the tree: a node of kind python per line."""
    p = python_profile()
    assert formats.folded(p, "on_cpu") == (
        "Py_RunMain;<module> (w.py:12);driver (w.py:9);Worker.hot_loop (w.py:6) 5\n"
        "Py_RunMain;<module> (w.py:12);driver (w.py:9);Worker.hot_loop (w.py:7) 2\n"
        "Py_RunMain;<module> (w.py:12);driver (w.py:9);compress (/usr/lib/python3.11/gzip.py);deflate 3\n"
        "Py_RunMain;run:x (a b.py:3) 1\n"
    )

    msg = parse_pprof(profile_pb2, formats.pprof(p))
    s = msg.string_table
    functions = {f.id: f for f in msg.function}
    locations = {loc.id: loc for loc in msg.location}
    mappings = {m.id: m for m in msg.mapping}

    def frames_of(sample: Any) -> list[tuple[str, str, int, str]]:
        out = []
        for lid in sample.location_id:  # leaf first
            loc = locations[lid]
            (line,) = loc.line
            fn = functions[line.function_id]
            out.append((s[fn.name], s[fn.filename], line.line, s[mappings[loc.mapping_id].filename]))
        return out

    assert frames_of(msg.sample[0]) == [
        ("Worker.hot_loop", "w.py", 6, "[python]"),
        ("driver", "w.py", 9, "[python]"),
        ("<module>", "w.py", 12, "[python]"),
        ("Py_RunMain", "Modules/main.c", 700, "libpython3.11.so.1.0"),
    ]
    assert frames_of(msg.sample[2])[:2] == [
        ("deflate", "", 0, "libz.so.1"),
        ("compress", "/usr/lib/python3.11/gzip.py", 0, "[python]"),
    ]
    # Lines 6 and 7 of hot_loop are one function (pprof aggregates by function unless asked for lines).
    assert len({line.function_id for loc in msg.location for line in loc.line if line.line in (6, 7)}) == 1
    py = next(m for m in msg.mapping if s[m.filename] == "[python]")
    assert py.has_functions and py.has_filenames and py.has_line_numbers

    doc = formats.speedscope(p)
    shared = doc["shared"]["frames"]
    assert {"name": "Worker.hot_loop", "file": "w.py", "line": 6} in shared
    assert {"name": "compress", "file": "/usr/lib/python3.11/gzip.py"} in shared  # no line: none given
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads(SPEEDSCOPE_SCHEMA.read_text()))

    tree = formats.flamegraph(p, "on_cpu")
    driver = _find(tree, "Py_RunMain", "<module>", "driver")
    assert (driver["kind"], driver["file"], driver["line"], driver["module"]) == (
        "python",
        "w.py",
        9,
        "[python]",
    )
    hot = [c for c in driver["children"] if c["name"] == "Worker.hot_loop"]
    assert [(c["line"], c["value"]) for c in hot] == [(6, 5), (7, 2)]  # a node per line, as py-spy draws
    assert formats.merge([p, p]).totals() == (22, 0, 0)
    assert formats.profile_json(p)["frames"][3] == {
        "name": "Worker.hot_loop",
        "module": "[python]",
        "file": "w.py",
        "line": 6,
        "kind": "python",
        "inlined": False,
    }

"""Profile renderings: pprof, folded stacks, speedscope, d3-flamegraph trees, merge and diff.

Pure functions of `model.Profile`: no I/O, no clocks, deterministic output (the
golden tests depend on it). Stacks in the model are root first; pprof wants
leaf first, everything else here keeps root first. docs/formats.md describes
each output.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import chain, repeat
from typing import Any

from .model import (
    KIND_JIT,
    KIND_KERNEL,
    KIND_PYTHON,
    KIND_UNKNOWN,
    KIND_USER,
    KIND_VDSO,
    Frame,
    Profile,
    Sample,
    SessionMeta,
)
from .protobuf import INT64_MAX as _MAX
from .protobuf import SMALL_VARINTS as _SMALL
from .protobuf import Strings as _Strings
from .protobuf import bytes_field as _bytes
from .protobuf import clamp as _clamp
from .protobuf import key as _key
from .protobuf import packed as _packed
from .protobuf import uint_field as _int
from .protobuf import varint as _varint

# The three sample values a profile carries, in pprof's sample_type order.
VALUES = ("on_cpu", "off_cpu", "off_cpu_ns")
_PPROF_TYPES = (("on_cpu", "count"), ("off_cpu", "count"), ("off_cpu_time", "nanoseconds"))

# flamegraph.pl's annotations: it colours `_[k]` frames as kernel and `_[i]` as inlined.
_KIND_SUFFIX = {KIND_KERNEL: "_[k]", KIND_VDSO: "_[v]", KIND_JIT: "_[j]"}

SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def check_value(value: str) -> str:
    if value not in VALUES:
        raise ValueError(f"value {value!r} is not one of {', '.join(VALUES)}")
    return value


def sample_value(s: Sample, value: str) -> int:
    if value == "on_cpu":
        return s.on_cpu
    if value == "off_cpu":
        return s.off_cpu
    return s.off_cpu_ns


def display_name(f: Frame, location: bool = False) -> str:
    """A frame's name in the text formats: kernel, vDSO and inlined frames keep a visible mark. With
    `location`, a Python frame's file and line follow its name, as py-spy writes them: `f (w.py:6)`
    (the formats without a field of their own for them: folded)."""
    name = f.name or "[unknown]"
    if location and f.kind == KIND_PYTHON and f.file:
        name += f" ({f.file}:{f.line})" if f.line > 0 else f" ({f.file})"
    # `;` separates frames and a line break ends a folded line: neither may appear inside a name.
    name = name.replace(";", ":")
    if not name.isprintable():
        name = "".join(c if c.isprintable() else "?" for c in name)
    name += _KIND_SUFFIX.get(f.kind, "")
    if f.inlined:
        name += "_[i]"
    return name


# ---------------------------------------------------------------------------
# Folded stacks


def folded(profile: Profile, value: str = "on_cpu") -> str:
    """Brendan Gregg's collapsed format: `root;...;leaf N` per distinct stack, sorted."""
    check_value(value)
    names = [display_name(f, location=True) for f in profile.frames]
    acc: dict[str, int] = {}
    for s in profile.samples:
        v = sample_value(s, value)
        if v <= 0:
            continue
        key = ";".join(names[i] for i in s.stack) or "[no frames]"
        acc[key] = acc.get(key, 0) + v
    return "".join(f"{k} {v}\n" for k, v in sorted(acc.items()))


# ---------------------------------------------------------------------------
# d3-flame-graph JSON tree


# A read renders at most this many tree nodes (about 40 MB of JSON): past it, a stack stops at its deepest
# frame already in the tree, its value counted there, and the answer says it is truncated.
MAX_TREE_NODES = 150_000  # ~24 MB of JSON, ~50 MB and ~1 s to build

# A call tree while it is built: [value, frame index, children by frame key or None, base (diffs)].
# About 150 bytes a node; a dict per node, as d3 wants them, was ~700 and kept a worker at 300 MB+
# for one large session.
_Tree = list[Any]


class _Keys:
    """One small int per distinct (name, kind, inlined[, file, line]): the identity of a node among its
    siblings. A Python frame is one node per file and line, as py-spy draws them: its line is what
    the flamegraph tells (a native node merges its addresses, its line is the first frame's)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, str, bool, str, int], int] = {}
        self.order: list[tuple[str, str, bool, str, int]] = []

    def of(self, profile: Profile) -> list[int]:
        out = []
        for f in profile.frames:
            if f.kind == KIND_PYTHON:
                key = (f.name, f.kind, f.inlined, f.file, f.line)
            else:
                key = (f.name, f.kind, f.inlined, "", 0)
            i = self.ids.get(key)
            if i is None:
                i = self.ids[key] = len(self.order)
                self.order.append(key)
            out.append(i)
        return out


def _build(profile: Profile, value: str, keys: _Keys, budget: list[int]) -> tuple[_Tree, bool]:
    """The call tree of a profile; `budget` ([nodes left]) is shared by the trees of one answer."""
    key_of = keys.of(profile)
    root: _Tree = [0, -1, None, 0]
    truncated = False
    for s in profile.samples:
        v = sample_value(s, value)
        if v <= 0:
            continue
        node = root
        node[0] += v
        for i in s.stack:
            kids = node[2]
            if kids is None:
                kids = node[2] = {}
            k = key_of[i]
            child = kids.get(k)
            if child is None:
                if budget[0] <= 0:
                    truncated = True
                    break
                budget[0] -= 1
                child = kids[k] = [0, i, None, 0]
            child[0] += v
            node = child
    return root, truncated


def _sorted_kids(node: _Tree, keys: _Keys) -> list[_Tree]:
    kids = node[2]
    if not kids:
        return []
    order = keys.order
    return [kids[k] for k in sorted(kids, key=order.__getitem__)]


def _fields(node: _Tree, frames: Sequence[Frame], diff_scale: float | None) -> dict[str, Any]:
    if node[1] < 0:
        out: dict[str, Any] = {"name": "all", "value": node[0], "kind": "root", "file": "", "line": 0}
        out.update(inlined=False, module="")
    else:
        f = frames[node[1]]
        out = {
            "name": f.name or "[unknown]",
            "value": node[0],
            "kind": f.kind or KIND_UNKNOWN,
            "file": f.file,
        }
        out.update(line=f.line, inlined=f.inlined, module=f.module)
    if diff_scale is not None:
        out["base"] = node[3]
        out["delta"] = round(node[0] - node[3] * diff_scale, 3)
    return out


def _to_dicts(root: _Tree, frames: Sequence[Frame], keys: _Keys, scale: float | None) -> dict[str, Any]:
    # Without recursion, here and in every walk of a tree: a tree is as deep as the longest stack.
    out = _fields(root, frames, scale)
    todo = [(root, out)]
    while todo:
        node, d = todo.pop()
        kids = _sorted_kids(node, keys)
        d["children"] = [_fields(k, frames, scale) for k in kids]
        todo.extend(zip(kids, d["children"], strict=True))
    return out


def _json_chunks(root: _Tree, frames: Sequence[Frame], keys: _Keys, scale: float | None) -> Iterator[str]:
    """The tree as tree_json() writes it, in pieces of about 64 KB: never the whole text at once."""
    out: list[str] = []
    size = 0
    todo: list[Any] = [root]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            piece = item
        else:
            head = json.dumps(_fields(item, frames, scale), separators=(",", ":"), allow_nan=False)[:-1]
            piece = head + ',"children":['
            todo.append("]}")
            kids = _sorted_kids(item, keys)
            for i in range(len(kids) - 1, -1, -1):
                todo.append(kids[i])
                if i:
                    todo.append(",")
        out.append(piece)
        size += len(piece)
        if size >= 1 << 16:
            yield "".join(out)
            out, size = [], 0
    if out:
        yield "".join(out)


def _diff_tree(a: Profile, b: Profile, value: str, max_nodes: int) -> tuple[_Tree, _Keys, float, bool]:
    keys = _Keys()
    budget = [max_nodes]
    tb, cut_b = _build(b, value, keys, budget)
    # A's tree only where B's is: its values become the `base` of B's nodes.
    key_of = keys.of(a)
    total_a = 0
    for s in a.samples:
        v = sample_value(s, value)
        if v <= 0:
            continue
        total_a += v
        node: _Tree | None = tb
        tb[3] += v
        for i in s.stack:
            kids = node[2] if node is not None else None
            node = kids.get(key_of[i]) if kids else None
            if node is None:
                break
            node[3] += v
    scale = tb[0] / total_a if total_a else 0.0
    return tb, keys, scale, cut_b


def flamegraph(profile: Profile, value: str = "on_cpu", max_nodes: int = 1 << 62) -> dict[str, Any]:
    """The call tree as d3-flame-graph reads it; the root is named "all"."""
    check_value(value)
    keys = _Keys()
    root, _ = _build(profile, value, keys, [max_nodes])
    return _to_dicts(root, profile.frames, keys, None)


def flamegraph_json(
    profile: Profile, value: str = "on_cpu", max_nodes: int = MAX_TREE_NODES
) -> tuple[Iterator[str], bool]:
    """tree_json(flamegraph(profile)) in pieces, at most `max_nodes` nodes; True when cut there."""
    check_value(value)
    keys = _Keys()
    root, truncated = _build(profile, value, keys, [max_nodes])
    return _json_chunks(root, profile.frames, keys, None), truncated


def diff(a: Profile, b: Profile, value: str = "on_cpu", max_nodes: int = 1 << 62) -> dict[str, Any]:
    """B's call tree, each node with `base` (A's value) and `delta` (B - A scaled to B's total).

    A is scaled by total(B)/total(A) before subtracting, so a 10 s session and a
    60 s one compare by share of time rather than by raw counts. Stacks only in
    A do not appear: the tree is B's.
    """
    check_value(value)
    tb, keys, scale, _ = _diff_tree(a, b, value, max_nodes)
    return _to_dicts(tb, b.frames, keys, scale)


def diff_json(
    a: Profile, b: Profile, value: str = "on_cpu", max_nodes: int = MAX_TREE_NODES
) -> tuple[Iterator[str], bool]:
    """tree_json(diff(a, b)) in pieces, at most `max_nodes` nodes; True when cut there."""
    check_value(value)
    tb, keys, scale, truncated = _diff_tree(a, b, value, max_nodes)
    return _json_chunks(tb, b.frames, keys, scale), truncated


def tree_json(tree: dict[str, Any]) -> str:
    """A flamegraph or diff tree as compact JSON, `children` last in each node.

    json.dumps recurses once per level and fails past ~1000; here only each node's own fields go
    through it, and the nesting is written from an explicit stack.
    """
    out: list[str] = []
    todo: list[Any] = [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        fields = {k: v for k, v in item.items() if k != "children"}
        head = json.dumps(fields, separators=(",", ":"), allow_nan=False)[:-1]
        out.append(head + (',"children":[' if fields else '"children":['))
        todo.append("]}")
        kids = item["children"]
        for i in range(len(kids) - 1, -1, -1):
            todo.append(kids[i])
            if i:
                todo.append(",")
    return "".join(out)


# ---------------------------------------------------------------------------
# Merge


# A merge stops taking profiles past this many frames in its distinct stacks (~40 MB): two stored
# sessions at the ingest limit (500 000 each) fit, a dashboard over many large ones does not.
MAX_MERGE_ENTRIES = 1_000_000


def merge(profiles: Iterable[Profile], max_entries: int = 1 << 62) -> Profile:
    """One profile summing several; identical stacks add up, per-thread identity is dropped.

    `meta` is the first profile's, with sample totals summed and the time span
    widened to cover every input. The first profile that would take the distinct stacks' frames
    past `max_entries` is not merged, nor any after it: the result's `truncated` says so.
    """
    frames: list[Frame] = []
    # Keyed by a plain tuple: hashing and comparing the dataclass itself costs several times more.
    frame_ids: dict[tuple[str, str, str, int, str, bool], int] = {}
    acc: dict[tuple[tuple[int, ...], bool, int], list[int]] = {}
    first: SessionMeta | None = None
    start = end = 0
    entries = 0
    truncated = False
    for p in profiles:
        cost = sum(len(s.stack) for s in p.samples)
        if first is not None and entries + cost > max_entries:
            truncated = True
            break
        entries += cost
        if first is None:
            first = p.meta
            start, end = p.meta.start_ns, p.meta.start_ns + p.meta.duration_ns
        else:
            start = min(start, p.meta.start_ns)
            end = max(end, p.meta.start_ns + p.meta.duration_ns)
        remap = []
        for f in p.frames:
            fkey = (f.name, f.module, f.file, f.line, f.kind, f.inlined)
            i = frame_ids.get(fkey)
            if i is None:
                i = frame_ids[fkey] = len(frames)
                frames.append(f)
            remap.append(i)
        for s in p.samples:
            # Keyed by the before-trigger flag and the wait state too: the merge keeps them apart.
            key = (tuple(remap[i] for i in s.stack), s.pre_trigger, s.wait)
            c = acc.get(key)
            if c is None:
                c = acc[key] = [0, 0, 0]
            c[0] += s.on_cpu
            c[1] += s.off_cpu
            c[2] += s.off_cpu_ns
    samples = [
        Sample(stack=k, on_cpu=c[0], off_cpu=c[1], off_cpu_ns=c[2], pre_trigger=pre, wait=wait)
        for (k, pre, wait), c in acc.items()
    ]
    meta = (
        replace(first, labels=dict(first.labels), processes=dict(first.processes))
        if first
        else SessionMeta("")
    )
    meta.start_ns, meta.duration_ns = start, end - start
    meta.on_cpu = sum(s.on_cpu for s in samples)
    meta.off_cpu = sum(s.off_cpu for s in samples)
    meta.off_cpu_ns = sum(s.off_cpu_ns for s in samples)
    pre = [s for s in samples if s.pre_trigger]
    meta.pre_on_cpu = sum(s.on_cpu for s in pre)
    meta.pre_off_cpu = sum(s.off_cpu for s in pre)
    meta.pre_off_cpu_ns = sum(s.off_cpu_ns for s in pre)
    return Profile(meta=meta, frames=frames, samples=samples, truncated=truncated)


# ---------------------------------------------------------------------------
# The whole profile as JSON


def profile_json(profile: Profile) -> dict[str, Any]:
    """Everything the profile holds: metadata, frames, samples (stacks as frame indexes, root first)."""
    return {
        "meta": profile.meta.to_json(),
        "frames": [
            {
                "name": f.name,
                "module": f.module,
                "file": f.file,
                "line": f.line,
                "kind": f.kind,
                "inlined": f.inlined,
            }
            for f in profile.frames
        ],
        "samples": [
            {
                "stack": list(s.stack),
                "pid": s.pid,
                "tid": s.tid,
                "thread": s.thread,
                "on_cpu": s.on_cpu,
                "off_cpu": s.off_cpu,
                "off_cpu_ns": s.off_cpu_ns,
                "pre_trigger": s.pre_trigger,
            }
            for s in profile.samples
        ],
    }


# ---------------------------------------------------------------------------
# speedscope


def speedscope(profile: Profile, name: str = "") -> dict[str, Any]:
    """A speedscope file: shared frames and one sampled profile per value type that has samples."""
    title = name or profile.meta.session_id or "bistouri"
    used: dict[int, int] = {}
    frames: list[dict[str, Any]] = []
    for s in profile.samples:
        for i in s.stack:
            if i not in used:
                used[i] = len(frames)
                f = profile.frames[i]
                entry: dict[str, Any] = {"name": display_name(f)}
                if f.file:
                    entry["file"] = f.file
                    if f.line > 0:
                        entry["line"] = f.line
                frames.append(entry)
    out_profiles = []
    for value in VALUES:
        stacks: list[list[int]] = []
        weights: list[int] = []
        for s in profile.samples:
            v = sample_value(s, value)
            if v > 0:
                if not s.stack and -1 not in used:
                    used[-1] = len(frames)  # as in folded output: a sample without frames stays visible
                    frames.append({"name": "[no frames]"})
                stacks.append([used[i] for i in s.stack] if s.stack else [used[-1]])
                weights.append(v)
        if not weights and value != "on_cpu":
            continue
        out_profiles.append(
            {
                "type": "sampled",
                "name": f"{title} {value}",
                "unit": "nanoseconds" if value == "off_cpu_ns" else "none",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": stacks,
                "weights": weights,
            }
        )
    return {
        "$schema": SPEEDSCOPE_SCHEMA,
        "shared": {"frames": frames},
        "profiles": out_profiles,
        "name": title,
        "activeProfileIndex": 0,
        "exporter": "bistouri",
    }


# ---------------------------------------------------------------------------
# pprof: a hand-written encoder for perftools.profiles.Profile (google/pprof proto/profile.proto)


def _mapping_name(kind: str, module: str) -> str:
    if kind == KIND_KERNEL:
        return "[kernel]"
    if kind == KIND_VDSO:
        return "[vdso]"
    return module or "[unknown]"


def locations_of(stack: Sequence[int], inlined: Sequence[bool]) -> list[tuple[int, ...]]:
    """Group a root-first stack into locations (pprof's, OTLP's), leaf first; `inlined[i]` is
    frame i's inlined flag.

    A frame marked inlined belongs to the location of the frame before it (toward
    the root); a location's lines run from the innermost inlined frame to its caller.
    """
    groups: list[list[int]] = []
    for i in stack:
        if inlined[i] and groups:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [tuple(reversed(g)) for g in reversed(groups)]


# A frame and a sample as rows: their fields in the order of Frame's and Sample's (the store's layout,
# Store.get_profile_rows; what the export encodes from, no objects built).
FrameRow = tuple[str, str, str, int, str, bool]  # name, module, file, line, kind, inlined
# stack, pid, tid, thread, on_cpu, off_cpu, off_cpu_ns, pre_trigger, wait
SampleRow = tuple[Any, ...]


def frame_rows(profile: Profile) -> tuple[list[FrameRow], list[SampleRow]]:
    """A profile's frames and samples as rows (pprof_rows, otlp.Request.add_rows)."""
    frames = [(f.name, f.module, f.file, f.line, f.kind, f.inlined) for f in profile.frames]
    samples = [
        (s.stack, s.pid, s.tid, s.thread, s.on_cpu, s.off_cpu, s.off_cpu_ns, s.pre_trigger, s.wait)
        for s in profile.samples
    ]
    return frames, samples


def pprof(profile: Profile, compress: bool = True) -> bytes:
    """The profile as a gzip-compressed pprof protobuf."""
    return pprof_rows(profile.meta, *frame_rows(profile), compress=compress)


# pprof's keys, precomputed: varint fields 1-4, and the messages of Profile (sample 2, mapping 3,
# location 4, function 5, string 6) and of its parts (Sample's location_id 1 and value 2, Location's line 4).
_T1, _T2, _T3, _T4 = (_key(f, 0) for f in (1, 2, 3, 4))
_SAMPLE_MSG, _LOCATION_MSG, _FUNCTION_MSG, _STRING_MSG = (_key(f, 2) for f in (2, 4, 5, 6))
_STACK_RUN, _VALUES_RUN, _LINE_MSG = (_key(f, 2) for f in (1, 2, 4))

# A location as PprofIds keeps it: its Location message, its id as a packed run holds it, the
# (name, file) of each of its lines' functions, its mapping's name, whether a line has a file.
_Location = tuple[bytes, bytes, tuple[tuple[str, str], ...], str, bool]


class PprofIds:
    """pprof's location, function and mapping ids, kept from one profile to the next.

    Ids in pprof are any non-zero numbers unique within a profile (only strings are indexes, into
    each profile's own table): a sender that encodes many profiles of the same binaries numbers a
    frame once and reuses its Location message, and a profile costs a lookup per frame and its
    strings. `pprof()` uses a fresh one per profile (ids from 1)."""

    MAX_LOCATIONS = 200_000  # past this many, forgotten (between two profiles) and numbered afresh

    def __init__(self) -> None:
        self.locations: dict[Any, _Location] = {}  # by a frame's row, or a tuple of rows (inlined)
        self.functions: dict[tuple[str, str], bytes] = {}  # (name, file) -> the id's varint
        self.mappings: dict[str, bytes] = {}  # name -> the id's varint

    def location(self, key: Any, group: Sequence[FrameRow]) -> _Location:
        """The location of frames (the innermost inlined first, their caller last), known by `key`
        (callers look it up in `locations` first: this builds it)."""
        functions = self.functions
        fkeys = tuple([(f[0], f[2]) for f in group])
        lines = b""
        for f, fk in zip(group, fkeys, strict=True):
            fid = functions.get(fk)
            if fid is None:
                fid = functions[fk] = _varint(len(functions) + 1)
            body = _T1 + fid + _T2 + _varint(f[3]) if f[3] > 0 else _T1 + fid
            lines += _LINE_MSG + _SMALL[len(body)] + body  # a Line is a few bytes
        outer = group[-1]
        mname = _mapping_name(outer[4], outer[1])
        mid = self.mappings.get(mname)
        if mid is None:
            mid = self.mappings[mname] = _varint(len(self.mappings) + 1)
        lid = _varint(len(self.locations) + 1)
        body = _T1 + lid + _T2 + mid + lines
        msg = _LOCATION_MSG + _varint(len(body)) + body
        loc = self.locations[key] = (msg, lid, fkeys, mname, any([f[2] for f in group]))
        return loc

    def bound(self) -> None:
        """Between two profiles: forgotten if past MAX_LOCATIONS (a sender's memory stays bounded)."""
        if len(self.locations) > self.MAX_LOCATIONS:
            self.locations.clear()
            self.functions.clear()
            self.mappings.clear()


def pprof_rows(
    meta: SessionMeta,
    frames: Sequence[FrameRow],
    samples: Sequence[SampleRow],
    compress: bool = True,
    ids: PprofIds | None = None,
) -> bytes:
    """pprof() of a profile given as rows (frame_rows' layout): what the Pyroscope export encodes,
    with the sender's `ids` (PprofIds) kept between its profiles.

    A frame at a time, not a sample at a time: each frame that is a location on its own is looked
    up once (its row, hashed in C), its strings added over all the frames at once; a sample is then
    its stack's ids joined. The same input and ids, the same bytes."""
    if ids is None:
        ids = PprofIds()
    else:
        ids.bound()
    st = _Strings()
    sample_types = b"".join(_bytes(1, _int(1, st(t)) + _int(2, st(u))) for t, u in _PPROF_TYPES)
    comm = meta.processes
    k_pid, k_tid, k_thread, k_comm = st("pid"), st("tid"), st("thread_name"), st("comm")

    inlined = [f[5] for f in frames]
    known = ids.locations.get
    location = ids.location
    # Each frame as a location on its own (an inlined one is only part of others'): None for those.
    single = [None if f[5] else known(f) or location(f, (f,)) for f in frames]
    used: dict[_Location, None] = dict.fromkeys(filter(None, single))  # in order, each once
    runs = [loc[1] if loc else b"" for loc in single]  # each frame's id as a packed run holds it
    groups: dict[tuple[int, ...], bytes] = {}
    with_inlined: set[str] = set()  # mappings with inlined frames

    def group_id(group: tuple[int, ...]) -> bytes:
        """The location of an inlined frame with its callers (the innermost first), or of an inlined
        frame alone at a stack's root."""
        lid = groups.get(group)
        if lid is None:
            rows = tuple(frames[i] for i in group)
            loc = known(rows) or location(rows, rows)
            used[loc] = None
            with_inlined.add(loc[3])
            lid = groups[group] = loc[1]
        return lid

    has_inlined = any(inlined)
    labels_of: dict[tuple[int, int, str, bool], bytes] = {}
    sample_msgs: list[bytes] = []
    for s in samples:
        stack = s[0]
        if has_inlined and any(map(inlined.__getitem__, stack)):
            run = b"".join(
                [
                    group_id(g) if len(g) > 1 or inlined[g[0]] else runs[g[0]]
                    for g in locations_of(stack, inlined)
                ]
            )
        else:
            run = b"".join(map(runs.__getitem__, reversed(stack)))
        # A sample's labels, the same for its (pid, tid, thread, flag) in the whole profile: built once.
        lkey = (s[1], s[2], s[3], s[7])
        labels = labels_of.get(lkey)
        if labels is None:
            pid, tid, thread, before = lkey
            parts = []
            if pid:
                parts.append(_bytes(3, _int(1, k_pid) + _int(3, _clamp(pid))))
                if pid in comm:
                    parts.append(_bytes(3, _int(1, k_comm) + _int(2, st(comm[pid]))))
            if tid:
                parts.append(_bytes(3, _int(1, k_tid) + _int(3, _clamp(tid))))
            if thread:
                parts.append(_bytes(3, _int(1, k_thread) + _int(2, st(thread))))
            if before:
                # `go tool pprof -tagfocus trigger=before` shows the onset; the strings are added only
                # when used, so a profile without the flight recorder has none of them.
                parts.append(_bytes(3, _int(1, st("trigger")) + _int(2, st("before"))))
            labels = labels_of[lkey] = b"".join(parts)
        # Values are packed and always three long, zeros included, as pprof requires.
        vals = _varint(min(s[4], _MAX)) + _varint(min(s[5], _MAX)) + _varint(min(s[6], _MAX))
        body = _VALUES_RUN + _SMALL[len(vals)] + vals + labels
        if run:  # an empty packed field is left out
            body = _STACK_RUN + _varint(len(run)) + run + body
        sample_msgs.append(_SAMPLE_MSG + _varint(len(body)) + body)

    # The functions and mappings of the locations used, their strings in this profile's table.
    locations = list(used)
    fkeys = list(dict.fromkeys(chain.from_iterable(loc[2] for loc in locations)))
    st.extend(chain.from_iterable(fkeys))
    index, fids = st.index, ids.functions
    v = _SMALL.__getitem__ if len(st.table) + 8 < len(_SMALL) else _varint  # string indexes: a table
    function_msgs = []
    for fk in fkeys:
        ni, fi = index[fk[0]], index[fk[1]]
        body = _T1 + fids[fk] + (_T2 + v(ni) + _T3 + v(ni) if ni else b"") + (_T4 + v(fi) if fi else b"")
        function_msgs.append(_FUNCTION_MSG + _SMALL[len(body)] + body)
    # A mapping says whether its frames have files and inlined frames.
    with_files = {loc[3] for loc in locations if loc[4]}
    mapping_msgs = []
    for mname in dict.fromkeys(loc[3] for loc in locations):
        has_files = mname in with_files
        body = (
            _T1
            + ids.mappings[mname]
            + _int(5, st(mname))
            + _int(7, 1)
            + _int(8, int(has_files))
            + _int(9, int(has_files))
            + _int(10, int(mname in with_inlined))
        )
        mapping_msgs.append(_bytes(3, body))

    comments = [st(f"session {meta.session_id}")] if meta.session_id else []
    if meta.resource:
        comments.append(st(f"trigger {meta.resource} {meta.stall}"))
    tail = (
        _int(9, _clamp(meta.start_ns))
        + _int(10, _clamp(meta.duration_ns))
        + _bytes(11, _int(1, st("cpu")) + _int(2, st("nanoseconds")))
        + _int(12, _clamp(meta.period_ns))
        + _packed(13, comments)
        + _int(14, st("on_cpu"))
    )
    encoded = [s.encode("utf-8", "replace") for s in st.table]
    lengths = list(map(_varint, map(len, encoded)))
    strings = b"".join(chain.from_iterable(zip(repeat(_STRING_MSG), lengths, encoded, strict=False)))
    body = (
        sample_types
        + b"".join(sample_msgs)
        + b"".join(mapping_msgs)
        + b"".join(loc[0] for loc in locations)
        + b"".join(function_msgs)
        + strings
        + tail
    )
    # mtime=0 keeps the output byte-identical for identical profiles.
    return gzip.compress(body, compresslevel=6, mtime=0) if compress else body


__all__ = [
    "KIND_KERNEL",
    "KIND_PYTHON",
    "KIND_UNKNOWN",
    "KIND_USER",
    "KIND_VDSO",
    "VALUES",
    "check_value",
    "diff",
    "display_name",
    "flamegraph",
    "folded",
    "frame_rows",
    "merge",
    "pprof",
    "pprof_rows",
    "profile_json",
    "speedscope",
    "tree_json",
]

"""Profile renderings: pprof (pprof.py), folded stacks, speedscope, d3-flamegraph trees, merge and diff.

Pure functions of `model.Profile`: no I/O, no clocks, deterministic output (the
golden tests depend on it). Stacks in the model are root first; pprof wants
leaf first, everything else here keeps root first. docs/formats.md describes
each output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..compat import zip_strict
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
from .pprof import PprofIds, frame_rows, pprof, pprof_rows  # pprof's own module; named here too

# The three sample values a profile carries, in pprof's sample_type order.
VALUES = ("on_cpu", "off_cpu", "off_cpu_ns")

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
        todo.extend(zip_strict(kids, d["children"]))
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


__all__ = [
    "KIND_KERNEL",
    "KIND_PYTHON",
    "KIND_UNKNOWN",
    "KIND_USER",
    "KIND_VDSO",
    "VALUES",
    "PprofIds",
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

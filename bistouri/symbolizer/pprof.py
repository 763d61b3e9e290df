"""pprof: a hand-written encoder for perftools.profiles.Profile (google/pprof's proto/profile.proto).

A pure function of a profile (docs/formats.md, "pprof"), given as a `model.Profile` (pprof) or as
the store's rows (pprof_rows: what the Pyroscope export encodes, with the ids it keeps between
profiles, PprofIds). locations_of groups a stack's frames into locations for OTLP too.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from typing import Any

from .model import KIND_KERNEL, KIND_VDSO, Profile, SessionMeta
from .protobuf import INT64_MAX as _MAX
from .protobuf import SMALL_VARINTS as _SMALL
from .protobuf import Strings as _Strings
from .protobuf import bytes_field as _bytes
from .protobuf import clamp as _clamp
from .protobuf import key as _key
from .protobuf import packed as _packed
from .protobuf import uint_field as _int
from .protobuf import varint as _varint

# The sample types, in the order of each sample's three values (formats.VALUES).
_PPROF_TYPES = (("on_cpu", "count"), ("off_cpu", "count"), ("off_cpu_time", "nanoseconds"))


def mapping_name(kind: str, module: str) -> str:
    """A frame's mapping as pprof and OTLP name it."""
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


def stack_run(
    stack: Sequence[int],
    flags: bytes,
    first: int,
    singles: Sequence[bytes],
    group: Callable[[tuple[int, ...]], bytes],
) -> bytes:
    """A root-first stack's packed run of location ids, leaf first, as locations_of groups it, for a
    stack with inlined frames: `flags[k]` says whether the stack's frame k is inlined, `first` is the
    first such k. A frame outside any group is its id from `singles` (by frame index), joined in C;
    only the groups cost Python steps (`group`: a group's id, of its frames root first, called leaf
    first as locations_of orders them: the same ids in the same order, so the same bytes)."""
    n = len(stack)
    spans = []  # (where the frames on their own start, the group's start, its end)
    start, p = 0, first
    while p >= 0:
        q = p - 1 if p else 0  # an inlined frame belongs to its caller's location (at the root: its own)
        r = p + 1
        while r < n and flags[r]:
            r += 1
        spans.append((start, q, r))
        start = r
        p = flags.find(1, r)
    parts = [b"".join(map(singles.__getitem__, reversed(stack[start:])))]
    for begin, q, r in reversed(spans):
        parts.append(group(tuple(stack[q:r])))  # a tuple already (the store's rows, Sample): itself
        parts.append(b"".join(map(singles.__getitem__, reversed(stack[begin:q]))))
    return b"".join(parts)


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

# A location as PprofIds keeps it: its Location message, its id as a packed run holds it, its lines'
# function ids (PprofIds.function_keys names them), its mapping's name, whether a line has a file.
_Location = tuple[bytes, bytes, tuple[bytes, ...], str, bool]


class PprofIds:
    """pprof's location, function and mapping ids, kept from one profile to the next.

    Ids in pprof are any non-zero numbers unique within a profile (only strings are indexes, into
    each profile's own table): a sender that encodes many profiles of the same binaries numbers a
    frame once and reuses its Location message, and a profile costs a lookup per frame and its
    strings. `pprof()` uses a fresh one per profile (ids from 1)."""

    # Past this many, forgotten (between two profiles) and numbered afresh: ~320 bytes each with their
    # strings (measured on the bench's `real` sessions: 1 462 locations for 200 sessions), ~16 MB at most.
    MAX_LOCATIONS = 50_000

    def __init__(self) -> None:
        self.locations: dict[Any, _Location] = {}  # by a frame's row, or a tuple of rows (inlined)
        self.functions: dict[tuple[str, str], bytes] = {}  # (name, file) -> the id's varint
        # The other way: a profile collects its functions by id (bytes, their hash kept), not by
        # (name, file) (a tuple, hashed anew each time).
        self.function_keys: dict[bytes, tuple[str, str]] = {}
        self.mappings: dict[str, bytes] = {}  # name -> the id's varint

    def location(self, key: Any, group: Sequence[FrameRow]) -> _Location:
        """The location of frames (the innermost inlined first, their caller last), known by `key`
        (callers look it up in `locations` first: this builds it)."""
        functions = self.functions
        fids = []
        lines = b""
        for f in group:
            fk = (f[0], f[2])
            fid = functions.get(fk)
            if fid is None:
                fid = functions[fk] = _varint(len(functions) + 1)
                self.function_keys[fid] = fk
            fids.append(fid)
            body = _T1 + fid + _T2 + _varint(f[3]) if f[3] > 0 else _T1 + fid
            lines += _LINE_MSG + _SMALL[len(body)] + body  # a Line is a few bytes
        outer = group[-1]
        mname = mapping_name(outer[4], outer[1])
        mid = self.mappings.get(mname)
        if mid is None:
            mid = self.mappings[mname] = _varint(len(self.mappings) + 1)
        lid = _varint(len(self.locations) + 1)
        body = _T1 + lid + _T2 + mid + lines
        msg = _LOCATION_MSG + _varint(len(body)) + body
        loc = self.locations[key] = (msg, lid, tuple(fids), mname, any([f[2] for f in group]))
        return loc

    def bound(self) -> None:
        """Between two profiles: forgotten if past MAX_LOCATIONS (a sender's memory stays bounded)."""
        if len(self.locations) > self.MAX_LOCATIONS:
            self.locations.clear()
            self.functions.clear()
            self.function_keys.clear()
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
    # In order, each once; by the object's id (a location's tuple would be hashed whole each time).
    used: dict[int, _Location] = {id(loc): loc for loc in single if loc}
    runs = [loc[1] if loc else b"" for loc in single]  # each frame's id as a packed run holds it
    groups: dict[tuple[int, ...], bytes] = {}  # by the group's frames, root first
    with_inlined: set[str] = set()  # mappings with inlined frames

    def group_id(group: tuple[int, ...]) -> bytes:
        """The location of an inlined frame with its callers (frame indices root first), or of an
        inlined frame alone at a stack's root."""
        lid = groups.get(group)
        if lid is None:
            rows = tuple([frames[i] for i in reversed(group)])  # the innermost first
            loc = known(rows) or location(rows, rows)
            used[id(loc)] = loc
            with_inlined.add(loc[3])
            lid = groups[group] = loc[1]
        return lid

    has_inlined = any(inlined)
    flags_of = bytes(inlined).__getitem__  # a frame's inlined flag as a byte, for stack_run
    labels_of: dict[tuple[int, int, str, bool], bytes] = {}
    sample_msgs: list[bytes] = []
    for s in samples:
        stack = s[0]
        flags = bytes(map(flags_of, stack)) if has_inlined else b""
        first = flags.find(1)
        if first >= 0:
            run = stack_run(stack, flags, first, runs, group_id)
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
    locations = list(used.values())
    fids = list(dict.fromkeys(chain.from_iterable([loc[2] for loc in locations])))
    fkeys = ids.function_keys
    st.extend(chain.from_iterable(map(fkeys.__getitem__, fids)))
    index = st.index
    v = _SMALL.__getitem__ if len(st.table) + 8 < len(_SMALL) else _varint  # string indexes: a table
    function_msgs = []
    for fid in fids:
        fk = fkeys[fid]
        ni, fi = index[fk[0]], index[fk[1]]
        body = _T1 + fid + (_T2 + v(ni) + _T3 + v(ni) if ni else b"") + (_T4 + v(fi) if fi else b"")
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
    strings = b"".join(chain.from_iterable(zip(repeat(_STRING_MSG), lengths, encoded)))
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
    "FrameRow",
    "PprofIds",
    "SampleRow",
    "frame_rows",
    "locations_of",
    "pprof",
    "pprof_rows",
    "stack_run",
]

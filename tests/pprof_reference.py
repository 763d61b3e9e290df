"""The pprof encoder of de21473 (a sample at a time, ids in order of first use), kept as the tests'
reference: the encoder in formats.py must give profiles that decode equal to its (test_pprof_reference).
"""

from __future__ import annotations

import gzip

from bistouri.symbolizer.model import KIND_KERNEL, KIND_VDSO, Frame, Profile
from bistouri.symbolizer.pprof import _PPROF_TYPES, locations_of
from bistouri.symbolizer.protobuf import Strings as _Strings
from bistouri.symbolizer.protobuf import bytes_field as _bytes
from bistouri.symbolizer.protobuf import clamp as _clamp
from bistouri.symbolizer.protobuf import packed as _packed
from bistouri.symbolizer.protobuf import uint_field as _int
from bistouri.symbolizer.protobuf import varint as _varint


def _mapping_name(f: Frame) -> str:
    if f.kind == KIND_KERNEL:
        return "[kernel]"
    if f.kind == KIND_VDSO:
        return "[vdso]"
    return f.module or "[unknown]"


def pprof(profile: Profile, compress: bool = True) -> bytes:
    """The profile as a gzip-compressed pprof protobuf."""
    st = _Strings()
    frames = profile.frames
    sample_types = b"".join(_bytes(1, _int(1, st(t)) + _int(2, st(u))) for t, u in _PPROF_TYPES)

    mappings: dict[str, int] = {}
    mapping_kinds: dict[str, set[str]] = {}
    functions: dict[tuple[str, str], int] = {}
    locations: dict[tuple[int, ...], int] = {}
    function_msgs: list[bytes] = []
    location_msgs: list[bytes] = []
    sample_msgs: list[bytes] = []
    comm = profile.meta.processes
    k_pid, k_tid, k_thread, k_comm = st("pid"), st("tid"), st("thread_name"), st("comm")

    def function_id(f: Frame) -> int:
        key = (f.name, f.file)
        fid = functions.get(key)
        if fid is None:
            fid = functions[key] = len(functions) + 1
            body = _int(1, fid) + _int(2, st(f.name)) + _int(3, st(f.name)) + _int(4, st(f.file))
            function_msgs.append(_bytes(5, body))
        return fid

    def location_id(group: tuple[int, ...]) -> int:
        lid = locations.get(group)
        if lid is None:
            lid = locations[group] = len(locations) + 1
            outer = frames[group[-1]]
            mname = _mapping_name(outer)
            mid = mappings.setdefault(mname, len(mappings) + 1)
            seen = mapping_kinds.setdefault(mname, set())
            lines = []
            for i in group:
                f = frames[i]
                if f.file:
                    seen.add("file")
                if f.inlined:
                    seen.add("inline")
                lines.append(_bytes(4, _int(1, function_id(f)) + _int(2, max(f.line, 0))))
            location_msgs.append(_bytes(4, _int(1, lid) + _int(2, mid) + b"".join(lines)))
        return lid

    inlined = [f.inlined for f in frames]
    has_inlined = any(inlined)
    single = [0] * len(frames)  # location id of a frame that is a location on its own
    labels_of: dict[tuple[int, int, str, bool], bytes] = {}
    for s in profile.samples:
        # Locations in order of first use, leaf first, whichever way: the same ids, the same bytes.
        if has_inlined and any(map(inlined.__getitem__, s.stack)):
            ids = [location_id(g) for g in locations_of(s.stack, inlined)]
        else:
            ids = []
            for i in reversed(s.stack):
                lid = single[i] or location_id((i,))
                single[i] = lid
                ids.append(lid)
        # A sample's labels, the same for its (pid, tid, thread, flag) in the whole profile: built once
        # (the strings they add are added at their first use either way).
        lkey = (s.pid, s.tid, s.thread, s.pre_trigger)
        labels = labels_of.get(lkey)
        if labels is None:
            parts = []
            if s.pid:
                parts.append(_bytes(3, _int(1, k_pid) + _int(3, _clamp(s.pid))))
                if s.pid in comm:
                    parts.append(_bytes(3, _int(1, k_comm) + _int(2, st(comm[s.pid]))))
            if s.tid:
                parts.append(_bytes(3, _int(1, k_tid) + _int(3, _clamp(s.tid))))
            if s.thread:
                parts.append(_bytes(3, _int(1, k_thread) + _int(2, st(s.thread))))
            if s.pre_trigger:
                # `go tool pprof -tagfocus trigger=before` shows the onset; the strings are added only
                # when used, so a profile without the flight recorder stays byte for byte the same.
                parts.append(_bytes(3, _int(1, st("trigger")) + _int(2, st("before"))))
            labels = labels_of[lkey] = b"".join(parts)
        # Values are packed and always three long, zeros included, as pprof requires.
        vals = _bytes(2, b"".join(_varint(_clamp(v)) for v in (s.on_cpu, s.off_cpu, s.off_cpu_ns)))
        sample_msgs.append(_bytes(2, _packed(1, ids) + vals + labels))

    mapping_msgs = []
    for mname, mid in mappings.items():
        kinds = mapping_kinds[mname]
        has_files = "file" in kinds
        body = (
            _int(1, mid)
            + _int(5, st(mname))
            + _int(7, 1)
            + _int(8, int(has_files))
            + _int(9, int(has_files))
            + _int(10, int("inline" in kinds))
        )
        mapping_msgs.append(_bytes(3, body))

    meta = profile.meta
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
    strings = b"".join(_bytes(6, s.encode("utf-8", "replace")) for s in st.table)
    body = (
        sample_types
        + b"".join(sample_msgs)
        + b"".join(mapping_msgs)
        + b"".join(location_msgs)
        + b"".join(function_msgs)
        + strings
        + tail
    )
    # mtime=0 keeps the output byte-identical for identical profiles.
    return gzip.compress(body, compresslevel=6, mtime=0) if compress else body

"""OTLP Profiles: a session as an ExportProfilesServiceRequest (opentelemetry-proto, v1development).

A pure function of `model.Profile`, like the renderings in formats.py (docs/formats.md, "OTLP"):
one ResourceProfiles per session, its resource the host and service, one ScopeProfiles with a
Profile per sample type that has samples (on-CPU samples always), the session's meaning as
the profiles' attributes. Frames become locations, a native frame with the frames inlined
into it one location of several lines (innermost first, as in pprof); each location says its
frame kind. The same bytes parse as a ProfilesData (same fields): what `--format otlp` writes.

Written against opentelemetry-proto 1.45 (proto v1.9 `profiles/v1development`): the
dictionary is shared by the request, each table's entry 0 is the empty value, a Profile has
one sample type, samples point at a stack of locations, leaf first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from .. import wire
from ..compat import zip_strict
from .model import KIND_JIT, KIND_KERNEL, KIND_PYTHON, KIND_USER, KIND_VDSO, Profile, SessionMeta
from .pprof import FrameRow, SampleRow, frame_rows, mapping_name, stack_run
from .protobuf import (
    INT64_MAX,
    SMALL_VARINTS,
    Strings,
    bytes_field,
    clamp,
    double_field,
    fixed64_field,
    key,
    packed,
    uint_field,
    varint,
)

SCOPE_NAME = "bistouri"
CONTENT_TYPE = "application/x-protobuf"

# (type, unit) of each Profile, with the sample value it carries: pprof's sample types, by name.
SAMPLE_TYPES = (
    ("on_cpu", "count", "on_cpu"),
    ("off_cpu", "count", "off_cpu"),
    ("off_cpu_time", "nanoseconds", "off_cpu_ns"),
)

_ON_CPU, _OFF_CPU, _OFF_CPU_NS = 4, 5, 6  # a SampleRow's values
# Each SAMPLE_TYPES entry's column of a SampleRow and (type, unit).
_COLUMNS = tuple(
    ({"on_cpu": _ON_CPU, "off_cpu": _OFF_CPU, "off_cpu_ns": _OFF_CPU_NS}[v], (t, u))
    for t, u, v in SAMPLE_TYPES
)

# The OpenTelemetry semantic conventions' `profile.frame.type`; a JIT frame named by a perf map
# has no value there: "jit". `bistouri.frame.kind` keeps the model's own kind.
_FRAME_TYPE = {
    KIND_KERNEL: "kernel",
    KIND_USER: "native",
    KIND_VDSO: "native",
    KIND_JIT: "jit",
    KIND_PYTHON: "cpython",
}

# Resource attributes: (key, how to read it off the session's metadata). An empty text is left out.
# Unit and container: what the agent read off the target's cgroup (wire `unit`, `container`).
_RESOURCE: tuple[tuple[str, Callable[[SessionMeta], Any]], ...] = (
    ("service.name", lambda m: m.service),
    ("host.name", lambda m: m.host),
    ("bistouri.tenant", lambda m: m.tenant),
    ("systemd.unit", lambda m: m.unit),
    ("container.id", lambda m: m.container_id),
    ("container.runtime", lambda m: m.runtime),
    ("k8s.pod.uid", lambda m: m.pod),
    ("os.kernel.release", lambda m: m.kernel_release),
)


def _session_attributes(m: SessionMeta) -> list[tuple[str, Any, str]]:
    """What the session means, as (key, value, unit): the trigger, its PSI figures, the episode."""
    out: list[tuple[str, Any, str]] = [
        ("bistouri.session.id", m.session_id, ""),
        ("bistouri.cgroup", m.cgroup, ""),
        ("bistouri.trigger.kind", m.trigger_kind, ""),
        ("bistouri.trigger.resource", m.resource, ""),
        ("bistouri.trigger.stall", m.stall, ""),
        ("bistouri.trigger.threshold", m.threshold_us, "us"),
        ("bistouri.trigger.window", m.window_us, "us"),
        ("bistouri.trigger.time_unix_nano", m.trigger_time_ns, "ns"),
        ("bistouri.psi.avg10", m.pressure.avg10, "%"),
        ("bistouri.psi.avg60", m.pressure.avg60, "%"),
        ("bistouri.psi.avg300", m.pressure.avg300, "%"),
        ("bistouri.psi.total", m.pressure.total_us, "us"),
        ("bistouri.pre_trigger", m.pre_trigger_ns, "ns"),
        ("bistouri.episode.victims", len(m.victims), ""),
        ("bistouri.episode.aggressors", len(m.aggressors), ""),
    ]
    if m.victims:
        v = m.victims[0]  # ranked: the one that stalled most
        out += [("bistouri.episode.top_victim.comm", v.get("comm", ""), "")]
        out += [("bistouri.episode.top_victim.stall", v.get("stall_ns", 0), "ns")]
    if m.aggressors:
        out += [("bistouri.episode.top_aggressor.cgroup", m.aggressors[0].get("cgroup", ""), "")]
    out += [(f"bistouri.label.{k}", v, "") for k, v in sorted(m.labels.items())]
    return out


def _any_value(v: Any) -> bytes:
    """An AnyValue: string (1), bool (2), int (3), double (4)."""
    if isinstance(v, bool):
        return uint_field(2, int(v)) if v else b""
    if isinstance(v, int):
        return uint_field(3, clamp(v))
    if isinstance(v, float):
        return double_field(4, v) if v == v else b""  # NaN (stored before ingest refused it): no value
    return bytes_field(1, str(v).encode("utf-8", "replace"))


def _key_value(k: str, v: Any) -> bytes:
    """A common.v1.KeyValue."""
    return bytes_field(1, k.encode()) + bytes_field(2, _any_value(v))


class Request:
    """An ExportProfilesServiceRequest being built: one ResourceProfiles per session added, the
    dictionary shared by all of them (a function, location or stack of one binary is written once per
    request, not once per session). Every table's entry 0 is the empty value.

    Built for the sender's batches: per session, each distinct frame is looked up once (by value:
    frames are interned per session, not across sessions), each sample's stack mapped by index.
    """

    def __init__(self) -> None:
        self.strings = Strings()
        self.attributes: dict[tuple[str, Any, str], int] = {}
        self.attribute_msgs = [b""]
        self.mappings: dict[str, int] = {}
        self.mapping_msgs = [b""]
        self.functions: dict[tuple[str, str], int] = {}
        self.function_msgs = [b""]
        # By a frame's row, or a tuple of rows (inlined ones first): hashed and compared in C (a
        # Frame's hash and comparison run in Python, several times slower).
        self.locations: dict[Any, int] = {}
        self.location_msgs = [b""]
        self.stacks: dict[bytes, int] = {}  # by the packed run of their location indices
        self.stack_msgs = [b""]
        self.kind_attrs: dict[str, bytes] = {}  # a location's attribute_indices field, by frame kind
        # A sample's attribute_indices field, by (pid, tid, thread, before the trigger, executable).
        self.sample_attrs: dict[tuple[int, int, str, bool, str], bytes] = {}
        self.wait_attrs: dict[int, bytes] = {}
        self.resource_profiles: list[bytes] = []
        self.size = 0  # bytes written so far, about (what bounds a request)

    def __len__(self) -> int:
        return len(self.resource_profiles)

    def attribute(self, k: str, v: Any, unit: str = "") -> int:
        key = (k, v, unit)
        i = self.attributes.get(key)
        if i is None:
            i = self.attributes[key] = len(self.attribute_msgs)
            st = self.strings
            body = uint_field(1, st(k)) + bytes_field(2, _any_value(v)) + uint_field(3, st(unit))
            self.attribute_msgs.append(body)
        return i

    def _mapping(self, name: str) -> int:
        i = self.mappings.get(name)
        if i is None:
            i = self.mappings[name] = len(self.mapping_msgs)
            self.mapping_msgs.append(uint_field(4, self.strings(name)))
        return i

    def _function(self, name: str, file: str) -> int:
        key = (name, file)
        i = self.functions.get(key)
        if i is None:
            i = self.functions[key] = len(self.function_msgs)
            st = self.strings
            n = st(name or "[unknown]")
            self.function_msgs.append(uint_field(1, n) + uint_field(2, n) + uint_field(3, st(file)))
        return i

    def _location(self, key: Any, group: Sequence[FrameRow]) -> int:
        """A location of frames (innermost inlined first, the native frame last), known by `key`."""
        i = self.locations.get(key)
        if i is None:
            i = self.locations[key] = len(self.location_msgs)
            outer = group[-1]
            kind = outer[4] or "unknown"
            lines = b"".join(
                bytes_field(3, uint_field(1, self._function(f[0], f[2])) + uint_field(2, max(f[3], 0)))
                for f in group
            )
            attrs = self.kind_attrs.get(kind)
            if attrs is None:
                ids = [
                    self.attribute("profile.frame.type", _FRAME_TYPE.get(kind, kind)),
                    self.attribute("bistouri.frame.kind", kind),
                ]
                attrs = self.kind_attrs[kind] = packed(4, ids)
            body = uint_field(1, self._mapping(mapping_name(outer[4], outer[1]))) + lines + attrs
            self.location_msgs.append(body)
            self.size += len(body)
        return i

    def _stack(self, run: bytes) -> int:
        """A new stack, of the packed run of its location indices (leaf first)."""
        i = self.stacks[run] = len(self.stack_msgs)
        msg = _PACKED_1 + varint(len(run)) + run
        self.stack_msgs.append(msg)
        self.size += len(msg)
        return i

    def add(self, profile: Profile) -> None:
        """The session as one more ResourceProfiles."""
        self.add_rows(profile.meta, *frame_rows(profile))

    def add_rows(self, meta: SessionMeta, frames: Sequence[FrameRow], samples: Sequence[SampleRow]) -> None:
        """The session as one more ResourceProfiles, from its frames and samples as rows: tuples of a
        Frame's and a Sample's fields in order (the store's layout: no objects built to send one)."""
        comm = meta.processes
        location = self._location
        known = self.locations.get
        # Each frame as a location on its own (an inlined one is only part of others'), looked up
        # once per session by its row: a tuple, hashed and compared in C.
        single = [0 if f[5] else known(f) or location(f, (f,)) for f in frames]
        # As a stack's packed run holds them (indices below 16384 from the table, not a call each).
        encoded = list(map(SMALL_VARINTS.__getitem__ if len(self.location_msgs) < 16384 else varint, single))
        has_inlined = any([f[5] for f in frames])
        flags_of = bytes([f[5] for f in frames]).__getitem__  # a frame's inlined flag as a byte
        groups: dict[tuple[int, ...], bytes] = {}  # a group's location index, encoded, by its frames

        def group_location(group: tuple[int, ...]) -> bytes:
            """The location of an inlined frame with its callers (frame indices root first)."""
            loc = groups.get(group)
            if loc is None:
                rows = [frames[j] for j in reversed(group)]  # the innermost first
                loc = groups[group] = varint(location(tuple(rows), rows))
            return loc

        stacks = self.stacks.get
        sample_attrs = self.sample_attrs
        session_attrs: dict[tuple[int, int, str, bool], bytes] = {}  # the same, without the executable
        wait_attr = self._wait_attr
        # One pass: each sample's stack and attributes (its head, shared by the profile of each
        # type), then its message in each profile it has a value for (_COLUMNS' order).
        on_cpu: list[bytes] = []
        off_cpu: list[bytes] = []
        off_cpu_ns: list[bytes] = []
        for s in samples:
            stack = s[0]
            flags = bytes(map(flags_of, stack)) if has_inlined else b""
            first = flags.find(1)
            if first >= 0:
                run = stack_run(stack, flags, first, encoded, group_location)
            else:
                run = b"".join(map(encoded.__getitem__, reversed(stack)))
            stack_id = stacks(run) or self._stack(run)  # or a new one
            skey = (s[1], s[2], s[3], s[7])
            attrs = session_attrs.get(skey)
            if attrs is None:
                akey = (*skey, comm.get(s[1], ""))
                attrs = sample_attrs.get(akey)
                if attrs is None:
                    attrs = sample_attrs[akey] = self._sample_attributes(*akey)
                session_attrs[skey] = attrs
            head = _STACK_INDEX + varint(stack_id) + attrs
            if s[4] > 0:
                v = varint(min(s[4], INT64_MAX))
                body = head + _VALUE_TAG + SMALL_VARINTS[len(v)] + v  # a Sample: its one value packed
                on_cpu.append(_SAMPLE_TAG + varint(len(body)) + body)
            if s[5] > 0 or s[6] > 0:
                # Two packed runs of one field concatenate: the sample's attributes, then its state.
                head += wait_attr(s[8])
                if s[5] > 0:
                    v = varint(min(s[5], INT64_MAX))
                    body = head + _VALUE_TAG + SMALL_VARINTS[len(v)] + v
                    off_cpu.append(_SAMPLE_TAG + varint(len(body)) + body)
                if s[6] > 0:
                    v = varint(min(s[6], INT64_MAX))
                    body = head + _VALUE_TAG + SMALL_VARINTS[len(v)] + v
                    off_cpu_ns.append(_SAMPLE_TAG + varint(len(body)) + body)

        profiles: list[bytes] = []
        tail = self._profile_tail(meta)
        for (_, type_), msgs in zip_strict(_COLUMNS, (on_cpu, off_cpu, off_cpu_ns)):
            if msgs or type_[0] == "on_cpu":  # an off-CPU profile only if it has samples
                profiles.append(bytes_field(2, self._sample_type(type_) + b"".join(msgs) + tail))

        resource = b"".join(
            bytes_field(1, _key_value(k, v)) for k, get in _RESOURCE if (v := get(meta)) not in ("", None)
        )
        rp = bytes_field(1, resource) + bytes_field(2, _SCOPE + b"".join(profiles))
        self.resource_profiles.append(rp)
        self.size += len(rp)

    def _sample_type(self, type_: tuple[str, str]) -> bytes:
        st = self.strings
        return bytes_field(1, uint_field(1, st(type_[0])) + uint_field(2, st(type_[1])))

    def _sample_attributes(self, pid: int, tid: int, thread: str, before: bool, exe: str) -> bytes:
        attrs: list[int] = []
        if pid:
            attrs.append(self.attribute("process.pid", pid))
            if exe:
                attrs.append(self.attribute("process.executable.name", exe))
        if tid:
            attrs.append(self.attribute("thread.id", tid))
        if thread:
            attrs.append(self.attribute("thread.name", thread))
        if before:
            attrs.append(self.attribute("bistouri.pre_trigger", True))
        return packed(2, attrs)

    def _wait_attr(self, wait: int) -> bytes:
        """The off-CPU profiles say which state each wait was in (D, S, ...)."""
        a = self.wait_attrs.get(wait)
        if a is None:
            name = wire.WAIT_NAMES.get(wait)
            a = self.wait_attrs[wait] = packed(2, [self.attribute("thread.state", name)]) if name else b""
        return a

    def _profile_tail(self, meta: SessionMeta) -> bytes:
        """What every Profile of a session ends with: times, period, id, the session's attributes."""
        st = self.strings
        period_type = bytes_field(5, uint_field(1, st("cpu")) + uint_field(2, st("nanoseconds")))
        return (
            fixed64_field(3, meta.start_ns)
            + uint_field(4, clamp(meta.duration_ns))
            + period_type
            + uint_field(6, clamp(meta.period_ns))
            + bytes_field(7, profile_id(meta.session_id))
            + packed(11, [self.attribute(k, v, u) for k, v, u in _session_attributes(meta)])
        )

    def encode(self) -> bytes:
        """The request's bytes (also a ProfilesData's: same fields)."""
        strings = [s.encode("utf-8", "replace") for s in self.strings.table]
        dictionary = (
            b"".join(bytes_field(1, m) for m in self.mapping_msgs)
            + b"".join(bytes_field(2, m) for m in self.location_msgs)
            + b"".join(bytes_field(3, m) for m in self.function_msgs)
            + bytes_field(4, b"")  # link_table[0]: no links
            + b"".join(bytes_field(5, s) for s in strings)
            + b"".join(bytes_field(6, m) for m in self.attribute_msgs)
            + b"".join(bytes_field(7, m) for m in self.stack_msgs)
        )
        return b"".join(bytes_field(1, rp) for rp in self.resource_profiles) + bytes_field(2, dictionary)


_PACKED_1 = key(1, 2)  # a Stack's location_indices
_STACK_INDEX = key(1, 0)  # a Sample's stack_index (never 0: entry 0 is the empty stack)
_SCOPE = bytes_field(1, bytes_field(1, SCOPE_NAME.encode()))  # a ScopeProfiles' scope: its name


_VALUE_TAG = key(4, 2)
_SAMPLE_TAG = key(2, 2)


def profile_id(session_id: str) -> bytes:
    """The 16 bytes naming a session's profiles: the same session always gets the same id."""
    return hashlib.sha256(session_id.encode()).digest()[:16]


def export_request(profile: Profile) -> bytes:
    """The session as a serialized ExportProfilesServiceRequest (and ProfilesData)."""
    req = Request()
    req.add(profile)
    return req.encode()


__all__ = ["CONTENT_TYPE", "SAMPLE_TYPES", "FrameRow", "Request", "SampleRow", "export_request", "profile_id"]

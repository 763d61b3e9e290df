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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import wire
from .formats import locations_of
from .model import KIND_JIT, KIND_KERNEL, KIND_PYTHON, KIND_USER, KIND_VDSO, Frame, Profile, SessionMeta
from .protobuf import Strings, bytes_field, clamp, double_field, fixed64_field, packed, uint_field
from .protobuf import varint as _varint

SCOPE_NAME = "bistouri"
CONTENT_TYPE = "application/x-protobuf"

# (type, unit) of each Profile, with the sample value it carries: pprof's sample types, by name.
SAMPLE_TYPES = (
    ("on_cpu", "count", "on_cpu"),
    ("off_cpu", "count", "off_cpu"),
    ("off_cpu_time", "nanoseconds", "off_cpu_ns"),
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


@dataclass(slots=True)
class _Dictionary:
    """The request's ProfilesDictionary while it is built; every table's entry 0 is empty."""

    strings: Strings
    attributes: dict[tuple[str, Any, str], int]
    attribute_msgs: list[bytes]
    mappings: dict[str, int]
    mapping_msgs: list[bytes]
    functions: dict[tuple[str, str], int]
    function_msgs: list[bytes]
    locations: dict[tuple[int, ...], int]
    location_msgs: list[bytes]
    stacks: dict[tuple[int, ...], int]
    stack_msgs: list[bytes]
    kind_attrs: dict[str, bytes]  # a location's attribute_indices field, by frame kind

    @classmethod
    def new(cls) -> _Dictionary:
        return cls(Strings(), {}, [b""], {}, [b""], {}, [b""], {}, [b""], {}, [b""], {})

    def attribute(self, k: str, v: Any, unit: str = "") -> int:
        key = (k, v, unit)
        i = self.attributes.get(key)
        if i is None:
            i = self.attributes[key] = len(self.attribute_msgs)
            st = self.strings
            body = uint_field(1, st(k)) + bytes_field(2, _any_value(v)) + uint_field(3, st(unit))
            self.attribute_msgs.append(body)
        return i

    def mapping(self, name: str) -> int:
        i = self.mappings.get(name)
        if i is None:
            i = self.mappings[name] = len(self.mapping_msgs)
            self.mapping_msgs.append(uint_field(4, self.strings(name)))
        return i

    def function(self, f: Frame) -> int:
        key = (f.name, f.file)
        i = self.functions.get(key)
        if i is None:
            i = self.functions[key] = len(self.function_msgs)
            st = self.strings
            name = st(f.name or "[unknown]")
            self.function_msgs.append(uint_field(1, name) + uint_field(2, name) + uint_field(3, st(f.file)))
        return i

    def location(self, group: tuple[int, ...], frames: list[Frame]) -> int:
        """A location of frames (innermost inlined first, the native frame last)."""
        i = self.locations.get(group)
        if i is None:
            i = self.locations[group] = len(self.location_msgs)
            outer = frames[group[-1]]
            kind = outer.kind or "unknown"
            lines = b"".join(
                bytes_field(
                    3, uint_field(1, self.function(frames[j])) + uint_field(2, max(frames[j].line, 0))
                )
                for j in group
            )
            attrs = self.kind_attrs.get(kind)
            if attrs is None:
                ids = [
                    self.attribute("profile.frame.type", _FRAME_TYPE.get(kind, kind)),
                    self.attribute("bistouri.frame.kind", kind),
                ]
                attrs = self.kind_attrs[kind] = packed(4, ids)
            body = uint_field(1, self.mapping(_mapping_name(outer))) + lines + attrs
            self.location_msgs.append(body)
        return i

    def stack(self, locations: tuple[int, ...]) -> int:
        i = self.stacks.get(locations)
        if i is None:
            i = self.stacks[locations] = len(self.stack_msgs)
            self.stack_msgs.append(packed(1, locations))
        return i

    def encode(self) -> bytes:
        strings = [s.encode("utf-8", "replace") for s in self.strings.table]
        return (
            b"".join(bytes_field(1, m) for m in self.mapping_msgs)
            + b"".join(bytes_field(2, m) for m in self.location_msgs)
            + b"".join(bytes_field(3, m) for m in self.function_msgs)
            + bytes_field(4, b"")  # link_table[0]: no links
            + b"".join(bytes_field(5, s) for s in strings)
            + b"".join(bytes_field(6, m) for m in self.attribute_msgs)
            + b"".join(bytes_field(7, m) for m in self.stack_msgs)
        )


def _mapping_name(f: Frame) -> str:
    if f.kind == KIND_KERNEL:
        return "[kernel]"
    if f.kind == KIND_VDSO:
        return "[vdso]"
    return f.module or "[unknown]"


def profile_id(session_id: str) -> bytes:
    """The 16 bytes naming a session's profiles: the same session always gets the same id."""
    return hashlib.sha256(session_id.encode()).digest()[:16]


def export_request(profile: Profile) -> bytes:
    """The session as a serialized ExportProfilesServiceRequest (and ProfilesData)."""
    d = _Dictionary.new()
    st = d.strings
    meta = profile.meta
    frames = profile.frames
    comm = meta.processes
    # A sample's stack and attributes, shared by the profiles of each sample type.
    stack_of: list[int] = []
    attrs_of: list[bytes] = []
    has_inlined = any(f.inlined for f in frames)
    single = [0] * len(frames)  # location index of a frame that is a location on its own
    for s in profile.samples:
        if has_inlined:
            locations = tuple(d.location(g, frames) for g in locations_of(s.stack, frames))
        else:
            ids = []
            for i in reversed(s.stack):
                loc = single[i]
                if not loc:
                    loc = single[i] = d.location((i,), frames)
                ids.append(loc)
            locations = tuple(ids)
        stack_of.append(d.stack(locations))
        attrs: list[int] = []
        if s.pid:
            attrs.append(d.attribute("process.pid", s.pid))
            if s.pid in comm:
                attrs.append(d.attribute("process.executable.name", comm[s.pid]))
        if s.tid:
            attrs.append(d.attribute("thread.id", s.tid))
        if s.thread:
            attrs.append(d.attribute("thread.name", s.thread))
        if s.pre_trigger:
            attrs.append(d.attribute("bistouri.pre_trigger", True))
        attrs_of.append(packed(2, attrs))
    # The off-CPU profiles say which state each wait was in (D, S, ...).
    wait_attr = {w: packed(2, [d.attribute("thread.state", n)]) for w, n in wire.WAIT_NAMES.items()}

    session_attrs = packed(11, [d.attribute(k, v, u) for k, v, u in _session_attributes(meta)])
    period_type = bytes_field(5, uint_field(1, st("cpu")) + uint_field(2, st("nanoseconds")))
    head = (
        fixed64_field(3, meta.start_ns)
        + uint_field(4, clamp(meta.duration_ns))
        + period_type
        + uint_field(6, clamp(meta.period_ns))
        + bytes_field(7, profile_id(meta.session_id))
    )
    profiles: list[bytes] = []
    for type_, unit, value in SAMPLE_TYPES:
        samples: list[bytes] = []
        off_cpu = value != "on_cpu"
        for i, s in enumerate(profile.samples):
            v = s.on_cpu if value == "on_cpu" else s.off_cpu if value == "off_cpu" else s.off_cpu_ns
            if v <= 0:
                continue
            attrs_field = attrs_of[i]
            if off_cpu:
                # Two packed runs of one field concatenate: the sample's attributes, then its state.
                attrs_field += wait_attr.get(s.wait, b"")
            samples.append(
                bytes_field(2, uint_field(1, stack_of[i]) + attrs_field + bytes_field(4, _varint(clamp(v))))
            )
        if not samples and value != "on_cpu":
            continue
        sample_type = bytes_field(1, uint_field(1, st(type_)) + uint_field(2, st(unit)))
        profiles.append(bytes_field(2, sample_type + b"".join(samples) + head + session_attrs))

    resource = b"".join(
        bytes_field(1, _key_value(k, v)) for k, get in _RESOURCE if (v := get(meta)) not in ("", None)
    )
    scope = bytes_field(1, bytes_field(1, SCOPE_NAME.encode()))
    resource_profiles = bytes_field(1, resource) + bytes_field(2, scope + b"".join(profiles))
    return bytes_field(1, resource_profiles) + bytes_field(2, d.encode())


__all__ = ["CONTENT_TYPE", "SAMPLE_TYPES", "export_request", "profile_id"]

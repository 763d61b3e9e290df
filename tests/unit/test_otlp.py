"""OTLP Profiles output, decoded by the official opentelemetry-proto classes (not by our code)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from bistouri import wire
from bistouri.compat import zip_strict
from bistouri.pressure import PressureFigures
from bistouri.symbolizer import otlp
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from tests.unit.test_formats import python_profile, sample_profile

pb = pytest.importorskip("opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2")
profiles_pb2 = pytest.importorskip("opentelemetry.proto.profiles.v1development.profiles_pb2")


def decode(data: bytes) -> Any:
    req = pb.ExportProfilesServiceRequest()
    req.ParseFromString(data)
    return req


def value_of(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Decoded:
    """A request read through the dictionary: names instead of indexes."""

    def __init__(self, data: bytes) -> None:
        self.req = decode(data)
        self.d = self.req.dictionary
        self.s = list(self.d.string_table)

    def attrs(self, indices: Any) -> dict[str, Any]:
        out = {}
        for i in indices:
            a = self.d.attribute_table[i]
            out[self.s[a.key_strindex]] = value_of(a.value)
        return out

    def resource(self) -> dict[str, Any]:
        rp = self.req.resource_profiles[0]
        return {kv.key: value_of(kv.value) for kv in rp.resource.attributes}

    def profiles(self) -> dict[str, Any]:
        sp = self.req.resource_profiles[0].scope_profiles[0]
        return {self.s[p.sample_type.type_strindex]: p for p in sp.profiles}

    def frames(self, sample: Any) -> list[tuple[str, str, int, str]]:
        """(name, file, line, kind) leaf first, inlined frames innermost first."""
        out = []
        for li in self.d.stack_table[sample.stack_index].location_indices:
            loc = self.d.location_table[li]
            kind = self.attrs(loc.attribute_indices)["bistouri.frame.kind"]
            for line in loc.lines:
                f = self.d.function_table[line.function_index]
                out.append((self.s[f.name_strindex], self.s[f.filename_strindex], line.line, kind))
        return out


def test_dictionary_tables_start_with_their_empty_entry() -> None:
    d = decode(otlp.export_request(sample_profile())).dictionary
    assert d.string_table[0] == ""
    for table in (d.mapping_table, d.location_table, d.function_table, d.attribute_table, d.stack_table):
        assert table[0].ByteSize() == 0
    assert len(d.link_table) == 1 and d.link_table[0].ByteSize() == 0


def test_known_shares_70_20_10_and_off_cpu_by_state() -> None:
    frames = [Frame("main", "app"), Frame("hot", "app"), Frame("warm", "app"), Frame("cold", "app")]
    frames.append(Frame("io_schedule", "vmlinux", kind="kernel"))
    samples = [
        Sample((0, 1), pid=5, tid=5, on_cpu=70),
        Sample((0, 2), pid=5, tid=6, on_cpu=20),
        Sample((0, 3), pid=5, tid=7, on_cpu=10),
        Sample((0, 4), pid=5, tid=5, off_cpu=3, off_cpu_ns=3_000, wait=wire.WAIT_D),
        Sample((0, 4), pid=5, tid=6, off_cpu=1, off_cpu_ns=1_000, wait=wire.WAIT_S),
    ]
    meta = SessionMeta("s-1", service="api", host="h1", processes={5: "app"}, period_ns=10_000_000)
    meta.start_ns, meta.duration_ns = 1_700_000_000_000_000_000, 5_000_000_000
    dec = Decoded(otlp.export_request(Profile(meta, frames, samples)))
    profiles = dec.profiles()
    on = profiles["on_cpu"]
    assert dec.s[on.sample_type.unit_strindex] == "count"
    leaf_share = Counter()
    for s in on.samples:
        leaf_share[dec.frames(s)[0][0]] += s.values[0]
    assert leaf_share == {"hot": 70, "warm": 20, "cold": 10}
    assert on.time_unix_nano == meta.start_ns and on.duration_nano == meta.duration_ns
    assert on.period == 10_000_000 and dec.s[on.period_type.type_strindex] == "cpu"
    assert on.profile_id == otlp.profile_id("s-1")
    by_state = {
        dec.attrs(s.attribute_indices)["thread.state"]: s.values[0] for s in profiles["off_cpu_time"].samples
    }
    assert by_state == {"D": 3_000, "S": 1_000}
    assert dec.s[profiles["off_cpu_time"].sample_type.unit_strindex] == "nanoseconds"
    assert dec.resource() == {"service.name": "api", "host.name": "h1"}
    assert dec.attrs(on.samples[0].attribute_indices)["process.executable.name"] == "app"


def test_inlined_and_python_frames_with_kinds_and_lines() -> None:
    dec = Decoded(otlp.export_request(sample_profile()))
    on = dec.profiles()["on_cpu"]
    stacks = [dec.frames(s) for s in on.samples]
    # parse_header is inlined into handle_request: one location, innermost line first.
    assert stacks[0][:2] == [("parse_header", "parse.h", 7, "user"), ("handle_request", "app.c", 22, "user")]
    kinds = {f[3] for st in stacks for f in st}
    assert {"kernel", "vdso", "user", "unknown"} <= kinds
    py = Decoded(otlp.export_request(python_profile()))
    first = py.frames(py.profiles()["on_cpu"].samples[0])
    assert first[0] == ("Worker.hot_loop", "w.py", 6, "python")
    loc = py.d.location_table[
        py.d.stack_table[py.profiles()["on_cpu"].samples[0].stack_index].location_indices[0]
    ]
    assert py.attrs(loc.attribute_indices)["profile.frame.type"] == "cpython"


def test_session_meaning_is_in_the_profile_attributes() -> None:
    meta = SessionMeta(
        "s-2",
        service="db",
        host="h2",
        tenant="t",
        labels={"env": "prod"},
        resource="memory",
        stall="full",
        threshold_us=150_000,
        window_us=1_000_000,
        cgroup="/system.slice/db.service",
        unit="db.service",
        container_id="ab" * 32,
        runtime="docker",
        pressure=PressureFigures(avg10=12.5, avg60=3.0, avg300=1.0, total_us=99),
        pre_trigger_ns=2_000_000_000,
        victims=[{"comm": "db", "stall_ns": 7}],
        aggressors=[{"cgroup": "/batch"}],
    )
    dec = Decoded(otlp.export_request(Profile(meta, [Frame("f")], [Sample((0,), on_cpu=1)])))
    on = dec.profiles()["on_cpu"]
    attrs = dec.attrs(on.attribute_indices)
    assert attrs["bistouri.trigger.resource"] == "memory" and attrs["bistouri.trigger.stall"] == "full"
    assert attrs["bistouri.trigger.threshold"] == 150_000 and attrs["bistouri.psi.avg10"] == 12.5
    assert attrs["bistouri.cgroup"] == "/system.slice/db.service"
    assert attrs["bistouri.pre_trigger"] == 2_000_000_000
    assert attrs["bistouri.episode.top_victim.comm"] == "db"
    assert attrs["bistouri.episode.top_aggressor.cgroup"] == "/batch"
    assert attrs["bistouri.label.env"] == "prod"
    assert set(dec.profiles()) == {"on_cpu"}  # no off-CPU samples: no off-CPU profiles
    resource = dec.resource()
    assert resource["bistouri.tenant"] == "t" and resource["systemd.unit"] == "db.service"
    assert (resource["container.id"], resource["container.runtime"]) == ("ab" * 32, "docker")
    assert "k8s.pod.uid" not in resource  # empty: left out


def test_the_same_bytes_are_a_profiles_data() -> None:
    data = otlp.export_request(sample_profile())
    pd = profiles_pb2.ProfilesData()
    pd.ParseFromString(data)
    assert len(pd.resource_profiles) == 1 and pd.dictionary.string_table[0] == ""
    assert otlp.export_request(sample_profile()) == data  # deterministic


def _session_view(dec: Decoded, rp: Any) -> dict[str, Any]:
    """What one ResourceProfiles says, read through the request's dictionary: no index left."""
    out: dict[str, Any] = {"resource": {kv.key: value_of(kv.value) for kv in rp.resource.attributes}}
    for p in rp.scope_profiles[0].profiles:
        samples = sorted(
            (tuple(dec.frames(s)), tuple(sorted(dec.attrs(s.attribute_indices).items())), tuple(s.values))
            for s in p.samples
        )
        out[dec.s[p.sample_type.type_strindex]] = (samples, sorted(dec.attrs(p.attribute_indices).items()))
    return out


def test_sessions_batched_in_one_request_read_as_each_alone() -> None:
    """A request of several sessions shares one dictionary; each ResourceProfiles says what the
    session's own request says, whatever came before it."""
    shares = Profile(
        SessionMeta("s-3", service="api", processes={5: "app"}),
        [Frame("main", "app"), Frame("hot", "app"), Frame("parse_header", "app", "parse.h", 7, inlined=True)],
        [Sample((0, 1), pid=5, on_cpu=70), Sample((0, 1, 2), pid=5, tid=6, off_cpu=2, off_cpu_ns=9)],
    )
    profiles = [sample_profile(), python_profile(), shares, sample_profile()]
    req = otlp.Request()
    for p in profiles:
        req.add(p)
    assert len(req) == 4
    batch = Decoded(req.encode())
    assert len(batch.req.resource_profiles) == 4
    for p, rp in zip_strict(profiles, batch.req.resource_profiles):
        alone = Decoded(otlp.export_request(p))
        assert _session_view(batch, rp) == _session_view(alone, alone.req.resource_profiles[0])
    # Shared: the two copies of sample_profile add nothing to the dictionary.
    again = otlp.Request()
    for p in profiles[:3]:
        again.add(p)
    assert len(Decoded(again.encode()).d.location_table) == len(batch.d.location_table)


def test_rows_as_stored_encode_as_the_profile_does() -> None:
    """The sender encodes the store's rows (Request.add_rows): the same bytes as from the objects."""
    from bistouri.symbolizer.service.store import profile_rows, profile_to_blob

    for p in (sample_profile(), python_profile()):
        by_rows = otlp.Request()
        by_rows.add_rows(p.meta, *profile_rows(profile_to_blob(p)))
        assert by_rows.encode() == otlp.export_request(p)


def test_stacks_with_inlined_frames_read_as_their_frames_each_location_once() -> None:
    """Stacks of service-shaped sessions (inlined frames, one at a stack's root, recursion) read back
    leaf first as pprof.locations_of groups them; a frame that is a location on its own is the same
    location whether or not its stack has inlined frames (one entry in the table, not two)."""
    from bistouri.symbolizer.pprof import locations_of
    from tests.unit.test_pprof_reference import real_shaped

    profiles = real_shaped(6, seed=4)
    req = otlp.Request()
    for p in profiles:
        req.add(p)
    dec = Decoded(req.encode())
    for p, rp in zip_strict(profiles, dec.req.resource_profiles):
        inlined = [f.inlined for f in p.frames]

        def frames(stack: tuple[int, ...], p: Profile = p, inlined: list[bool] = inlined) -> tuple[Any, ...]:
            """(name, file, line, kind) leaf first; a location's kind is its outer frame's."""
            out = []
            for g in locations_of(stack, inlined):
                kind = p.frames[g[-1]].kind
                out += [
                    (p.frames[i].name or "[unknown]", p.frames[i].file, p.frames[i].line, kind) for i in g
                ]
            return tuple(out)

        want = Counter(frames(s.stack) for s in p.samples if s.on_cpu > 0)
        (on_cpu,) = [
            q for q in rp.scope_profiles[0].profiles if dec.s[q.sample_type.type_strindex] == "on_cpu"
        ]
        assert Counter(tuple(dec.frames(s)) for s in on_cpu.samples) == want
    d = dec.d
    locations = [
        (loc.mapping_index, tuple((ln.function_index, ln.line) for ln in loc.lines))
        for loc in d.location_table
    ]
    assert len(set(locations)) == len(locations)

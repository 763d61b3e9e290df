"""Forwarding (exports.py) with the real service: sessions posted as the agent does reach real HTTP
endpoints started here, as OTLP Profiles (decoded by opentelemetry-proto's classes) and as Pyroscope
pprof (decoded by pprof's own profile.proto), each exactly once, through outages, restarts, slow
endpoints and two instances on one PostgreSQL.
"""

from __future__ import annotations

import gzip
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from bistouri import wire
from bistouri.compat import zip_strict
from testkit.pg import PgServer
from testkit.sink import Received, Sink
from testkit.symbolizer import SymbolizerURL, metric_value, stop
from tests.integration.conftest import DemoBinary, post_sessions, put_kernel
from tests.pprof_proto import compile_profile_proto

pb = pytest.importorskip("opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2")

OTLP_PATH = "/v1development/profiles"


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def shares_session(sid: str, binary: DemoBinary, start_ns: int = 1_763_000_000 * 10**9) -> Any:
    """A session whose on-CPU samples end in leaf_work, middle_step and main: 70, 20 and 10."""

    def user(*names: str) -> tuple[Any, ...]:
        return tuple(wire.UserFrame(wire.FRAME_RESOLVED, binary.build_id, binary.offsets[n]) for n in names)

    traces = [
        wire.Trace((), user("leaf_work", "middle_step", "main"), 100, 100, on_cpu=70),
        wire.Trace((), user("middle_step", "main"), 100, 101, on_cpu=20),
        wire.Trace((), user("main"), 100, 101, on_cpu=10),
        wire.Trace((), user("main"), 100, 101, off_cpu=3, off_cpu_ns=9_000_000, wait=wire.WAIT_S),
    ]
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger("cpu", "some", 100_000, 2_000_000, "/test.slice", start_ns - 10**6),
        kernel=wire.KernelInfo("6.18.0-test", b"", 0),
        start_ns=start_ns,
        duration_ns=10 * 10**9,
        period_ns=10_000_000,
        service="checkout",
        host="host-1",
        labels={"zone": "z1"},
        processes={100: "bistouri-demo"},
        threads={100: "bistouri-demo", 101: "worker"},
        traces=traces,
    )


def otlp_session_ids(r: Received) -> list[str]:
    req = pb.ExportProfilesServiceRequest()
    req.ParseFromString(r.body)
    d = req.dictionary
    out = []
    for rp in req.resource_profiles:
        p = rp.scope_profiles[0].profiles[0]
        attrs = {
            d.string_table[d.attribute_table[i].key_strindex]: d.attribute_table[i].value
            for i in p.attribute_indices
        }
        out.append(attrs["bistouri.session.id"].string_value)
    return out


def received_ids(sink: Sink) -> Counter[str]:
    return Counter(sid for r in sink.accepted(OTLP_PATH) for sid in otlp_session_ids(r))


def start_exporting(
    symbolizer_server: Callable[..., SymbolizerURL],
    tmp_path: Path,
    sink: Sink,
    binary: DemoBinary,
    **flags: Any,
) -> SymbolizerURL:
    flags.setdefault("otlp_endpoint", sink.url + OTLP_PATH)
    return symbolizer_server(tmp_path, binary_dir=binary.dir, **flags)


def test_a_session_reaches_otlp_and_pyroscope_with_its_exact_shares(
    symbolizer_server: Callable[..., SymbolizerURL],
    tmp_path: Path,
    sink: Sink,
    demo_binary: DemoBinary,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    headers = tmp_path / "otlp-headers"
    headers.write_text("# the collector's token\nAuthorization: Bearer otlp-secret\n")
    url = start_exporting(
        symbolizer_server,
        tmp_path,
        sink,
        demo_binary,
        otlp_headers_file=headers,
        pyroscope_url=sink.url + "/pyro",
        pyroscope_tenant="team-a",
    )
    assert post_sessions(url, [shares_session("shares-1", demo_binary)]).status_code == 200
    sink.wait_for(
        lambda s: len(s.accepted(OTLP_PATH)) == 1 and len(s.accepted("/pyro")) == 1, 30, "both sends"
    )

    # OTLP, read with the official classes.
    otlp_req = sink.accepted(OTLP_PATH)[0]
    assert otlp_req.headers["Authorization"] == "Bearer otlp-secret"
    assert otlp_req.headers["Content-Type"] == "application/x-protobuf"
    req = pb.ExportProfilesServiceRequest()
    req.ParseFromString(otlp_req.body)
    d, s = req.dictionary, list(req.dictionary.string_table)
    rp = req.resource_profiles[0]
    resource = {kv.key: kv.value.string_value for kv in rp.resource.attributes}
    assert resource["service.name"] == "checkout" and resource["host.name"] == "host-1"
    profiles = {s[p.sample_type.type_strindex]: p for p in rp.scope_profiles[0].profiles}
    leaf = Counter()
    for smp in profiles["on_cpu"].samples:
        first = d.location_table[d.stack_table[smp.stack_index].location_indices[0]]
        name = s[d.function_table[first.lines[0].function_index].name_strindex]
        leaf[name] += smp.values[0]
    total = sum(leaf.values())
    assert {k: v / total for k, v in leaf.items()} == {"leaf_work": 0.7, "middle_step": 0.2, "main": 0.1}
    off = profiles["off_cpu_time"].samples
    assert len(off) == 1 and off[0].values[0] == 9_000_000
    state = [d.attribute_table[i] for i in off[0].attribute_indices]
    assert any(s[a.key_strindex] == "thread.state" and a.value.string_value == "S" for a in state)

    # Pyroscope: pprof, read with pprof's own profile.proto, pushed with its name and labels.
    pyro = sink.accepted("/pyro")[0]
    assert pyro.path == "/pyro/ingest" and pyro.query["format"] == "pprof"
    assert pyro.headers["X-Scope-OrgID"] == "team-a"
    name = pyro.query["name"]
    assert name.startswith("checkout{") and "host=host-1" in name and "zone=z1" in name
    assert "session_id=shares-1" in name
    assert int(pyro.query["until"]) - int(pyro.query["from"]) == 10
    profile_pb2 = compile_profile_proto(tmp_path_factory.mktemp("pprof"))
    prof = profile_pb2.Profile()
    prof.ParseFromString(gzip.decompress(pyro.body))
    st = list(prof.string_table)
    fn = {f.id: st[f.name] for f in prof.function}
    loc = {lc.id: fn[lc.line[0].function_id] for lc in prof.location}
    pleaf = Counter()
    for smp in prof.sample:
        pleaf[loc[smp.location_id[0]]] += smp.value[0]
    assert pleaf == {"leaf_work": 70, "middle_step": 20, "main": 10}

    metrics = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "bistouri_symbolizer_exports_sent_total", {"exporter": "otlp"}) == 1
    assert metric_value(metrics, "bistouri_symbolizer_exports_sent_total", {"exporter": "pyroscope"}) == 1
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_sessions") == 0


def test_an_outage_and_a_restart_lose_nothing_and_double_nothing(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path, sink: Sink, demo_binary: DemoBinary
) -> None:
    sink.status = 503  # down
    state_dir = tmp_path / "state"
    url = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, state_dir=state_dir)
    ids = [f"down-{i:02}" for i in range(12)]
    for i in range(0, 6, 3):
        assert post_sessions(url, [shares_session(x, demo_binary) for x in ids[i : i + 3]]).status_code == 200
    sink.wait_for(lambda s: len(s.received) >= 2, 20, "failed sends during the outage")
    metrics = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "bistouri_symbolizer_exports_failed_total", {"reason": "status_5xx"}) >= 1
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_sessions") == 6
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_oldest_seconds") > 0
    # A restart while the endpoint is still down: the queue is in the database.
    stop(url)
    url = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, state_dir=state_dir)
    for i in range(6, 12, 3):
        assert post_sessions(url, [shares_session(x, demo_binary) for x in ids[i : i + 3]]).status_code == 200
    time.sleep(1.0)
    sink.status = 200  # back
    sink.wait_for(lambda s: set(received_ids(s)) == set(ids), 120, "every session after the outage")
    time.sleep(2.0)  # anything sent twice would come now
    counts = received_ids(sink)
    assert counts == Counter({x: 1 for x in ids})
    metrics = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_sessions") == 0


def test_pyroscope_push_batches_through_an_outage_each_session_once_with_its_shares(
    symbolizer_server: Callable[..., SymbolizerURL],
    tmp_path: Path,
    sink: Sink,
    demo_binary: DemoBinary,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--pyroscope-api push`: sessions queued while Pyroscope is down leave in batches once it is
    back, each exactly once, each its own series with its pprof (pprof's profile.proto: 70/20/10)."""
    from tests.pprof_proto import compile_push_proto

    push_pb2 = compile_push_proto(tmp_path_factory.mktemp("push"))
    profile_pb2 = compile_profile_proto(tmp_path_factory.mktemp("pprof"))
    sink.status = 503
    flags = {"pyroscope_url": sink.url + "/pyro", "pyroscope_api": "push", "otlp_endpoint": []}
    state_dir = tmp_path / "state"
    url = symbolizer_server(tmp_path, binary_dir=demo_binary.dir, state_dir=state_dir, **flags)
    ids = [f"push-{i:02}" for i in range(9)]
    assert post_sessions(url, [shares_session(x, demo_binary) for x in ids[:6]]).status_code == 200
    sink.wait_for(lambda s: len(s.received) >= 1, 20, "a failed push during the outage")
    stop(url)  # a restart while down: the queue is in the database
    url = symbolizer_server(tmp_path, binary_dir=demo_binary.dir, state_dir=state_dir, **flags)
    assert post_sessions(url, [shares_session(x, demo_binary) for x in ids[6:]]).status_code == 200
    sink.status = 200

    sink.wait_for(
        lambda s: sum(map(len, pushed_series(s, push_pb2))) >= len(ids), 120, "every session after the outage"
    )
    time.sleep(2.0)  # anything sent twice would come now
    requests_series = pushed_series(sink, push_pb2)
    assert max(map(len, requests_series)) > 1  # batched
    series = [x for batch in requests_series for x in batch]
    labels = [{p.name: p.value for p in x.labels} for x in series]
    assert Counter(la["session_id"] for la in labels) == Counter({x: 1 for x in ids})
    for la, x in zip_strict(labels, series):
        assert la["service_name"] == "checkout" and la["__name__"] == "process_cpu" and la["zone"] == "z1"
        prof = profile_pb2.Profile()
        prof.ParseFromString(gzip.decompress(x.samples[0].raw_profile))
        st = list(prof.string_table)
        fn = {f.id: st[f.name] for f in prof.function}
        loc = {lc.id: fn[lc.line[0].function_id] for lc in prof.location}
        leaf: Counter[str] = Counter()
        for smp in prof.sample:
            leaf[loc[smp.location_id[0]]] += smp.value[0]
        assert leaf == {"leaf_work": 70, "middle_step": 20, "main": 10}
    metrics = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_sessions") == 0


def pushed_series(sink: Sink, push_pb2: Any) -> list[list[Any]]:
    """The series of each push request accepted, in order."""
    out = []
    for r in sink.accepted("/pyro/push.v1.PusherService/Push"):
        req = push_pb2.PushRequest()
        req.ParseFromString(r.body)
        out.append(list(req.series))
    return out


def test_a_slow_endpoint_does_not_slow_ingest(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path, sink: Sink, demo_binary: DemoBinary
) -> None:
    sink.delay_s = 8.0  # every send takes 8 s
    url = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, workers=1)
    assert post_sessions(url, [shares_session("warm-up", demo_binary)]).status_code == 200
    took = []
    for i in range(8):
        t0 = time.monotonic()
        assert post_sessions(url, [shares_session(f"slow-{i}", demo_binary)]).status_code == 200
        took.append(time.monotonic() - t0)
    assert max(took) < 2.0, took  # ingest answers while the sender waits on the endpoint
    assert len(sink.received) <= 1 + 8  # and nothing was sent more than once meanwhile
    sink.delay_s = 0.0
    sink.wait_for(lambda s: len(received_ids(s)) == 9, 120, "the slow endpoint to get every session")


@pytest.fixture
def fresh_db(postgres: PgServer) -> str:
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE IF EXISTS sessions, kernels, pending_builds, upload_files, upload_parts, "
            "export_queue, schema_version"
        )
    return postgres.url


def test_two_instances_on_one_postgresql_never_send_a_session_twice(
    symbolizer_server: Callable[..., SymbolizerURL],
    tmp_path: Path,
    sink: Sink,
    demo_binary: DemoBinary,
    fresh_db: str,
) -> None:
    sink.delay_s = 0.02  # sends overlap: each instance's two senders claim while others send
    a = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, db=fresh_db)
    b = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, db=fresh_db)
    ids = [f"pg-{i:03}" for i in range(60)]
    for i in range(0, len(ids), 5):
        target = a if i % 10 else b
        assert (
            post_sessions(target, [shares_session(x, demo_binary) for x in ids[i : i + 5]]).status_code == 200
        )
    sink.wait_for(lambda s: set(received_ids(s)) == set(ids), 120, "every session from the two instances")
    time.sleep(2.0)
    assert received_ids(sink) == Counter({x: 1 for x in ids})
    sent = sum(
        metric_value(requests.get(u + "/metrics", timeout=10).text, "bistouri_symbolizer_exports_sent_total")
        for u in (a, b)
    )
    assert sent == len(ids)


def test_a_session_with_kernel_frames_goes_out_at_once_when_its_kernel_is_known(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path, sink: Sink, demo_binary: DemoBinary
) -> None:
    """Only a session missing symbols waits (PENDING_DELAY_S) before it is sent."""
    url = start_exporting(symbolizer_server, tmp_path, sink, demo_binary)
    assert put_kernel(url).status_code in (200, 201, 204)
    from tests.integration.conftest import make_session

    assert post_sessions(url, [make_session("k-1", demo_binary)]).status_code == 200
    sink.wait_for(lambda s: received_ids(s) == Counter({"k-1": 1}), 20, "the session with kernel frames")


def test_rows_of_an_endpoint_no_longer_configured_are_dropped_at_start_up(
    symbolizer_server: Callable[..., SymbolizerURL], tmp_path: Path, sink: Sink, demo_binary: DemoBinary
) -> None:
    sink.status = 503  # down: the sessions stay queued
    state_dir = tmp_path / "state"
    url = start_exporting(symbolizer_server, tmp_path, sink, demo_binary, state_dir=state_dir)
    ids = ["gone-1", "gone-2"]
    assert post_sessions(url, [shares_session(x, demo_binary) for x in ids]).status_code == 200
    stop(url)
    # The OTLP endpoint removed, Pyroscope added: the old rows go at start-up, counted; new sessions go out.
    sink.status = 200
    url = symbolizer_server(
        tmp_path, binary_dir=demo_binary.dir, state_dir=state_dir, pyroscope_url=sink.url + "/pyro"
    )
    metrics = requests.get(url + "/metrics", timeout=10).text
    dropped = {"exporter": "otlp", "reason": "endpoint_removed"}
    assert metric_value(metrics, "bistouri_symbolizer_exports_dropped_total", dropped) == 2
    assert metric_value(metrics, "bistouri_symbolizer_export_queue_sessions") == 0
    assert post_sessions(url, [shares_session("new-1", demo_binary)]).status_code == 200
    sink.wait_for(lambda s: len(s.accepted("/pyro")) == 1, 30, "the new session at Pyroscope")
    assert not sink.accepted(OTLP_PATH)

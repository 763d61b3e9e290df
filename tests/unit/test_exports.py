"""The export queue on SQLite (claims, leases, bounds) and the sender's handling of answers."""

from __future__ import annotations

import gzip
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from bistouri.symbolizer import formats
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from bistouri.symbolizer.service import exports
from bistouri.symbolizer.service.exports import OTLP, PYROSCOPE, Endpoint, ExportConfig, Exporter
from bistouri.symbolizer.service.metrics import Metrics
from bistouri.symbolizer.service.store import Store, StoredSession
from testkit.sink import Sink

EP = "otlp http://collector/v1development/profiles"


def record(sid: str, service: str = "api") -> StoredSession:
    meta = SessionMeta(
        sid, service=service, host="h", processes={1: "app"}, start_ns=10**18, duration_ns=10**9
    )
    profile = Profile(meta, [Frame("main", "app")], [Sample((0,), pid=1, on_cpu=3)])
    return StoredSession(meta, profile, raw=b"r" * 50)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(str(tmp_path / "db"))
    s.migrate()
    return s


def test_a_session_is_queued_once_per_endpoint_in_the_transaction_that_stores_it(store: Store) -> None:
    assert store.insert(record("a"), export_to=(EP, "pyroscope http://p")) > 0
    assert store.insert(record("a"), export_to=(EP,)) == 0  # a duplicate queues nothing
    backlog = store.export_backlog()
    assert {k: b.rows for k, b in backlog.items()} == {EP: 1, "pyroscope http://p": 1}
    assert backlog[EP].bytes > 0


def test_claims_never_overlap_and_leases_expire(store: Store) -> None:
    for sid in ("a", "b", "c"):
        store.insert(record(sid), export_to=(EP,))
    a = store.claim_exports(EP, "A", 60 * 10**9, 2)
    b = store.claim_exports(EP, "B", 60 * 10**9, 5)
    assert [c.session_id for c in a] == ["a", "b"] and [c.session_id for c in b] == ["c"]
    assert store.claim_exports(EP, "C", 60 * 10**9, 5) == []
    assert not store.finish_export("a", EP, "B")  # not B's claim
    assert store.finish_export("a", EP, "A")
    # Given back with a backoff: not due yet; then due, its attempt counted.
    store.retry_export("b", EP, "A", time.time_ns() + 60 * 10**9, failed=True)
    assert store.claim_exports(EP, "C", 60 * 10**9, 5) == []
    store.retry_export("c", EP, "B", 0, failed=False)
    assert [c.session_id for c in store.claim_exports(EP, "C", 1, 5)] == ["c"]
    time.sleep(0.01)  # C's lease (1 ns) is over: another takes the row
    again = store.claim_exports(EP, "D", 60 * 10**9, 5)
    assert [(c.session_id, c.attempts) for c in again] == [("c", 0)]


def test_bounds_drop_the_oldest_and_count_them(store: Store) -> None:
    for i in range(5):
        store.insert(record(f"s{i}"), export_to=(EP,))
    dropped = store.drop_exports(max_rows=3, max_bytes=1 << 30, max_age_ns=10**12)
    assert dropped == {f"{EP}\nqueue_full": 2}
    assert sorted(c.session_id for c in store.claim_exports(EP, "A", 10**9, 10)) == ["s2", "s3", "s4"]
    size = store.export_backlog()[EP].bytes // 3
    assert store.drop_exports(max_rows=10, max_bytes=size * 2, max_age_ns=10**12) == {f"{EP}\nqueue_full": 1}
    time.sleep(0.01)
    assert store.drop_exports(max_rows=10, max_bytes=1 << 30, max_age_ns=1) == {f"{EP}\nexpired": 2}
    assert store.export_backlog() == {}


def test_headers_file(tmp_path: Path) -> None:
    f = tmp_path / "h"
    f.write_text("# token\nAuthorization: Bearer abc:def\n\nX-Scope-OrgID: t1\n")
    assert exports.read_headers(str(f)) == {"Authorization": "Bearer abc:def", "X-Scope-OrgID": "t1"}
    f.write_text("no colon here\n")
    with pytest.raises(ValueError, match=":1: not a 'Name: value'"):
        exports.read_headers(str(f))


def test_pyroscope_name_and_labels_stay_parsable() -> None:
    p = record("s{1}", service="my app").profile
    p.meta.cgroup = "/system.slice/db.service"
    p.meta.labels = {"env": "prod,eu", "team-x": "a=b"}
    p.meta.unit, p.meta.container_id, p.meta.runtime = "db.service", "cd" * 32, "podman"
    q = dict(kv.split("=", 1) for kv in exports.pyroscope_query(p).split("&"))
    name = unquote(q["name"])
    assert name.startswith("my_app{") and name.endswith("}")
    labels = dict(kv.split("=", 1) for kv in name[len("my_app{") : -1].split(","))
    assert labels["cgroup"] == "/system.slice/db.service" and labels["env"] == "prod_eu"
    assert labels["team_x"] == "a_b" and labels["session_id"] == "s_1_"
    assert (labels["systemd_unit"], labels["container_id"], labels["container_runtime"]) == (
        "db.service",
        "cd" * 32,
        "podman",
    )
    assert q["from"] == str(10**9) and q["until"] == str(10**9 + 1) and q["format"] == "pprof"


def test_backoff_doubles_to_its_cap() -> None:
    assert 0.8 <= exports.backoff_s(1) <= 1.2
    assert 6.4 <= exports.backoff_s(4) <= 9.6
    assert exports.backoff_s(50) <= exports.MAX_BACKOFF_S * 1.2


def test_the_sender_sends_retries_and_drops_by_the_answer(store: Store) -> None:
    with Sink() as sink:
        otlp_ep = Endpoint(OTLP, sink.url + "/v1development/profiles", {"Authorization": "Bearer t"})
        pyro_ep = Endpoint(PYROSCOPE, sink.url + "/pyro")
        config = ExportConfig((otlp_ep, pyro_ep))
        metrics = Metrics(lambda: store)
        sender = Exporter(store, config, metrics)
        store.insert(record("ok"), export_to=config.keys)
        sink.status = 429
        sender.run_once()
        # 429 without Retry-After: both endpoints paused, the rows kept with an attempt counted.
        assert metrics.exports_failed.labels(OTLP, "status_429")._value.get() == 1
        assert {k: b.rows for k, b in store.export_backlog().items()} == {k: 1 for k in config.keys}
        assert not sender.run_once()  # paused: nothing claimed
        sink.status = 200
        sender._disabled_until = dict.fromkeys(sender._disabled_until, 0.0)
        store._exec("UPDATE export_queue SET next_ns = 0")
        assert sender.run_once()
        assert store.export_backlog() == {}
        assert metrics.exports_sent.labels(OTLP)._value.get() == 1
        got = {r.path: r for r in sink.accepted()}
        assert got["/v1development/profiles"].headers["Authorization"] == "Bearer t"
        assert gzip.decompress(got["/pyro/ingest"].body)  # pprof, gzip'd
        # A refusal a retry cannot change: dropped and counted.
        sink.status = 400
        store.insert(record("bad"), export_to=(otlp_ep.key,))
        sender.run_once()
        assert store.export_backlog() == {}
        assert metrics.exports_dropped.labels(OTLP, "refused")._value.get() == 1
        # Deleted by retention before it was sent.
        store.insert(record("gone"), export_to=(otlp_ep.key,))
        store._exec("DELETE FROM sessions WHERE id = 'gone'")
        sender.run_once()
        assert metrics.exports_dropped.labels(OTLP, "session_gone")._value.get() == 1
        sender.close()


def test_an_endpoint_that_never_ends_its_answer_does_not_hold_the_sender(store: Store) -> None:
    """Only the status is read: a body that trickles forever (a gigabyte declared, a byte every
    half second) must not keep the sender, whose read timeout restarts with every byte."""
    with Sink() as sink:
        sink.endless_body = True
        config = ExportConfig((Endpoint(OTLP, sink.url + "/v1development/profiles"),))
        metrics = Metrics(lambda: store)
        sender = Exporter(store, config, metrics)
        store.insert(record("s"), export_to=config.keys)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (sender.run_once(), done.set()), daemon=True)
        worker.start()
        # A sender reading the body would never return while the sink lives: its answer never ends.
        assert done.wait(60), "the sender is still reading the endless answer"
        assert metrics.exports_sent.labels(OTLP)._value.get() == 1
        assert store.export_backlog() == {}
        sender.close()


def test_a_session_missing_symbols_is_due_later(store: Store) -> None:
    store.insert(record("pending"), export_to=(EP,), export_after_ns=60 * 10**9)
    store.insert(record("named"), export_to=(EP,))
    assert [c.session_id for c in store.claim_exports(EP, "A", 10**9, 10)] == ["named"]
    assert store.export_backlog()[EP].rows == 2


def _otlp_ids(body: bytes) -> list[str]:
    pb = pytest.importorskip("opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2")
    req = pb.ExportProfilesServiceRequest()
    req.ParseFromString(gzip.decompress(body))
    d = req.dictionary
    ids = []
    for rp in req.resource_profiles:
        for i in rp.scope_profiles[0].profiles[0].attribute_indices:
            a = d.attribute_table[i]
            if d.string_table[a.key_strindex] == "bistouri.session.id":
                ids.append(a.value.string_value)
    return ids


def test_otlp_sessions_go_in_one_request_and_a_refused_one_alone(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued sessions leave in one request (BATCH at most); a request refused is sent again a
    session a request, so only the session refused is dropped."""
    monkeypatch.setattr(exports, "BATCH", 4)
    config = ExportConfig((Endpoint(OTLP, "http://collector/v1development/profiles"),))
    metrics = Metrics(lambda: store)
    sender = Exporter(store, config, metrics)
    requests_seen: list[list[str]] = []

    def post(ep: Endpoint, body: bytes, query: str) -> None:
        ids = _otlp_ids(body)
        requests_seen.append(ids)
        if "bad" in ids:
            raise exports._Refused("status_400")

    monkeypatch.setattr(sender, "_post", post)
    for sid in ("a", "b", "c", "d", "e"):
        store.insert(record(sid), export_to=config.keys)
    assert sender.run_once() and sender.run_once()
    assert sorted(map(sorted, requests_seen)) == [["a", "b", "c", "d"], ["e"]]
    assert metrics.exports_sent.labels(OTLP)._value.get() == 5

    requests_seen.clear()
    for sid in ("f", "bad", "g"):
        store.insert(record(sid), export_to=config.keys)
    sender.run_once()
    assert sorted(requests_seen[0]) == ["bad", "f", "g"]
    assert sorted(ids[0] for ids in requests_seen[1:]) == ["bad", "f", "g"]  # then each alone
    assert store.export_backlog() == {}
    assert metrics.exports_sent.labels(OTLP)._value.get() == 7
    assert metrics.exports_dropped.labels(OTLP, "refused")._value.get() == 1
    sender.close()


def test_rows_of_an_endpoint_no_longer_configured_are_dropped_at_start_up(store: Store) -> None:
    kept = Endpoint(OTLP, "http://collector/v1development/profiles")
    store.insert(record("s"), export_to=(kept.key, "pyroscope http://old", "otlp http://older"))
    metrics = Metrics(lambda: store)
    sender = Exporter(store, ExportConfig((kept,)), metrics)
    sender.forget_removed_endpoints()
    assert set(store.export_backlog()) == {kept.key}
    assert metrics.exports_dropped.labels(PYROSCOPE, "endpoint_removed")._value.get() == 1
    assert metrics.exports_dropped.labels(OTLP, "endpoint_removed")._value.get() == 1
    # No endpoint left: the queue empties (no sender runs to bound it).
    Exporter(store, ExportConfig(), metrics).forget_removed_endpoints()
    assert store.export_backlog() == {}
    sender.close()


def test_the_prepared_request_is_the_post_it_replaced(store: Store) -> None:
    """Each endpoint's request is prepared once (exports.Exporter._prepare): the same path, query,
    headers and body as requests' own post of them, each request its own copy."""
    with Sink() as sink:
        pyro_ep = Endpoint(PYROSCOPE, sink.url + "/pyro/", {"X-Scope-OrgID": "t1"})
        config = ExportConfig((pyro_ep,))
        sender = Exporter(store, config, Metrics(lambda: store))
        for sid in ("a", "b"):
            store.insert(record(sid, service=f"svc-{sid}"), export_to=config.keys)
        while sender.run_once():
            pass
        got = sink.accepted("/pyro/ingest")
        assert sorted(r.query["name"].split("{")[0] for r in got) == ["svc-a", "svc-b"]
        for r in got:
            assert r.headers["X-Scope-OrgID"] == "t1"
            assert r.headers["Content-Type"] == "application/octet-stream"
            assert int(r.headers["Content-Length"]) > 0 and gzip.decompress(r.body)
        # Each request its own body and query: the prepared one copied, never changed.
        assert len({r.body for r in got}) == 2 and len({r.query["name"] for r in got}) == 2
        assert sender._prepared[pyro_ep.key].body is None
        sender.close()


def test_pyroscope_push_sends_a_batch_as_ingest_would_each(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--pyroscope-api push`: queued sessions leave up to BATCH a request, one series a session with
    the labels /ingest would give it and its pprof as /ingest takes it, decoded with Pyroscope's push
    messages and pprof's profile.proto (protoc-generated, not our encoder); each session once."""
    from tests.pprof_proto import compile_profile_proto, compile_push_proto
    from tests.unit.test_pprof_reference import resolved

    push_pb2, pprof_pb2 = compile_push_proto(tmp_path), compile_profile_proto(tmp_path)
    monkeypatch.setattr(exports, "BATCH", 4)
    with Sink() as sink:
        ep = Endpoint(PYROSCOPE, sink.url + "/pyro", {"X-Scope-OrgID": "t1"}, api=exports.PUSH)
        config = ExportConfig((ep,))
        metrics = Metrics(lambda: store)
        sender = Exporter(store, config, metrics)
        records = {sid: record(sid, service=f"svc-{sid}") for sid in "abcde"}
        for r in records.values():
            store.insert(r, export_to=config.keys)
        while sender.run_once():
            pass
        got = sink.accepted()
        assert [r.path for r in got] == ["/pyro/push.v1.PusherService/Push"] * 2
        assert got[0].headers["Content-Type"] == "application/proto"
        assert got[0].headers["X-Scope-OrgID"] == "t1"
        seen: list[str] = []
        for r in got:
            req = push_pb2.PushRequest()
            req.ParseFromString(r.body)
            for series in req.series:
                labels = {p.name: p.value for p in series.labels}
                sid = labels["session_id"]
                seen.append(sid)
                meta = records[sid].meta
                # What Pyroscope's /ingest makes of the same session's query and pprof.
                assert labels == {
                    "__name__": "process_cpu",
                    "__delta__": "false",
                    "service_name": f"svc-{sid}",
                    "pyroscope_spy": "bistouri",
                    **exports.pyroscope_labels(meta),
                }
                (sample,) = series.samples
                assert resolved(pprof_pb2, sample.raw_profile) == resolved(
                    pprof_pb2, formats.pprof(records[sid].profile)
                )
                assert str(uuid.UUID(sample.ID)) == sample.ID
        assert sorted(seen) == list("abcde") and [len(_series(push_pb2, r)) for r in got] == [4, 1]
        assert store.export_backlog() == {}
        assert metrics.exports_sent.labels(PYROSCOPE)._value.get() == 5
        # A batch refused: each session alone, only those refused dropped (here all: 400).
        sink.received.clear()
        sink.status = 400
        for sid in ("f", "g"):
            store.insert(record(sid), export_to=config.keys)
        sender.run_once()
        assert [len(_series(push_pb2, r)) for r in sink.received] == [2, 1, 1]
        assert metrics.exports_dropped.labels(PYROSCOPE, "refused")._value.get() == 2
        assert store.export_backlog() == {}
        sender.close()


def _series(push_pb2: Any, r: Any) -> list[Any]:
    req = push_pb2.PushRequest()
    req.ParseFromString(r.body)
    return list(req.series)

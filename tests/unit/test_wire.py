"""The session wire format: round trips, golden bytes, validation, size per sample."""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import msgpack
import pytest

from bistouri import wire
from bistouri.compat import zip_strict
from bistouri.errors import WireError
from bistouri.pressure import PressureFigures
from bistouri.symbolizer.model import SessionMeta
from bistouri.wire import decode as wire_decode

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "session-v3.msgpack"
GOLDEN_V2 = GOLDEN.with_name("session-v2.msgpack")  # written by VERSION 2: no episode, no wait states
GOLDEN_V1 = GOLDEN.with_name("session-v1.msgpack")  # written by VERSION 1: old spool files must still decode
GOLDEN_V4 = GOLDEN.with_name("session-v4.msgpack")  # a session with Python frames (VERSION 4)


def sample_session(n_stacks: int = 3, repeat: int = 1, v1: bool = False, v2: bool = False) -> wire.Session:
    """v1: what version 1 could say (no file names, no JIT frames); v2: no episode, no wait states."""
    bid = bytes(range(20))
    libc = bytes(range(20, 40))
    app, libc_name = ("", "") if v1 else ("burner", "libc.so.6")
    jit = () if v1 else (wire.UserFrame(wire.FRAME_JIT, b"", 0x7F0000001234, "JS:*hotLoop /app/x.js:2:17"),)
    no_build_id = () if v1 else (wire.UserFrame(wire.FRAME_RESOLVED, b"", 0x4242, "libplain.so"),)
    traces = []
    for i in range(n_stacks):
        traces.append(
            wire.Trace(
                kernel=(0xFFFFFFFF81000000 + 0x100 * i, 0xFFFFFFFF81002000),
                user=(
                    *jit,
                    wire.UserFrame(wire.FRAME_RESOLVED, bid, 0x1150 + i, app),
                    wire.UserFrame(wire.FRAME_RESOLVED, bid, 0x11B8, app),
                    *no_build_id,
                    wire.UserFrame(wire.FRAME_RESOLVED, libc, 0x2724A, libc_name),
                    wire.UserFrame(wire.FRAME_VDSO, b"", 0x7FFC12345678),
                ),
                pid=100,
                tid=101 + i % 2,
                on_cpu=10 * repeat,
                off_cpu=i,
                off_cpu_ns=1_500_000 * i,
                wait=wire.WAIT_D if v1 or v2 else wire.WAIT_STATES[i % 3],
            )
        )
    episode = None
    if not (v1 or v2):
        episode = wire.Episode(
            victims=(wire.Victim(100, 101, "burner", 900_000_000, 700_000_000, 5, 40_000_000, 1_000),),
            aggressors=(
                wire.Aggressor("/hogs", 3_900_000_000, 4096, 1, 0, 0),
                wire.Aggressor("/svc", 900_000_000, 0, 0, 1 << 20, 8192),
            ),
        )
    return wire.Session(
        session_id="6f1c2a8e-6b55-4a3e-9b9b-2a1f0d6c0001",
        trigger=wire.Trigger(
            "cpu",
            "some",
            100_000,
            2_000_000,
            "/svc",
            1_700_000_000_000_000_000,
            pressure=PressureFigures(12.5, 3.25, 1.0, 123456),
        ),
        kernel=wire.KernelInfo("6.18.44", bytes(range(100, 120)), 0xFFFFFFFF81000000),
        start_ns=1_700_000_000_000_000_000,
        duration_ns=3_000_000_000,
        period_ns=52_631_578,
        tenant="t",
        service="svc",
        host="host-1",
        labels={"env": "prod"},
        processes={100: "burner"},
        threads={101: "burner", 102: "worker"},
        traces=traces,
        episode=episode,
    )


def python_frame(name: str, file: str, line: int) -> wire.UserFrame:
    return wire.UserFrame(wire.FRAME_PYTHON, b"", line, name, file)


def python_session() -> wire.Session:
    """sample_session's, with a CPython process's stacks: Python frames where the eval loop's native
    frame was, under a C function (libz) and over the interpreter's main, and the Python note."""
    s = sample_session(n_stacks=2)
    libpython, libz = bytes(range(40, 60)), bytes(range(60, 80))
    main = wire.UserFrame(wire.FRAME_RESOLVED, libpython, 0x2A0F1, "libpython3.11.so.1.0")
    module = python_frame("<module>", "/srv/app/w.py", 12)
    driver = python_frame("driver", "/srv/app/w.py", 9)
    traces = [
        wire.Trace(
            kernel=(),
            user=(python_frame("Worker.hot_loop", "/srv/app/w.py", 6), driver, module, main),
            pid=300,
            tid=300,
            on_cpu=40,
        ),
        wire.Trace(
            kernel=(0xFFFFFFFF81000000,),
            user=(
                wire.UserFrame(wire.FRAME_RESOLVED, libz, 0x3310, "libz.so.1"),
                python_frame("compress", "/usr/lib/python3.11/gzip.py", 0),  # line unknown
                driver,
                module,
                main,
            ),
            pid=300,
            tid=301,
            on_cpu=7,
            off_cpu=2,
            off_cpu_ns=3_000_000,
            wait=wire.WAIT_S,
        ),
    ]
    s.traces = [*s.traces, *traces]
    s.processes = {**s.processes, 300: "python3.11"}
    s.threads = {**s.threads, 300: "python3.11", 301: "compressor"}
    s.unwind = wire.UnwindSummary({"table": 120}, {"entry": 49}, python={"named": 47, "version_unknown": 2})
    return s


def test_round_trip_is_exact():
    s = sample_session()
    assert wire.decode_session(wire.encode_session(s)) == s


def test_the_unwind_note_round_trips_and_is_absent_when_empty():
    s = sample_session()
    assert "unwind" not in wire.session_to_wire(s)  # sessions without walks: bytes as before
    s.unwind = wire.UnwindSummary({"table": 900, "frame_pointer": 12}, {"entry": 95, "bad_frame": 2})
    back = wire.decode_session(wire.encode_session(s))
    assert back == s and back.unwind.walks["entry"] == 95


def test_the_jit_note_round_trips_and_older_readers_ignore_it():
    s = sample_session()
    s.unwind = wire.UnwindSummary(jit={"jvm_ok": 2, "jvm_cut_in_jit": 1, "node_unnamed": 1})
    m = wire.session_to_wire(s)
    assert m["unwind"]["jit"] == {"jvm_ok": 2, "jvm_cut_in_jit": 1, "node_unnamed": 1}
    assert wire.decode_session(wire.encode_session(s)) == s
    # A reader before it took `frames` and `walks` by name: the extra key is left alone.
    assert set(m["unwind"]) == {"frames", "walks", "jit"} and m["unwind"]["frames"] == {}
    # The symbolizer keeps it with the session's metadata (the UI says it in words).
    assert SessionMeta.from_wire(s).to_json()["unwind"]["jit"]["node_unnamed"] == 1
    assert "jit" not in SessionMeta.from_wire(sample_session()).to_json()["unwind"]
    s.unwind.jit = {f"k{i}": 1 for i in range(17)}
    with pytest.raises(WireError):
        wire.decode_session(wire.encode_session(s))


def test_the_kernel_note_round_trips_and_older_readers_ignore_it():
    """What the agent's kernel lacks (bpf/features.py), with the samples taken without it."""
    s = sample_session()
    s.unwind = wire.UnwindSummary({"frame_pointer": 3}, {"entry": 1}, kernel={"no_bpf_loop": 7})
    m = wire.session_to_wire(s)
    assert m["unwind"]["kernel"] == {"no_bpf_loop": 7}
    assert wire.decode_session(wire.encode_session(s)) == s
    # A reader before it takes `frames` and `walks` by name: the extra key is left alone.
    assert m["unwind"]["frames"] == {"frame_pointer": 3}
    assert "kernel" not in wire.session_to_wire(sample_session()).get("unwind", {})


def test_golden_bytes_are_stable():
    data = wire.encode_session(sample_session())
    if not GOLDEN.exists():  # first run writes it; the file is committed
        GOLDEN.write_bytes(data)
    assert data == GOLDEN.read_bytes(), "the wire format changed: bump VERSION and update docs/wire-format.md"


def test_version_1_sessions_still_decode():
    """Spool files written before VERSION 2 (no file names, no JIT frames) are read as they were."""
    assert wire.decode_session(GOLDEN_V1.read_bytes()) == sample_session(v1=True)


def test_version_2_sessions_still_decode():
    """Spool files written before VERSION 3 (no episode, every off-CPU wait a D wait) still decode."""
    assert wire.decode_session(GOLDEN_V2.read_bytes()) == sample_session(v2=True)


def test_episode_and_wait_states_travel_in_v3():
    m = wire.session_to_wire(sample_session())
    assert m["episode"]["victims"] == [[100, 101, "burner", 900_000_000, 700_000_000, 5, 40_000_000, 1_000]]
    assert m["episode"]["aggressors"][0] == ["/hogs", 3_900_000_000, 4096, 1, 0, 0]
    # A D wait keeps the 5-element row of v2; S and reclaim carry their state.
    assert [len(r) for r in m["traces"]] == [5, 6, 6] and [r[5] for r in m["traces"][1:]] == [1, 2]
    # Without an episode, nothing is added: the session is as small as in v2.
    assert "episode" not in wire.session_to_wire(sample_session(v2=True))


def test_every_wait_state_round_trips_and_is_named():
    s = sample_session(n_stacks=len(wire.WAIT_STATES))
    waits = zip_strict(s.traces, wire.WAIT_STATES)
    s = dataclasses.replace(s, traces=tuple(dataclasses.replace(t, wait=w) for t, w in waits))
    assert [t.wait for t in wire.decode_session(wire.encode_session(s)).traces] == list(wire.WAIT_STATES)
    assert wire.WAIT_NAMES[wire.WAIT_RUNQUEUE] == "runqueue" and set(wire.WAIT_NAMES) == set(wire.WAIT_STATES)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m["traces"][0].append(7), "wait 7 is not one of"),
        (lambda m: m.update(episode=[]), "episode must be a map"),
        (lambda m: m["episode"]["victims"][0].pop(), "victims[0] must be"),
        (lambda m: m["episode"]["aggressors"][0].__setitem__(1, -1), "unsigned 64-bit"),
        (lambda m: m["episode"].update(victims=[[1, 1, "x", 0, 0, 0, 0, 0]] * 1025), "at most 1024 rows"),
    ],
)
def test_bad_episode_is_refused_with_its_place(mutate, message):
    m = wire.session_to_wire(sample_session())
    mutate(m)
    with pytest.raises(WireError) as ei:
        wire.session_from_wire(m)
    assert message in str(ei.value)


def test_file_names_and_jit_names_travel_in_tables():
    m = wire.session_to_wire(sample_session())
    assert m["v"] == 3
    assert m["mapping_names"] == ["burner", "libplain.so", "libc.so.6"] and m["mappings"][1] == b""
    assert m["jit_names"] == ["JS:*hotLoop /app/x.js:2:17"]
    assert m["uframes"][0] == [wire.FRAME_JIT, 0, 0x7F0000001234]


def test_batch_concatenates_encoded_sessions():
    a, b = sample_session(), sample_session(2)
    b.session_id = "other"
    body = wire.encode_batch([wire.encode_session(a), wire.encode_session(b)])
    maps = wire.decode_batch(body)
    assert [wire.session_from_wire(m) for m in maps] == [a, b]
    many = wire.encode_batch([wire.encode_session(a)] * 20)
    assert len(wire.decode_batch(many)) == 20


def test_repeated_stacks_cost_under_20_bytes_per_sample():
    s = sample_session(n_stacks=20, repeat=50)
    data = wire.encode_session(s)
    assert len(data) / s.total_samples < 20
    assert len(gzip.compress(data)) < len(data)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda m: m.update(v=5), "unsupported_version"),
        (lambda m: m["uframes"].append([wire.FRAME_JIT, 5, 1]), "malformed"),
        (lambda m: m.update(v=1), "malformed"),  # v1 knows no JIT frame (nor an empty build id)
        (lambda m: m["mapping_names"].pop(), "malformed"),
        (lambda m: m["jit_names"].append(7), "malformed"),
        (lambda m: m.pop("traces"), "malformed"),
        (lambda m: m["traces"].append([99, 0, 1, 0, 0]), "malformed"),
        (lambda m: m["uframes"].append([0, 42, 1]), "malformed"),
        (lambda m: m["trigger"].update(resource="disk"), "malformed"),
        (lambda m: m["kframes"].append(-1), "malformed"),
        (lambda m: m["uframes"].append([1, -1, -5]), "malformed"),
        (lambda m: m.update(labels={"a": 1}), "malformed"),
        (lambda m: m.update(id=""), "malformed"),
        (lambda m: m["trigger"].update(kind="cron"), "malformed"),
        (lambda m: m.update(pre_traces=[[99, 0, 1, 0, 0]]), "malformed"),
        (lambda m: m.update(pre_traces={}), "malformed"),
        (lambda m: m.update(pre_trigger_ns=-1), "malformed"),
        (lambda m: m.update(unwind=[1]), "malformed"),
        (lambda m: m.update(unwind={"walks": {f"r{i}": 1 for i in range(9)}}), "malformed"),
        (lambda m: m.update(unwind={"frames": {"table": -1}}), "malformed"),
        (lambda m: m.update(unwind={"frames": {"x" * 33: 1}}), "malformed"),
    ],
)
def test_invalid_sessions_are_rejected_with_a_reason(mutate, reason):
    m = wire.session_to_wire(sample_session())
    mutate(m)
    with pytest.raises(WireError) as e:
        wire.session_from_wire(msgpack.unpackb(msgpack.packb(m, use_bin_type=True), raw=False))
    assert e.value.reason == reason


def test_garbage_is_malformed_not_a_crash():
    for junk in (b"", b"\xc1", b"\x92\x01", b"not msgpack at all", msgpack.packb([1, 2])):
        with pytest.raises(WireError):
            wire.decode_session(junk)
        with pytest.raises(WireError):
            wire.decode_batch(junk)


def test_object_count_is_the_decoders():
    m = wire.session_to_wire(sample_session(n_stacks=40))
    n = wire.count_objects(m)
    data = msgpack.packb(m, use_bin_type=True)
    wire_decode._Reader(data, max_objects=n).session()  # exactly enough
    with pytest.raises(WireError, match="msgpack values"):
        wire_decode._Reader(data, max_objects=n - 1).session()


def test_a_session_too_large_for_one_request_keeps_its_heaviest_traces():
    s = sample_session(n_stacks=400)
    s.traces = [dataclasses.replace(t, on_cpu=i, off_cpu=0) for i, t in enumerate(s.traces)]
    whole = wire.count_objects(wire.session_to_wire(s))
    data, left_out = wire.encode_session_to_fit(s, max_objects=whole // 3)
    kept = wire.decode_session(data)
    assert 0 < left_out < 400 and len(kept.traces) == 400 - left_out
    assert wire.count_objects(msgpack.unpackb(data, raw=False)) <= whole // 3
    # The heaviest stay: weights 0..399, so the kept ones are the top len(kept.traces).
    assert min(t.on_cpu for t in kept.traces) == 400 - len(kept.traces)
    assert wire.encode_session_to_fit(s, max_objects=whole) == (wire.encode_session(s), 0)


def test_pre_trigger_traces_and_a_manual_trigger_round_trip():
    import dataclasses

    s = sample_session()
    s.traces.append(dataclasses.replace(s.traces[0], on_cpu=4, pre_trigger=True))  # same stack, before
    s.pre_trigger_ns = 4_800_000_000
    s.trigger = dataclasses.replace(s.trigger, kind=wire.TRIGGER_MANUAL)
    m = wire.session_to_wire(s)
    assert m["trigger"]["kind"] == "manual" and m["pre_trigger_ns"] == 4_800_000_000
    assert len(m["traces"]) == 3 and len(m["pre_traces"]) == 1
    assert m["pre_traces"][0][0] == m["traces"][0][0]  # the stack is stored once
    assert m["total"] == s.total_samples == 30 + 4 + 3
    assert wire.decode_session(wire.encode_session(s)) == s


def test_sessions_without_the_new_keys_encode_as_before_and_older_readers_ignore_them():
    m = wire.session_to_wire(sample_session())
    assert "pre_traces" not in m and "pre_trigger_ns" not in m and "kind" not in m["trigger"]
    decoded = wire.decode_session(wire.encode_session(sample_session()))
    assert decoded.trigger.kind == wire.TRIGGER_PSI and decoded.pre_trigger_ns == 0


def test_a_long_pre_trigger_table_is_read_row_by_row_like_the_others():
    s = sample_session(n_stacks=3 * wire.MAX_ARRAY_LEN)  # each table over MAX_ARRAY_LEN rows
    s.traces = [dataclasses.replace(t, pre_trigger=i % 2 == 0) for i, t in enumerate(s.traces)]
    body = wire.encode_batch([wire.encode_session(s)])
    (m,) = wire.decode_batch(body)
    decoded = wire.session_from_wire(m)
    assert sorted(map(repr, decoded.traces)) == sorted(map(repr, s.traces))  # after, then before


def test_a_session_over_the_symbolization_work_of_one_request_is_cut_to_fit():
    # Two distinct frames per trace: 30 000 traces are 60 000 distinct frames, over the 50 000 a
    # request may make the symbolizer resolve (it would refuse the session whole: 413).
    s = sample_session(n_stacks=30_000)
    data, left_out = wire.encode_session_to_fit(s)
    frames = wire.work_of(msgpack.unpackb(data, raw=False))[0]
    assert left_out > 0 and frames <= wire.MAX_FRAMES_PER_REQUEST
    assert frames > 0.8 * wire.MAX_FRAMES_PER_REQUEST, "no more left out than needed"


def test_python_frames_round_trip_in_version_4():
    s = python_session()
    m = wire.session_to_wire(s)
    assert m["v"] == 4
    # One row per function, its file once: a frame is [4, function, line].
    assert m["py_files"] == ["/srv/app/w.py", "/usr/lib/python3.11/gzip.py"]
    assert m["py_functions"] == [["Worker.hot_loop", 0], ["driver", 0], ["<module>", 0], ["compress", 1]]
    assert [f for f in m["uframes"] if f[0] == wire.FRAME_PYTHON] == [
        [4, 0, 6],
        [4, 1, 9],
        [4, 2, 12],
        [4, 3, 0],
    ]
    assert m["unwind"]["python"] == {"named": 47, "version_unknown": 2}
    back = wire.decode_session(wire.encode_session(s))
    assert back == s
    hot = back.traces[-2].user[0]
    assert (hot.kind, hot.name, hot.file, hot.address) == (
        wire.FRAME_PYTHON,
        "Worker.hot_loop",
        "/srv/app/w.py",
        6,
    )


def test_golden_bytes_of_version_4_are_stable():
    data = wire.encode_session(python_session())
    if not GOLDEN_V4.exists():  # first run writes it; the file is committed
        GOLDEN_V4.write_bytes(data)
    assert data == GOLDEN_V4.read_bytes(), (
        "the wire format changed: bump VERSION and update docs/wire-format.md"
    )
    assert wire.decode_session(GOLDEN_V4.read_bytes()) == python_session()


def test_a_session_without_python_stays_version_3_and_a_python_note_alone_makes_it_4():
    """So that a symbolizer that reads up to 3 takes every session of an agent that sampled no Python."""
    m = wire.session_to_wire(sample_session())
    assert m["v"] == 3 and "py_files" not in m and "py_functions" not in m
    s = sample_session()
    s.unwind = wire.UnwindSummary(python={"no_thread_key": 5})
    m = wire.session_to_wire(s)
    assert (
        m["v"] == 4
        and "py_functions" not in m
        and m["unwind"] == {"frames": {}, "walks": {}, "python": {"no_thread_key": 5}}
    )
    assert wire.decode_session(wire.encode_session(s)) == s


def test_the_batch_envelope_stays_version_3_whatever_its_sessions():
    """Each session says its own version; a 4 on the envelope would make an older symbolizer refuse
    a whole batch, its version-3 sessions with it."""
    body = wire.encode_batch([wire.encode_session(sample_session()), wire.encode_session(python_session())])
    assert msgpack.unpackb(body, raw=False)["v"] == wire.BATCH_VERSION == 3
    assert [m["v"] for m in wire.decode_batch(body)] == [3, 4]
    v4_envelope = msgpack.packb({"v": 4, "sessions": []})
    assert wire.decode_batch(v4_envelope) == []  # read: 1 to 4


def test_python_tables_count_in_the_work_of_a_session():
    m = wire.session_to_wire(python_session())
    frames = wire.work_of(m)[0]
    assert frames == len(m["kframes"]) + len(m["uframes"]) + len(m["py_functions"])
    n = wire.count_objects(m)
    data = msgpack.packb(m, use_bin_type=True)
    wire_decode._Reader(data, max_objects=n).session()  # the new tables counted as the decoder counts
    with pytest.raises(WireError, match="msgpack values"):
        wire_decode._Reader(data, max_objects=n - 1).session()


def test_a_python_session_too_large_for_one_request_is_cut_to_fit():
    s = python_session()
    many = [
        dataclasses.replace(t, user=(python_frame(f"f{i}", f"/m{i}.py", 1 + i % 7), *t.user))
        for i, t in enumerate(s.traces[-1:] * 400)
    ]
    s.traces = many
    whole = wire.count_objects(wire.session_to_wire(s))
    data, left_out = wire.encode_session_to_fit(s, max_objects=whole // 3)
    assert 0 < left_out < 400
    m = msgpack.unpackb(data, raw=False)
    assert wire.count_objects(m) <= whole // 3 and len(m["py_functions"]) < 400
    assert len(wire.decode_session(data).traces) == 400 - left_out


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.update(v=3),  # kind 4 in a session below version 4
        lambda m: m["uframes"].append([wire.FRAME_PYTHON, 99, 1]),  # no such function
        lambda m: m["uframes"].append([wire.FRAME_PYTHON, 0, wire.MAX_PY_LINE + 1]),
        lambda m: m["uframes"].append([wire.FRAME_PYTHON, 0, -1]),
        lambda m: m["uframes"].append([True, 0, 1]),
        lambda m: m["py_functions"].append(["f", 9]),  # no such file
        lambda m: m["py_functions"].append(["f"]),
        lambda m: m["py_functions"].append([7, 0]),
        lambda m: m["py_functions"].append(["x" * (wire.MAX_PY_NAME_CHARS + 1), 0]),
        lambda m: m["py_files"].append("/" * (wire.MAX_PY_FILE_CHARS + 1)),
        lambda m: m["py_files"].append(b"/w.py"),
        lambda m: m.update(py_files={}),
        lambda m: m.update(py_functions="f"),
        lambda m: m["unwind"].update(python={f"r{i}": 1 for i in range(wire.MAX_PY_NOTE_KEYS + 1)}),
        lambda m: m["unwind"].update(python={"named": -1}),
        lambda m: m["unwind"].update(python=[]),
    ],
)
def test_invalid_python_frames_are_malformed(mutate):
    m = wire.session_to_wire(python_session())
    mutate(m)
    with pytest.raises(WireError) as e:
        wire.session_from_wire(msgpack.unpackb(msgpack.packb(m, use_bin_type=True), raw=False))
    assert e.value.reason == "malformed"


def test_python_limits_pass_at_their_limit_and_a_v3_session_ignores_python_keys():
    m = wire.session_to_wire(python_session())
    m["py_files"][0] = "/" * wire.MAX_PY_FILE_CHARS
    m["py_functions"][0][0] = "f" * wire.MAX_PY_NAME_CHARS
    m["uframes"].append([wire.FRAME_PYTHON, 0, wire.MAX_PY_LINE])
    s = wire.session_from_wire(m)
    assert len(s.traces[-2].user[0].file) == wire.MAX_PY_FILE_CHARS
    # A version-3 session is read as a version-3 reader reads it: keys it does not know are ignored.
    m3 = wire.session_to_wire(sample_session())
    m3.update(py_files=7, py_functions=None, unwind={"python": "junk"})
    assert wire.session_from_wire(m3).unwind.python == {}


def test_a_reader_of_version_3_takes_the_batch_and_its_v3_sessions_and_refuses_the_v4_one_alone(monkeypatch):
    """What an older symbolizer does with a newer agent's batch (its READABLE_VERSIONS were (1, 2, 3))."""
    monkeypatch.setattr(wire_decode, "READABLE_VERSIONS", (1, 2, 3))
    body = wire.encode_batch([wire.encode_session(sample_session()), wire.encode_session(python_session())])
    v3, v4 = wire.decode_batch(body)  # the envelope says 3: read
    assert wire.session_from_wire(v3) == sample_session()
    with pytest.raises(WireError) as e:
        wire.session_from_wire(v4)
    assert e.value.reason == "unsupported_version"


def test_python_names_and_lines_past_the_limits_are_cut_not_the_session():
    """Names come from the target's memory: one too long (or a line out of range) must not have the
    symbolizer refuse the whole session."""
    s = python_session()
    huge = python_frame("n" * (wire.MAX_PY_NAME_CHARS + 5), "/" + "d" * wire.MAX_PY_FILE_CHARS, -1)
    far = python_frame("far", "/w.py", wire.MAX_PY_LINE + 1)
    s.traces[-1] = dataclasses.replace(s.traces[-1], user=(huge, far, *s.traces[-1].user))
    back = wire.decode_session(wire.encode_session(s))
    got_huge, got_far = back.traces[-1].user[:2]
    assert got_huge.name == "n" * wire.MAX_PY_NAME_CHARS and len(got_huge.file) == wire.MAX_PY_FILE_CHARS
    assert (got_huge.address, got_far.address) == (0, 0)


def test_a_jit_name_past_its_limit_is_cut_not_the_session():
    """A perf map is the target's file: one name longer than the decoder takes must not have the
    symbolizer refuse the whole session."""
    s = python_session()
    jit = wire.UserFrame(
        wire.FRAME_JIT, b"", 0x7F00_0000_1000, "LazyCompile:" + "x" * wire.MAX_JIT_NAME_CHARS
    )
    s.traces[-1] = dataclasses.replace(s.traces[-1], user=(jit, *s.traces[-1].user))
    back = wire.decode_session(wire.encode_session(s))
    assert back.traces[-1].user[0].name == jit.name[: wire.MAX_JIT_NAME_CHARS]


GOLDEN_CONTAINER = GOLDEN.with_name("session-v3-container.msgpack")  # version 3 with unit and container
CONTAINER_ID = "4f1b9c2e7a6d5038b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e"


def container_session() -> wire.Session:
    s = sample_session()
    s.trigger = dataclasses.replace(s.trigger, cgroup=f"/system.slice/docker-{CONTAINER_ID}.scope")
    s.unit = f"docker-{CONTAINER_ID}.scope"
    s.container = wire.Container(CONTAINER_ID, "containerd", "8d9a4c2b-5e6f-4a1b-9c3d-2e1f0a9b8c7d")
    return s


def test_unit_and_container_round_trip_as_optional_keys_of_any_version():
    s = container_session()
    m = wire.session_to_wire(s)
    assert m["v"] == 3  # no bump: a reader before them ignores two keys it does not know
    assert m["unit"] == s.unit
    assert m["container"] == {"id": CONTAINER_ID, "runtime": "containerd", "pod": s.container.pod}
    assert wire.decode_session(wire.encode_session(s)) == s
    s.container = wire.Container(CONTAINER_ID, "docker")  # no pod: no key
    assert wire.session_to_wire(s)["container"] == {"id": CONTAINER_ID, "runtime": "docker"}
    assert wire.decode_session(wire.encode_session(s)) == s
    py = python_session()
    py.unit, py.container = "app.service", wire.Container(CONTAINER_ID, "podman")
    assert wire.decode_session(wire.encode_session(py)) == py
    # Without them: not written, so every session before them encodes byte for byte as before.
    assert not {"unit", "container"} & set(wire.session_to_wire(sample_session()))
    # A runtime this build does not know is taken as it is (a later agent may name more).
    s.container = wire.Container(CONTAINER_ID, "lxc")
    assert wire.decode_session(wire.encode_session(s)).container == s.container


def test_golden_bytes_with_unit_and_container_are_stable():
    data = wire.encode_session(container_session())
    if not GOLDEN_CONTAINER.exists():  # first run writes it; the file is committed
        GOLDEN_CONTAINER.write_bytes(data)
    assert data == GOLDEN_CONTAINER.read_bytes()
    assert wire.decode_session(GOLDEN_CONTAINER.read_bytes()) == container_session()


@pytest.mark.parametrize(
    "bad",
    [
        {"unit": 3},
        {"unit": "u" * (wire.MAX_UNIT_CHARS + 1)},
        {"container": "abc"},
        {"container": {"runtime": "docker"}},
        {"container": {"id": "", "runtime": "docker"}},
        {"container": {"id": "x" * (wire.MAX_CONTAINER_ID_CHARS + 1), "runtime": "docker"}},
        {"container": {"id": "abc", "runtime": "r" * (wire.MAX_RUNTIME_CHARS + 1)}},
        {"container": {"id": "abc", "runtime": "docker", "pod": ["p"]}},
    ],
)
def test_a_bad_unit_or_container_is_refused(bad):
    m = {**wire.session_to_wire(sample_session()), **bad}
    with pytest.raises(WireError, match="malformed"):
        wire.decode_session(msgpack.packb(m, use_bin_type=True))


def test_the_packages_names_are_its_modules_own() -> None:
    # The codecs' names are imported at first use (wire.__getattr__): each name the package
    # exports resolves, to the object of the module that defines it.
    import importlib

    for name in wire.__all__:
        value = getattr(wire, name)
        module = wire._CODECS.get(name)
        if module is not None:
            assert value is getattr(importlib.import_module(f"bistouri.wire.{module}"), name)
    with pytest.raises(AttributeError):
        wire.no_such_name  # noqa: B018

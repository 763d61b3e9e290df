"""Python frames (wire v4) through a real symbolizer service: stored, read back in every format.

A real `bistouri symbolizer` (gunicorn; SQLite, and PostgreSQL where one can be
started) gets, in one batch as the agent sends it, a version-4 session whose user
stacks hold CPython frames (qualified name, file, line) spliced between native
frames of a real binary, and a version-3 session of an older agent. The
flamegraph JSON, pprof (parsed with the real schema), folded and speedscope
answers keep the Python frames in place with their file and line.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
import requests

from bistouri import wire
from tests.pprof_proto import compile_profile_proto

from .conftest import DemoBinary, make_session, post_sessions, put_kernel

APP = "/srv/app/w.py"


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


def py(name: str, line: int, file: str = APP) -> wire.UserFrame:
    return wire.UserFrame(wire.FRAME_PYTHON, b"", line, name, file)


def python_session(sid: str, binary: DemoBinary) -> wire.Session:
    """make_session's, with a CPython process's stacks: leaf first, a C function (leaf_work) called
    from Python, the Python frames where the eval loop was, then the interpreter's own frames."""
    s = make_session(sid, binary)

    def native(name: str) -> wire.UserFrame:
        return wire.UserFrame(wire.FRAME_RESOLVED, binary.build_id, binary.offsets[name])

    module, driver = py("<module>", 12), py("driver", 9)
    interpreter = (native("middle_step"), native("main"))
    s.traces = [
        *s.traces,
        wire.Trace((), (py("Worker.hot_loop", 6), driver, module, *interpreter), 200, 200, on_cpu=30),
        wire.Trace((), (py("Worker.hot_loop", 7), driver, module, *interpreter), 200, 200, on_cpu=4),
        wire.Trace(
            (),
            (
                native("leaf_work"),
                py("compress", 0, "/usr/lib/python3.11/gzip.py"),
                driver,
                module,
                *interpreter,
            ),
            200,
            201,
            on_cpu=6,
        ),
    ]
    s.processes = {**s.processes, 200: "python3.11"}
    s.threads = {**s.threads, 200: "python3.11", 201: "gz"}
    s.unwind = wire.UnwindSummary({"table": 50}, {"entry": 40}, python={"named": 40, "version_unknown": 3})
    return s


def get(url: str, path: str, **params: str) -> requests.Response:
    r = requests.get(url + path, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r


def child(node: dict[str, Any], name: str, **match: Any) -> dict[str, Any]:
    (found,) = [c for c in node["children"] if c["name"] == name and all(c[k] == v for k, v in match.items())]
    return found


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_python_frames_are_stored_and_rendered_in_every_format(
    db: str,
    request: pytest.FixtureRequest,
    symbolizer_server: Any,
    tmp_path: Path,
    demo_binary: DemoBinary,
    profile_pb2: ModuleType,
) -> None:
    flags: dict[str, Any] = {"workers": 2, "binary_dir": demo_binary.dir}
    if db == "postgres":
        pg = request.getfixturevalue("postgres")
        psycopg = pytest.importorskip("psycopg", reason="psycopg (3) is the PostgreSQL driver")
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute(
                "DROP TABLE IF EXISTS sessions, kernels, uploads, pending_builds, upload_chunks, "
                "upload_files, upload_parts, export_queue, schema_version"
            )
        flags["db"] = pg.url
    url = symbolizer_server(tmp_path, **flags)
    assert put_kernel(url).status_code == 204
    new, old = python_session("py-1", demo_binary), make_session("old-1", demo_binary)
    assert wire.session_to_wire(new)["v"] == 4 and wire.session_to_wire(old)["v"] == 3
    r = post_sessions(url, [new, old])
    assert r.status_code == 200 and sorted(r.json()["accepted"]) == ["old-1", "py-1"], r.text

    meta = get(url, "/v1/sessions/py-1").json()
    assert meta["unwind"]["python"] == {"named": 40, "version_unknown": 3}
    assert "python" not in get(url, "/v1/sessions/old-1").json()["unwind"]

    # The flamegraph tree: native root, the Python frames under it (a node per line), the C call under
    # its Python caller; every Python node of kind python, with its file and line.
    tree = get(url, "/v1/sessions/py-1/flamegraph").json()
    main = child(tree, "main")
    step = child(main, "middle_step")
    module = child(step, "<module>")
    assert (module["kind"], module["file"], module["line"], module["module"]) == (
        "python",
        APP,
        12,
        "[python]",
    )
    driver = child(module, "driver")
    hot6, hot7 = child(driver, "Worker.hot_loop", line=6), child(driver, "Worker.hot_loop", line=7)
    assert (hot6["value"], hot7["value"], hot6["file"], hot6["kind"]) == (30, 4, APP, "python")
    compress = child(driver, "compress")
    assert (compress["file"], compress["line"]) == ("/usr/lib/python3.11/gzip.py", 0)
    leaf = child(compress, "leaf_work")
    assert leaf["kind"] == "user" and leaf["file"].endswith("demo.c") and leaf["line"] > 0

    # folded: `name (file:line)`, as py-spy writes it.
    folded = get(url, "/v1/sessions/py-1/folded").text
    assert f"main;middle_step;<module> ({APP}:12);driver ({APP}:9);Worker.hot_loop ({APP}:6) 30\n" in folded
    assert f"driver ({APP}:9);compress (/usr/lib/python3.11/gzip.py);leaf_work 6\n" in folded

    # pprof, parsed with the real schema: Function name and filename, Line.line, leaf first.
    msg = profile_pb2.Profile()
    msg.ParseFromString(gzip.decompress(get(url, "/v1/sessions/py-1/pprof").content))
    s = msg.string_table
    functions = {f.id: f for f in msg.function}
    locations = {loc.id: loc for loc in msg.location}
    mappings = {m.id: s[m.filename] for m in msg.mapping}

    def frames(sample: Any) -> list[tuple[str, str, int, str]]:
        out = []
        for lid in sample.location_id:
            loc = locations[lid]
            for line in loc.line:
                fn = functions[line.function_id]
                out.append((s[fn.name], s[fn.filename], line.line, mappings[loc.mapping_id]))
        return out

    stacks = [frames(x) for x in msg.sample]
    hot = next(st for st in stacks if st[0][:3] == ("Worker.hot_loop", APP, 6))
    assert hot[:3] == [
        ("Worker.hot_loop", APP, 6, "[python]"),
        ("driver", APP, 9, "[python]"),
        ("<module>", APP, 12, "[python]"),
    ]
    assert [f[0] for f in hot[3:]] == ["middle_step", "main"]
    c_call = next(
        st for st in stacks if len(st) > 1 and st[1][0] == "compress"
    )  # the C function under its Python caller
    assert c_call[0][0] == "leaf_work" and c_call[1][:3] == ("compress", "/usr/lib/python3.11/gzip.py", 0)

    # speedscope: the frame's name, file and line apart.
    shared = get(url, "/v1/sessions/py-1/speedscope").json()["shared"]["frames"]
    assert {"name": "Worker.hot_loop", "file": APP, "line": 6} in shared

    # The older agent's session is as before.
    old_folded = get(url, "/v1/sessions/old-1/folded").text
    assert "main;middle_step;leaf_work 40\n" in old_folded and "[python]" not in old_folded


def test_a_python_frame_in_a_version_3_session_is_refused_alone(
    symbolizer_server: Any, tmp_path: Path, demo_binary: DemoBinary
) -> None:
    """A session that says version 3 but holds a Python frame is malformed; the rest of its batch is kept."""
    url = symbolizer_server(tmp_path, workers=1, binary_dir=demo_binary.dir)
    bad = wire.session_to_wire(python_session("bad-1", demo_binary))
    bad["v"] = 3
    good = wire.encode_session(make_session("good-1", demo_binary))
    body = gzip.compress(wire.encode_batch([msgpack.packb(bad, use_bin_type=True), good]))
    r = requests.post(
        url + "/v1/sessions",
        data=body,
        headers={"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == ["good-1"]
    (rejected,) = r.json()["rejected"]
    assert rejected["reason"] == "malformed" and "needs version 4" in rejected["detail"]

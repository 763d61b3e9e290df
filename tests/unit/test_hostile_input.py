"""Attack suite, in process: hostile symbols, msgpack shapes and stack depths against the symbolizer's parts.

Each input here once broke something (see testkit/hostile.py); hypothesis then looks for the next one. The
same inputs go through the real service in tests/integration/test_attacks_input.py.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bistouri import wire
from bistouri.errors import WireError
from bistouri.symbolizer import demangle as dm
from bistouri.symbolizer import formats, kallsyms
from bistouri.symbolizer.demangle import demangle
from bistouri.symbolizer.kallsyms import KallsymsError, KallsymsTooLarge, parse_kallsyms
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from bistouri.symbolizer.service.store import Store
from testkit.hostile import cxx_bomb, kallsyms_bomb, msgpack_empty_arrays_bomb, rust_v0_bomb

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------
# Demangler


def _bounded(name: str, out: str) -> bool:
    # A clone suffix adds at most " [clone ]" per ".part" of the name.
    return len(out) <= dm.MAX_DEMANGLED_CHARS + 5 * len(name)


def test_rust_v0_backref_bomb_stays_mangled() -> None:
    """206 characters printed 25 M characters in 13 s: the budget stops it and the name stays mangled."""
    for levels in (21, 25, 60):
        name = rust_v0_bomb(levels)
        assert demangle(name) == name


def test_rust_v0_backrefs_within_budget_still_decode() -> None:
    out = demangle(rust_v0_bomb(3))
    assert out == "a::f::<u8, (u8, u8), ((u8, u8), (u8, u8)), (((u8, u8), (u8, u8)), ((u8, u8), (u8, u8)))>"


def test_cxx_substitution_bomb_never_reaches_libstdcxx() -> None:
    """284 characters made __cxa_demangle print 3.5 GB in 40 s."""
    for levels in (28, 40):
        name = cxx_bomb(levels)
        assert demangle(name) == name


def test_cxx_output_is_cut_at_the_limit() -> None:
    # 9 levels print 6.5 k characters: within the work estimate, over the output limit.
    out = demangle(cxx_bomb(9))
    assert len(out) == dm.MAX_DEMANGLED_CHARS
    assert out.startswith("f(A, A<A, A>, A<A<A, A>") and out.endswith(dm.TRUNCATED_MARK)


def test_overlong_names_are_not_decoded() -> None:
    name = "_ZN" + "3foo" * (dm.MAX_NAME_CHARS // 4) + "E"
    assert demangle(name) == name


def test_v0_char_constant_out_of_unicode_is_invalid() -> None:
    name = "_RINvC1a1fKcffffffffffffffffff_E"  # chr() of it raised OverflowError, not ValueError
    assert demangle(name) == name


def test_v0_huge_binder_is_invalid() -> None:
    name = "_RINvC1a1fFGzzzzzzzzzz_EuEE"  # for<'a, 'b, … 10^17 lifetimes> fn()
    assert demangle(name) == name


_V0_TOKENS = list("CNIMXYBEGKLTARQPOFDSpuvhjlmxyUcsb_0123456789") + ["B_", "B0_", "B1_", "3foo", "Cs1_"]


@FUZZ
@given(st.text(max_size=600))
def test_fuzz_any_text(name: str) -> None:
    for candidate in (name, "_R" + name, "_Z" + name, "_ZN" + name):
        out = demangle(candidate)
        assert isinstance(out, str) and _bounded(candidate, out)


@settings(FUZZ, max_examples=100)
@given(st.lists(st.sampled_from(_V0_TOKENS), max_size=300), st.integers(0, 80))
def test_fuzz_v0_shaped(tokens: list[str], levels: int) -> None:
    for name in ("_R" + "".join(tokens), rust_v0_bomb(levels) + "".join(tokens), rust_v0_bomb(levels)):
        out = demangle(name)
        assert isinstance(out, str) and _bounded(name, out)


@FUZZ
@given(st.lists(st.sampled_from(list("NIESTLZ_0123456789AvifKRP") + ["S_", "S0_", "T_", "1A"]), max_size=300))
def test_fuzz_itanium_shaped(tokens: list[str]) -> None:
    name = "_Z" + "".join(tokens)
    out = demangle(name)
    assert isinstance(out, str) and _bounded(name, out)


# ---------------------------------------------------------------------------
# msgpack shapes against the decoder


def _session_map(python: bool = False, **changes: Any) -> dict[str, Any]:
    """A valid session map (python: version 4, with Python frames and note), with `changes`."""
    from tests.unit.test_wire import python_session, sample_session

    m = wire.session_to_wire(python_session() if python else sample_session())
    m.update(changes)
    return m


def _batch(*sessions: Any) -> bytes:
    return msgpack.packb({"v": wire.BATCH_VERSION, "sessions": list(sessions)}, use_bin_type=True)


def _peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated through Python's allocators while fn runs (msgpack's objects included)."""
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _too_large(data: bytes) -> WireError:
    with pytest.raises(WireError) as e:
        wire.decode_batch(data)
    assert e.value.reason == "too_large", e.value
    return e.value


def test_empty_arrays_bomb_is_refused_before_it_is_decoded() -> None:
    """72 KiB of gzip (16 M empty arrays) took a worker to 1.24 GB: refused from the array header."""
    data = gzip.decompress(msgpack_empty_arrays_bomb())
    assert _peak_bytes(lambda: _too_large(data)) < 4 << 20  # the reader's 1 MiB window


@pytest.mark.parametrize(
    "shape",
    [
        # A table of empty rows.
        lambda n: _batch(_session_map(stacks=[[]] * n)),
        # Rows within the array limit, many of them.
        lambda n: _batch(_session_map(stacks=[[[], []]] * (n // 2))),
        # Many sessions, each under the budget, over it together.
        lambda n: _batch(*[_session_map(kframes=[0] * (n // 500)) for _ in range(600)]),
        # One-byte integers that are each a new object (-32..-6 are not cached).
        lambda n: _batch(_session_map(kframes=[-20] * n)),
    ],
)
def test_object_budget_bounds_memory(shape: Callable[[int], bytes]) -> None:
    data = shape(wire.MAX_BATCH_OBJECTS + 10)
    # Under the budget a value costs ~60 bytes: the refusal comes before 300 MB.
    assert _peak_bytes(lambda: _too_large(data)) < 250 << 20


def test_processes_of_the_wrong_type_are_malformed() -> None:
    # Found by test_fuzz_msgpack_shapes: `processes: true` raised TypeError.
    with pytest.raises(WireError, match="processes must be an array"):
        wire.session_from_wire(_session_map(processes=True))


def test_oversized_arrays_and_strings_are_refused() -> None:
    for data in (
        _batch(_session_map(stacks=[[[0] * (wire.MAX_ARRAY_LEN + 1), []]])),
        _batch(_session_map(tenant="x" * (wire.MAX_STR_BYTES + 1))),
        _batch(_session_map(mappings=[b"x" * 65])),
        _batch(_session_map(labels={f"k{i}": "v" for i in range(wire.MAX_MAP_LEN + 1)})),
        msgpack.packb({"v": 1, "sessions": [{}] * (wire.MAX_SESSIONS_PER_BATCH + 1)}),
    ):
        with pytest.raises(WireError):
            wire.decode_batch(data)


def test_python_tables_are_bounded_like_the_others() -> None:
    """(v4) py_files and py_functions: strings within MAX_STR_BYTES, rows within MAX_ARRAY_LEN, and
    the tables read row by row (longer than MAX_ARRAY_LEN as a whole, like every table)."""
    for data in (
        _batch(_session_map(python=True, py_files=["/" * (wire.MAX_STR_BYTES + 1)])),
        _batch(_session_map(python=True, py_functions=[["f", 0, *[0] * wire.MAX_ARRAY_LEN]])),
    ):
        with pytest.raises(WireError) as e:
            wire.decode_batch(data)
        assert e.value.reason == "too_large"
    many = 3 * wire.MAX_ARRAY_LEN
    m = _session_map(python=True, py_files=[f"/m{i}.py" for i in range(many)])
    m["py_functions"] = [[f"f{i}", i] for i in range(many)]
    (back,) = wire.decode_batch(_batch(m))
    assert len(wire.session_from_wire(back).traces) == len(m["traces"])


def test_stack_frame_limits() -> None:
    m = _session_map()
    m["kframes"] = [0xFFFFFFFF81000000 + i for i in range(wire.MAX_KERNEL_FRAMES + 1)]
    m["stacks"] = [[list(range(wire.MAX_KERNEL_FRAMES + 1)), []]]
    m["traces"] = [[0, 0, 1, 0, 0]]
    with pytest.raises(WireError, match="kernel and 0 user frames, at most 512 and 1024") as e:
        wire.session_from_wire(m)
    assert e.value.reason == "too_large"
    m["stacks"] = [[list(range(wire.MAX_KERNEL_FRAMES)), []]]
    assert len(wire.session_from_wire(m).traces[0].kernel) == wire.MAX_KERNEL_FRAMES


def _with_trigger(**kw: Any) -> dict[str, Any]:
    m = _session_map()
    m["trigger"] = {**m["trigger"], **kw}
    return m


def _with_kernel(**kw: Any) -> dict[str, Any]:
    m = _session_map()
    m["kernel"] = {**m["kernel"], **kw}
    return m


@pytest.mark.parametrize(
    ("session", "field"),
    [
        (lambda: _session_map(tenant="t" * 257), "session[6f1c2a8e-6b55-4a3e-9b9b-2a1f0d6c0001].tenant"),
        (lambda: _session_map(service="s" * 257), ".service must be a string of at most 256"),
        (lambda: _session_map(host="h" * 257), ".host must be a string of at most 256"),
        (lambda: _session_map(labels={f"k{i}": "" for i in range(65)}), "65 labels, at most 64"),
        (lambda: _session_map(labels={"k" * 129: ""}), "keys are 1 to 128 characters"),
        (lambda: _session_map(labels={"": "v"}), "keys are 1 to 128 characters"),
        (lambda: _session_map(labels={"k": "v" * 1025}), "values at most 1024"),
        (lambda: _session_map(processes=[[1, "c" * 65]]), ".processes[0] must be at most 64"),
        (lambda: _session_map(threads=[[1, 1, "n" * 65]]), ".threads[0].name must be at most 64"),
        (lambda: _with_trigger(cgroup="/" * 4097), ".trigger.cgroup must be a string of at most 4096"),
        (lambda: _with_kernel(release="r" * 257), ".kernel.release must be a string of at most 256"),
        (lambda: _session_map(id="i" * 65), "session.id must be 1 to 64 characters"),
    ],
)
def test_text_fields_have_limits(session: Callable[[], dict[str, Any]], field: str) -> None:
    with pytest.raises(WireError, match=re.escape(field)) as e:
        wire.session_from_wire(session())
    assert e.value.reason == "malformed"


def test_text_fields_at_their_limits_pass() -> None:
    m = _session_map(
        tenant="t" * 256,
        labels={"k" * 128: "v" * 1024, **{f"k{i}": "" for i in range(63)}},
        processes=[[100, "c" * 64]],
    )
    m["trigger"]["cgroup"] = "/" * 4096
    m["kernel"]["release"] = "r" * 256
    s = wire.decode_batch(_batch(m))[0]
    assert wire.session_from_wire(s).trigger.cgroup == "/" * 4096


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=80)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=10), kids, max_size=6),
    max_leaves=40,
)
_KEYS = ["v", "id", "trigger", "kernel", "mappings", "kframes", "uframes", "stacks", "threads", "traces"]
_PY_KEYS = ["py_files", "py_functions", "unwind"]  # (v4)


@st.composite
def _session_shapes(draw: st.DrawFn) -> Any:
    """A valid session with some fields replaced by arbitrary values, or anything at all."""
    if draw(st.booleans()):
        return draw(_VALUES)
    m = _session_map(python=draw(st.booleans()))
    for key in draw(
        st.lists(st.sampled_from(_KEYS + _PY_KEYS + ["labels", "processes", "tenant"]), max_size=3)
    ):
        m[key] = draw(_VALUES)
    if "py_functions" in m and draw(st.booleans()):  # a Python row or frame made wrong, the rest valid
        table = draw(st.sampled_from(["py_files", "py_functions", "uframes"]))
        rows = m.get(table)
        if isinstance(rows, list) and rows:
            rows[draw(st.integers(0, len(rows) - 1))] = draw(_VALUES)
    return m


@FUZZ
@given(st.lists(_session_shapes(), max_size=4), _VALUES)
def test_fuzz_msgpack_shapes(sessions: list[Any], version: Any) -> None:
    for body in (_batch(*sessions), msgpack.packb({"v": version, "sessions": sessions}, use_bin_type=True)):
        try:
            items = wire.decode_batch(body)
        except WireError:
            continue
        for item in items:
            try:
                wire.session_from_wire(item)
            except WireError:
                pass


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_msgpack_bytes(data: bytes) -> None:
    for decode in (wire.decode_batch, wire.decode_session):
        try:
            decode(data)
        except WireError:
            pass


# ---------------------------------------------------------------------------
# Stack depths through the formats


def _deep_profile(depth: int, sid: str = "deep", leaf: str = "leaf") -> Profile:
    frames = [Frame(f"f{i}", "deep.so") for i in range(depth - 1)] + [Frame(leaf, "deep.so")]
    stack = tuple(range(depth))
    samples = [Sample(stack, on_cpu=3, off_cpu=1, off_cpu_ns=10), Sample(stack[: depth // 2], on_cpu=1)]
    return Profile(SessionMeta(sid), frames, samples)


def _depth(tree: dict[str, Any]) -> int:
    depth = 0
    while tree["children"]:
        tree = tree["children"][0]
        depth += 1
    return depth


def test_deep_stacks_render_everywhere() -> None:
    """A 1 500-frame stack made flamegraphs, merges and diffs raise RecursionError (deepest: 496)."""
    a, b = _deep_profile(1500), _deep_profile(1500, "b", leaf="other")
    merged = formats.merge([a, b])
    for tree in (
        formats.flamegraph(a),
        formats.flamegraph(merged),
        formats.diff(a, b),
        formats.diff(merged, a),
    ):
        text = formats.tree_json(tree)
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(20_000)  # json.loads and == recurse per level, as json.dumps did
        try:
            assert json.loads(text) == tree
        finally:
            sys.setrecursionlimit(old)
    assert _depth(formats.flamegraph(a)) == 1500
    assert formats.folded(a).count(";") == 1499 + 749
    formats.speedscope(a)
    formats.pprof(a)


def test_tree_json_is_json_dumps() -> None:
    from tests.unit.test_formats import sample_profile

    for tree in (formats.flamegraph(sample_profile()), formats.diff(sample_profile(), sample_profile())):
        assert json.loads(formats.tree_json(tree)) == tree


@settings(FUZZ, max_examples=40)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=4), st.sampled_from(formats.VALUES))
def test_fuzz_stack_depths(depths: list[int], value: str) -> None:
    profiles = [_deep_profile(max(d, 1), f"s{i}") for i, d in enumerate(depths)]
    merged = formats.merge(profiles)
    formats.tree_json(formats.flamegraph(merged, value))
    formats.tree_json(formats.diff(profiles[0], merged, value))
    formats.tree_json(formats.diff(merged, profiles[-1], value))


# ---------------------------------------------------------------------------
# kallsyms uploads


def test_kallsyms_bomb_is_refused_in_bounded_memory() -> None:
    """16 MiB of kallsyms lines (24 KiB of gzip) took a worker to 658 MB."""
    bomb = kallsyms_bomb(16)

    def parse() -> None:
        with pytest.raises(KallsymsTooLarge, match="more than 500000 text symbols"):
            parse_kallsyms(bomb)

    assert _peak_bytes(parse) < 64 << 20


def test_kallsyms_decompressed_size_is_checked_while_decompressing() -> None:
    bomb = gzip.compress(b"\n" * (kallsyms.MAX_SNAPSHOT_BYTES + 1), mtime=0)

    def parse() -> None:
        with pytest.raises(KallsymsTooLarge, match="larger than 33554432 bytes uncompressed"):
            parse_kallsyms(bomb)

    assert _peak_bytes(parse) < 8 << 20


def test_kallsyms_names_and_framing_are_checked() -> None:
    good = b"ffffffff81000000 T _text\nffffffff81000100 T schedule\n"
    with pytest.raises(KallsymsError, match="a symbol name is over 512 bytes"):
        parse_kallsyms(good + b"ffffffff81000200 T " + b"n" * 513 + b"\n")
    with pytest.raises(KallsymsError, match="truncated"):
        parse_kallsyms(gzip.compress(good)[:-12])
    with pytest.raises(KallsymsError, match="after its gzip member"):
        parse_kallsyms(gzip.compress(good) + b"junk")
    # A line too long for a symbol is skipped whole, even across slices.
    long_line = b"ffffffff81000300 T " + b"x" * (3 << 20) + b"ffffffff81000400 T hidden\n"
    idx = parse_kallsyms(gzip.compress(good + long_line + b"ffffffff81000500 T after\n"))
    assert idx.lookup(0xFFFFFFFF81000404) == ("schedule", "", 0x304)
    assert idx.address_of("after") == 0xFFFFFFFF81000500 and idx.address_of("hidden") is None
    # A line cut between two slices of the decompressed text is joined again.
    lines = b"".join(b"ffffffff%08x T fn_%07d\n" % (0x81000000 + 16 * i, i) for i in range(60_000))
    idx = parse_kallsyms(gzip.compress(lines))
    assert len(idx) == 60_000 and idx.lookup(0xFFFFFFFF81000000 + 16 * 59_999 + 4) == ("fn_0059999", "", 4)


def test_uploaded_kernels_expire_and_count_in_the_size_limit(tmp_path: Path) -> None:
    from tests.unit.test_store import DAY, T0, record

    s = Store(str(tmp_path / "k.db"), retention_days=7)
    s.migrate()
    s.put_kernel("aa", b"A" * 1000)  # uploaded now, needed by a session
    s.put_kernel("bb", b"B" * 1000)  # uploaded now, needed by none
    s.insert(record("uses-aa", T0, kernel_build_id="aa"))
    far = time.time_ns() + 30 * DAY
    assert s.expire_kernels(far) == ["bb"]  # aa is kept while its session is
    assert s.has_kernel("aa") and not s.has_kernel("bb")

    s.retention_days = None
    s.put_kernel("cc", b"C" * 100_000)
    sessions = s.stats()[1]
    s.max_db_bytes = sessions + 1000 + 50_000
    assert s.kernel_bytes() == 101_000
    assert s.expire_kernels() == ["cc"]  # an unused kernel goes before any session
    assert s.stats()[0] == 1
    s.put_kernel("dd", b"D" * 100_000)
    s.insert(record("uses-dd", T0 + DAY, kernel_build_id="dd"))
    assert s.expire_kernels() == []
    assert s.enforce_retention()["size"] >= 1  # the kernel's bytes push sessions out


def test_expired_kernel_leaves_the_state_dir_and_is_asked_for_again(tmp_path: Path) -> None:
    from bistouri.symbolizer.service.server import ServerConfig, SymbolizerApp
    from testkit.wsgiclient import Client

    app = SymbolizerApp(ServerConfig(state_dir=tmp_path, max_db_bytes=10), lambda kernels: None)  # type: ignore[arg-type,return-value]
    app.store.migrate()
    client = Client(app)
    snapshot = gzip.compress(b"ffffffff81000000 T _text\nffffffff81000100 T schedule\n")
    assert client.put("/v1/kernels/" + "ab" * 20, data=snapshot).status_code == 204
    assert client.get("/v1/kernels/" + "ab" * 20).status_code == 200
    app.run_retention()  # no session needs it and the database is over 10 bytes
    assert not app.store.has_kernel("ab" * 20) and not app.kallsyms.has("ab" * 20)
    assert client.get("/v1/kernels/" + "ab" * 20).status_code == 404  # the agent uploads it again

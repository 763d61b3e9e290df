"""The pprof encoder (formats.pprof_rows: a frame at a time, ids kept between profiles by the export's
sender) against the reference encoder it replaced (tests/pprof_reference.py, a sample at a time):
both decoded by pprof's own profile.proto, each sample resolved to its stack of (mapping, function,
file, line), its values and labels, must be equal. Ids and table order may differ; what a reader
of the profile sees may not."""

from __future__ import annotations

import gzip
import random
from collections import Counter
from types import ModuleType
from typing import Any

import pytest

from bistouri.symbolizer import formats
from bistouri.symbolizer.model import Frame, Profile, Sample, SessionMeta
from tests.pprof_proto import compile_profile_proto
from tests.pprof_reference import pprof as reference_pprof
from tests.unit.test_formats import python_profile, sample_profile


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


def resolved(pb2: ModuleType, data: bytes) -> dict[str, Any]:
    """What a pprof reader sees, ids resolved: samples as a multiset, the profile's own fields."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    m = pb2.Profile()
    m.ParseFromString(data)
    s = m.string_table
    assert s[0] == ""
    functions = {f.id: (s[f.name], s[f.system_name], s[f.filename]) for f in m.function}
    mappings = {
        p.id: (s[p.filename], p.has_functions, p.has_filenames, p.has_line_numbers, p.has_inline_frames)
        for p in m.mapping
    }
    assert len(functions) == len(m.function) and len(mappings) == len(m.mapping)  # ids unique
    locations = {
        loc.id: (mappings[loc.mapping_id], tuple((functions[ln.function_id], ln.line) for ln in loc.line))
        for loc in m.location
    }
    assert len(locations) == len(m.location)
    samples: Counter[Any] = Counter()
    for x in m.sample:
        labels = tuple(sorted((s[la.key], s[la.str] if la.str else la.num) for la in x.label))
        samples[tuple(locations[i] for i in x.location_id), tuple(x.value), labels] += 1
    return {
        "types": [(s[t.type], s[t.unit]) for t in m.sample_type],
        "samples": samples,
        "time": (m.time_nanos, m.duration_nanos, s[m.period_type.type], s[m.period_type.unit], m.period),
        "comments": [s[c] for c in m.comment],
        "default": s[m.default_sample_type],
    }


def real_shaped(n: int, seed: int) -> list[Profile]:
    """Sessions shaped as a service's: frames of a few binaries (names, files, lines; some inlined
    into their caller, one at a stack's root), kernel and vDSO frames under them, recursion, a
    frame listed twice, an empty stack, threads, samples before the trigger, a count past int64."""
    rng = random.Random(seed)
    pool = [Frame(f"k_{i}", "vmlinux", kind="kernel") for i in range(30)]
    pool.append(Frame("__vdso_clock_gettime", "[vdso]", kind="vdso"))
    for lib in ("libpython3.11.so.1.0", "libc.so.6", "app"):
        for i in range(200):
            file = f"src/{lib}/{i % 17}.c" if rng.random() < 0.6 else ""
            line = rng.randint(0, 3000) if file else 0
            pool.append(Frame(f"{lib}_fn_{i}", lib, file, line, inlined=bool(file) and rng.random() < 0.1))
    out = []
    for k in range(n):
        frames = rng.sample(pool, 150)
        frames.append(frames[3])  # the same row twice in one table
        inlined_root = next((i for i, f in enumerate(frames) if f.inlined), 0)
        samples = [Sample((), pid=7, on_cpu=1)]
        for j in range(60):
            stack = [rng.randrange(len(frames)) for _ in range(rng.randint(1, 30))]
            if j % 7 == 0:
                stack = [inlined_root, *stack]
            if j % 11 == 0:
                stack += stack[-3:]  # recursion
            samples.append(
                Sample(
                    tuple(stack),
                    pid=100 + j % 3,
                    tid=100 + j % 5,
                    thread=f"t{j % 4}" if j % 6 else "",
                    on_cpu=rng.randint(0, 40) if j else 1 << 64,
                    off_cpu=rng.randint(0, 2),
                    off_cpu_ns=rng.randint(0, 10**8),
                    pre_trigger=j % 9 == 0,
                )
            )
        meta = SessionMeta(
            session_id=f"real-{seed}-{k}",
            processes={100: "python3", 101: "worker"},
            resource="cpu",
            stall="some",
            start_ns=1_700_000_000_000_000_000 + k,
            duration_ns=10**10,
            period_ns=52_631_578,
        )
        out.append(Profile(meta=meta, frames=frames, samples=samples))
    return out


def test_the_encoder_decodes_equal_to_the_reference_one(profile_pb2: ModuleType) -> None:
    profiles = [sample_profile(), python_profile(), *real_shaped(30, seed=1)]
    ids = formats.PprofIds()  # as the sender keeps them, from one profile to the next
    for p in profiles:
        want = resolved(profile_pb2, reference_pprof(p))
        assert resolved(profile_pb2, formats.pprof(p)) == want, p.meta.session_id
        rows = formats.frame_rows(p)
        assert resolved(profile_pb2, formats.pprof_rows(p.meta, *rows, ids=ids)) == want, p.meta.session_id


def test_ids_kept_between_profiles_are_forgotten_past_their_bound(profile_pb2: ModuleType) -> None:
    ids = formats.PprofIds()
    ids.MAX_LOCATIONS = 100
    for p in real_shaped(5, seed=2):
        got = formats.pprof_rows(p.meta, *formats.frame_rows(p), ids=ids)
        assert len(ids.locations) <= 100 + len(p.frames) + len(p.samples) * 30  # one profile's worth
        assert resolved(profile_pb2, got) == resolved(profile_pb2, reference_pprof(p))


def test_the_same_profile_gives_the_same_bytes() -> None:
    p = real_shaped(1, seed=3)[0]
    assert formats.pprof(p) == formats.pprof(p)
    a, b = formats.PprofIds(), formats.PprofIds()
    rows = formats.frame_rows(p)
    assert formats.pprof_rows(p.meta, *rows, ids=a) == formats.pprof_rows(p.meta, *rows, ids=b)


def _varint(n: int) -> bytes:
    """Protocol buffers' base-128 varint, a byte at a time (n >= 0)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_varints_are_protocol_buffers_base_128() -> None:
    from bistouri.symbolizer import protobuf

    assert [_varint(n) for n in range(1 << 14)] == protobuf.SMALL_VARINTS
    for n in (1 << 14, (1 << 14) + 1, 300_000, 1 << 35, protobuf.INT64_MAX):
        assert protobuf.varint(n) == _varint(n)
    assert protobuf.varint(-1) == _varint((1 << 64) - 1)  # int64 negatives: ten bytes

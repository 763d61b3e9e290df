"""Go binaries: their id without a GNU build id, and `.gopclntab` (names, file:line, inlined calls,
stack rules) for the three layouts, on real programs built here and on tables built by hand;
hostile tables stay bounded."""

from __future__ import annotations

import bisect
import random
import shutil
import struct
import subprocess
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bistouri import gopclntab, wire
from bistouri.bpf.abi import CfaKind
from bistouri.compat import zip_strict
from bistouri.elf import GO_ID_LEN, ElfFile, go_file_id, is_go_file_id, read_build_id
from bistouri.gopclntab import (
    FLAG_TOPFRAME,
    MAX_INLINE_DEPTH,
    MAX_PCVALUE_STEPS,
    GoFrame,
    GoPclnError,
    GoPclnTab,
    InlineTrees,
    read_pclntab,
)
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.service.uploads import UploadRefused, Uploads
from bistouri.symbolizer.sources import DebugSources
from bistouri.unwind.ehframe import build_table, unpack_rows
from testkit.gobuild import go_build

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- tables built by hand, one per layout ---------------------------------------------------------

TEXT = 0x401000
RO = 0x480000
LAYOUTS = {(1, 16): 0xFFFFFFFA, (1, 18): 0xFFFFFFF0, (1, 20): 0xFFFFFFF1}


def _uvarint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pcvalue(spans: list[tuple[int, int]]) -> bytes:
    """(end offset, value) spans from the entry, as the Go linker encodes them."""
    out = bytearray()
    val, pc = -1, 0
    for end, value in spans:
        dv = value - val
        out += _uvarint(dv << 1 if dv >= 0 else (-dv - 1) << 1 | 1) + _uvarint(end - pc)
        val, pc = value, end
    return bytes(out + b"\0")


# main.f at TEXT (0x40 bytes) has main.g inlined at [0x10, 0x20), called from the line of
# offset 0x8; main.h follows it (0x20 bytes) and is an outermost frame (TOPFRAME).
FUNCS = [
    {
        "name": "main.f",
        "entry": TEXT,
        "end": TEXT + 0x40,
        "lines": [(0x10, 10), (0x20, 20), (0x40, 12)],
        "inl": [(0x10, -1), (0x20, 0), (0x40, -1)],
        "sp": [(0x4, 0), (0x3C, 16), (0x40, 0)],
        "flag": 0,
    },
    {
        "name": "main.h",
        "entry": TEXT + 0x40,
        "end": TEXT + 0x60,
        "lines": [(0x20, 30)],
        "sp": [(0x20, 0)],
        "flag": FLAG_TOPFRAME,
    },
]
INLINE = {"name": "main.g", "parent_pc": 0x8}


def build_table_bytes(version: tuple[int, int]) -> tuple[bytes, InlineTrees]:
    names = bytearray(b"\0")
    nameoff = {}
    for n in ["main.f", "main.h", "main.g"]:
        nameoff[n] = len(names)
        names += n.encode() + b"\0"
    files = b"\0/src/main.go\0"
    cutab = struct.pack("<I", 1)  # file 0 of CU 0 is at filetab offset 1
    pctab = bytearray(b"\0")
    tables = []
    for f in FUNCS:
        t = {}
        for key in ("lines", "sp", "inl"):
            if key in f:
                t[key] = len(pctab)
                pctab += _pcvalue(f[key])  # type: ignore[arg-type]
        t["file"] = len(pctab)
        pctab += _pcvalue([(f["end"] - f["entry"], 0)])  # type: ignore[operator]
        tables.append(t)
    # The inline tree, in "rodata" at RO (1.16: an address; later: an offset from gofunc = RO).
    if version >= (1, 20):
        tree = struct.pack("<B3xiii", 0, nameoff["main.g"], INLINE["parent_pc"], 0)
    else:
        tree = struct.pack("<hBxiiii", -1, 0, 0, 20, nameoff["main.g"], INLINE["parent_pc"])
    ro = b"\0" * 16 + tree
    tree_off = 16
    head = 64 if version == (1, 16) else 72
    names_at = head
    cu_at = names_at + len(names)
    files_at = cu_at + len(cutab)
    pctab_at = files_at + len(files)
    pcln_at = (pctab_at + len(pctab) + 7) & ~7
    ent = 16 if version == (1, 16) else 8
    ftab = bytearray()
    funcs = bytearray()
    func_base = (len(FUNCS) + 1) * ent
    for f, t in zip_strict(FUNCS, tables):
        foff = func_base + len(funcs)
        entry = f["entry"]
        ftab += (
            struct.pack("<QQ", entry, foff) if version == (1, 16) else struct.pack("<II", entry - TEXT, foff)
        )
        npcdata = 3 if "inl" in t else 0
        nfuncdata = 4 if "inl" in t else 0
        fields = (0, 0, t["sp"], t["file"], t["lines"], npcdata, 0)
        if version == (1, 16):
            body = struct.pack("<Qi7IB2xB", entry, nameoff[f["name"]], *fields, 0, nfuncdata)
        elif version == (1, 18):
            body = struct.pack(
                "<Ii7IBBxB", entry - TEXT, nameoff[f["name"]], *fields, 0, f["flag"], nfuncdata
            )
        else:
            body = struct.pack(
                "<Ii7IiBBxB", entry - TEXT, nameoff[f["name"]], *fields, 1, 0, f["flag"], nfuncdata
            )
        funcs += body
        if npcdata:
            funcs += struct.pack("<3I", 0, 0, t["inl"])
        if nfuncdata:
            if version == (1, 16):
                if (pcln_at + func_base + len(funcs)) % 8:
                    funcs += b"\0" * 4
                funcs += struct.pack("<4Q", 0, 0, 0, RO + tree_off)
            else:
                funcs += struct.pack("<4I", 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, tree_off)
        while len(funcs) % 8:
            funcs += b"\0"
    last = FUNCS[-1]["end"]
    ftab += struct.pack("<QQ", last, 0) if version == (1, 16) else struct.pack("<II", last - TEXT, 0)  # type: ignore[operator]
    offsets = (names_at, cu_at, files_at, pctab_at, pcln_at)
    header = struct.pack("<IBBBB", LAYOUTS[version], 0, 0, 1, 8)
    if version == (1, 16):
        header += struct.pack("<7Q", len(FUNCS), 1, *offsets)
    else:
        header += struct.pack("<8Q", len(FUNCS), 1, TEXT, *offsets)
    data = header + names + cutab + files + pctab
    data += b"\0" * (pcln_at - len(data)) + ftab + funcs
    return bytes(data), InlineTrees(ro, RO, RO)


@pytest.mark.parametrize("version", list(LAYOUTS))
def test_each_layout_names_lines_and_inlined_calls(version: tuple[int, int]) -> None:
    data, inl = build_table_bytes(version)
    tab = GoPclnTab(data, TEXT, inl)
    assert tab.version == version and len(tab) == 2
    assert tab.function(TEXT + 0x3) == ("main.f", 3)
    assert tab.frames(TEXT + 0x3) == [GoFrame("main.f", "/src/main.go", 10)]
    # main.g inlined: its own line, then the call site's line in main.f.
    assert tab.frames(TEXT + 0x14) == [
        GoFrame("main.g", "/src/main.go", 20),
        GoFrame("main.f", "/src/main.go", 10),
    ]
    assert tab.frames(TEXT + 0x30) == [GoFrame("main.f", "/src/main.go", 12)]
    assert tab.frames(TEXT + 0x45) == [GoFrame("main.h", "/src/main.go", 30)]
    assert tab.frames(TEXT + 0x60) == [] and tab.frames(TEXT - 1) == []
    assert [(s, e, n) for s, e, n in tab.symbols().items()] == [
        (TEXT, TEXT + 0x40, "main.f"),
        (TEXT + 0x40, TEXT + 0x60, "main.h"),
    ]
    rules = list(tab.frame_rules())
    assert rules[0] == (TEXT, TEXT + 0x40, 0, [(TEXT, 0), (TEXT + 4, 16), (TEXT + 0x3C, 0)])
    assert rules[1][2] & FLAG_TOPFRAME if version != (1, 16) else rules[1][2] == 0


def test_without_its_inline_trees_a_table_still_names_and_numbers_lines() -> None:
    data, _ = build_table_bytes((1, 18))
    tab = GoPclnTab(data, TEXT, None)
    assert tab.frames(TEXT + 0x14) == [GoFrame("main.f", "/src/main.go", 20)]


@pytest.mark.parametrize(
    ("patch", "why"),
    [
        (lambda d: b"\0\0\0\0" + d[4:], "unknown header"),
        (lambda d: d[:7] + b"\x04" + d[8:], "unknown header"),  # pointer size 4
        (lambda d: d[:8] + struct.pack("<Q", 10**9) + d[16:], "functions"),
        (lambda d: d[:32] + struct.pack("<Q", 1 << 40) + d[40:], "past the table"),
        (lambda d: d[:40], "too short"),
    ],
)
def test_bad_headers_are_refused(patch, why: str) -> None:  # type: ignore[no-untyped-def]
    data, inl = build_table_bytes((1, 18))
    with pytest.raises(GoPclnError, match=why):
        GoPclnTab(patch(data), TEXT, inl)


def test_an_inline_chain_that_loops_is_cut() -> None:
    """1.20 finds a call's parent at its call site: a call site inside the call loops for ever."""
    data, inl = build_table_bytes((1, 20))
    tree = struct.pack("<B3xiii", 0, 1, 0x14, 0)  # parent pc inside the inlined range itself
    looped = InlineTrees(inl.data[:16] + tree, inl.vaddr, inl.gofunc)
    frames = GoPclnTab(data, TEXT, looped).frames(TEXT + 0x14)
    assert len(frames) == MAX_INLINE_DEPTH + 1


def _survives(data: bytes, inl: InlineTrees) -> None:
    try:
        tab = GoPclnTab(data, TEXT, inl)
    except GoPclnError:
        return
    for pc in (TEXT, TEXT + 0x14, TEXT + 0x30, TEXT + 0x45, TEXT + 0x100):
        assert isinstance(tab.frames(pc), list)
        tab.function(pc)
    tab.symbols()
    for _ in tab.frame_rules():
        pass


@FUZZ
@given(
    st.sampled_from(list(LAYOUTS)),
    st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), max_size=12),
)
def test_fuzz_damaged_tables(version: tuple[int, int], edits: list[tuple[int, int]]) -> None:
    data, inl = build_table_bytes(version)
    buf = bytearray(data)
    for at, byte in edits:
        buf[at % len(buf)] = byte
    tree = bytearray(inl.data)
    for at, byte in edits[:3]:
        tree[at % len(tree)] = byte
    t0 = time.process_time()
    _survives(bytes(buf), InlineTrees(bytes(tree), inl.vaddr, inl.gofunc))
    assert time.process_time() - t0 < 1.0


@FUZZ
@given(st.binary(min_size=64, max_size=2048))
def test_fuzz_any_bytes_after_a_valid_magic(tail: bytes) -> None:
    for magic in LAYOUTS.values():
        _survives(struct.pack("<IBBBB", magic, 0, 0, 1, 8) + tail, InlineTrees(b"", RO, RO))


def _decoded(tab: GoPclnTab, at: int) -> Callable[[int], int | None]:
    """The table at `at` in the data decoded whole as a function's record holds it: its value at a PC."""
    runs: list[int] = []
    lo, hi, vo = gopclntab._decode(tab._data, at, TEXT, 1, runs)
    assert len(runs) == 2 * (hi - lo) + 1 and hi - lo <= MAX_PCVALUE_STEPS
    array("q", runs)  # every start, end and value an int64, whatever the table holds
    return lambda pc: gopclntab._run_value(runs, lo, hi, vo, pc)


def test_a_pc_is_searched_among_its_bucket_s_functions() -> None:
    """The bucket search (`_first`) answers as a search of the whole function table: near bucket
    edges, outside the table, and in a table spanning far more than its functions (its buckets
    then wider, their number bounded)."""
    data, inl = build_table_bytes((1, 16))
    pcln = struct.unpack_from("<Q", data, 8 + 6 * 8)[0]
    rng = random.Random(5)
    for end in (TEXT + 0x60, TEXT + 0x3000, 1 << 62):
        buf = bytearray(data)
        struct.pack_into("<Q", buf, pcln + 2 * 16, end)  # the last function's end
        tab = GoPclnTab(bytes(buf), TEXT, inl)
        assert len(tab._first) <= len(tab) + 1024 + 2
        edges = [TEXT + k * 0x1000 + d for k in range(4) for d in (-1, 0, 1)]
        pcs = [0, TEXT - 1, TEXT + 0x3F, TEXT + 0x40, end - 1, end, end + 0x1000, *edges]
        pcs += [rng.randrange(TEXT - 0x100, end + 0x2000) for _ in range(200)]
        for pc in pcs:
            i = bisect.bisect_right(tab._entries, pc) - 1
            want = i if 0 <= i < len(tab) and pc < tab._entries[i + 1] else None
            key = tab.key(pc)
            assert tab._index(pc) == want and (key & 0x1FFFFF if key is not None else None) == want, hex(pc)


def test_a_pc_value_table_that_never_ends_is_bounded() -> None:
    data, inl = build_table_bytes((1, 18))
    # A table of 1-byte pc steps, value +1 each, far past the function: decoding stops at its bound.
    endless = b"\x02\x01" * 200_000
    at = len(data)
    tab = GoPclnTab(data + endless, TEXT, inl)
    t0 = time.process_time()
    assert tab._pcvalue(at - tab._pctab, TEXT, TEXT + 10**7) is None
    assert time.process_time() - t0 < 2.0
    value = _decoded(tab, at)
    assert value(TEXT + 5) == 5 and value(TEXT + 3) == 3
    assert value(TEXT + MAX_PCVALUE_STEPS - 1) == MAX_PCVALUE_STEPS - 1
    assert value(TEXT + MAX_PCVALUE_STEPS) is None and value(TEXT - 1) is None


def _reference_value(table: bytes, entry: int, pc: int) -> int | None:
    """A pc-value table read the plain way, from the entry each time (the layout's definition)."""
    pos, val, cur = 0, -1, entry
    for step in range(MAX_PCVALUE_STEPS):
        try:
            uv, pos = gopclntab._uvarint(table, pos, len(table))
            if uv == 0 and step:
                return None
            val += -((uv >> 1) + 1) if uv & 1 else uv >> 1
            delta, pos = gopclntab._uvarint(table, pos, len(table))
        except GoPclnError:
            return None
        if not (-(2**63) <= val < 2**63 and cur < 2**63):
            return None  # a table past 64 bits ends there
        if cur <= pc < cur + delta:
            return val
        cur += delta
    return None


@FUZZ
@given(st.binary(max_size=96), st.lists(st.integers(0, 1 << 12), min_size=1, max_size=24))
def test_fuzz_decoded_tables_answer_as_the_plain_walk(table: bytes, offsets: list[int]) -> None:
    """Any bytes: a table decoded whole and bisected answers as the walk from the entry, and never
    holds more runs than its bound."""
    data, inl = build_table_bytes((1, 18))
    tab = GoPclnTab(data + table, TEXT, inl)
    value = _decoded(tab, len(data))
    for off in offsets:
        assert value(TEXT + off) == _reference_value(table, TEXT, TEXT + off), off


def test_what_lookups_keep_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bounds the decoded state is dropped whole, and lookups answer as before."""
    data, inl = build_table_bytes((1, 20))
    want = {pc: GoPclnTab(data, TEXT, inl).frames(pc) for pc in range(TEXT, TEXT + 0x60)}
    monkeypatch.setattr(gopclntab, "MAX_HELD_FUNCS", 1)
    tab = GoPclnTab(data, TEXT, inl)
    for _ in range(2):
        for pc, frames in want.items():
            assert tab.frames(pc) == frames, hex(pc)
            assert len(tab._funcs) <= 1


def test_equal_keys_give_equal_frames() -> None:
    """What a caller keeps one answer per key for: the addresses of a key share its frames."""
    data, inl = build_table_bytes((1, 20))
    tab = GoPclnTab(data, TEXT, inl)
    pcs = list(range(TEXT - 4, TEXT + 0x100))
    assert list(tab.keys([None, *pcs])) == [None, *map(tab.key, pcs)]  # a batch as one at a time
    by_key: dict[int, set[tuple[GoFrame, ...]]] = {}
    for pc in pcs:
        key = tab.key(pc)
        assert (key is None) == (tab.chain(pc) == ())
        if key is not None:
            by_key.setdefault(key, set()).add(tab.chain(pc))
    assert by_key and all(len(chains) == 1 for chains in by_key.values())


def test_a_batch_answers_as_frames_at_of_each_key() -> None:
    """`answers` (the resolver's batch): each PC's frames as `frames_at` of its key, one object a
    key, held up to the bound; PCs in no function are None."""
    data, inl = build_table_bytes((1, 20))
    tab = GoPclnTab(data, TEXT, inl)
    pcs = [None, *range(TEXT - 4, TEXT + 0x64), *range(TEXT, TEXT + 0x60, 3)]
    held: dict[int, tuple[GoFrame, ...]] = {}
    got, unnamed = tab.answers(pcs, gopclntab._go_frame, held, 1000)
    assert unnamed == [] and held
    by_key: dict[int, tuple[GoFrame, ...]] = {}
    for pc, frames in zip_strict(pcs, got):
        key = tab.key(pc) if pc is not None else None
        if key is None:
            assert frames is None, pc
            continue
        assert frames == tab.frames_at(key, gopclntab._go_frame), hex(pc)
        assert by_key.setdefault(key, frames) is frames  # shared by the PCs of a key
    assert any(len(f) > 1 for f in by_key.values())  # inlined calls among them
    # Held answers are given again as they are; past the bound, none is added.
    again, _ = tab.answers(pcs, gopclntab._go_frame, held, 1000)
    assert all(again[i] is held[k] for i, k in enumerate(map(tab.key, pcs[1:]), 1) if k is not None)
    few: dict[int, tuple[GoFrame, ...]] = {}
    assert tab.answers(pcs, gopclntab._go_frame, few, 2)[0] == got and len(few) == 2


I64 = st.integers(-(2**63), 2**63 - 1)


@given(st.integers(0, gopclntab.MAX_FUNCS), I64, st.integers(0, 2**63 - 1), I64)
def test_a_key_holds_any_table_values(i: int, fileno: int, line: int, ix: int) -> None:
    """Keys are one int each: any int64 a (hostile) table gives comes back, and unequal parts
    never make equal keys."""
    key = gopclntab._key(i, fileno, line, ix)
    assert gopclntab._unkey(key) == (i, fileno, line, ix)
    assert key != gopclntab._key(i, fileno, line, ix ^ 1)


def test_a_damaged_run_ends_its_table_and_keeps_the_runs_before_it() -> None:
    data, inl = build_table_bytes((1, 18))
    at = len(data)
    # Two runs, then a varint that never ends (the data's end): the two still answer.
    tab = GoPclnTab(data + b"\x02\x04\x02\x04" + b"\xff" * 12, TEXT, inl)
    value = _decoded(tab, at)
    assert [value(TEXT + pc) for pc in (0, 3, 4, 7, 8, 100)] == [0, 0, 1, 1, None, None]
    # A start PC past 64 bits: the table ends before it (its end held as 2^63 - 1).
    big = b"\x02" + b"\xff" * 8 + b"\x7f" + b"\x02\x01\x00"
    tab = GoPclnTab(data + big, TEXT, inl)
    value = _decoded(tab, at)
    assert value(TEXT) == 0 and value(2**63 - 2) == 0 and value(2**63 - 1) is None
    # A value past 64 bits: the same.
    tab = GoPclnTab(data + b"\x04\x04" + b"\xfe" + b"\xff" * 8 + b"\x01\x04\x00", TEXT, inl)
    value = _decoded(tab, at)
    assert [value(TEXT + pc) for pc in (0, 3, 4)] == [1, 1, None]


# --- real Go programs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gobins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("go")
    return {
        "plain": go_build("gohot", d),
        "stripped": go_build("gohot", d, "-s", "-w"),
        "no_buildid": go_build("gohot", d, "-s", "-w", "-buildid="),
        "pie": go_build("gohot", d, "-s", "-w", pie=True),
    }


def test_a_go_binary_has_an_id_of_its_own(gobins: dict[str, Path]) -> None:
    ids = {}
    for kind, path in gobins.items():
        with ElfFile(path) as f:
            assert f.build_id is None  # Go's linker writes no GNU note
            ids[kind] = f.file_id
            assert f.file_id is not None and is_go_file_id(f.file_id) and len(f.file_id) == GO_ID_LEN
            if kind != "no_buildid":
                assert f.go_build_id and f.file_id == go_file_id(b"buildid\0" + f.go_build_id)
        assert read_build_id(path) == ids[kind]  # what the agent, uploads and sources key it by
        assert read_build_id(path) == ids[kind]  # stable
    assert len(set(ids.values())) == len(gobins)
    # A GNU build id is the id of a file that has one, and never looks like a Go one.
    with ElfFile("/bin/true") as f:
        assert f.file_id == f.build_id and not is_go_file_id(f.file_id or b"")


def _go_tool_addr2line(binary: Path, pcs: list[int]) -> list[tuple[str, str]]:
    go = shutil.which("go")
    assert go is not None
    out = subprocess.run(
        [go, "tool", "addr2line", str(binary)],
        input="".join(f"0x{pc:x}\n" for pc in pcs),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    return list(zip_strict(out[0::2], out[1::2]))


def test_names_and_lines_equal_go_tool_addr2line(gobins: dict[str, Path]) -> None:
    """On the stripped build (-s -w: no .symtab, no DWARF), every function's name and the
    innermost file:line of sampled addresses equal what Go's own addr2line says of the plain one."""
    with ElfFile(gobins["stripped"]) as f:
        tab = read_pclntab(f)
        assert f.section(".symtab") is None and not f.has_dwarf
    assert tab is not None and tab.version >= (1, 18)
    rng = random.Random(7)
    funcs = list(tab.symbols().items())
    pcs = [rng.randrange(s, e) for s, e, _ in rng.sample(funcs, min(400, len(funcs)))]
    want = _go_tool_addr2line(gobins["plain"], pcs)
    same = 0
    for pc, (func, where) in zip_strict(pcs, want):
        frames = tab.frames(pc)
        assert frames and frames[-1].function == func, (hex(pc), frames, func)
        file, _, line = where.rpartition(":")  # ":-1" past the code (alignment padding): unknown
        same += (frames[0].file, frames[0].line) == ((file, int(line)) if line != "-1" else ("", 0))
    assert same >= 0.99 * len(pcs), (same, len(pcs))


def test_the_inlined_call_is_unfolded(gobins: dict[str, Path]) -> None:
    with ElfFile(gobins["stripped"]) as f:
        tab = read_pclntab(f)
    assert tab is not None
    start, end = next((s, e) for s, e, n in tab.symbols().items() if n == "main.hotLoop")
    src = (Path(__file__).parents[2] / "fixtures/go/gohot/main.go").read_text().splitlines()
    mix_line = next(i + 1 for i, t in enumerate(src) if "inlined into hotLoop" in t)
    call_line = next(i + 1 for i, t in enumerate(src) if "x = mix(x, i)" in t)
    chains = {tuple((fr.function, fr.line) for fr in tab.frames(pc)) for pc in range(start, end)}
    assert (("main.mix", mix_line), ("main.hotLoop", call_line)) in chains, chains


def test_stack_rules_end_at_goexit_and_keep_the_caller_of_a_frameless_leaf(gobins: dict[str, Path]) -> None:
    with ElfFile(gobins["stripped"]) as f:
        syms = {n: (s, e) for s, e, n in read_pclntab(f).symbols().items()}  # type: ignore[union-attr]
    rows = unpack_rows(build_table(str(gobins["stripped"])))
    pcs = [r.pc for r in rows]

    def rule_at(pc: int):  # type: ignore[no-untyped-def]
        import bisect

        return rows[bisect.bisect_right(pcs, pc) - 1]

    assert rule_at(syms["runtime.goexit"][0] + 1).cfa_kind == CfaKind.END
    hot = rule_at(syms["main.hotLoop"][0] + 4)
    assert (hot.cfa_kind, hot.cfa_off) == (CfaKind.RSP, 8)  # no frame: the return address at RSP
    mid = rule_at(syms["main.middle"][1] - 8)  # in its body, after the prologue... or the epilogue
    assert mid.cfa_kind == CfaKind.RSP
    assert rule_at(syms["runtime.systemstack"][0] + 4).cfa_kind == CfaKind.NONE  # writes SP


@pytest.mark.parametrize("kind", ["plain", "stripped"])
def test_the_resolver_names_go_frames_from_a_binary_dir(
    gobins: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy(gobins[kind], bindir / "gohot")
    bid = read_build_id(bindir / "gohot")
    assert bid is not None
    with ElfFile(bindir / "gohot") as f:
        tab = read_pclntab(f)
        start = next(s for s, _, n in tab.symbols().items() if n == "main.hotLoop")  # type: ignore[union-attr]
        seg = next(s for s in f.segments if s.vaddr <= start < s.vaddr + s.memsz)
    off = start - seg.vaddr + seg.offset + 8
    session = wire.Session(
        "go-1",
        wire.Trigger("cpu", threshold_us=100, cgroup="/"),
        wire.KernelInfo("6.1", b"", 0),
        start_ns=1,
        duration_ns=1,
        period_ns=1000,
        processes={1: "gohot"},
        threads={1: "gohot"},
        traces=[wire.Trace((), (wire.UserFrame(wire.FRAME_RESOLVED, bid, off, "gohot"),), 1, 1, on_cpu=1)],
    )
    session = wire.decode_session(wire.encode_session(session))
    with Resolver(DebugSources(binary_dirs=[str(bindir)], debuginfod_urls=[]), use_llvm=False) as r:
        p = r.symbolize(session)
    leaf = p.frames[p.samples[0].stack[-1]]
    assert leaf.name == "main.hotLoop" and leaf.module == "gohot"
    assert leaf.file and leaf.file.endswith("gohot/main.go") and leaf.line, leaf
    # The same file uploaded by an agent: accepted under its Go id, and it names that tenant's frames.
    Uploads._verify(str(bindir / "gohot"), (bindir / "gohot").stat().st_size, bid.hex())
    with pytest.raises(UploadRefused, match="as claimed"):
        Uploads._verify(str(bindir / "gohot"), 100, "ab" * 20)
    tree = tmp_path / "uploads" / "default" / ".build-id" / bid.hex()[:2]
    tree.mkdir(parents=True)
    shutil.copy(gobins[kind], tree / bid.hex()[2:])
    uploads = DebugSources(debuginfod_urls=[], uploads_dir=str(tmp_path / "uploads"))
    with Resolver(uploads, use_llvm=False) as r:
        p = r.symbolize(session)
    assert p.frames[p.samples[0].stack[-1]].name == "main.hotLoop"


DEBIAN_GO = Path("/usr/bin/prometheus")  # Debian's, external linker (make deps: APT_MONITORING)


@pytest.mark.skipif(not DEBIAN_GO.exists(), reason="Debian's prometheus is not installed")
def test_a_go_program_nobody_here_wrote(tmp_path: Path) -> None:
    """Debian's prometheus: linked by gcc (a GNU build id, .eh_frame for its C part, stripped to a
    debuglink): its names and lines are read from the pclntab as Go's addr2line reads them, its
    inline trees found, and its unwind table ends goroutine stacks at runtime.goexit."""
    if shutil.which("go") is None:
        pytest.skip("go is not installed (Debian: golang-go)")
    with ElfFile(DEBIAN_GO) as f:
        assert f.build_id is not None and f.file_id == f.build_id
        tab = read_pclntab(f)
        text = f.section(".text")
    assert tab is not None and tab._inl is not None and text is not None
    rng = random.Random(11)
    funcs = list(tab.symbols().items())
    pcs = [rng.randrange(s, e) for s, e, _ in rng.sample(funcs, 500)]
    # Go 1.19's addr2line takes the .text section's address for runtime.text, which gcc's crt code
    # precedes by 0x100 bytes here: it is asked that much lower. (The runtime, and this reader, take
    # the table's own textStart: function entries then fall on Go's stack-check prologues.)
    shift = tab._text_start - text.addr
    same = 0
    for pc, (func, where) in zip_strict(pcs, _go_tool_addr2line(DEBIAN_GO, [pc - shift for pc in pcs])):
        frames = tab.frames(pc)
        file, _, line = where.rpartition(":")
        same += frames[-1].function == func and (frames[0].file, frames[0].line) == (
            (file, int(line)) if line != "-1" else ("", 0)
        )
    assert same >= 0.99 * len(pcs), (same, len(pcs))
    goexit = next(s for s, _, n in funcs if n == "runtime.goexit")
    rows = unpack_rows(build_table(str(DEBIAN_GO)))
    assert any(r.pc == goexit and r.cfa_kind == CfaKind.END for r in rows)


def test_the_agent_knows_a_running_go_program_by_its_go_id(gobins: dict[str, Path]) -> None:
    """procmaps (the agent, record) reads the mapped Go binary's id: its frames are resolved
    against it and the uploader finds the file under it."""
    from bistouri.host.procmaps import ProcMaps

    proc = subprocess.Popen([str(gobins["stripped"])], stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None and proc.stderr.readline() == b"ready\n"
        pm = ProcMaps()
        pm.track(proc.pid)
        bid = read_build_id(gobins["stripped"])
        assert bid is not None and is_go_file_id(bid)
        where = pm.locate(bid)
        assert where is not None and where.build_id() == bid
    finally:
        proc.kill()
        proc.wait()


def test_a_pie_is_named_from_its_relocated_table(gobins: dict[str, Path]) -> None:
    """Go's linker puts a PIE's table in `.data.rel.ro.gopclntab`; its moduledata pointers are
    relocations, so its frames have names and lines but not their inlined callers."""
    with ElfFile(gobins["pie"]) as f:
        assert f.type == 3  # ET_DYN
        tab = read_pclntab(f)
    assert tab is not None
    start = next(s for s, _, n in tab.symbols().items() if n == "main.hotLoop")
    src = str(Path(__file__).parents[2] / "fixtures/go/gohot/main.go")
    assert any(fr[-1] == GoFrame("main.hotLoop", src, fr[-1].line) and fr[-1].line > 0
               for fr in map(tab.frames, range(start, start + 32)))  # fmt: skip


def test_decoded_tables_answer_as_the_walk_from_the_entry(gobins: dict[str, Path]) -> None:
    """A function's tables are decoded once for all its addresses, in any order: the same answers
    as a first look at each address."""
    with ElfFile(gobins["stripped"]) as f:
        cold, warm = read_pclntab(f), read_pclntab(f)
    assert cold is not None and warm is not None
    pcs = [pc for s, e, _ in list(cold.symbols().items())[:300] for pc in range(s, e)]
    random.Random(3).shuffle(pcs)
    for pc in pcs:
        warm.frames(pc)
    assert warm._funcs
    for pc in pcs:
        cold._funcs.clear()  # every look a first one: decoded from the entry
        assert warm.frames(pc) == cold.frames(pc), hex(pc)


def test_a_batch_in_any_order_answers_as_each_pc_alone(
    gobins: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`answers` looks a batch up in address order: whatever order its PCs come in, with Nones, PCs
    outside the text and the decoded state dropped in the middle of the batch, each PC's answer is
    where it was asked and the one it gets alone."""
    with ElfFile(gobins["stripped"]) as f:
        batch, alone = read_pclntab(f), read_pclntab(f)
    assert batch is not None and alone is not None
    pcs: list[int | None] = [pc for s, e, _ in list(alone.symbols().items())[:200] for pc in range(s, e, 3)]
    pcs += [None, 0, 1 << 62, None]
    random.Random(5).shuffle(pcs)
    monkeypatch.setattr(gopclntab, "MAX_HELD_FUNCS", 4)
    got, unnamed = batch.answers(pcs, gopclntab._go_frame, {}, 1 << 20)
    assert len(got) == len(pcs) and unnamed == sorted(unnamed)
    assert sum(f is not None for f in got) > len(pcs) - 5
    for pc, frames in zip_strict(pcs, got):
        assert frames == alone.answers([pc], gopclntab._go_frame, {}, 0)[0][0], pc

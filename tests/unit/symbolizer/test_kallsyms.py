"""kallsyms snapshots: parsing, lookups at the edges, the on-disk store."""

from __future__ import annotations

import gzip
import threading
from pathlib import Path

import pytest

from bistouri.symbolizer.kallsyms import KallsymsError, KallsymsStore, parse_kallsyms
from bistouri.wire.snapshot import loaded_code_digest

from .helpers import FIXTURE_SRC

SNAPSHOT = (FIXTURE_SRC / "kallsyms.txt").read_bytes()
BID = bytes.fromhex("3b43fad5" * 5)


def test_parse_fixture() -> None:
    idx = parse_kallsyms(SNAPSHOT)
    assert idx.text_addr == 0xFFFFFFFF81000000
    assert len(idx) == 14  # distinct text addresses: aliases merged, data dropped
    # Real names win over section labels and __pi_ aliases at one address.
    assert idx.lookup(0xFFFFFFFF81000010) == ("srso_alias_untrain_ret", "", 0x10)
    assert idx.lookup(0xFFFFFFFF81000100) == ("do_one_initcall", "", 0)
    # Global/weak before local at one address.
    assert idx.lookup(0xFFFFFFFF81000401) == ("weak_alias_of_helper", "", 1)
    assert idx.lookup(0xFFFFFFFF81001004) == ("kprobe_handler", "", 4)
    assert idx.lookup(0xFFFFFFFF81200010) == ("schedule", "", 0x10)
    assert idx.lookup(0xFFFFFFFFA0000804) == ("ext4_mount", "ext4", 4)
    assert idx.lookup(0xFFFFFFFFA0010010) == ("bpf_prog_6deef7357e7b4530_handle_exec", "bpf", 0x10)
    assert idx.lookup(0xFFFFFFFFA0020001) == ("ftrace_trampoline", "__builtin__ftrace", 1)


@pytest.mark.parametrize(
    "ip",
    [
        0xFFFFFFFF80FFFFFF,  # below the kernel
        0xFFFFFFFF81001300,  # after __kprobes_text_end: padding
        0xFFFFFFFF81200500,  # after _etext
        0xFFFFFFFF81400200,  # after _einittext
        0xFFFFFFFFA0020000 + (2 << 20),  # past the last symbol by more than any function's length
    ],
)
def test_addresses_past_section_ends_are_unknown(ip: int) -> None:
    assert parse_kallsyms(SNAPSHOT).lookup(ip) is None


def test_unprivileged_snapshot_is_refused() -> None:
    zeroed = b"\n".join(b"0000000000000000 " + line[17:] for line in SNAPSHOT.splitlines())
    with pytest.raises(KallsymsError, match="read without privileges"):
        parse_kallsyms(zeroed)
    with pytest.raises(KallsymsError, match="not /proc/kallsyms"):
        parse_kallsyms(b"hello world\n")


def test_real_proc_kallsyms_parses_fast_enough() -> None:
    data = Path("/proc/kallsyms").read_bytes()
    try:
        idx = parse_kallsyms(data)
    except KallsymsError:
        pytest.skip("/proc/kallsyms shows no addresses to this user (not root)")
    assert len(idx) > 1000
    assert idx.address_of("schedule") is not None


def test_store_round_trip(tmp_path: Path) -> None:
    store = KallsymsStore(str(tmp_path))
    assert not store.has(BID) and store.get(BID) is None
    store.put(BID, gzip.compress(SNAPSHOT))  # gzip'd upload
    path = tmp_path / "kernels" / (BID.hex() + ".kallsyms.gz")
    assert store.has(BID) and store.has(BID.hex()) and path.is_file()
    assert gzip.decompress(path.read_bytes()) == SNAPSHOT
    # A new store (another process) loads it lazily from disk.
    idx = KallsymsStore(str(tmp_path)).get(BID)
    assert idx is not None and idx.lookup(0xFFFFFFFF81200010) == ("schedule", "", 0x10)


def test_store_lru(tmp_path: Path) -> None:
    store = KallsymsStore(str(tmp_path), max_loaded=2)
    ids = [bytes([i]) * 20 for i in range(3)]
    for bid in ids:
        store.put(bid, SNAPSHOT)
    assert len(store._loaded) == 2 and ids[0].hex() not in store._loaded
    assert store.get(ids[0]) is not None  # reloaded from disk
    assert list(store._loaded) == [ids[2].hex(), ids[0].hex()]


def test_store_rejects_bad_input(tmp_path: Path) -> None:
    store = KallsymsStore(str(tmp_path), max_bytes=len(SNAPSHOT) - 1)
    with pytest.raises(KallsymsError, match="larger than"):
        store.put(BID, SNAPSHOT)
    with pytest.raises(KallsymsError, match="larger than"):
        store.put(BID, gzip.compress(SNAPSHOT))
    with pytest.raises(KallsymsError, match="not valid gzip"):
        store.put(BID, b"\x1f\x8bgarbage")
    with pytest.raises(ValueError, match="invalid build id"):
        store.put("../../etc/passwd", SNAPSHOT)
    assert not list((tmp_path / "kernels").iterdir())  # nothing half-written


def test_store_concurrent_get(tmp_path: Path) -> None:
    KallsymsStore(str(tmp_path)).put(BID, SNAPSHOT)
    store = KallsymsStore(str(tmp_path))
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(store.get(BID))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in got}) == 1 and got[0] is not None  # parsed once, shared


def test_the_snapshot_reports_the_agents_loaded_code_digest() -> None:
    """The symbolizer's digest of a snapshot, parsed in slices, is the agent's of the same text: an agent
    compares the two to know whether the snapshot it finds lists the modules and programs it has now."""
    text = b"".join(
        [b"ffffffff81000000 T _text\n", b"ffffffff81000100 T schedule\n"]
        + [b"ffffffffc%07x t f%d\t[mod%d]\n" % (i * 64, i, i % 7) for i in range(200_000)]
    )
    agent_view = loaded_code_digest(text)
    assert parse_kallsyms(gzip.compress(text)).loaded_code == agent_view
    assert parse_kallsyms(text).loaded_code == agent_view
    one_less = text[: text.rfind(b"\n", 0, len(text) - 1) + 1]
    assert loaded_code_digest(one_less) != agent_view
    # Only the modules' and programs' lines count: the kernel's own do not move it.
    assert loaded_code_digest(text.replace(b" schedule\n", b" schedule2\n")) == agent_view


@pytest.mark.parametrize("order", ["as written", "modules first", "shuffled"])
def test_rows_in_any_order_give_each_address_its_preferred_name(order: str) -> None:
    """The rows are merged from their ascending runs (/proc/kallsyms has a few: its modules'), or
    sorted past `_Parsed.MAX_RUNS` (a shuffled /proc/kallsyms): either way each address once, in
    order, with the preferred of its names, the first line among equals; the fixture and the real
    /proc/kallsyms."""
    import random

    from bistouri.symbolizer.kallsyms import _Parsed

    real = Path("/proc/kallsyms").read_bytes()
    for snapshot in (SNAPSHOT, real):
        lines = snapshot.splitlines(keepends=True)
        if order == "modules first":
            lines = [ln for ln in lines if b"[" in ln] + [ln for ln in lines if b"[" not in ln]
        elif order == "shuffled":
            random.Random(7).shuffle(lines)
        try:
            parsed = _Parsed(iter([b"".join(lines)]))
        except KallsymsError:
            continue  # /proc/kallsyms without addresses (not root): the fixture alone
        merged = len(parsed.runs) <= _Parsed.MAX_RUNS
        assert merged == (order != "shuffled" or snapshot is not real)  # both paths taken
        # What it must give: by address, then preference, then the line's rank.
        rows = sorted(range(len(parsed.addrs)), key=lambda i: (parsed.addrs[i], parsed.prefs[i], i))
        want: dict[int, tuple[int, str, str]] = {}
        for i in rows:
            a = parsed.addrs[i]
            want.setdefault(a, (a, parsed._name(i), parsed.modules[parsed.row_module[i]]))
        assert list(parsed.symbols()) == list(want.values())
    assert parse_kallsyms(SNAPSHOT).lookup(0xFFFFFFFF81000010) == ("srso_alias_untrain_ret", "", 0x10)

"""Spool: atomic writes, byte bound with oldest-first drops, restarts, corruption, threads."""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import CollectorRegistry

from bistouri import atomicfile, wire
from bistouri.agent.spool import Spool, read_waiting

HEADER = wire.FILE_HEADER.size  # with no kernel build id


def dropped(reg: CollectorRegistry, reason: str) -> float:
    return reg.get_sample_value("bistouri_spool_dropped_total", {"reason": reason}) or 0.0


def make(tmp_path, max_bytes=10_000, **kw) -> tuple[Spool, CollectorRegistry]:
    reg = CollectorRegistry()
    return Spool(str(tmp_path / "spool"), max_bytes, registry=reg, **kw), reg


def test_put_read_ack_roundtrip(tmp_path):
    sp, reg = make(tmp_path)
    n1 = sp.put("a1", b"first")
    n2 = sp.put("b2", b"second")
    assert n1 and n2 and n1 < n2
    assert [(e.name, e.session_id, e.size) for e in sp.pending()] == [
        (n1, "a1", HEADER + 5),
        (n2, "b2", HEADER + 6),
    ]
    assert sp.read(n1) == b"first"
    assert reg.get_sample_value("bistouri_spool_sessions") == 2
    assert reg.get_sample_value("bistouri_spool_bytes") == 2 * HEADER + 11
    sp.ack(n1)
    sp.ack(n1)  # idempotent
    assert [e.name for e in sp.pending()] == [n2]
    assert not os.path.exists(tmp_path / "spool" / n1)
    assert reg.get_sample_value("bistouri_spool_bytes") == HEADER + 6
    assert os.listdir(tmp_path / "spool" / "tmp") == []


def test_bad_session_id(tmp_path):
    sp, _ = make(tmp_path)
    for bad in ["", "../x", "a/b", "a.b", "x" * 65]:
        with pytest.raises(ValueError):
            sp.put(bad, b"x")


def test_full_spool_drops_oldest_and_counts(tmp_path):
    sp, reg = make(tmp_path, max_bytes=3 * (HEADER + 100))
    names = [sp.put(f"s{i}", bytes(100)) for i in range(5)]
    assert [e.name for e in sp.pending()] == names[2:]
    assert dropped(reg, "spool_full") == 2
    assert sp.total_bytes == 3 * (HEADER + 100) <= sp.max_bytes
    assert sp.read(names[0]) is None  # gone from disk too
    # A session bigger than the whole spool is refused without evicting anything.
    assert sp.put("huge", bytes(1000)) is None
    assert dropped(reg, "too_large") == 1
    assert len(sp) == 3


def test_survives_restart_in_order_and_continues_sequence(tmp_path):
    sp, _ = make(tmp_path)
    a = sp.put("a", b"A")
    b = sp.put("b", b"B")
    sp.ack(a)
    sp2, reg2 = make(tmp_path)
    assert [e.name for e in sp2.pending()] == [b]
    assert reg2.get_sample_value("bistouri_spool_sessions") == 1
    c = sp2.put("c", b"C")
    assert c is not None and c > b
    assert [sp2.read(e.name) for e in sp2.pending()] == [b"B", b"C"]


def test_restart_with_smaller_bound_evicts(tmp_path):
    sp, _ = make(tmp_path)
    for i in range(4):
        sp.put(f"s{i}", bytes(100))
    sp2, reg = make(tmp_path, max_bytes=2 * (HEADER + 100))
    assert [e.session_id for e in sp2.pending()] == ["s2", "s3"]
    assert dropped(reg, "spool_full") == 2


def test_partial_tmp_file_removed_and_counted(tmp_path):
    make(tmp_path)
    with open(tmp_path / "spool" / "tmp" / "000000000009.x.bses", "wb") as f:
        f.write(b"BSP1 half")
    sp2, reg = make(tmp_path)
    assert os.listdir(tmp_path / "spool" / "tmp") == []
    assert dropped(reg, "partial") == 1
    assert len(sp2) == 0


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda raw: raw[:-3], "truncated"),
        (lambda raw: raw[:5], "shorter than its header"),
        (lambda raw: b"XXXX" + raw[4:], "bad magic"),
        (lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]), "checksum mismatch"),
    ],
)
def test_corrupt_files_are_quarantined(tmp_path, damage, why):
    sp, _ = make(tmp_path)
    name = sp.put("victim", b"payload bytes")
    good = sp.put("fine", b"ok")
    assert name and good
    path = tmp_path / "spool" / name
    path.write_bytes(damage(path.read_bytes()))
    sp2, reg = make(tmp_path)  # also after a restart
    assert sp2.read(name) is None
    assert dropped(reg, "corrupt") == 1
    assert [e.name for e in sp2.pending()] == [good]
    [(rname, reason)] = sp2.rejected()
    assert rname == name and why in reason
    assert sp2.read(good) == b"ok"


def test_reject_moves_aside_with_reason_bounded(tmp_path):
    sp, reg = make(tmp_path, max_bytes=100_000, max_rejected_bytes=2 * (HEADER + 10))
    names = [sp.put(f"r{i}", bytes(10)) for i in range(3)]
    for n in names:
        assert n is not None
        sp.reject(n, "unknown build id")
    assert len(sp) == 0
    assert [n for n, _ in sp.rejected()] == names[1:]  # oldest rejected evicted
    assert sp.rejected()[0][1] == "unknown build id"
    assert dropped(reg, "rejected_evicted") == 1
    assert reg.get_sample_value("bistouri_spool_rejected_total") == 3
    assert sorted(os.listdir(tmp_path / "spool" / "rejected")) == sorted(
        [n for n in names[1:]] + [n + ".reason" for n in names[1:]]
    )


def test_foreign_files_are_left_alone(tmp_path):
    make(tmp_path)
    (tmp_path / "spool" / "README").write_text("hands off")
    sp2, _ = make(tmp_path)
    assert len(sp2) == 0 and (tmp_path / "spool" / "README").exists()


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as ei:
        Spool(str(blocker / "spool"), 1000, registry=None)
    assert "cannot create the spool directory" in str(ei.value) and "--spool-dir" in str(ei.value)


def test_write_error_is_counted_not_raised(tmp_path):
    sp, reg = make(tmp_path)
    os.rmdir(tmp_path / "spool" / "tmp")  # next write fails with ENOENT
    assert sp.put("x", b"data") is None
    assert dropped(reg, "write_error") == 1
    assert len(sp) == 0


def test_concurrent_writer_and_reader(tmp_path):
    sp, reg = make(tmp_path, max_bytes=50 * (HEADER + 64))
    total = 150
    acked: list[bytes] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def writer():
        try:
            for i in range(total):
                sp.put(f"w{i}", i.to_bytes(4, "big") * 16)
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            done.set()

    def reader():
        try:
            while not (done.is_set() and len(sp) == 0):
                for e in sp.pending():
                    data = sp.read(e.name)
                    if data is not None:
                        acked.append(data)
                        sp.ack(e.name)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    # Every session was either delivered once or dropped once (spool_full); none twice, none lost.
    seen = [int.from_bytes(d[:4], "big") for d in acked]
    assert len(seen) == len(set(seen))
    assert len(seen) + dropped(reg, "spool_full") == total
    assert dropped(reg, "corrupt") == 0


def test_kernel_build_id_rides_in_the_file_header_across_restarts(tmp_path):
    kernel = bytes(range(20))
    sp, _ = make(tmp_path, kernel_build_id=kernel)
    name = sp.put("k1", b"session")
    assert name is not None
    assert [e.kernel_build_id for e in sp.pending()] == [kernel]
    assert [e.size for e in sp.pending()] == [HEADER + 20 + 7]
    sp2, _ = make(tmp_path)  # a restart on another kernel: the file still says which kernel it needs
    assert [e.kernel_build_id for e in sp2.pending()] == [kernel]
    assert wire.unframe_session((tmp_path / "spool" / name).read_bytes()) == wire.SessionFile(
        b"session", kernel
    )
    assert sp2.read(name) == b"session"


def test_files_of_format_1_still_read(tmp_path):
    import struct
    import zlib

    make(tmp_path)
    name = "000000000007.old.bses"
    (tmp_path / "spool" / name).write_bytes(struct.pack("<4sII", b"BSP1", 3, zlib.crc32(b"old")) + b"old")
    sp, _ = make(tmp_path)
    assert [(e.name, e.kernel_build_id) for e in sp.pending()] == [(name, b"")]
    assert sp.read(name) == b"old"


def test_directory_fsync_failure_keeps_the_session_and_counts_no_drop(tmp_path, monkeypatch):
    def fails(path: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomicfile, "fsync_dir", fails)
    reg = CollectorRegistry()
    sp = Spool(str(tmp_path / "spool"), 10_000, registry=reg)
    name = sp.put("f1", b"data")
    assert name is not None  # it was a drop before, though the file stayed and was sent
    assert [e.name for e in sp.pending()] == [name]
    assert dropped(reg, "write_error") == 0
    assert sp.read(name) == b"data"


def test_reject_without_its_reason_file_is_still_tracked_and_bounded(tmp_path):
    sp, reg = make(tmp_path, max_bytes=100_000, max_rejected_bytes=HEADER + 10)
    first = sp.put("r0", bytes(10))
    assert first is not None
    # A directory in the way makes writing the .reason file fail for real.
    os.mkdir(tmp_path / "spool" / "rejected" / (first + ".reason"))
    sp.reject(first, "malformed")
    assert sp.rejected() == [(first, "")]
    second = sp.put("r1", bytes(10))
    assert second is not None
    sp.reject(second, "malformed")
    # The bound evicted the first one: before, it was never tracked and stayed for good.
    assert [n for n, _ in sp.rejected()] == [second]
    assert not (tmp_path / "spool" / "rejected" / first).exists()
    assert dropped(reg, "rejected_evicted") == 1


def test_a_reader_beside_the_agent_changes_nothing(tmp_path):
    spool = Spool(str(tmp_path), 1 << 20, registry=None)
    spool.put("a", b"session a")
    partial = tmp_path / "tmp" / "000000000002.b.bses"
    partial.write_bytes(b"half-written by the agent")
    (tmp_path / "000000000003.c.bses").write_bytes(b"damaged")
    (waiting,) = read_waiting(str(tmp_path))
    assert waiting.data == b"session a"
    assert partial.exists() and (tmp_path / "000000000003.c.bses").exists()

"""CommMatcher: user-space matching tables and the BPF LPM keys."""

from __future__ import annotations

import struct

import pytest

from bistouri.agent.config import Rule, Target
from bistouri.agent.matcher import COMM_KEY, CommMatcher, lpm_key
from bistouri.pressure import PressureThreshold


def target(rule_id: int, kind: str, comm: str) -> Target:
    return Target(
        rule_id=rule_id,
        rule=Rule(kind, comm),
        service_id=f"svc{rule_id}",
        resources=(PressureThreshold("cpu", 10.0),),
    )


def matcher(*rules: tuple[str, str]) -> CommMatcher:
    return CommMatcher(target(i + 1, kind, comm) for i, (kind, comm) in enumerate(rules))


@pytest.mark.parametrize(
    ("comm", "expected"),
    [("node", [1]), ("nodejs", []), ("nod", []), ("", []), ("xnode", [])],
)
def test_exact(comm, expected):
    assert matcher(("Exact", "node")).match(comm) == expected


@pytest.mark.parametrize(
    ("comm", "expected"),
    [("worker-", [1]), ("worker-1", [1]), ("worker-123456789", [1]), ("worker", []), ("aworker-1", [])],
)
def test_prefix(comm, expected):
    assert matcher(("Prefix", "worker-")).match(comm) == expected


def test_all_matching_targets_not_only_the_longest():
    m = matcher(
        ("Prefix", "p"), ("Prefix", "py"), ("Exact", "python3"), ("Prefix", "python3"), ("Exact", "py")
    )
    assert m.match("python3") == [1, 2, 3, 4]
    assert m.match("python3.11") == [1, 2, 4]
    assert m.match("py") == [1, 2, 5]
    assert m.match("perl") == [1]
    assert m.match("ruby") == []


def test_same_comm_in_two_targets_returns_both():
    assert matcher(("Exact", "postgres"), ("Exact", "postgres")).match("postgres") == [1, 2]


def test_empty_prefix_matches_everything():
    m = matcher(("Prefix", ""))
    assert m.match("anything") == [1]
    assert m.match("") == [1]


def test_bytes_and_truncation_to_kernel_comm():
    m = matcher(("Exact", "abcdefghijklmno"))  # 15 bytes, the longest a kernel comm gets
    assert m.match(b"abcdefghijklmno") == [1]
    # A longer name as seen in argv is truncated the way the kernel does it.
    assert m.match("abcdefghijklmnopqrst") == [1]
    # A NUL-padded comm straight from a BPF event.
    assert m.match(b"abcdefghijklmno\0") == [1]
    assert matcher(("Exact", "node")).match(b"node\0\0\0\0\0\0\0\0\0\0\0\0") == [1]


def test_utf8_comm():
    m = matcher(("Prefix", "日本"))
    assert m.match("日本語") == [1]
    assert m.match("日") == []


def test_matches_checks_rule_id_and_comm():
    m = matcher(("Exact", "node"), ("Prefix", "worker-"))
    assert m.matches(1, "node")
    assert not m.matches(1, "nodejs")
    assert m.matches(2, "worker-7")
    assert not m.matches(2, "node")
    assert not m.matches(3, "node")  # stale id after a reload
    assert m.rule_ids == frozenset({1, 2})
    assert m.target(2) is not None and m.target(3) is None


def test_lpm_key_layout_matches_struct_bistouri_comm_key():
    assert COMM_KEY.size == 20
    key = lpm_key(b"node", 40)
    assert len(key) == 20
    prefixlen, comm = struct.unpack("=I16s", key)
    assert prefixlen == 40 and comm == b"node" + b"\0" * 12


def test_lpm_entries_prefixlens():
    m = matcher(("Exact", "node"), ("Prefix", "worker-"), ("Prefix", ""), ("Exact", "abcdefghijklmno"))
    entries = dict(m.lpm_entries())
    assert entries == {
        lpm_key(b"node", 40): 1,  # 4 bytes + NUL
        lpm_key(b"worker-", 56): 2,  # 7 bytes, no NUL
        lpm_key(b"", 0): 3,  # matches every task
        lpm_key(b"abcdefghijklmno", 128): 4,  # 15 bytes + NUL: the whole key
    }


def test_lpm_entries_one_per_key():
    m = matcher(("Exact", "node"), ("Exact", "node"), ("Prefix", "node"))
    entries = m.lpm_entries()
    assert len(entries) == 2  # Exact "node" shared by targets 1 and 2; Prefix is another key
    assert dict(entries)[lpm_key(b"node", 40)] in (1, 2)
    assert dict(entries)[lpm_key(b"node", 32)] == 3


def _lpm_lookup(entries: list[tuple[bytes, int]], comm: bytes) -> int | None:
    """What the kernel's LPM trie answers for a 128-bit lookup of `comm` (a reference model)."""
    data = comm[:15].ljust(16, b"\0")
    best: tuple[int, int] | None = None
    for key, value in entries:
        bits, kcomm = struct.unpack("=I16s", key)
        nbytes = bits // 8
        if data[:nbytes] == kcomm[:nbytes] and (best is None or bits > best[0]):
            best = (bits, value)
    return None if best is None else best[1]


@pytest.mark.parametrize("comm", [b"node", b"nodejs", b"no", b"worker-1", b"worker", b"x", b""])
def test_lpm_model_agrees_with_user_space(comm):
    m = matcher(("Exact", "node"), ("Prefix", "worker-"), ("Exact", "no"))
    hit = _lpm_lookup(m.lpm_entries(), comm)
    # The kernel must report a candidate whenever user space would match, and vice versa.
    assert (hit is not None) == bool(m.match(comm))
    if hit is not None:
        assert hit in m.match(comm)


@pytest.mark.bpf
def test_kernel_lpm_trie_agrees_with_user_space():
    """The real BPF comm trie, loaded from the shipped object (programs off: maps only)."""
    from bistouri.bpf.handles import BpfObject
    from tests.conftest import BPF_OBJECT

    m = matcher(
        ("Exact", "node"),
        ("Prefix", "worker-"),
        ("Exact", "no"),
        ("Prefix", "py"),
        ("Exact", "python3"),
        ("Exact", "abcdefghijklmno"),
    )
    comms = [b"node", b"nodejs", b"no", b"n", b"worker-1", b"worker", b"py", b"python3", b"python3.11"]
    comms += [b"abcdefghijklmno", b"abcdefghijklmn", b"bash", b""]
    with BpfObject(BPF_OBJECT) as obj:
        for prog in obj.programs.values():
            prog.set_autoload(False)
        obj.load()
        trie = obj.maps["comm_rules"]
        assert (trie.key_size, trie.value_size) == (COMM_KEY.size, 4)
        for key, rule_id in m.lpm_entries():
            trie.update(key, struct.pack("=I", rule_id))
        for comm in comms:
            # What handle_exec looks up: the task's 16-byte comm, all 128 bits.
            hit = trie.lookup(lpm_key(comm, 128))
            expected = m.match(comm)
            assert (hit is not None) == bool(expected), comm
            if hit is not None:
                assert struct.unpack("=I", hit)[0] in expected, comm

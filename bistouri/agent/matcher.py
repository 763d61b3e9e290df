"""Comm matching: a user-space byte trie and the keys of the BPF LPM trie.

The kernel side only answers "does some rule match this comm?" (one value per
key); user space re-matches with `CommMatcher.match`, which returns every
matching rule, Exact and Prefix, so two targets sharing a comm both fire.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..compat import SLOTS
from .config import COMM_MAX_BYTES, Target

COMM_LEN = COMM_MAX_BYTES + 1  # BISTOURI_COMM_LEN in bpf/bistouri.h, NUL included
# struct bistouri_comm_key { __u32 prefixlen; __u8 comm[16]; }, native endian, no padding.
COMM_KEY = struct.Struct(f"=I{COMM_LEN}s")
PREFIX_FULL = COMM_LEN * 8  # prefixlen of a lookup key: all 16 bytes


@dataclass(**SLOTS)
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    exact: list[int] = field(default_factory=list)  # rules that end here, NUL included
    prefix: list[int] = field(default_factory=list)  # rules matching everything below


def _comm_bytes(comm: str | bytes) -> bytes:
    b = comm.encode("utf-8", "surrogateescape") if isinstance(comm, str) else comm
    # The kernel never reports more than 15 bytes; compare what it would.
    return b.split(b"\0", 1)[0][:COMM_MAX_BYTES]


def lpm_key(comm: bytes, prefixlen: int) -> bytes:
    """A packed bistouri_comm_key."""
    return COMM_KEY.pack(prefixlen, comm)


class CommMatcher:
    """Matches task names against the targets' rules."""

    def __init__(self, targets: Iterable[Target]) -> None:
        # Targets named by cgroup or unit have no comm rule: the walk finds their processes.
        self._targets = {t.rule_id: t for t in targets if t.rule is not None}
        self._rules = {rid: t.rule for rid, t in self._targets.items() if t.rule is not None}
        self._root = _Node()
        for rid, rule in self._rules.items():
            node = self._root
            for byte in rule.comm_bytes:
                node = node.children.setdefault(byte, _Node())
            (node.exact if rule.type == "Exact" else node.prefix).append(rid)

    def __len__(self) -> int:
        return len(self._targets)

    @property
    def rule_ids(self) -> frozenset[int]:
        return frozenset(self._targets)

    def target(self, rule_id: int) -> Target | None:
        return self._targets.get(rule_id)

    def match(self, comm: str | bytes) -> list[int]:
        """Rule ids of every target matching `comm`, ascending."""
        node: _Node | None = self._root
        found: list[int] = []
        for byte in _comm_bytes(comm):
            assert node is not None
            found.extend(node.prefix)
            node = node.children.get(byte)
            if node is None:
                break
        if node is not None:
            found.extend(node.prefix)
            found.extend(node.exact)
        return sorted(found)

    def matches(self, rule_id: int, comm: str | bytes) -> bool:
        """Whether `rule_id` is current and matches `comm`: how stale exec events are spotted."""
        t = self._rules.get(rule_id)
        if t is None:
            return False
        b = _comm_bytes(comm)
        want = t.comm_bytes
        return b == want if t.type == "Exact" else b.startswith(want)

    def lpm_entries(self) -> list[tuple[bytes, int]]:
        """(key, rule_id) pairs for the BPF comm trie, one per distinct key, sorted by key.

        Exact keys cover the comm and its NUL ((len+1)*8 bits), so "node" does not
        match "nodejs"; Prefix keys cover len*8 bits, and an empty Prefix is the
        0-bit key that matches every task.
        """
        entries: dict[bytes, int] = {}
        for rid, rule in sorted(self._rules.items()):
            comm = rule.comm_bytes
            bits = (len(comm) + 1) * 8 if rule.type == "Exact" else len(comm) * 8
            entries.setdefault(lpm_key(comm, bits), rid)
        return sorted(entries.items())

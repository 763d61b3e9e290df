"""Raw stack copies held until their process's tables are in, then walked into stack records.

A process that asks for them (FilterFlags.RAW_STACK: `record`'s targets and the agent's
sessions' processes, until the tables of their files are published) has each on-CPU sample
whose user walk was cut short sent as an abi.RawStack: the registers, the event as the BPF
walk left it, and the top of the user stack. The ring thread keeps these here, bounded in
count and bytes, and once the process's tables are in walks each with the same rows as the
BPF walk (unwind/rawwalk.py) into the event's user stack: an ordinary stack record, same
weight (1), same timestamp.
Perf's `--call-graph dwarf` does the same with its copies, at `perf script` time.

Copies beyond the bounds, and those whose tables did not come in time (released at the end
of the capture, or of the agent's session that wanted them), go on as the BPF walk left them;
every outcome is counted (`RawStackStats`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Collection
from dataclasses import dataclass

from ..bpf import abi
from ..compat import SLOTS
from ..unwind.rawwalk import AARCH64, RuleOf, Walked, walk

_EVENT_AT = abi.RAW_EVENT_OFFSET
_EVENT_END = abi.RAW_EVENT_OFFSET + abi.STACK_EVENT_SIZE
_STACK_AT = abi.RAW_BYTES_OFFSET
_PID_AT = abi.RAW_EVENT_OFFSET + abi.StackEvent.pid.offset
_PID = struct.Struct("<I")
_HASH_AT = abi.StackEvent.user_key.offset + abi.UserStackKey.hash.offset
_USIZE_AT = abi.StackEvent.user_stack_size.offset
_WALK_AT = abi.StackEvent.user_by_table.offset  # user_by_table, user_by_fp, user_walk_end
_USER_AT = abi.USER_STACK_OFFSET
_USER_FRAMES_FIELD = struct.Struct("<i")
_U64 = (1 << 64) - 1


@dataclass(**SLOTS)
class RawStackStats:
    """Counters of the raw stack copies: received, walked, whole, cut short, dropped."""

    received: int = 0  # raw copies read from the ring
    walked: int = 0  # walked with the process's tables into a stack record
    whole: int = 0  # ... of which reached the entry
    left_copy: int = 0  # ... of which ended at a word outside the copy (cut short)
    unwalked: int = 0  # released as the BPF walk left them: the tables were not in by the end
    dropped: int = 0  # over the bounds: sent on at once as the BPF walk left them
    walk_cpu_s: float = 0.0  # the ring thread's CPU in the walks (rules looked up in the maps included)


def pid_of(record: bytes) -> int:
    return int(_PID.unpack_from(record, _PID_AT)[0])


def event_of(record: bytes) -> bytes:
    """The stack event of a raw copy as the BPF walk left it."""
    return record[_EVENT_AT:_EVENT_END]


def hash_ips(ips: list[int]) -> int:
    """hash_ips() of bpf/stack.bpf.h (FNV-1a over the IPs): the user stack key's hash."""
    h = 0xCBF29CE484222325
    for ip in ips:
        h = ((h ^ ip) * 0x100000001B3) & _U64
    return h


def walked_event(record: bytes, rule_of: RuleOf, aarch64: bool = AARCH64) -> tuple[bytes, Walked]:
    """The raw copy's event with its user stack walked again by `rule_of`'s rows; kept as the BPF
    walk left it if that went further (its frames are the same up to where it stopped)."""
    ip, sp, bp, lr, size = abi.RAW_STACK_HEAD.unpack_from(record)
    size = max(0, min(size, abi.RAW_STACK_BYTES, len(record) - _STACK_AT))
    w = walk(ip, sp, bp, record[_STACK_AT : _STACK_AT + size], sp, rule_of, lr=lr, aarch64=aarch64)
    event = bytearray(record[_EVENT_AT:_EVENT_END])
    before = max(0, _USER_FRAMES_FIELD.unpack_from(event, _USIZE_AT)[0]) // 8
    if len(w.ips) < before:
        return bytes(event), w
    n = len(w.ips)
    struct.pack_into(f"<{n}Q", event, _USER_AT, *w.ips)
    _USER_FRAMES_FIELD.pack_into(event, _USIZE_AT, n * 8)
    struct.pack_into("<Q", event, _HASH_AT, hash_ips(w.ips))
    event[_WALK_AT : _WALK_AT + 3] = bytes((min(w.by_table, 255), min(w.by_fp, 255), w.stop))
    return bytes(event), w


class RawStacks:
    """The copies held by process until its tables are in (`ready`). The ring thread's alone."""

    def __init__(self, max_records: int = 8192, max_bytes: int = 32 << 20) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.stats = RawStackStats()
        self._held: dict[int, list[bytes]] = {}
        self._records = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._records

    @property
    def nbytes(self) -> int:
        """Bytes of the copies held now."""
        return self._bytes

    def hold(self, record: bytes) -> bool:
        """Keep a copy for later; False if the bounds are reached (the caller sends its event on)."""
        if self._records >= self.max_records or self._bytes + len(record) > self.max_bytes:
            self.stats.dropped += 1
            return False
        self._held.setdefault(pid_of(record), []).append(record)
        self._records += 1
        self._bytes += len(record)
        return True

    def held_pids(self) -> set[int]:
        return set(self._held)

    def take(self, pid: int) -> list[bytes]:
        """The copies of `pid`, no longer held."""
        records = self._held.pop(pid, [])
        self._records -= len(records)
        self._bytes -= sum(map(len, records))
        return records

    def walk(self, record: bytes, rule_of: RuleOf) -> bytes:
        """The copy walked into a stack event (counted)."""
        cpu = time.thread_time()
        event, w = walked_event(record, rule_of)
        self.stats.walk_cpu_s += time.thread_time() - cpu
        self.stats.walked += 1
        self.stats.whole += w.stop == abi.Counter.WALK_END
        self.stats.left_copy += w.left_copy
        return event

    def release(self, pids: Collection[int] | None = None) -> list[bytes]:
        """The copies still held (of `pids`, or all), as the BPF walk left their events (counted):
        their tables did not come in time."""
        out: list[bytes] = []
        for pid in list(self._held) if pids is None else [p for p in pids if p in self._held]:
            out.extend(event_of(r) for r in self.take(pid))
        self.stats.unwalked += len(out)
        return out

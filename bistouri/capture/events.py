"""Ring-buffer records decoded, and the two caches that complete them.

The BPF programs send raw user IPs; `procmaps.ProcMaps` maps them to (file, offset)
and `ResolvedStacks` keeps that answer per distinct user stack, so a stack is mapped
once. An on-CPU sample comes whole only the first time (after that, the kernel counts
repeats: `SentSamples` keeps the sample the counts are weighed on, and tells the
kernel what it forgets). Both caches are used by the ring-buffer thread only.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, Union

from ..bpf import abi
from ..compat import SLOTS
from ..cpython.processes import NO_PYTHON, PythonStack
from ..host.procmaps import USER_FRAME, ProcMaps


# Not frozen: a frozen dataclass costs 5x more to build, and one is built per sample.
@dataclass(**SLOTS)
class StackSample:
    """One stack event, header decoded; the stacks stay raw until the session capture needs them.
    Treated as immutable."""

    kind: int
    pid: int
    tid: int
    cpu: int
    timestamp_ns: int
    blocked_ns: int
    # How many samples this one stands for: on-CPU, 1 + its repeats counted in the kernel;
    # off-CPU, 1 + the waits rate limiting skipped before it.
    weight: int
    comm: str
    kernel_len: int  # bytes of `stacks` holding kernel IPs (0 on error)
    stacks: bytes  # kernel IPs then mapped user frames (procmaps.USER_FRAME): the dedup key
    # How the user stack was walked: frames by table, frames by frame pointer, why it ended
    # (an abi.WALK_ENDS key, 0: no walk), one byte each, as the kernel sent them.
    walk: bytes = b"\0\0\0"
    # The Python frames of a CPython process (abi.PyFrame records, innermost first), raw ...
    python: bytes = b""
    # ... and named as the sample arrived (the process may be gone by the session's end), with the
    # sample's data-quality note; spliced into the stack when the session is built (docs/python-frames.md).
    py: PythonStack = NO_PYTHON
    # Repeats counted in the kernel: when the drain read their count (monotonic ns; the kernel's
    # clock). The flight recorder times them so; timestamp_ns stays the first sample's.
    counted_ns: int = 0

    def weighed(self, weight: int, counted_ns: int | None = None) -> StackSample:
        """The same sample standing for `weight` samples (dataclasses.replace costs 10x more,
        and this runs for every counted repeat at every drain); `counted_ns`: see above."""
        return StackSample(
            self.kind,
            self.pid,
            self.tid,
            self.cpu,
            self.timestamp_ns,
            self.blocked_ns,
            weight,
            self.comm,
            self.kernel_len,
            self.stacks,
            self.walk,
            self.python,
            self.py,
            self.counted_ns if counted_ns is None else counted_ns,
        )

    @property
    def nbytes(self) -> int:
        """What a held sample costs beyond ENTRY_OVERHEAD_BYTES (flight.py): its raw stacks, raw Python
        frames and named ones."""
        return len(self.stacks) + len(self.python) + PY_FRAME_BYTES * len(self.py.frames)


# A named Python frame held in a sample or a trace: its slot in the frames tuple and a share of the tuple
# and of the PythonFrame objects, which a process's samples share (tracemalloc: 22 bytes a frame in stacks
# 3 deep, 10 at 20, 9 at 60; a frame no other trace shares, its registry gone, costs ~100).
PY_FRAME_BYTES = 24


@dataclass(frozen=True, **SLOTS)
class ExecMatch:
    """An exec that matched an exec rule: the process, its cgroup and comm."""

    rule_id: int
    pid: int
    cgroup_id: int
    comm: str


@dataclass(frozen=True, **SLOTS)
class BpfErrorEvent:
    """An error a BPF program reported through the ring (a `Counter` kind and its code)."""

    kind: abi.Counter
    pid: int
    code: int


_STACK_MAX = abi.MAX_DEPTH * 8  # bytes of IPs in either stack


@functools.lru_cache(maxsize=4096)
def _comm(raw: bytes) -> str:
    return abi.comm_bytes(raw)


V = TypeVar("V")


class _KernelMirroredLru(Generic[V]):
    """A least-recently-used map of what the kernel believes user space holds, bounded in
    entries and in bytes; whatever leaves it is passed to `forget`, which deletes the key
    in the kernel's map so that the next sample under it comes whole again."""

    def __init__(self, max_entries: int, max_bytes: int, forget: Callable[[bytes], None] | None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._forget = forget
        self._items: OrderedDict[bytes, tuple[V, int]] = OrderedDict()  # key -> (value, bytes)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def _put(self, key: bytes, value: V, size: int) -> None:
        self._drop(key)
        self._items[key] = (value, size)
        self._bytes += size
        while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
            self.forget(next(iter(self._items)))

    def _get(self, key: bytes) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def _drop(self, key: bytes) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]

    def forget(self, key: bytes) -> None:
        self._drop(key)
        if self._forget is not None:
            self._forget(key)


class ResolvedStacks(_KernelMirroredLru[tuple[int, bytes]]):
    """Mapped frames of the user stacks seen so far, by their raw key (pid, mm, hash of IPs),
    with the generation of the process's table they were mapped with: a repeated stack
    costs one lookup, and a re-read table (a new mapping) maps it again. Bounded in bytes,
    least recently used out first; nothing to tell the kernel."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        super().__init__(1 << 62, max_bytes, None)

    def frames(self, key: bytes, pid: int, map_count: int, ips: bytes, maps: ProcMaps) -> bytes:
        generation = maps.generation(pid, map_count)
        got = self._get(key)
        if got is not None and got[0] == generation:
            return got[1]
        frames = maps.resolve(pid, struct.unpack(f"<{len(ips) // 8}Q", ips))
        # Under the generation asked for: if a miss re-read the table, the next sample maps again.
        self._put(key, (generation, frames), len(frames) + 100)
        return frames


class SentSamples(_KernelMirroredLru["StackSample"]):
    """On-CPU samples sent whole, by sample key (thread, kernel stack hash, user stack key):
    the kernel counts their repeats, and each drain weighs these by the counts.

    Bounded in entries (as the kernel's map) and in bytes of stacks, least recently
    counted out first; what leaves is forgotten in the kernel's `known_samples` too.
    """

    def __init__(
        self,
        max_entries: int = 16384,
        max_bytes: int = 8 << 20,
        forget: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__(max_entries, max_bytes, forget)

    def remember(self, key: bytes, sample: StackSample) -> None:
        self._put(key, sample, len(sample.stacks))

    def get(self, key: bytes) -> StackSample | None:
        return self._get(key)


_PY_DEPTH_AT = abi.StackEvent.py_depth.offset
_PY_STATUS_AT = abi.StackEvent.py_status.offset
_PY_AT = abi.StackEvent.py_frames.offset
_PY_FRAME = abi.PY_FRAME.size


def decode_stack(
    data: bytes,
    maps: ProcMaps,
    cache: ResolvedStacks,
    name_python: Callable[[int, bytes, int], PythonStack] | None = None,
) -> StackSample:
    """A stack record → its header fields, the kernel IPs and the mapped user frames, and with
    `name_python` (pid, raw Python frames, abi.PyStatus → PythonStack) its Python frames named.

    The hot path at high frequency (one call per record): one unpack, two slices, and for
    a user stack seen before one dict lookup.
    """
    header = abi.STACK_HEADER.unpack_from(data)
    kind, pid, tid, cpu, ts, blocked, weight, map_count, key, _khash, ksize, usize, walk, comm = header
    # Negative sizes are bpf_get_stack errors; the bounds keep a bad header inside the record.
    ksize = max(0, min(ksize, _STACK_MAX))
    usize = max(0, min(usize, _STACK_MAX)) & ~7
    k0 = abi.KERNEL_STACK_OFFSET
    u0 = abi.USER_STACK_OFFSET
    user = cache.frames(key, pid, map_count, data[u0 : u0 + usize], maps) if usize else b""
    stacks = data[k0 : k0 + ksize] + user
    depth = data[_PY_DEPTH_AT]
    python = data[_PY_AT : _PY_AT + min(depth, abi.PY_MAX_DEPTH) * _PY_FRAME] if depth else b""
    py = name_python(pid, python, data[_PY_STATUS_AT]) if name_python is not None else NO_PYTHON
    return StackSample(kind, pid, tid, cpu, ts, blocked, weight, _comm(comm), ksize, stacks, walk, python, py)


def split_stacks(sample_stacks: bytes, kernel_len: int) -> tuple[tuple[int, ...], list[tuple[int, int, int]]]:
    """Kernel IPs and (procmaps.FrameStatus, file id or reason, offset or IP) user frames,
    both leaf first."""
    kernel = struct.unpack_from(f"<{kernel_len // 8}Q", sample_stacks)
    user = list(USER_FRAME.iter_unpack(sample_stacks[kernel_len:]))
    return tuple(ip for ip in kernel if ip), user


def decode_exec(data: bytes) -> ExecMatch:
    rule_id, pid, cgroup_id, comm = abi.EXEC_EVENT.unpack_from(data)
    return ExecMatch(rule_id, pid, cgroup_id, abi.comm_bytes(comm))


def decode_error(data: bytes) -> BpfErrorEvent:
    kind, pid, code, _ts = abi.ERROR_EVENT.unpack_from(data)
    return BpfErrorEvent(abi.Counter(kind) if kind < abi.COUNTER_MAX else abi.Counter(0), pid, code)


Event = Union[StackSample, ExecMatch, BpfErrorEvent]  # Union: a 3.9 runtime alias


_ON_CPU = int(abi.EventKind.ON_CPU)  # a plain int: IntEnum comparisons cost more
_UKEY_AT = abi.StackEvent.user_key.offset
_KHASH_AT = abi.StackEvent.kernel_hash.offset
_KERNEL_HASH = struct.Struct("<Q")
_SAMPLE_KEY_HEAD = abi.SAMPLE_KEY_HEAD


def counted_sample_key(data: bytes, sample: StackSample) -> bytes | None:
    """The key under which the kernel counts repeats of this record (struct
    bistouri_sample_key), or None: only on-CPU samples are counted."""
    if sample.kind != _ON_CPU:
        return None
    head = _SAMPLE_KEY_HEAD.pack(sample.tid, 0, *_KERNEL_HASH.unpack_from(data, _KHASH_AT))
    return head + data[_UKEY_AT : _UKEY_AT + abi.USER_STACK_KEY.size]

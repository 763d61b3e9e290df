"""Ring-buffer records decoded, and the two caches that complete them.

The BPF programs send a user stack's build-id frames only the first time (after
that, raw IPs and a key: `UserStackCache` substitutes the frames), and an on-CPU
sample whole only the first time (after that, the kernel counts repeats:
`SentSamples` keeps the sample the counts are weighed on). Both caches are used
by the ring-buffer thread only, and tell the kernel what they forget.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import abi


# Not frozen: a frozen dataclass costs 5x more to build, and one is built per sample.
@dataclass(slots=True)
class StackSample:
    """One stack event, header decoded; the stacks stay raw until the orchestrator needs them.
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
    stacks: bytes  # kernel IPs then user frames: the dedup key


@dataclass(frozen=True, slots=True)
class ExecMatch:
    rule_id: int
    pid: int
    cgroup_id: int
    comm: str


@dataclass(frozen=True, slots=True)
class BpfErrorEvent:
    kind: abi.Counter
    pid: int
    code: int


_KERNEL_MAX = abi.MAX_DEPTH * 8
_USER_MAX = abi.MAX_DEPTH * abi.USER_FRAME.size


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


class UserStackCache(_KernelMirroredLru[bytes]):
    """Build-id frames of the user stacks sent so far, by their raw key (pid, mm, hash of IPs).

    The kernel walks build ids only for a stack it has not sent before (~8 µs a sample
    otherwise, measured); repeats come as raw IPs and get their frames from here. Bounded
    in bytes, least recently used out first; what leaves is forgotten in the kernel's
    `known_user_stacks` too.
    """

    def __init__(self, max_bytes: int = 16 << 20, forget: Callable[[bytes], None] | None = None) -> None:
        super().__init__(1 << 62, max_bytes, forget)
        self.misses = 0  # known to the kernel, not here: frames left as raw IPs

    def remember(self, key: bytes, frames: bytes) -> None:
        self._put(key, frames, len(frames))

    def frames(self, key: bytes, ips: bytes) -> bytes:
        frames = self._get(key)
        if frames is not None:
            return frames
        # Its first sample was lost (or forgotten): keep the addresses, have the kernel resend.
        self.misses += 1
        self.forget(key)
        return ips_as_frames(ips)


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


def ips_as_frames(ips: bytes) -> bytes:
    """Raw user IPs as frames with status 2 (an address, no build id): still shipped, never lost."""
    n = len(ips) // 8
    return b"".join(abi.USER_FRAME.pack(2, _NO_BUILD_ID, ip) for ip in struct.unpack_from(f"<{n}Q", ips))


_NO_BUILD_ID = bytes(abi.BUILD_ID_SIZE)


def decode_stack(data: bytes, cache: UserStackCache | None = None) -> StackSample:
    """A stack record → its header fields and the used part of each stack, back to back.

    The hot path at high frequency (one call per sample): one unpack, two slices, and for a
    repeated user stack one dict lookup.
    """
    header = abi.STACK_HEADER.unpack_from(data)
    kind, pid, tid, cpu, ts, blocked, weight, fmt, key, _kernel_hash, ksize, usize, comm = header
    # Negative sizes are bpf_get_stack errors; the bounds keep a bad header inside the record.
    ksize = max(0, min(ksize, _KERNEL_MAX))
    k0 = abi.KERNEL_STACK_OFFSET
    u0 = abi.USER_STACK_OFFSET
    if fmt == _FRAMES:
        user = data[u0 : u0 + max(0, min(usize, _USER_MAX))]
        if cache is not None and user:
            cache.remember(key, user)
    else:
        ips = data[u0 : u0 + max(0, min(usize, _KERNEL_MAX))]
        user = cache.frames(key, ips) if fmt == _KNOWN and cache is not None and ips else ips_as_frames(ips)
    stacks = data[k0 : k0 + ksize] + user
    return StackSample(kind, pid, tid, cpu, ts, blocked, weight, _comm(comm), ksize, stacks)


_FRAMES = int(abi.UserFormat.FRAMES)  # plain ints: IntEnum comparisons cost more
_KNOWN = int(abi.UserFormat.KNOWN)
_ON_CPU = int(abi.EventKind.ON_CPU)
_FORMAT_AT = abi.StackEvent.user_format.offset  # u32, little-endian: its first byte is the value
_UKEY_AT = abi.StackEvent.user_key.offset
_KHASH_AT = abi.StackEvent.kernel_hash.offset
_KERNEL_HASH = struct.Struct("<Q")
_SAMPLE_KEY_HEAD = abi.SAMPLE_KEY_HEAD


def split_stacks(
    sample_stacks: bytes, kernel_len: int
) -> tuple[tuple[int, ...], list[tuple[int, bytes, int]]]:
    """Kernel IPs and (status, build_id, offset_or_ip) user frames, both leaf first."""
    kernel = struct.unpack_from(f"<{kernel_len // 8}Q", sample_stacks)
    user = []
    for off in range(kernel_len, len(sample_stacks) - abi.USER_FRAME.size + 1, abi.USER_FRAME.size):
        status, build_id, value = abi.USER_FRAME.unpack_from(sample_stacks, off)
        if status == 0:  # BPF_STACK_BUILD_ID_EMPTY ends the stack
            break
        user.append((status, build_id, value))
    return tuple(ip for ip in kernel if ip), user


def decode_exec(data: bytes) -> ExecMatch:
    rule_id, pid, cgroup_id, comm = abi.EXEC_EVENT.unpack_from(data)
    return ExecMatch(rule_id, pid, cgroup_id, abi.comm_bytes(comm))


def decode_error(data: bytes) -> BpfErrorEvent:
    kind, pid, code, _ts = abi.ERROR_EVENT.unpack_from(data)
    return BpfErrorEvent(abi.Counter(kind) if kind < abi.COUNTER_MAX else abi.Counter(0), pid, code)


Event = StackSample | ExecMatch | BpfErrorEvent


def counted_sample_key(data: bytes, sample: StackSample) -> bytes | None:
    """The key under which the kernel counts repeats of this record (struct
    bistouri_sample_key), or None: only on-CPU samples of a known user stack are counted."""
    if sample.kind != _ON_CPU or data[_FORMAT_AT] != _KNOWN:
        return None
    head = _SAMPLE_KEY_HEAD.pack(sample.tid, 0, *_KERNEL_HASH.unpack_from(data, _KHASH_AT))
    return head + data[_UKEY_AT : _UKEY_AT + abi.USER_STACK_KEY.size]

"""ctypes mirrors of the structs and enums in bpf/bistouri.h: the one description of
the ring records user space reads (sizes come from here, never from literals).

tests/bpf/test_abi.py compares every mirror (size, field offsets, enum values) with
the BTF of the built object; the profiler does the same at load time, so an agent
never decodes events with a stale layout.
"""

from __future__ import annotations

import ctypes
import struct
from ctypes import Structure, c_int16, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64
from enum import IntEnum

from .handles import Btf


# How an unwind row (struct bistouri_unwind_row, built by ehframe.py) finds the CFA and the saved RBP.
class CfaKind(IntEnum):
    """How the CFA of a row is found (`cfa_kind` of a row)."""

    NONE = 0  # no CFI covers the PC: the walk uses the frame pointer
    RSP = 1  # CFA = RSP + cfa_off
    RBP = 2  # CFA = RBP + cfa_off
    PLT = 3  # .plt entry: CFA = RSP + 8, + 8 more when (RIP & 15) >= cfa_off
    SIGNAL = 4  # signal trampoline (__restore_rt): registers come from the ucontext at RSP
    OTHER = 5  # an expression or register the walk cannot evaluate: frame pointer
    END = 6  # the outermost frame (_start, clone3): return address undefined
    # Copies of one fixed-size trampoline from the region's start (CPython's perf trampolines,
    # which carry no CFI and keep no frame pointer): in each cfa_off-byte copy, CFA = RSP + 16
    # from offset rbp_off & 0xff up to offset rbp_off >> 8, RSP + 8 elsewhere.
    TRAMPOLINE = 7


class RbpKind(IntEnum):
    UNCHANGED = 0  # the caller's RBP is the callee's
    AT_CFA = 1  # saved at CFA + rbp_off
    OTHER = 2  # in another register or an expression: unknown to the walk


class RaKind(IntEnum):
    """Where the return address is: bits 2-3 of a row's `rbp_kind` byte (`RA_SHIFT`), 0 on x86-64."""

    CFA = 0  # x86-64: CFA - 8; aarch64: CFA + rbp_off + 8, beside the saved x29 (stp x29, x30)
    LR = 1  # aarch64: still in the link register x30 (a leaf, or before the prologue saved it)
    AT_OFF = 2  # aarch64: saved alone at CFA + rbp_off, x29 unchanged


RBP_KIND_MASK = 3
RA_SHIFT = 2


COMM_LEN = 16
MAX_DEPTH = 127


class EventKind(IntEnum):
    ON_CPU = 1
    OFF_CPU = 2


class FilterFlags(IntEnum):
    ON_CPU = 1
    OFF_CPU = 2
    # On-CPU samples cut short are also sent as raw stack copies (RawStack), walked in user space
    # once the process's tables are in (`record`: capture/rawstacks.py).
    RAW_STACK = 8
    # Only the flight recorder watches the process: its waits are counted in the kernel's
    # `recorder_waits` (RecordedWait), not sent; read when a session starts (bpf/recorder.bpf.h).
    RECORDED = 16


FILTER_DIVISOR_SHIFT = 8  # bits 8-15 of a pid filter value: one on-CPU sample kept in this many
FILTER_DIVISOR_MAX = 255


def filter_value(flags: int, divisor: int = 1) -> int:
    """A pid filter value: what to capture, and one on-CPU sample kept in `divisor`."""
    return flags | min(max(divisor, 1), FILTER_DIVISOR_MAX) << FILTER_DIVISOR_SHIFT


class Counter(IntEnum):
    """Indexes of the BPF `counters` map, and kinds of error events."""

    STACK_RESERVE_FAILED = 0
    EXEC_RESERVE_FAILED = 1
    KERNEL_STACK_ERROR = 2
    USER_STACK_ERROR = 3
    OFFCPU_PENDING_FULL = 4
    OFFCPU_RATE_LIMITED = 5
    OFFCPU_TOO_SHORT = 6
    ON_CPU_SAMPLES = 7
    OFF_CPU_SAMPLES = 8
    EXEC_MATCHES = 9
    MAP_CHANGES = 10
    FRAMES_BY_TABLE = 11
    FRAMES_BY_FP = 12
    WALK_END = 13
    WALK_NO_FP = 14
    WALK_READ_FAILED = 15
    WALK_DEPTH = 16
    WALK_BAD_FRAME = 17
    RULE_CACHE_HITS = 18
    RAW_STACKS = 19  # samples sent as raw stack copies (FilterFlags.RAW_STACK)
    RAW_STACK_LOST = 20  # raw copies lost to a full raw_stacks ring: sent as the BPF walk left them


COUNTER_MAX = 21

# Why a user walk ended (a stack event's user_walk_end, a WALK_* counter): the names that
# metrics and sessions use.
WALK_ENDS: dict[int, str] = {
    Counter.WALK_END: "entry",
    Counter.WALK_NO_FP: "no_frame_pointer",
    Counter.WALK_READ_FAILED: "read_failed",
    Counter.WALK_DEPTH: "max_depth",
    Counter.WALK_BAD_FRAME: "bad_frame",
}

# Unwind tables in BPF maps (bistouri/unwind/tables.py fills them; ehframe.py defines the rows).
UNWIND_MAPPINGS = 64  # per process
UNWIND_PROCS = 512


class UserStackKey(Structure):
    _fields_ = [("pid", c_uint32), ("reserved", c_uint32), ("mm", c_uint64), ("hash", c_uint64)]


class SampleKey(Structure):
    _fields_ = [("tid", c_uint32), ("reserved", c_uint32), ("kernel_hash", c_uint64), ("user", UserStackKey)]


# ---- CPython frames (issue 21): bpf/bistouri.h's block of the same name; bistouri/cpython/ fills the record.

PY_MAX_DEPTH = 64
PY_FRAME_ENTRY = 1  # bit 0 of PyFrame.code: the oldest frame of one C activation of the eval loop
PY_NO_OFFSET = 0xFFFF_FFFF  # PyFrame.offset unknown


class PyInstrKind(IntEnum):
    """How a frame's instruction field reads."""

    LASTI_BYTES = 0  # int f_lasti, a byte offset (3.8, 3.9); -1 before the first instruction
    LASTI_UNITS = 1  # int f_lasti, in code units of 2 bytes (3.10)
    POINTER = 2  # pointer to the executing code unit inside the code object (3.11+)


class PyEntryKind(IntEnum):
    """How the walk tells where one C activation of the eval loop starts."""

    EVERY = 0  # ≤3.10: one C activation per Python frame
    IS_ENTRY = 1  # 3.11: the byte at `frame_entry` is 1 on the activation's oldest frame
    SHIM = 2  # 3.12+: each activation pushes a shim frame (owner byte == shim_owner), not emitted


class PyStatus(IntEnum):
    """Why a stack event's Python walk ended (its py_status)."""

    NOT_PYTHON = 0
    DONE = 1
    NO_THREAD = 2
    READ_FAILED = 3
    DEPTH = 4
    NO_ARCH = 5


class PythonProc(Structure):
    _fields_ = [
        ("tstate_slot", c_uint64),
        ("tstate_frame", c_uint16),
        ("cframe_frame", c_int16),
        ("frame_previous", c_uint16),
        ("frame_code", c_uint16),
        ("frame_instr", c_uint16),
        ("frame_entry", c_int16),
        ("frame_size", c_uint16),
        ("code_adaptive", c_uint16),
        ("code_window", c_uint16),
        ("code_window_size", c_uint16),
        ("code_firstlineno", c_uint16),
        ("code_filename", c_uint16),
        ("code_name", c_uint16),
        ("code_linetable", c_uint16),
        ("instr_kind", c_uint8),
        ("entry_kind", c_uint8),
        ("shim_owner", c_uint8),
        ("reserved", c_uint8),
        ("version", c_uint16),
        ("str_hash", c_uint16),
        ("tstate_datastack", c_int16),
        ("code_version", c_int16),
        ("code_counter", c_uint64),
        ("owner", c_uint32),
        ("tstate_interp", c_uint16),
        ("counter_in_interp", c_uint8),
        ("reserved2", c_uint8),
    ]


class PyFrame(Structure):
    _fields_ = [("code", c_uint64), ("offset", c_uint32), ("checksum", c_uint32)]


class StackEvent(Structure):
    _fields_ = [
        ("kind", c_uint32),
        ("pid", c_uint32),
        ("tid", c_uint32),
        ("cpu", c_uint32),
        ("timestamp_ns", c_uint64),
        ("blocked_ns", c_uint64),
        ("waits", c_uint32),
        ("map_count", c_uint32),
        ("user_key", UserStackKey),
        ("kernel_hash", c_uint64),
        ("kernel_stack_size", c_int32),
        ("user_stack_size", c_int32),
        ("user_by_table", c_uint8),
        ("user_by_fp", c_uint8),
        ("user_walk_end", c_uint8),
        ("py_depth", c_uint8),
        ("py_status", c_uint8),
        ("reserved", c_uint8 * 3),
        ("comm", c_uint8 * COMM_LEN),
        ("kernel_stack", c_uint64 * MAX_DEPTH),
        ("user_stack", c_uint64 * MAX_DEPTH),
        ("py_frames", PyFrame * PY_MAX_DEPTH),
    ]


# A raw stack copy (struct bistouri_raw_stack): the registers, the event as walked, then the top of
# the user stack from sp, sent up to the stack_size bytes copied.
RAW_STACK_BYTES = 16384


class RawStack(Structure):
    _fields_ = [
        ("ip", c_uint64),
        ("sp", c_uint64),
        ("bp", c_uint64),
        ("lr", c_uint64),  # aarch64's x30; 0 on x86-64
        ("stack_size", c_uint32),
        ("reserved", c_uint32),
        ("event", StackEvent),
        ("stack", c_uint8 * RAW_STACK_BYTES),
    ]


class ExecEvent(Structure):
    _fields_ = [
        ("rule_id", c_uint32),
        ("pid", c_uint32),
        ("cgroup_id", c_uint64),
        ("comm", c_uint8 * COMM_LEN),
    ]


class ErrorEvent(Structure):
    _fields_ = [("kind", c_uint32), ("pid", c_uint32), ("code", c_int64), ("timestamp_ns", c_uint64)]


class CommKey(Structure):
    _fields_ = [("prefixlen", c_uint32), ("comm", c_uint8 * COMM_LEN)]


class Config(Structure):
    _fields_ = [
        ("offcpu_min_ns", c_uint64),
        ("offcpu_interval_ns", c_uint64),
        ("runqueue_interval_ns", c_uint64),
        ("wakeup_bytes", c_uint64),
        ("tp_btf_skip", c_uint32),
        ("reserved", c_uint32),
    ]


class UnwindRow(Structure):
    _fields_ = [
        ("pc", c_uint32),
        ("cfa_off", c_int32),
        ("rbp_off", c_int16),
        ("cfa_kind", c_uint8),
        ("rbp_kind", c_uint8),
    ]


class UnwindMapping(Structure):
    _fields_ = [
        ("start", c_uint64),
        ("end", c_uint64),
        ("bias", c_uint64),
        ("first", c_uint32),
        ("count", c_uint32),
        ("buckets", c_uint32),
        ("bucket_count", c_uint32),
        ("bucket_base", c_uint32),
        ("bucket_shift", c_uint32),
    ]


class UnwindProc(Structure):
    _fields_ = [("slot", c_uint32), ("count", c_uint32), ("flags", c_uint32)]


# ---- Episode report (issue 12): bpf/bistouri.h's block of the same name.


class EpisodeFilter(IntEnum):
    ON = 4  # a pid_filter bit beside FilterFlags: account the process's threads by state


class EpisodeKind(IntEnum):
    """Stack events of the episode hooks, beside EventKind."""

    SLEEP = 16  # interruptible (S) wait
    RECLAIM = 17  # direct reclaim or compaction
    RUNQUEUE = 18  # waiting for a CPU: blocked_ns is the mean delay of the `waits` it stands for


class ThreadState(IntEnum):
    UNKNOWN = 0
    RUNNING = 1
    RUNNABLE = 2
    BLOCKED_D = 3
    BLOCKED_S = 4


class EpisodeCounter(IntEnum):
    """Indexes of the BPF `episode_counters` map."""

    SWITCHES = 0
    WAKEUPS = 1
    THREADS_FULL = 2
    STACKS_LIMITED = 3
    RECLAIMS = 4
    RUNQUEUE_STACKS = 5
    STACKS_REUSED = 6


EPISODE_COUNTER_MAX = 7


class ThreadTimes(Structure):
    _fields_ = [
        ("pid", c_uint32),
        ("tid", c_uint32),
        ("on_cpu_ns", c_uint64),
        ("runqueue_ns", c_uint64),
        ("blocked_d_ns", c_uint64),
        ("blocked_s_ns", c_uint64),
        ("reclaim_ns", c_uint64),
        ("runqueue_waits", c_uint64),
        ("d_waits", c_uint64),
        ("s_waits", c_uint64),
        ("reclaims", c_uint64),
        ("since_ns", c_uint64),
        ("reclaim_start_ns", c_uint64),
        ("stack_ns", c_uint64),
        ("state", c_uint32),
        ("skipped", c_uint32),
        ("comm", c_uint8 * COMM_LEN),
        ("runqueue_unsent_ns", c_uint64),
        ("runqueue_unsent", c_uint32),
        ("reserved", c_uint32),
        ("stack_at", c_uint64),
        ("stack_kernel_hash", c_uint64),
        ("stack_user_hash", c_uint64),
    ]


# C struct name -> mirror. Every shared struct must be listed here.
# ---- The flight recorder's waits, counted in the kernel (issue 22): bpf/bistouri.h's block of the same name.

RECORDER_SLOTS = 64  # one a second, the last RECORDER_SLOTS seconds


class RecorderKey(Structure):
    _fields_ = [("tid", c_uint32), ("kind", c_uint32), ("kernel_hash", c_uint64), ("user_key", UserStackKey)]


class RecorderSlot(Structure):
    _fields_ = [("second", c_uint32), ("waits", c_uint32), ("blocked_ns", c_uint64)]


RECORDED_EVENT_BYTES = StackEvent.py_frames.offset  # a StackEvent up to its Python frames


class RecordedWait(Structure):
    _fields_ = [("slots", RecorderSlot * RECORDER_SLOTS), ("event", c_uint8 * RECORDED_EVENT_BYTES)]


class RecorderCounter(IntEnum):
    """Indexes of the BPF `recorder_counters` map."""

    KEPT = 0  # wait events counted into recorder_waits instead of sent
    ENTRIES = 1  # entries created (those no longer present were evicted)
    REFUSED = 2  # events the map could not take


RECORDER_COUNTER_MAX = 3


MIRRORS: dict[str, type[Structure]] = {
    "bistouri_user_stack_key": UserStackKey,
    "bistouri_sample_key": SampleKey,
    "bistouri_stack_event": StackEvent,
    "bistouri_raw_stack": RawStack,
    "bistouri_exec_event": ExecEvent,
    "bistouri_error_event": ErrorEvent,
    "bistouri_comm_key": CommKey,
    "bistouri_config": Config,
    "bistouri_unwind_row": UnwindRow,
    "bistouri_unwind_mapping": UnwindMapping,
    "bistouri_unwind_proc": UnwindProc,
    "bistouri_thread_times": ThreadTimes,
    "bistouri_python_proc": PythonProc,
    "bistouri_py_frame": PyFrame,
    "bistouri_recorder_key": RecorderKey,
    "bistouri_recorder_slot": RecorderSlot,
    "bistouri_recorded_wait": RecordedWait,
}

# C enum name -> (prefix of its constants, mirror), compared value by value.
ENUMS: dict[str, tuple[str, type[IntEnum]]] = {
    "bistouri_event_kind": ("BISTOURI_EVENT_", EventKind),
    "bistouri_filter_flags": ("BISTOURI_FILTER_", FilterFlags),
    "bistouri_counter": ("BISTOURI_CNT_", Counter),
    "bistouri_cfa_kind": ("BISTOURI_CFA_", CfaKind),
    "bistouri_rbp_kind": ("BISTOURI_RBP_", RbpKind),
    "bistouri_ra_kind": ("BISTOURI_RA_", RaKind),
    "bistouri_episode_filter": ("BISTOURI_EPISODE_FILTER_", EpisodeFilter),
    "bistouri_episode_kind": ("BISTOURI_EVENT_", EpisodeKind),
    "bistouri_thread_state": ("BISTOURI_STATE_", ThreadState),
    "bistouri_episode_counter": ("BISTOURI_EPC_", EpisodeCounter),
    "bistouri_py_instr_kind": ("BISTOURI_PY_INSTR_", PyInstrKind),
    "bistouri_py_entry_kind": ("BISTOURI_PY_ENTRY_", PyEntryKind),
    "bistouri_py_status": ("BISTOURI_PY_STATUS_", PyStatus),
    "bistouri_recorder_counter": ("BISTOURI_RC_", RecorderCounter),
}

# Precompiled decoders for the hot path (the ring-buffer callback).
# user_key stays packed (it is a map key as is); the three walk bytes stay packed too (UserWalk).
STACK_HEADER = struct.Struct("<IIIIQQII24sQii3s5x16s")
SAMPLE_KEY_HEAD = struct.Struct("<IIQ")  # tid, reserved, kernel_hash; the user key follows
USER_STACK_KEY = struct.Struct("<IIQQ")
STACK_HEADER_SIZE = STACK_HEADER.size
KERNEL_STACK_OFFSET = StackEvent.kernel_stack.offset
USER_STACK_OFFSET = StackEvent.user_stack.offset
STACK_EVENT_SIZE = ctypes.sizeof(StackEvent)
PY_FRAME = struct.Struct("<QII")  # a PyFrame: code (| PY_FRAME_ENTRY), offset, checksum
RAW_STACK_HEAD = struct.Struct("<QQQQI4x")  # ip, sp, bp, lr, stack_size
RAW_EVENT_OFFSET = RawStack.event.offset
RAW_BYTES_OFFSET = RawStack.stack.offset
EXEC_EVENT = struct.Struct("<IIQ16s")
ERROR_EVENT = struct.Struct("<IIqQ")


def abi_mismatches(btf: Btf) -> list[str]:
    """Differences between the mirrors and the object's BTF; empty when they agree."""
    problems: list[str] = []
    for cname, mirror in MIRRORS.items():
        found = btf.struct(cname)
        if found is None:
            problems.append(f"struct {cname}: absent from the object's BTF (not anchored?)")
            continue
        size, members = found
        if size != ctypes.sizeof(mirror):
            problems.append(f"struct {cname}: size {size} in BTF, {ctypes.sizeof(mirror)} in abi.py")
        c_fields = [(m.name, m.offset) for m in members]
        py_fields = [(name, getattr(mirror, name).offset) for name, *_ in mirror._fields_]
        if c_fields != py_fields:
            problems.append(f"struct {cname}: fields {c_fields} in BTF, {py_fields} in abi.py")
    for cname, (prefix, enum) in ENUMS.items():
        values = btf.enum(cname)
        if values is None:
            problems.append(f"enum {cname}: absent from the object's BTF (not anchored?)")
            continue
        c_values = {k.removeprefix(prefix): v for k, v in values.items()}
        py_values = {m.name: int(m.value) for m in enum}
        if enum is Counter:
            py_values["MAX"] = COUNTER_MAX
        if enum is EpisodeCounter:
            py_values["MAX"] = EPISODE_COUNTER_MAX
        if enum is RecorderCounter:
            py_values["MAX"] = RECORDER_COUNTER_MAX
        if c_values != py_values:
            problems.append(f"enum {cname}: {c_values} in BTF, {py_values} in abi.py")
    return problems


def comm_bytes(comm: bytes) -> str:
    return comm.split(b"\0", 1)[0].decode(errors="replace")

"""The session wire format: what the agent spools and sends, what the symbolizer ingests.

A session is one msgpack map, dictionary-encoded so that a repeated stack costs
a few bytes: build ids, kernel IPs, user frames and stacks each live once in a
table, and traces point into them by index. A request carries several sessions
(`encode_batch`), gzip-compressed by the transport. docs/wire-format.md is the
reference; tests/golden holds byte-exact examples.

Packing and unpacking are pure functions: no I/O, no clocks.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgpack

from ..errors import WireError
from ..pressure import RESOURCES, STALLS

VERSION = 3
# v1: no mapping names, no JIT frames (old spool files); v2: no episode, no wait states
READABLE_VERSIONS = (1, 2, 3)

# User frame kinds, as sent on the wire.
FRAME_RESOLVED = 0  # mapping index (build id, file name) + file offset
FRAME_VDSO = 1  # raw IP inside the process's vDSO
FRAME_UNKNOWN = 2  # raw IP in no mapping of the process
FRAME_JIT = 3  # (v2) raw IP in JIT code, named from the process's perf map (jit name index)
FRAME_KINDS = (FRAME_RESOLVED, FRAME_VDSO, FRAME_UNKNOWN, FRAME_JIT)

# What started a session: a PSI event, or an operator asking the agent (capture now).
TRIGGER_PSI = "psi"
TRIGGER_MANUAL = "manual"
TRIGGER_KINDS = (TRIGGER_PSI, TRIGGER_MANUAL)

MAX_U64 = (1 << 64) - 1

# (v3) What an off-CPU trace waited in: the 6th element of a trace row, absent for D. The one
# vocabulary of wait states: the API's and the UI's state names are WAIT_NAMES' values.
WAIT_D = 0  # uninterruptible (D) wait, the only kind before v3
WAIT_S = 1  # interruptible sleep (S): futex, locks, poll, sleeps
WAIT_RECLAIM = 2  # direct reclaim or compaction
WAIT_RUNQUEUE = 3  # runnable, waiting for a CPU (preempted, or woken and not yet running)
WAIT_STATES = (WAIT_D, WAIT_S, WAIT_RECLAIM, WAIT_RUNQUEUE)
WAIT_NAMES = {WAIT_D: "D", WAIT_S: "S", WAIT_RECLAIM: "reclaim", WAIT_RUNQUEUE: "runqueue"}
MAX_VICTIMS = 1024  # episode rows the decoder accepts (the agent keeps 256 / 20)
MAX_AGGRESSORS = 256

# Limits of what the decoder accepts: it runs on untrusted input. docs/api.md ("Limits") quotes them.
MAX_SESSIONS_PER_BATCH = 1000
# msgpack values one request may hold, every element of every array and map counted: each costs a
# worker ~60 bytes decoded, and a byte of gzip'd msgpack can hold ~1000 of them (empty arrays).
MAX_BATCH_OBJECTS = 3_000_000
# One session must fit a request alone, with room for the batch around it (encode_session_to_fit).
MAX_SESSION_OBJECTS = MAX_BATCH_OBJECTS * 9 // 10
# The symbolization work of one request (`work_of`): at these a worker spends at most ~2 s and
# ~150 MB. The symbolizer refuses a session over them (413) and puts off the rest of a batch past
# them; the agent leaves the lightest stacks out of a session over them (encode_session_to_fit).
MAX_FRAMES_PER_REQUEST = 50_000  # distinct kernel + user frames
MAX_STACKS_PER_REQUEST = 50_000  # distinct stacks
MAX_STACK_ENTRIES_PER_REQUEST = 500_000  # frames in all the stacks, counted once per stack
MAX_STR_BYTES = 16384  # any string, in UTF-8 bytes; the text fields have tighter limits below
MAX_BIN_LEN = 64  # build ids
MAX_USER_FRAMES = 1024  # per stack; the agent's BPF program collects at most 127
MAX_KERNEL_FRAMES = 512  # per stack; the kernel's limit (sysctl kernel.perf_event_max_stack) is 127
# Any array inside a table row (a stack's frames, a trace): past the frame limits, so that a stack a
# little too deep is refused alone, with its session named, and a huge one ends the whole request.
MAX_ARRAY_LEN = 2 * MAX_USER_FRAMES
MAX_LABELS = 64
MAX_MAP_LEN = 2 * MAX_LABELS  # any map (a session's fields, labels, trigger): past MAX_LABELS, as arrays
MAX_LABEL_KEY_CHARS = 128
MAX_LABEL_VALUE_CHARS = 1024
MAX_NAME_CHARS = 256  # tenant, service, host
MAX_COMM_CHARS = 64  # process and thread names; the kernel's TASK_COMM_LEN is 16
MAX_CGROUP_CHARS = 4096  # the kernel's PATH_MAX
MAX_RELEASE_CHARS = 256  # uname -r; the kernel's is 64
MAX_SESSION_ID_CHARS = 64
MAX_MAPPING_NAME_CHARS = 256  # a mapped file's base name (NAME_MAX is 255)
MAX_JIT_NAME_CHARS = 1024  # a perf-map name (node's carry the script path and position)


@dataclass(frozen=True, slots=True)
class UserFrame:
    kind: int  # FRAME_*
    build_id: bytes  # empty unless kind == FRAME_RESOLVED (and empty then if the file has none)
    address: int  # file offset when resolved, raw IP otherwise
    name: str = ""  # resolved: the mapped file's basename; jit: the function's name


@dataclass(frozen=True, slots=True)
class Trace:
    """One distinct stack of one thread, with its counts. Frames are leaf first."""

    kernel: tuple[int, ...]
    user: tuple[UserFrame, ...]
    pid: int
    tid: int
    on_cpu: int = 0
    off_cpu: int = 0
    off_cpu_ns: int = 0
    pre_trigger: bool = False  # sampled by the flight recorder before the trigger
    wait: int = WAIT_D  # (v3) what the off-CPU counts waited in (WAIT_*)


class FiredTrigger(Protocol):
    """What `Trigger.from_psi` reads of a PSI event (host.psi.PsiEvent): the wire format stays below the
    host readers (tests/unit/test_layers.py)."""

    @property
    def resource(self) -> str: ...
    @property
    def stall(self) -> str: ...
    @property
    def threshold_us(self) -> int: ...
    @property
    def window_us(self) -> int: ...
    @property
    def time_ns(self) -> int: ...
    @property
    def avg10(self) -> float: ...
    @property
    def avg60(self) -> float: ...
    @property
    def avg300(self) -> float: ...
    @property
    def total_us(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Trigger:
    resource: str  # cpu | memory | io (a manual capture: the target's first resource)
    stall: str = "some"  # some | full
    threshold_us: int = 0
    window_us: int = 0
    cgroup: str = ""  # cgroup2 path relative to the mount, "/" for system-wide
    time_ns: int = 0  # wall clock of the PSI event
    avg10: float = 0.0
    avg60: float = 0.0
    avg300: float = 0.0
    total_us: int = 0
    kind: str = TRIGGER_PSI  # psi | manual

    @classmethod
    def from_psi(cls, event: FiredTrigger, cgroup: str) -> Trigger:
        """A session's trigger from the PSI event that fired; `cgroup` is relative to the cgroup2
        mount, "/" for system-wide."""
        return cls(
            resource=event.resource,
            stall=event.stall,
            threshold_us=event.threshold_us,
            window_us=event.window_us,
            cgroup=cgroup,
            time_ns=event.time_ns,
            avg10=event.avg10,
            avg60=event.avg60,
            avg300=event.avg300,
            total_us=event.total_us,
        )


@dataclass(frozen=True, slots=True)
class Victim:
    """(v3) One watched thread's time by state over the episode (episode.py)."""

    pid: int
    tid: int
    comm: str
    on_cpu_ns: int = 0
    runqueue_ns: int = 0  # runnable, waiting for a CPU
    blocked_d_ns: int = 0
    blocked_s_ns: int = 0
    reclaim_ns: int = 0  # direct reclaim and compaction (overlaps the states above)

    @property
    def stall_ns(self) -> int:
        """What PSI counts as stalled: waiting for a CPU, for I/O (D), for memory (reclaim)."""
        return self.runqueue_ns + self.blocked_d_ns + self.reclaim_ns


@dataclass(frozen=True, slots=True)
class Aggressor:
    """(v3) What one cgroup used over the episode (episode.py)."""

    cgroup: str  # relative to the cgroup2 mount
    cpu_ns: int = 0
    io_bytes: int = 0
    io_ops: int = 0
    memory_bytes: int = 0  # growth of memory.current
    reclaim_bytes: int = 0  # reclaimed from it (memory.stat pgsteal)


@dataclass(frozen=True, slots=True)
class Episode:
    """(v3) Who waited and who used the machine, over the session's window, ranked."""

    victims: tuple[Victim, ...] = ()
    aggressors: tuple[Aggressor, ...] = ()


@dataclass(slots=True)
class UnwindSummary:
    """How a session's user stacks were walked, weighted by samples: the data-quality note."""

    # user frames by how they were unwound: "table" (.eh_frame rows) or "frame_pointer"
    frames: dict[str, int] = field(default_factory=dict)
    # samples by why their user walk ended: entry (the whole stack), no_frame_pointer,
    # read_failed, max_depth, bad_frame (abi.WALK_ENDS)
    walks: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, dict[str, int]]:
        return {"frames": dict(self.frames), "walks": dict(self.walks)}


@dataclass(frozen=True, slots=True)
class KernelInfo:
    release: str = ""
    build_id: bytes = b""
    text_addr: int = 0  # runtime address of _text (KASLR-corrected base)
    boot_id: bytes = b""  # /proc/sys/kernel/random/boot_id (16 bytes): its kallsyms snapshot is this boot's


@dataclass(slots=True)
class Session:
    session_id: str
    trigger: Trigger
    kernel: KernelInfo
    start_ns: int  # wall clock
    duration_ns: int
    period_ns: int  # sampling period of the on-CPU sampler
    tenant: str = ""
    service: str = ""
    host: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    processes: dict[int, str] = field(default_factory=dict)  # pid -> comm
    threads: dict[int, str] = field(default_factory=dict)  # tid -> thread name
    traces: list[Trace] = field(default_factory=list)
    # How long before the trigger the session starts (flight-recorder samples): start_ns is
    # trigger time minus this; traces with pre_trigger=True were sampled in it.
    pre_trigger_ns: int = 0
    unwind: UnwindSummary = field(default_factory=UnwindSummary)
    episode: Episode | None = None  # (v3) absent from older sessions and manual ones without it

    @property
    def total_samples(self) -> int:
        return sum(t.on_cpu + t.off_cpu for t in self.traces)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def session_to_wire(s: Session) -> dict[str, Any]:
    """Dictionary-encode a session into plain msgpack-able values."""
    mappings: dict[tuple[bytes, str], int] = {}
    jit_names: dict[str, int] = {}
    kframes: dict[int, int] = {}
    uframes: dict[UserFrame, int] = {}
    stacks: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    threads: dict[int, int] = {}
    kframe_list: list[int] = []
    uframe_list: list[list[int]] = []
    stack_list: list[list[list[int]]] = []
    thread_list: list[list[Any]] = []
    traces: list[list[int]] = []
    pre_traces: list[list[int]] = []

    for t in s.traces:
        kidx = []
        for ip in t.kernel:
            i = kframes.get(ip)
            if i is None:
                i = kframes[ip] = len(kframe_list)
                kframe_list.append(ip)
            kidx.append(i)
        uidx = []
        for f in t.user:
            i = uframes.get(f)
            if i is None:
                m = -1
                if f.kind == FRAME_RESOLVED:
                    m = mappings.setdefault((f.build_id, f.name), len(mappings))
                elif f.kind == FRAME_JIT:
                    m = jit_names.setdefault(f.name, len(jit_names))
                i = uframes[f] = len(uframe_list)
                uframe_list.append([f.kind, m, f.address])
            uidx.append(i)
        key = (tuple(kidx), tuple(uidx))
        si = stacks.get(key)
        if si is None:
            si = stacks[key] = len(stack_list)
            stack_list.append([kidx, uidx])
        ti = threads.get(t.tid)
        if ti is None:
            ti = threads[t.tid] = len(thread_list)
            thread_list.append([t.pid, t.tid, s.threads.get(t.tid, "")])
        row = [si, ti, t.on_cpu, t.off_cpu, t.off_cpu_ns]
        if t.wait != WAIT_D:
            row.append(t.wait)
        (pre_traces if t.pre_trigger else traces).append(row)

    tr = s.trigger
    trigger: dict[str, Any] = {
        "resource": tr.resource,
        "stall": tr.stall,
        "threshold_us": tr.threshold_us,
        "window_us": tr.window_us,
        "cgroup": tr.cgroup,
        "time_ns": tr.time_ns,
        "avg": [tr.avg10, tr.avg60, tr.avg300],
        "total_us": tr.total_us,
    }
    # Optional keys only when they differ from their default: older readers ignore them,
    # and a session without them encodes byte for byte as before.
    if tr.kind != TRIGGER_PSI:
        trigger["kind"] = tr.kind
    kernel: dict[str, Any] = {
        "release": s.kernel.release,
        "build_id": s.kernel.build_id,
        "text": s.kernel.text_addr,
    }
    if s.kernel.boot_id:  # absent when unknown, as from agents before it existed
        kernel["boot"] = s.kernel.boot_id
    out: dict[str, Any] = {
        "v": VERSION,
        "id": s.session_id,
        "tenant": s.tenant,
        "service": s.service,
        "host": s.host,
        "labels": dict(s.labels),
        "processes": [[pid, comm] for pid, comm in sorted(s.processes.items())],
        "trigger": trigger,
        "kernel": kernel,
        "start_ns": s.start_ns,
        "duration_ns": s.duration_ns,
        "period_ns": s.period_ns,
        "total": s.total_samples,
        "mappings": [bid for bid, _ in sorted(mappings, key=mappings.__getitem__)],
        "mapping_names": [name for _, name in sorted(mappings, key=mappings.__getitem__)],
        "jit_names": sorted(jit_names, key=jit_names.__getitem__),
        "kframes": kframe_list,
        "uframes": uframe_list,
        "stacks": stack_list,
        "threads": thread_list,
        "traces": traces,
    }
    if pre_traces:
        out["pre_traces"] = pre_traces
        out["pre_trigger_ns"] = s.pre_trigger_ns
    if s.unwind.frames or s.unwind.walks:
        out["unwind"] = s.unwind.to_json()
    if s.episode is not None:
        out["episode"] = {
            "victims": [
                [
                    v.pid,
                    v.tid,
                    v.comm,
                    v.on_cpu_ns,
                    v.runqueue_ns,
                    v.blocked_d_ns,
                    v.blocked_s_ns,
                    v.reclaim_ns,
                ]
                for v in s.episode.victims
            ],
            "aggressors": [
                [a.cgroup, a.cpu_ns, a.io_bytes, a.io_ops, a.memory_bytes, a.reclaim_bytes]
                for a in s.episode.aggressors
            ],
        }
    return out


def encode_session(s: Session) -> bytes:
    """One session as msgpack bytes: the spool file content and the unit of a batch."""
    return _pack(session_to_wire(s))


def count_objects(obj: Any) -> int:
    """msgpack values as the decoder counts them against MAX_BATCH_OBJECTS: each array and map, its
    length + 1."""
    n = 0
    todo = [obj]
    while todo:
        v = todo.pop()
        items = v.values() if isinstance(v, dict) else v
        n += len(v) + 1
        todo.extend(x for x in items if isinstance(x, (list, dict)))
    return n if isinstance(obj, (list, dict)) else 0


def work_of(m: Any) -> tuple[int, int, int]:
    """The symbolization work of a session map: (distinct frames, distinct stacks, frames in all the
    stacks). What is malformed counts 0: decoding refuses it."""
    if not isinstance(m, dict):
        return 0, 0, 0

    def listed(key: str) -> list[Any]:
        v = m.get(key)
        return v if isinstance(v, list) else []

    stacks = listed("stacks")
    entries = 0
    for st in stacks:
        if isinstance(st, list):
            entries += sum(len(part) for part in st if isinstance(part, list))
    return len(listed("kframes")) + len(listed("uframes")), len(stacks), entries


def _overshoot(m: dict[str, Any], max_objects: int) -> float:
    """How far a session map is over what one request may hold: > 1 when it is over."""
    frames, stacks, entries = work_of(m)
    return max(
        count_objects(m) / max_objects,
        frames / MAX_FRAMES_PER_REQUEST,
        stacks / MAX_STACKS_PER_REQUEST,
        entries / MAX_STACK_ENTRIES_PER_REQUEST,
    )


def encode_session_to_fit(s: Session, max_objects: int = 0) -> tuple[bytes, int]:
    """`encode_session`, keeping the session within what one request may hold (MAX_SESSION_OBJECTS
    and the work limits): beyond it the lightest traces are left out. Returns the bytes and how many
    traces were left out, so that the agent never spools a session the symbolizer must refuse."""
    budget = max_objects or MAX_SESSION_OBJECTS
    traces = sorted(s.traces, key=lambda t: t.on_cpu + t.off_cpu, reverse=True)
    keep = len(traces)
    while True:
        m = session_to_wire(s if keep == len(traces) else replace(s, traces=traces[:keep]))
        over = _overshoot(m, budget)
        if over <= 1 or keep == 0:
            return _pack(m), len(traces) - keep
        # What a session holds grows about linearly with its traces: aim a little under, check again.
        keep = min(keep - 1, int(keep / over * 0.95))


def encode_batch(encoded_sessions: Iterable[bytes]) -> bytes:
    """A request body from already-encoded sessions, without re-encoding them."""
    items = list(encoded_sessions)
    head = _pack({"v": VERSION, "sessions": None})
    # Replace the nil placeholder by an array header followed by the raw sessions.
    assert head.endswith(b"\xc0")
    n = len(items)
    if n < 16:
        arr = bytes([0x90 | n])
    elif n < 1 << 16:
        arr = b"\xdc" + n.to_bytes(2, "big")
    else:
        arr = b"\xdd" + n.to_bytes(4, "big")
    return head[:-1] + arr + b"".join(items)


# ---------------------------------------------------------------------------
# Decoding, with validation: the symbolizer runs this on untrusted input.


def _req(m: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in m:
        raise WireError("malformed", f"{where}.{key} is missing")
    v = m[key]
    if typ is int and isinstance(v, bool):
        raise WireError("malformed", f"{where}.{key} must be an integer")
    if not isinstance(v, typ):
        raise WireError("malformed", f"{where}.{key} has type {type(v).__name__}")
    return v


def _u64(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_U64:
        raise WireError("malformed", f"{where} must be an unsigned 64-bit integer")
    return v


def _index(v: Any, size: int, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < size:
        raise WireError("malformed", f"{where} index {v!r} out of range (table of {size})")
    return v


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WireError("malformed", f"{where} must be a number")
    f = float(v)
    if not math.isfinite(f):  # JSON has no NaN: one stored session would break every session list
        raise WireError("malformed", f"{where} must be a finite number")
    return f


def session_from_wire(m: Any) -> Session:
    """Validate and decode one dictionary-encoded session."""
    if not isinstance(m, dict):
        raise WireError("malformed", "a session must be a map")
    v = m.get("v")
    if v not in READABLE_VERSIONS:
        raise WireError("unsupported_version", f"session version {v!r}, this build reads {READABLE_VERSIONS}")
    sid = _req(m, "id", str, "session")
    if not 0 < len(sid) <= MAX_SESSION_ID_CHARS:
        raise WireError("malformed", f"session.id must be 1 to {MAX_SESSION_ID_CHARS} characters")
    where = f"session[{sid}]"
    trig = _req(m, "trigger", dict, where)
    resource = _req(trig, "resource", str, where + ".trigger")
    if resource not in RESOURCES:
        raise WireError("malformed", f"{where}.trigger.resource {resource!r} is not one of {RESOURCES}")
    stall = trig.get("stall", "some")
    if stall not in STALLS:
        raise WireError("malformed", f"{where}.trigger.stall {stall!r} is not one of {STALLS}")
    avg = trig.get("avg", [0.0, 0.0, 0.0])
    if not isinstance(avg, list) or len(avg) != 3:
        raise WireError("malformed", f"{where}.trigger.avg must be [avg10, avg60, avg300]")
    cgroup = _str(trig, "cgroup", where + ".trigger", MAX_CGROUP_CHARS)
    kind = trig.get("kind", TRIGGER_PSI)
    if kind not in TRIGGER_KINDS:
        raise WireError("malformed", f"{where}.trigger.kind {kind!r} is not one of {TRIGGER_KINDS}")
    trigger = Trigger(
        kind=kind,
        resource=resource,
        stall=stall,
        threshold_us=_u64(trig.get("threshold_us", 0), where + ".trigger.threshold_us"),
        window_us=_u64(trig.get("window_us", 0), where + ".trigger.window_us"),
        cgroup=cgroup,
        time_ns=_u64(trig.get("time_ns", 0), where + ".trigger.time_ns"),
        avg10=_float(avg[0], where + ".trigger.avg"),
        avg60=_float(avg[1], where + ".trigger.avg"),
        avg300=_float(avg[2], where + ".trigger.avg"),
        total_us=_u64(trig.get("total_us", 0), where + ".trigger.total_us"),
    )
    k = _req(m, "kernel", dict, where)
    kbid = k.get("build_id", b"")
    if not isinstance(kbid, bytes) or len(kbid) > 64:
        raise WireError("malformed", f"{where}.kernel.build_id must be a build id (bin, 0-64 bytes)")
    krel = _str(k, "release", where + ".kernel", MAX_RELEASE_CHARS)
    boot = k.get("boot", b"")
    if not isinstance(boot, bytes) or len(boot) not in (0, 16):
        raise WireError("malformed", f"{where}.kernel.boot must be a boot id (bin, 16 bytes)")
    kernel = KernelInfo(
        release=krel, build_id=kbid, text_addr=_u64(k.get("text", 0), where + ".kernel.text"), boot_id=boot
    )

    labels = m.get("labels", {})
    if not isinstance(labels, dict) or not all(
        isinstance(a, str) and isinstance(b, str) for a, b in labels.items()
    ):
        raise WireError("malformed", f"{where}.labels must map strings to strings")
    if len(labels) > MAX_LABELS:
        raise WireError("malformed", f"{where}.labels: {len(labels)} labels, at most {MAX_LABELS}")
    for key, value in labels.items():
        if not 0 < len(key) <= MAX_LABEL_KEY_CHARS or len(value) > MAX_LABEL_VALUE_CHARS:
            raise WireError(
                "malformed",
                f"{where}.labels[{key[:64]!r}]: keys are 1 to {MAX_LABEL_KEY_CHARS} characters, "
                f"values at most {MAX_LABEL_VALUE_CHARS}",
            )
    processes: dict[int, str] = {}
    process_rows = m.get("processes") or []
    if not isinstance(process_rows, list):
        raise WireError("malformed", f"{where}.processes must be an array of [pid, comm]")
    for i, p in enumerate(process_rows):
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)):
            raise WireError("malformed", f"{where}.processes entries are [pid, comm]")
        _comm(p[1], f"{where}.processes[{i}]")
        processes[_u64(p[0], where + ".processes.pid")] = p[1]

    mappings = _req(m, "mappings", list, where)
    min_id = 1 if v == 1 else 0  # v2: a file without a build id is known by its name only
    for i, b in enumerate(mappings):
        if not isinstance(b, bytes) or not min_id <= len(b) <= 64:
            raise WireError("malformed", f"{where}.mappings[{i}] must be a build id (bin, {min_id}-64 bytes)")
    mapping_names = m.get("mapping_names", [""] * len(mappings)) if v >= 2 else [""] * len(mappings)
    if not (
        isinstance(mapping_names, list)
        and len(mapping_names) == len(mappings)
        and all(isinstance(n, str) and len(n) <= MAX_MAPPING_NAME_CHARS for n in mapping_names)
    ):
        raise WireError(
            "malformed",
            f"{where}.mapping_names must hold one name (<= {MAX_MAPPING_NAME_CHARS} chars) per mapping",
        )
    jit_names = m.get("jit_names", []) if v >= 2 else []
    if not (
        isinstance(jit_names, list)
        and all(isinstance(n, str) and len(n) <= MAX_JIT_NAME_CHARS for n in jit_names)
    ):
        raise WireError(
            "malformed", f"{where}.jit_names must be strings of at most {MAX_JIT_NAME_CHARS} characters"
        )
    kframes = [_u64(ip, f"{where}.kframes") for ip in _req(m, "kframes", list, where)]
    uframes: list[UserFrame] = []
    for i, f in enumerate(_req(m, "uframes", list, where)):
        if not (isinstance(f, list) and len(f) == 3 and f[0] in FRAME_KINDS):
            raise WireError("malformed", f"{where}.uframes[{i}] must be [kind, mapping, address]")
        kind, mi, addr = f
        addr = _u64(addr, f"{where}.uframes[{i}].address")
        bid, name = b"", ""
        if kind == FRAME_RESOLVED:
            mi = _index(mi, len(mappings), f"{where}.uframes[{i}].mapping")
            bid, name = mappings[mi], mapping_names[mi]
        elif kind == FRAME_JIT:
            name = jit_names[_index(mi, len(jit_names), f"{where}.uframes[{i}].jit name")]
        uframes.append(UserFrame(kind, bid, addr, name))
    stacks: list[tuple[tuple[int, ...], tuple[UserFrame, ...]]] = []
    for i, st in enumerate(_req(m, "stacks", list, where)):
        if not (
            isinstance(st, list) and len(st) == 2 and isinstance(st[0], list) and isinstance(st[1], list)
        ):
            raise WireError("malformed", f"{where}.stacks[{i}] must be [kernel indexes, user indexes]")
        if len(st[0]) > MAX_KERNEL_FRAMES or len(st[1]) > MAX_USER_FRAMES:
            raise WireError(
                "too_large",
                f"{where}.stacks[{i}] has {len(st[0])} kernel and {len(st[1])} user frames, "
                f"at most {MAX_KERNEL_FRAMES} and {MAX_USER_FRAMES}",
            )
        kst = tuple(kframes[_index(x, len(kframes), f"{where}.stacks[{i}]")] for x in st[0])
        ust = tuple(uframes[_index(x, len(uframes), f"{where}.stacks[{i}]")] for x in st[1])
        stacks.append((kst, ust))
    thread_rows: list[tuple[int, int]] = []
    threads: dict[int, str] = {}
    for i, th in enumerate(_req(m, "threads", list, where)):
        if not (isinstance(th, list) and len(th) == 3 and isinstance(th[2], str)):
            raise WireError("malformed", f"{where}.threads[{i}] must be [pid, tid, name]")
        pid = _u64(th[0], f"{where}.threads[{i}].pid")
        tid = _u64(th[1], f"{where}.threads[{i}].tid")
        _comm(th[2], f"{where}.threads[{i}].name")
        thread_rows.append((pid, tid))
        threads[tid] = th[2]
    traces: list[Trace] = []
    pre_rows = m.get("pre_traces", [])
    if not isinstance(pre_rows, list):
        raise WireError("malformed", f"{where}.pre_traces must be a list")
    post_rows = _req(m, "traces", list, where)
    for name, rows, pre in (("traces", post_rows, False), ("pre_traces", pre_rows, True)):
        for i, tr in enumerate(rows):
            at = f"{where}.{name}[{i}]"
            if not (isinstance(tr, list) and (len(tr) == 5 or (v >= 3 and len(tr) == 6))):
                raise WireError("malformed", f"{at} must be [stack, thread, on, off, off_ns(, wait)]")
            wait = tr[5] if len(tr) == 6 else WAIT_D
            if wait not in WAIT_STATES or isinstance(wait, bool):
                raise WireError("malformed", f"{at}.wait {wait!r} is not one of {WAIT_STATES}")
            kst, ust = stacks[_index(tr[0], len(stacks), f"{at}.stack")]
            pid, tid = thread_rows[_index(tr[1], len(thread_rows), f"{at}.thread")]
            traces.append(
                Trace(
                    kernel=kst,
                    user=ust,
                    pid=pid,
                    tid=tid,
                    on_cpu=_u64(tr[2], f"{at}.on_cpu"),
                    off_cpu=_u64(tr[3], f"{at}.off_cpu"),
                    off_cpu_ns=_u64(tr[4], f"{at}.off_cpu_ns"),
                    pre_trigger=pre,
                    wait=wait,
                )
            )
    return Session(
        session_id=sid,
        trigger=trigger,
        kernel=kernel,
        start_ns=_u64(_req(m, "start_ns", int, where), where + ".start_ns"),
        duration_ns=_u64(_req(m, "duration_ns", int, where), where + ".duration_ns"),
        period_ns=_u64(_req(m, "period_ns", int, where), where + ".period_ns"),
        tenant=_str(m, "tenant", where, MAX_NAME_CHARS),
        service=_str(m, "service", where, MAX_NAME_CHARS),
        host=_str(m, "host", where, MAX_NAME_CHARS),
        labels=dict(labels),
        processes=processes,
        threads=threads,
        traces=traces,
        pre_trigger_ns=_u64(m.get("pre_trigger_ns", 0), where + ".pre_trigger_ns"),
        unwind=_unwind_summary(m.get("unwind"), where + ".unwind"),
        episode=_episode(m["episode"], where + ".episode") if v >= 3 and "episode" in m else None,
    )


_MAX_UNWIND_KEYS = 8  # per map of an unwind summary: a few known names, more is an attack


def _unwind_summary(v: Any, where: str) -> UnwindSummary:
    """The optional data-quality note (absent in sessions of agents before it)."""
    if v is None:
        return UnwindSummary()
    if not isinstance(v, dict):
        raise WireError("malformed", f"{where} must be a map")
    out = UnwindSummary()
    for name, target in (("frames", out.frames), ("walks", out.walks)):
        counts = v.get(name, {})
        if not isinstance(counts, dict) or len(counts) > _MAX_UNWIND_KEYS:
            raise WireError("malformed", f"{where}.{name} must be a map of at most {_MAX_UNWIND_KEYS} counts")
        for key, n in counts.items():
            if not isinstance(key, str) or len(key) > 32 or not isinstance(n, int):
                raise WireError("malformed", f"{where}.{name} must map short names to counts")
            target[key] = _u64(n, f"{where}.{name}.{key}")
    return out


def _episode(m: Any, where: str) -> Episode:
    if not isinstance(m, dict):
        raise WireError("malformed", f"{where} must be a map with victims and aggressors")
    rows_v, rows_a = m.get("victims", []), m.get("aggressors", [])
    if not isinstance(rows_v, list) or len(rows_v) > MAX_VICTIMS:
        raise WireError("malformed", f"{where}.victims must be a list of at most {MAX_VICTIMS} rows")
    if not isinstance(rows_a, list) or len(rows_a) > MAX_AGGRESSORS:
        raise WireError("malformed", f"{where}.aggressors must be a list of at most {MAX_AGGRESSORS} rows")
    victims = []
    for i, r in enumerate(rows_v):
        at = f"{where}.victims[{i}]"
        if not (isinstance(r, list) and len(r) == 8 and isinstance(r[2], str)):
            raise WireError("malformed", f"{at} must be [pid, tid, comm, on_cpu, runqueue, D, S, reclaim] ns")
        _comm(r[2], at + ".comm")
        pid, tid, *ns = (_u64(x, at) for x in (r[0], r[1], *r[3:]))
        victims.append(Victim(pid, tid, r[2], *ns))
    aggressors = []
    for i, r in enumerate(rows_a):
        at = f"{where}.aggressors[{i}]"
        if not (
            isinstance(r, list) and len(r) == 6 and isinstance(r[0], str) and len(r[0]) <= MAX_CGROUP_CHARS
        ):
            raise WireError(
                "malformed", f"{at} must be [cgroup, cpu_ns, io_bytes, io_ops, memory_bytes, reclaim_bytes]"
            )
        aggressors.append(Aggressor(r[0], *(_u64(x, at) for x in r[1:])))
    return Episode(tuple(victims), tuple(aggressors))


def _str(m: Mapping[str, Any], key: str, where: str, limit: int = MAX_NAME_CHARS) -> str:
    v = m.get(key, "")
    if not isinstance(v, str) or len(v) > limit:
        raise WireError("malformed", f"{where}.{key} must be a string of at most {limit} characters")
    return v


def _comm(v: str, where: str) -> None:
    if len(v) > MAX_COMM_CHARS:
        raise WireError("malformed", f"{where} must be at most {MAX_COMM_CHARS} characters")


# The tables of a session: read row by row, so that no array holding more than MAX_ARRAY_LEN values is
# decoded in one go (msgpack decodes an array's values before its length can be counted).
_TABLES = frozenset(
    (
        "processes",
        "mappings",
        "mapping_names",
        "jit_names",
        "kframes",
        "uframes",
        "stacks",
        "threads",
        "traces",
        "pre_traces",
    )
)
_MAP_TYPES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_ARRAY_TYPES = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


class _Reader:
    """A bounded msgpack reader over one buffer: every limit above, and MAX_BATCH_OBJECTS in all."""

    def __init__(self, data: bytes, max_objects: int = MAX_BATCH_OBJECTS) -> None:
        self.data = data
        self.objects = 0
        self.max_objects = max_objects
        self.u = msgpack.Unpacker(
            io.BytesIO(data),  # read in slices: feeding the whole body would copy it
            read_size=min(len(data), 1 << 20) or 1,
            raw=False,
            strict_map_key=True,
            max_buffer_size=len(data) or 1,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_BIN_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            list_hook=self._list,
            object_hook=self._map,
        )

    def count(self, n: int) -> None:
        self.objects += n
        if self.objects > self.max_objects:
            raise WireError("too_large", f"more than {self.max_objects} msgpack values in one request")

    def _list(self, v: list[Any]) -> list[Any]:
        self.count(len(v) + 1)
        return v

    def _map(self, v: dict[str, Any]) -> dict[str, Any]:
        self.count(len(v) + 1)
        return v

    def peek(self) -> int:
        pos = self.u.tell()
        return self.data[pos] if pos < len(self.data) else -1

    def value(self) -> Any:
        return self.u.unpack()

    def header(self, types: frozenset[int], limit: int, what: str) -> int:
        """The length of the map or array that comes next (counted), or -1 if something else comes."""
        if self.peek() not in types:
            return -1
        n = self.u.read_map_header() if types is _MAP_TYPES else self.u.read_array_header()
        if n > limit:
            raise WireError("too_large", f"{what} has {n} entries, at most {limit}")
        self.count(n + 1)
        return int(n)

    def session(self) -> Any:
        """One session map, its tables row by row; anything else as it is, for the validator to refuse."""
        n = self.header(_MAP_TYPES, MAX_MAP_LEN, "a session")
        if n < 0:
            return self.value()
        m: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value()
            if not isinstance(key, str):
                raise WireError("malformed", "a session's keys must be strings")
            rows = self.header(_ARRAY_TYPES, self.max_objects, f"session.{key}") if key in _TABLES else -1
            m[key] = [self.value() for _ in range(rows)] if rows >= 0 else self.value()
        return m

    def end(self) -> None:
        if self.u.tell() != len(self.data):
            raise WireError(
                "malformed", f"not valid msgpack: {len(self.data) - self.u.tell()} bytes of extra data"
            )


def _read(data: bytes, read: Callable[[_Reader], Any]) -> Any:
    try:
        reader = _Reader(data)
        out = read(reader)
        reader.end()
        return out
    except (msgpack.OutOfData, msgpack.BufferFull):  # BufferFull: a header claims more than the body has
        raise WireError("malformed", "not valid msgpack: truncated")
    except ValueError as e:
        if "exceeds max_" in str(e):  # one of the msgpack limits above
            raise WireError("too_large", f"{e}: see the limits in docs/api.md")
        raise WireError("malformed", f"not valid msgpack: {e}")
    except (msgpack.UnpackException, TypeError) as e:
        raise WireError("malformed", f"not valid msgpack: {e}")


def decode_session(data: bytes) -> Session:
    """Decode one session as written by `encode_session` (a spool file)."""
    return session_from_wire(_read(data, _Reader.session))


def decode_batch(data: bytes, max_sessions: int = MAX_SESSIONS_PER_BATCH) -> list[Any]:
    """Split a request body into undecoded session maps (each validated on its own).

    The whole request is held to MAX_BATCH_OBJECTS values: over it, the batch is refused as too large
    (the agent then sends fewer sessions at a time).
    """
    sessions: list[Any] = _read(data, lambda r: _batch(r, max_sessions))
    return sessions


def _batch(r: _Reader, max_sessions: int) -> list[Any]:
    n = r.header(_MAP_TYPES, MAX_MAP_LEN, "a batch")
    if n < 0:
        raise WireError("malformed", "a batch must be a map")
    version: Any = None
    sessions: list[Any] | None = None
    for _ in range(n):
        key = r.value()
        if key == "sessions":
            count = r.header(_ARRAY_TYPES, MAX_BATCH_OBJECTS, "batch.sessions")
            if count < 0:
                raise WireError("malformed", "batch.sessions must be an array")
            if count > max_sessions:
                raise WireError("too_large", f"{count} sessions in one batch, at most {max_sessions}")
            sessions = [r.session() for _ in range(count)]
        elif key == "v":
            version = r.value()
        else:
            r.value()
    if version not in READABLE_VERSIONS:
        raise WireError(
            "unsupported_version", f"batch version {version!r}, this build reads {READABLE_VERSIONS}"
        )
    if sessions is None:
        raise WireError("malformed", "batch.sessions must be an array")
    return sessions


# ---------------------------------------------------------------------------
# Session files: the one framing of a session on disk (the spool, `bistouri symbolize`).
#
# A file is a header, then the kernel build id, then the msgpack session. The
# CRC32 covers the build id and the session, so damage anywhere is spotted. The
# build id rides beside the session so that the exporter learns which kernel a
# session needs without decoding it. Files of format 1 (no build id) still read.

FILE_MAGIC = b"BSP2"
FILE_MAGIC_V1 = b"BSP1"
FILE_HEADER = struct.Struct("<4sIIB")  # magic, session length, crc32, build id length
_FILE_HEADER_V1 = struct.Struct("<4sII")  # magic, session length, crc32 of the session
FILE_HEADER_MAX = FILE_HEADER.size + 255  # enough to learn a file's build id


@dataclass(frozen=True, slots=True)
class SessionFile:
    """An encoded session as stored in a file, with the kernel build id it was captured on."""

    data: bytes  # the msgpack session (`encode_session`)
    kernel_build_id: bytes = b""


def frame_session(f: SessionFile) -> bytes:
    """The bytes of a session file."""
    if len(f.kernel_build_id) > 255:
        raise ValueError(f"a kernel build id has at most 255 bytes, got {len(f.kernel_build_id)}")
    crc = zlib.crc32(f.data, zlib.crc32(f.kernel_build_id))
    head = FILE_HEADER.pack(FILE_MAGIC, len(f.data), crc, len(f.kernel_build_id))
    return head + f.kernel_build_id + f.data


def is_framed(raw: bytes) -> bool:
    return raw[:4] in (FILE_MAGIC, FILE_MAGIC_V1)


def unframe_session(raw: bytes) -> SessionFile:
    """The session in a file's bytes, checked; WireError("corrupt", why) if it is damaged."""
    magic = raw[:4]
    if magic == FILE_MAGIC_V1:
        if len(raw) < _FILE_HEADER_V1.size:
            raise WireError("corrupt", "shorter than its header")
        _, length, crc = _FILE_HEADER_V1.unpack_from(raw)
        bid, data = b"", raw[_FILE_HEADER_V1.size :]
    elif magic == FILE_MAGIC:
        if len(raw) < FILE_HEADER.size:
            raise WireError("corrupt", "shorter than its header")
        _, length, crc, bid_len = FILE_HEADER.unpack_from(raw)
        start = FILE_HEADER.size + bid_len
        bid, data = raw[FILE_HEADER.size : start], raw[start:]
        if len(bid) != bid_len:
            raise WireError("corrupt", "shorter than its header")
    else:
        raise WireError("corrupt", f"bad magic {magic!r}: not a bistouri session file")
    if length != len(data):
        raise WireError("corrupt", f"truncated: {len(data)} of {length} bytes")
    if zlib.crc32(data, zlib.crc32(bid)) != crc:
        raise WireError("corrupt", "checksum mismatch")
    return SessionFile(data, bid)


def framed_kernel_build_id(head: bytes) -> bytes:
    """The kernel build id from the first FILE_HEADER_MAX bytes of a file (b"" if it has none)."""
    if head[:4] != FILE_MAGIC or len(head) < FILE_HEADER.size:
        return b""
    n = head[FILE_HEADER.size - 1]
    bid = head[FILE_HEADER.size : FILE_HEADER.size + n]
    return bid if len(bid) == n else b""

"""The session wire format: what the agent spools and sends, what the symbolizer ingests.

A session is one msgpack map, dictionary-encoded so that a repeated stack costs
a few bytes: build ids, kernel IPs, user frames and stacks each live once in a
table, and traces point into them by index. A request carries several sessions
(`encode_batch`), gzip-compressed by the transport. docs/wire-format.md is the
reference; tests/golden holds byte-exact examples.

Packing and unpacking are pure functions: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import WireError

VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: no mapping names, no JIT frames (old spool files)

# User frame kinds, as sent on the wire.
FRAME_RESOLVED = 0  # mapping index (build id, file name) + file offset
FRAME_VDSO = 1  # raw IP inside the process's vDSO
FRAME_UNKNOWN = 2  # raw IP in no mapping of the process
FRAME_JIT = 3  # (v2) raw IP in JIT code, named from the process's perf map (jit name index)
FRAME_KINDS = (FRAME_RESOLVED, FRAME_VDSO, FRAME_UNKNOWN, FRAME_JIT)

RESOURCES = ("cpu", "memory", "io")
STALLS = ("some", "full")

MAX_U64 = (1 << 64) - 1


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


@dataclass(frozen=True, slots=True)
class Trigger:
    resource: str  # cpu | memory | io
    stall: str = "some"  # some | full
    threshold_us: int = 0
    window_us: int = 0
    cgroup: str = ""  # cgroup2 path relative to the mount, "/" for system-wide
    time_ns: int = 0  # wall clock of the PSI event
    avg10: float = 0.0
    avg60: float = 0.0
    avg300: float = 0.0
    total_us: int = 0


@dataclass(frozen=True, slots=True)
class KernelInfo:
    release: str = ""
    build_id: bytes = b""
    text_addr: int = 0  # runtime address of _text (KASLR-corrected base)


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
        traces.append([si, ti, t.on_cpu, t.off_cpu, t.off_cpu_ns])

    tr = s.trigger
    return {
        "v": VERSION,
        "id": s.session_id,
        "tenant": s.tenant,
        "service": s.service,
        "host": s.host,
        "labels": dict(s.labels),
        "processes": [[pid, comm] for pid, comm in sorted(s.processes.items())],
        "trigger": {
            "resource": tr.resource,
            "stall": tr.stall,
            "threshold_us": tr.threshold_us,
            "window_us": tr.window_us,
            "cgroup": tr.cgroup,
            "time_ns": tr.time_ns,
            "avg": [tr.avg10, tr.avg60, tr.avg300],
            "total_us": tr.total_us,
        },
        "kernel": {"release": s.kernel.release, "build_id": s.kernel.build_id, "text": s.kernel.text_addr},
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


def encode_session(s: Session) -> bytes:
    """One session as msgpack bytes: the spool file content and the unit of a batch."""
    return _pack(session_to_wire(s))


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
    return float(v)


def session_from_wire(m: Any) -> Session:
    """Validate and decode one dictionary-encoded session."""
    if not isinstance(m, dict):
        raise WireError("malformed", "a session must be a map")
    v = m.get("v")
    if v not in READABLE_VERSIONS:
        raise WireError("unsupported_version", f"session version {v!r}, this build reads {READABLE_VERSIONS}")
    sid = _req(m, "id", str, "session")
    if not 0 < len(sid) <= 64:
        raise WireError("malformed", "session.id must be 1 to 64 characters")
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
    cgroup = trig.get("cgroup", "")
    if not isinstance(cgroup, str):
        raise WireError("malformed", f"{where}.trigger.cgroup must be a string")
    trigger = Trigger(
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
    krel = k.get("release", "")
    if not isinstance(kbid, bytes) or len(kbid) > 64 or not isinstance(krel, str):
        raise WireError("malformed", f"{where}.kernel must hold release (str) and build_id (bin)")
    kernel = KernelInfo(release=krel, build_id=kbid, text_addr=_u64(k.get("text", 0), where + ".kernel.text"))

    labels = m.get("labels", {})
    if not isinstance(labels, dict) or not all(
        isinstance(a, str) and isinstance(b, str) for a, b in labels.items()
    ):
        raise WireError("malformed", f"{where}.labels must map strings to strings")
    processes: dict[int, str] = {}
    for p in m.get("processes", []) or []:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)):
            raise WireError("malformed", f"{where}.processes entries are [pid, comm]")
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
        and all(isinstance(n, str) and len(n) <= 256 for n in mapping_names)
    ):
        raise WireError("malformed", f"{where}.mapping_names must hold one name (<= 256 chars) per mapping")
    jit_names = m.get("jit_names", []) if v >= 2 else []
    if not (isinstance(jit_names, list) and all(isinstance(n, str) and len(n) <= 1024 for n in jit_names)):
        raise WireError("malformed", f"{where}.jit_names must be strings of at most 1024 characters")
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
        thread_rows.append((pid, tid))
        threads[tid] = th[2]
    traces: list[Trace] = []
    for i, tr in enumerate(_req(m, "traces", list, where)):
        if not (isinstance(tr, list) and len(tr) == 5):
            raise WireError("malformed", f"{where}.traces[{i}] must be [stack, thread, on, off, off_ns]")
        kst, ust = stacks[_index(tr[0], len(stacks), f"{where}.traces[{i}].stack")]
        pid, tid = thread_rows[_index(tr[1], len(thread_rows), f"{where}.traces[{i}].thread")]
        traces.append(
            Trace(
                kernel=kst,
                user=ust,
                pid=pid,
                tid=tid,
                on_cpu=_u64(tr[2], f"{where}.traces[{i}].on_cpu"),
                off_cpu=_u64(tr[3], f"{where}.traces[{i}].off_cpu"),
                off_cpu_ns=_u64(tr[4], f"{where}.traces[{i}].off_cpu_ns"),
            )
        )
    return Session(
        session_id=sid,
        trigger=trigger,
        kernel=kernel,
        start_ns=_u64(_req(m, "start_ns", int, where), where + ".start_ns"),
        duration_ns=_u64(_req(m, "duration_ns", int, where), where + ".duration_ns"),
        period_ns=_u64(_req(m, "period_ns", int, where), where + ".period_ns"),
        tenant=_str(m, "tenant", where),
        service=_str(m, "service", where),
        host=_str(m, "host", where),
        labels=dict(labels),
        processes=processes,
        threads=threads,
        traces=traces,
    )


def _str(m: Mapping[str, Any], key: str, where: str, limit: int = 256) -> str:
    v = m.get(key, "")
    if not isinstance(v, str) or len(v) > limit:
        raise WireError("malformed", f"{where}.{key} must be a string of at most {limit} characters")
    return v


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise WireError("malformed", f"not valid msgpack: {e}")


def decode_session(data: bytes) -> Session:
    """Decode one session as written by `encode_session` (a spool file)."""
    return session_from_wire(_unpack(data))


def decode_batch(data: bytes, max_sessions: int = 1000) -> list[Any]:
    """Split a request body into undecoded session maps (each validated on its own)."""
    obj = _unpack(data)
    if not isinstance(obj, dict):
        raise WireError("malformed", "a batch must be a map")
    if obj.get("v") not in READABLE_VERSIONS:
        raise WireError(
            "unsupported_version", f"batch version {obj.get('v')!r}, this build reads {READABLE_VERSIONS}"
        )
    sessions = obj.get("sessions")
    if not isinstance(sessions, list):
        raise WireError("malformed", "batch.sessions must be an array")
    if len(sessions) > max_sessions:
        raise WireError("too_large", f"{len(sessions)} sessions in one batch, at most {max_sessions}")
    return sessions

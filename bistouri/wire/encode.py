"""Sessions to bytes: dictionary-encoded msgpack (`encode_session`), bounded to what a request may carry
(`encode_session_to_fit`), several to a request body (`encode_batch`). Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import msgpack

from .model import (
    BATCH_VERSION,
    FRAME_JIT,
    FRAME_PYTHON,
    FRAME_RESOLVED,
    MAX_FRAMES_PER_REQUEST,
    MAX_JIT_NAME_CHARS,
    MAX_PY_FILE_CHARS,
    MAX_PY_LINE,
    MAX_PY_NAME_CHARS,
    MAX_SESSION_OBJECTS,
    MAX_STACK_ENTRIES_PER_REQUEST,
    MAX_STACKS_PER_REQUEST,
    TRIGGER_PSI,
    VERSION,
    VERSION_WITHOUT_PYTHON,
    WAIT_D,
    Session,
    UserFrame,
)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def session_to_wire(s: Session) -> dict[str, Any]:
    """Dictionary-encode a session into plain msgpack-able values."""
    mappings: dict[tuple[bytes, str], int] = {}
    jit_names: dict[str, int] = {}
    # (v4) Python functions by (name, file index) and their files: a frame is [4, function, line].
    py_files: dict[str, int] = {}
    py_functions: dict[tuple[str, int], int] = {}
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
                m, address = -1, f.address
                if f.kind == FRAME_RESOLVED:
                    m = mappings.setdefault((f.build_id, f.name), len(mappings))
                elif f.kind == FRAME_JIT:
                    # Cut to what the decoder takes, as the Python names below: the perf map is the process's
                    m = jit_names.setdefault(f.name[:MAX_JIT_NAME_CHARS], len(jit_names))
                elif f.kind == FRAME_PYTHON:
                    # Within what the decoder takes: names read from a process are the process's to choose,
                    # and one past a limit would have the whole session refused.
                    file = py_files.setdefault(f.file[:MAX_PY_FILE_CHARS], len(py_files))
                    m = py_functions.setdefault((f.name[:MAX_PY_NAME_CHARS], file), len(py_functions))
                    address = address if 0 <= address <= MAX_PY_LINE else 0  # 0: line unknown
                i = uframes[f] = len(uframe_list)
                uframe_list.append([f.kind, m, address])
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
        "avg": [tr.pressure.avg10, tr.pressure.avg60, tr.pressure.avg300],
        "total_us": tr.pressure.total_us,
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
    # Version 4 only for what version 3 cannot say: any other session stays readable by older symbolizers.
    python = bool(py_functions or s.unwind.python)
    out: dict[str, Any] = {
        "v": VERSION if python else VERSION_WITHOUT_PYTHON,
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
    }
    if py_functions:
        out["py_files"] = list(py_files)  # dicts keep insertion order: index order
        out["py_functions"] = [[name, file] for name, file in py_functions]
    out.update(
        kframes=kframe_list, uframes=uframe_list, stacks=stack_list, threads=thread_list, traces=traces
    )
    if pre_traces:
        out["pre_traces"] = pre_traces
        out["pre_trigger_ns"] = s.pre_trigger_ns
    if s.unwind:
        out["unwind"] = s.unwind.to_json()
    # Optional, as the trigger's `kind`: read by no reader before them, and not by version 3's rule.
    if s.unit:
        out["unit"] = s.unit
    if s.container is not None:
        c = s.container
        out["container"] = {"id": c.id, "runtime": c.runtime, **({"pod": c.pod} if c.pod else {})}
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
    # (v4) a Python function costs no lookup but is a frame of the profile all the same
    frames = len(listed("kframes")) + len(listed("uframes")) + len(listed("py_functions"))
    return frames, len(stacks), entries


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
    head = _pack({"v": BATCH_VERSION, "sessions": None})
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

"""Bytes to sessions, with validation: the symbolizer runs this on untrusted input. Every limit of
model.py is checked while reading, not after (`_Reader` counts msgpack objects as it goes).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from ..errors import WireError
from ..pressure import RESOURCES, STALLS, PressureFigures
from .model import (
    FRAME_JIT,
    FRAME_KINDS,
    FRAME_PYTHON,
    FRAME_RESOLVED,
    MAX_AGGRESSORS,
    MAX_ARRAY_LEN,
    MAX_BATCH_OBJECTS,
    MAX_BIN_LEN,
    MAX_CGROUP_CHARS,
    MAX_COMM_CHARS,
    MAX_CONTAINER_ID_CHARS,
    MAX_JIT_NAME_CHARS,
    MAX_KERNEL_FRAMES,
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_MAP_LEN,
    MAX_MAPPING_NAME_CHARS,
    MAX_NAME_CHARS,
    MAX_POD_CHARS,
    MAX_PY_FILE_CHARS,
    MAX_PY_LINE,
    MAX_PY_NAME_CHARS,
    MAX_PY_NOTE_KEYS,
    MAX_RELEASE_CHARS,
    MAX_RUNTIME_CHARS,
    MAX_SESSION_ID_CHARS,
    MAX_SESSIONS_PER_BATCH,
    MAX_STR_BYTES,
    MAX_U64,
    MAX_UNIT_CHARS,
    MAX_USER_FRAMES,
    MAX_VICTIMS,
    READABLE_VERSIONS,
    TRIGGER_KINDS,
    TRIGGER_PSI,
    WAIT_D,
    WAIT_STATES,
    Aggressor,
    Container,
    Episode,
    KernelInfo,
    Session,
    Trace,
    Trigger,
    UnwindSummary,
    UserFrame,
    Victim,
)

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
        pressure=PressureFigures(
            avg10=_float(avg[0], where + ".trigger.avg"),
            avg60=_float(avg[1], where + ".trigger.avg"),
            avg300=_float(avg[2], where + ".trigger.avg"),
            total_us=_u64(trig.get("total_us", 0), where + ".trigger.total_us"),
        ),
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
    py_functions = _py_functions(m, where) if v >= 4 else []
    kframes = [_u64(ip, f"{where}.kframes") for ip in _req(m, "kframes", list, where)]
    uframes: list[UserFrame] = []
    for i, f in enumerate(_req(m, "uframes", list, where)):
        if not (isinstance(f, list) and len(f) == 3 and f[0] in FRAME_KINDS and not isinstance(f[0], bool)):
            raise WireError("malformed", f"{where}.uframes[{i}] must be [kind, mapping, address]")
        kind, mi, addr = f
        addr = _u64(addr, f"{where}.uframes[{i}].address")
        bid, name, file = b"", "", ""
        if kind == FRAME_RESOLVED:
            mi = _index(mi, len(mappings), f"{where}.uframes[{i}].mapping")
            bid, name = mappings[mi], mapping_names[mi]
        elif kind == FRAME_JIT:
            name = jit_names[_index(mi, len(jit_names), f"{where}.uframes[{i}].jit name")]
        elif kind == FRAME_PYTHON:
            if v < 4:  # a reader of version 3 would refuse it too: never take it for something else
                raise WireError("malformed", f"{where}.uframes[{i}]: a Python frame (kind 4) needs version 4")
            if addr > MAX_PY_LINE:
                raise WireError("malformed", f"{where}.uframes[{i}].line {addr} is past {MAX_PY_LINE}")
            name, file = py_functions[_index(mi, len(py_functions), f"{where}.uframes[{i}].python function")]
        uframes.append(UserFrame(kind, bid, addr, name, file))
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
        unwind=_unwind_summary(m.get("unwind"), where + ".unwind", v),
        episode=_episode(m["episode"], where + ".episode") if v >= 3 and "episode" in m else None,
        unit=_str(m, "unit", where, MAX_UNIT_CHARS),
        container=_container(m.get("container"), where + ".container"),
    )


def _container(m: Any, where: str) -> Container | None:
    """The optional container of a session's target (any version: older readers ignore the key)."""
    if m is None:
        return None
    if not isinstance(m, dict):
        raise WireError("malformed", f"{where} must be a map with id and runtime")
    cid = _str(m, "id", where, MAX_CONTAINER_ID_CHARS)
    if not cid:
        raise WireError("malformed", f"{where}.id must not be empty")
    return Container(cid, _str(m, "runtime", where, MAX_RUNTIME_CHARS), _str(m, "pod", where, MAX_POD_CHARS))


def _py_functions(m: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    """(v4) The Python functions a session's frames name: [name, file index] rows over its file names."""
    files = m.get("py_files", [])
    if not (
        isinstance(files, list) and all(isinstance(f, str) and len(f) <= MAX_PY_FILE_CHARS for f in files)
    ):
        raise WireError(
            "malformed", f"{where}.py_files must be strings of at most {MAX_PY_FILE_CHARS} characters"
        )
    rows = m.get("py_functions", [])
    if not isinstance(rows, list):
        raise WireError("malformed", f"{where}.py_functions must be an array of [name, file]")
    out = []
    for i, row in enumerate(rows):
        if not (
            isinstance(row, list)
            and len(row) == 2
            and isinstance(row[0], str)
            and len(row[0]) <= MAX_PY_NAME_CHARS
        ):
            raise WireError(
                "malformed",
                f"{where}.py_functions[{i}] must be [name of at most {MAX_PY_NAME_CHARS} characters, file]",
            )
        out.append((row[0], files[_index(row[1], len(files), f"{where}.py_functions[{i}].file")]))
    return out


_MAX_UNWIND_KEYS = 8  # per map of an unwind summary: a few known names, more is an attack
_MAX_JIT_KEYS = 16  # of its `jit` notes (10 names today)


def _unwind_summary(v: Any, where: str, version: int) -> UnwindSummary:
    """The optional data-quality note (absent in sessions of agents before it); its `python` counts
    (v4) are read in a version-4 session only."""
    if v is None:
        return UnwindSummary()
    if not isinstance(v, dict):
        raise WireError("malformed", f"{where} must be a map")
    out = UnwindSummary()
    maps = [
        ("frames", out.frames, _MAX_UNWIND_KEYS),
        ("walks", out.walks, _MAX_UNWIND_KEYS),
        ("jit", out.jit, _MAX_JIT_KEYS),
        ("kernel", out.kernel, _MAX_UNWIND_KEYS),  # any version: readers before it ignore it
    ]
    if version >= 4:
        maps.append(("python", out.python, MAX_PY_NOTE_KEYS))
    for name, target, limit in maps:
        counts = v.get(name, {})
        if not isinstance(counts, dict) or len(counts) > limit:
            raise WireError("malformed", f"{where}.{name} must be a map of at most {limit} counts")
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
        "py_files",
        "py_functions",
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

"""The CPython processes among the capture targets: each described once, its frames named while it lives.

What the capture layer holds (docs/python-frames.md): `add(pid)` when a process becomes a target (it
pushes the BPF record of an `Interpreter` into `python_procs`; an `Unsupported` is counted by reason and
the process keeps its native frames), `name(pid, raw)` for a sample's raw Python frames, `remove(pid)`
when it is no longer one. A process that exec'd (its start time is the same, its executable is not) is
described again at its next `add`. Bounded: at most `max_processes`, least recently added out first,
each with its namer's bounded cache.
"""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..bpf import abi
from ..compat import SLOTS
from .discover import REASONS, Interpreter, Unsupported, describe, maps_libpython
from .naming import FREED, CodeNamer
from .splice import EvalLoop, decode

MAX_PROCESSES = 256
MAX_REFUSED = 8192  # processes remembered as not walked (the pid filter holds 4096)
RETRY_S = 1.0  # a process refused for a reason that passes (it was starting) is described again this often
TRANSIENT_REASONS = ("no_thread_key", "unreadable")
_MAX_FRAMES = 1 << 16  # named frames kept per process, then forgotten all at once
_MAX_STACK_BYTES = 64 << 10  # raw stacks kept named per process (bytes of their records), then forgotten


class PythonFrame(NamedTuple):
    """A named Python frame: qualified name (3.11+; the name before), file, line (0: none), and whether it
    is the oldest of its C activation of the eval loop (where splice.py stops). A tuple: it is part of a
    trace's key, hashed at every sample (a dataclass's __hash__ is a Python call per frame)."""

    name: str
    filename: str
    line: int
    entry: bool = False


# A sample's note in the session's data-quality summary (wire.UnwindSummary.python), besides the
# process's own reason when it is not walked (discover.REASONS but not_python).
NAMED = "named"  # Python frames in the stack
_WALK_NOTES: dict[int, str] = {
    abi.PyStatus.NO_THREAD: "no_thread_state",  # a thread with no thread state (not Python's, or not yet)
    abi.PyStatus.DONE: "no_frame",  # a thread state with no Python frame (running C only)
    abi.PyStatus.READ_FAILED: "read_failed",  # its innermost frame could not be read
    abi.PyStatus.NOT_PYTHON: "no_record",  # sampled before its BPF record was pushed, or after it left
    abi.PyStatus.NO_ARCH: "no_arch",  # no walk on this architecture
}
UNNAMED = "unnamed"  # frames walked for a process this registry no longer holds (evicted, removed)
NOTES = (NAMED, *_WALK_NOTES.values(), UNNAMED, *(r for r in REASONS if r != "not_python"))


class PythonStack(NamedTuple):
    """What a sample's Python walk gave, for the capture: the frames named (innermost first), the sample's
    note ("" for a process that is not CPython: not counted), and the eval loop to splice them at."""

    frames: tuple[PythonFrame, ...]
    note: str
    eval_loop: EvalLoop | None


NO_PYTHON = PythonStack((), "", None)  # a sample of a process that is not CPython


@dataclass(frozen=True, **SLOTS)
class PythonStats:
    """What the metrics read: processes walked, and those not walked by reason (discover.REASONS)."""

    walked: int = 0
    not_walked: dict[str, int] = field(default_factory=dict)


@dataclass(**SLOTS)
class _Process:
    """A CPython process described: its interpreter's layout, namers and caches of frames."""

    identity: tuple[int, int, int]  # start time, the executable's device and inode
    interp: Interpreter
    namer: CodeNamer
    frames: dict[tuple[int, int, int | None, bool], PythonFrame]
    eval_loop: EvalLoop
    empty: dict[int, PythonStack]  # py_status -> the stack of a sample without Python frames
    # Raw stacks named before: a loop's samples repeat a few (30 frames: 0.5 us a hit, 13 us named again),
    # and their traces share one tuple.
    stacks: dict[bytes, tuple[PythonFrame, ...]] = field(default_factory=dict)
    stack_bytes: int = 0


@dataclass(frozen=True, **SLOTS)
class _Refused:
    """A process that is not a CPython bistouri can read, and why (kept to not look again)."""

    identity: tuple[int, int, int]
    why: Unsupported
    stack: PythonStack  # its samples' (NO_PYTHON when not CPython at all)
    at: float  # when it was described (monotonic)


class PythonProcesses:
    """The described CPython processes. Not thread-safe: its owner (capture.Profiler) holds a lock around
    every call, as `add` and `remove` come from the threads that change the pid filter and `stack` from
    the one that drains the ring."""

    def __init__(
        self,
        proc_root: str = "/proc",
        max_processes: int = MAX_PROCESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc_root = proc_root
        self.max_processes = max_processes
        self._procs: OrderedDict[int, _Process] = OrderedDict()
        # Processes described and not walked: identity, why, and their samples' stack (NO_PYTHON when not
        # CPython at all), so that adding them again costs no description.
        self._refused: dict[int, _Refused] = {}
        self._clock = clock
        # Processes not walked, by reason; every reason there from the start (a scrape copies it while
        # this thread counts: no key is ever added).
        self.unsupported: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self.walked = 0  # processes described for the walk

    def close(self) -> None:
        for p in self._procs.values():
            p.namer.close()
        self._procs.clear()
        self._refused.clear()

    def add(self, pid: int) -> Interpreter | Unsupported:
        """`pid` described (again when it exec'd since): its Interpreter, or why it has none."""
        identity = self._identity(pid)
        known = self._procs.get(pid)
        if known is not None and known.identity == identity:
            self._procs.move_to_end(pid)
            return known.interp
        refused = self._refused.get(pid)
        if refused is not None and refused.identity == identity and not self._may_change(pid, refused):
            return refused.why
        self.remove(pid)
        found = describe(pid, self.proc_root)
        if isinstance(found, Interpreter):
            try:
                namer = CodeNamer(found, self.proc_root)
            except OSError as e:
                found = Unsupported("unreadable", f"memory: {e.strerror}")
        if isinstance(found, Unsupported):
            if refused is None or refused.identity != identity or refused.why.reason != found.reason:
                self.unsupported[found.reason] += 1  # a process counted once per reason, not per retry
            stack = NO_PYTHON if found.reason == "not_python" else PythonStack((), found.reason, None)
            self._refused[pid] = _Refused(identity, found, stack, self._clock())
            if len(self._refused) > MAX_REFUSED:
                del self._refused[next(iter(self._refused))]
            return found
        eval_loop = EvalLoop.of(found.build_id, found.path, found.eval_ranges)
        self._procs[pid] = _Process(identity, found, namer, {}, eval_loop, {})
        self.walked += 1
        while len(self._procs) > self.max_processes:
            _, old = self._procs.popitem(last=False)
            old.namer.close()
        return found

    @property
    def stats(self) -> PythonStats:
        return PythonStats(self.walked, dict(self.unsupported))

    def _may_change(self, pid: int, refused: _Refused) -> bool:
        """Whether a process refused before, still the same program, is worth describing again: one that
        was starting (its libpython not mapped yet, its runtime not initialised: no thread key, memory
        unreadable) becomes walkable; the rest (a version or build we do not walk) never does."""
        reason = refused.why.reason
        if reason == "not_python":
            return maps_libpython(pid, self.proc_root)
        if reason in TRANSIENT_REASONS:
            return self._clock() - refused.at >= RETRY_S
        return False

    def retry_due(self, pid: int) -> bool:
        """Whether a process refused for a reason that passes (it was starting) is due another look:
        its mappings may have stopped changing before its runtime was initialised (a busy host), so
        its samples ask for it (Profiler._name_python), at most every RETRY_S."""
        refused = self._refused.get(pid)
        return (
            refused is not None
            and refused.why.reason in TRANSIENT_REASONS
            and self._clock() - refused.at >= RETRY_S
        )

    def remove(self, pid: int) -> None:
        self._refused.pop(pid, None)
        p = self._procs.pop(pid, None)
        if p is not None:
            p.namer.close()

    def interpreter(self, pid: int) -> Interpreter | None:
        p = self._procs.get(pid)
        return p.interp if p is not None else None

    def known(self, pid: int) -> Interpreter | Unsupported | None:
        """How `pid` was last described, without looking at the process again; None: not added."""
        p = self._procs.get(pid)
        if p is not None:
            return p.interp
        refused = self._refused.get(pid)
        return refused.why if refused is not None else None

    def stack(self, pid: int, raw: bytes, status: int) -> PythonStack:
        """A sample's Python walk (its raw frames, abi.PyStatus) named, with its note; NO_PYTHON for a
        process that is not CPython."""
        p = self._procs.get(pid)
        if p is None:
            refused = self._refused.get(pid)
            if refused is not None:
                return refused.stack
            return PythonStack((), UNNAMED, None) if raw else NO_PYTHON
        if raw:
            return PythonStack(self._name(p, raw), NAMED, p.eval_loop)
        empty = p.empty.get(status)
        if empty is None:
            empty = p.empty[status] = PythonStack((), _WALK_NOTES.get(status, "read_failed"), p.eval_loop)
        return empty

    def name(self, pid: int, raw: bytes) -> tuple[PythonFrame, ...]:
        """A sample's raw Python frames (innermost first) named; () for a process not added."""
        p = self._procs.get(pid)
        if p is None or not raw:
            return ()
        return self._name(p, raw)

    def _name(self, p: _Process, raw: bytes) -> tuple[PythonFrame, ...]:
        known = p.stacks.get(raw)
        if known is not None:
            return known
        out = []
        for f in decode(raw):
            key = (f.code, f.checksum, f.offset, f.entry)
            named = p.frames.get(key)
            if named is None:
                code = p.namer.name(f.code, f.checksum)
                line = code.line(f.offset) if code is not FREED else None
                named = PythonFrame(code.name, code.filename, line or 0, f.entry)
                if len(p.frames) >= _MAX_FRAMES:
                    p.frames.clear()
                p.frames[key] = named
            out.append(named)
        if p.stack_bytes + len(raw) > _MAX_STACK_BYTES:
            p.stacks.clear()
            p.stack_bytes = 0
        named_stack = p.stacks[raw] = tuple(out)
        p.stack_bytes += len(raw)
        return named_stack

    def _identity(self, pid: int) -> tuple[int, int, int]:
        """What changes when `pid` is another process or another program (0s when it is gone)."""
        try:
            with open(f"{self.proc_root}/{pid}/stat", "rb") as f:
                stat = f.read(4096)
            st = os.stat(f"{self.proc_root}/{pid}/exe")
        except OSError:
            return (0, 0, 0)
        fields = stat.rpartition(b")")[2].split()
        start = int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0
        return (start, st.st_dev, st.st_ino)

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
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .discover import REASONS, Interpreter, Unsupported, describe
from .naming import FREED, CodeNamer
from .splice import decode

MAX_PROCESSES = 256
_MAX_FRAMES = 1 << 16  # named frames kept per process, then forgotten all at once


@dataclass(frozen=True, slots=True)
class PythonFrame:
    """A named Python frame: qualified name (3.11+; the name before), file, line (0: none)."""

    name: str
    filename: str
    line: int


@dataclass(frozen=True, slots=True)
class PythonStats:
    """What the metrics read: processes walked, and those not walked by reason (discover.REASONS)."""

    walked: int = 0
    not_walked: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Process:
    identity: tuple[int, int, int]  # start time, the executable's device and inode
    interp: Interpreter
    namer: CodeNamer
    frames: dict[tuple[int, int, int | None], PythonFrame]


class PythonProcesses:
    """The described CPython processes; one thread's (the capture's) alone."""

    def __init__(self, proc_root: str = "/proc", max_processes: int = MAX_PROCESSES) -> None:
        self.proc_root = proc_root
        self.max_processes = max_processes
        self._procs: OrderedDict[int, _Process] = OrderedDict()
        # Processes not walked, by reason; every reason there from the start (a scrape copies it while
        # this thread counts: no key is ever added).
        self.unsupported: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self.walked = 0  # processes described for the walk

    def close(self) -> None:
        for p in self._procs.values():
            p.namer.close()
        self._procs.clear()

    def add(self, pid: int) -> Interpreter | Unsupported:
        """`pid` described (again when it exec'd since): its Interpreter, or why it has none."""
        identity = self._identity(pid)
        known = self._procs.get(pid)
        if known is not None and known.identity == identity:
            self._procs.move_to_end(pid)
            return known.interp
        self.remove(pid)
        found = describe(pid, self.proc_root)
        if isinstance(found, Unsupported):
            self.unsupported[found.reason] += 1
            return found
        try:
            namer = CodeNamer(found, self.proc_root)
        except OSError as e:
            self.unsupported["unreadable"] += 1
            return Unsupported("unreadable", f"memory: {e.strerror}")
        self._procs[pid] = _Process(identity, found, namer, {})
        self.walked += 1
        while len(self._procs) > self.max_processes:
            _, old = self._procs.popitem(last=False)
            old.namer.close()
        return found

    @property
    def stats(self) -> PythonStats:
        return PythonStats(self.walked, dict(self.unsupported))

    def remove(self, pid: int) -> None:
        p = self._procs.pop(pid, None)
        if p is not None:
            p.namer.close()

    def interpreter(self, pid: int) -> Interpreter | None:
        p = self._procs.get(pid)
        return p.interp if p is not None else None

    def name(self, pid: int, raw: bytes) -> tuple[PythonFrame, ...]:
        """A sample's raw Python frames (innermost first) named; () for a process not added."""
        p = self._procs.get(pid)
        if p is None or not raw:
            return ()
        out = []
        for f in decode(raw):
            key = (f.code, f.checksum, f.offset)
            named = p.frames.get(key)
            if named is None:
                code = p.namer.name(f.code, f.checksum)
                line = code.line(f.offset) if code is not FREED else None
                named = PythonFrame(code.name, code.filename, line or 0)
                if len(p.frames) >= _MAX_FRAMES:
                    p.frames.clear()
                p.frames[key] = named
            out.append(named)
        return tuple(out)

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

"""Symbolized profiles: what the resolver produces, the store keeps and the formats render.

Stacks here are **root first**: the user-space root (`main`, `_start`) comes
first, then the user frames down to the system call, then the kernel frames
down to the leaf. That is the order of folded stacks and flamegraphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Final

from .. import wire
from ..compat import SLOTS
from ..pressure import PressureFigures

# Frame kinds.
KIND_KERNEL = "kernel"
KIND_USER = "user"
KIND_VDSO = "vdso"
KIND_JIT = "jit"  # JIT or interpreter code named by the process's perf map
KIND_PYTHON = "python"  # a CPython function, named by the agent (wire v4): file and line are its source's
KIND_UNKNOWN = "unknown"


# A frame as the symbolizers hold and cache it: a Frame's fields, in its order, in a plain tuple.
# Holding only str, int and bool, the cyclic collector stops tracking it (and an answer, a tuple of
# them) at its first look, where a Frame stays tracked as long as it lives: a Go binary's 50 000
# distinct addresses leave ~36 000 answers and as many frames in the result cache, and every full
# collection walked all of them (two in that batch where names only had one). A profile's frames
# are made from them once per profile (stacks.SessionStacks.profile).
FrameRow = tuple[str, str, str, int, str, bool]


class Frame:
    """One frame of a profile. Immutable (its attributes are Final for mypy): equal frames are
    shared within a profile (made once from the symbolizers' interned `FrameRow`).

    Equality, hash and repr are those of a frozen dataclass of these fields (equal only to a
    Frame; the hash of the fields' tuple), written out: a frozen dataclass's __init__ sets each
    field through object.__setattr__, ~4x the cost of this one, and a symbolizer makes one frame
    per distinct line (Go's, a batch of 50 000 addresses: ~48 000)."""

    __slots__ = ("file", "inlined", "kind", "line", "module", "name")
    __match_args__ = ("name", "module", "file", "line", "kind", "inlined")

    # The demangled function name; `module+0xoffset` when it cannot be named; Python: the qualified name.
    name: Final[str]
    module: Final[str]  # ELF file name (basename), "vmlinux" or a kernel module name, "[python]"
    file: Final[str]  # source file from DWARF (Python: co_filename), "" when unknown
    line: Final[int]  # source line from DWARF (Python: the line being run), 0 when unknown
    kind: Final[str]
    inlined: Final[bool]  # inlined into the frame that follows it toward the root

    def __init__(
        self,
        name: str,
        module: str = "",
        file: str = "",
        line: int = 0,
        kind: str = KIND_USER,
        inlined: bool = False,
    ) -> None:
        self.name = name
        self.module = module
        self.file = file
        self.line = line
        self.kind = kind
        self.inlined = inlined

    def __eq__(self, other: object) -> bool:
        if type(other) is not Frame:
            return NotImplemented
        return (
            self.name == other.name
            and self.module == other.module
            and self.file == other.file
            and self.line == other.line
            and self.kind == other.kind
            and self.inlined == other.inlined
        )

    def __hash__(self) -> int:
        return hash((self.name, self.module, self.file, self.line, self.kind, self.inlined))

    @property
    def row(self) -> FrameRow:
        """The fields as the symbolizers hold them; `Frame(*f.row) == f`."""
        return (self.name, self.module, self.file, self.line, self.kind, self.inlined)

    def __repr__(self) -> str:
        return (
            f"Frame(name={self.name!r}, module={self.module!r}, file={self.file!r}, "
            f"line={self.line!r}, kind={self.kind!r}, inlined={self.inlined!r})"
        )


@dataclass(**SLOTS)
class Sample:
    """One sample of a profile: its stack (frame indexes) and thread."""

    stack: tuple[int, ...]  # indexes into Profile.frames, root first
    pid: int = 0
    tid: int = 0
    thread: str = ""
    on_cpu: int = 0  # on-CPU sample count
    off_cpu: int = 0  # off-CPU wait count
    off_cpu_ns: int = 0  # off-CPU blocked time
    pre_trigger: bool = False  # sampled by the flight recorder before the trigger (the onset)
    wait: int = wire.WAIT_D  # what its off-CPU counts waited in (wire.WAIT_*)


# The states a profile can be read in (`state=` of the read API): every sample, the on-CPU
# ones, or the waits in one state (the episode page's flamegraph per state).
STATES = ("all", "on_cpu", *wire.WAIT_NAMES.values())
_WAIT_BY_NAME = {name: wait for wait, name in wire.WAIT_NAMES.items()}

# What a profile read keeps of a session (`part=` of the read API): all of it, or the samples
# taken before or after the trigger.
PARTS = ("all", "before", "after")


@dataclass(**SLOTS)
class SessionMeta:
    """A profile's metadata: session, host, trigger and times."""

    session_id: str
    tenant: str = ""
    service: str = ""
    host: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    processes: dict[int, str] = field(default_factory=dict)  # pid -> comm
    resource: str = ""
    stall: str = "some"
    threshold_us: int = 0
    window_us: int = 0
    cgroup: str = ""
    trigger_time_ns: int = 0
    pressure: PressureFigures = field(default_factory=PressureFigures)  # the trigger's, as the agent read it
    start_ns: int = 0
    duration_ns: int = 0
    period_ns: int = 0
    kernel_release: str = ""
    on_cpu: int = 0
    off_cpu: int = 0
    off_cpu_ns: int = 0
    trigger_kind: str = wire.TRIGGER_PSI  # psi | manual (capture now)
    pre_trigger_ns: int = 0  # the session starts this long before its trigger (flight recorder)
    # The part of the totals above sampled before the trigger.
    pre_on_cpu: int = 0
    pre_off_cpu: int = 0
    pre_off_cpu_ns: int = 0
    # How the user stacks were walked (wire.UnwindSummary.to_json()): frames by table or
    # frame pointer, samples by why their walk ended, (v4) CPython samples by what their Python
    # walk gave. Empty for agents before it.
    unwind: dict[str, dict[str, int]] = field(default_factory=dict)
    # (v3) The episode report as GET /v1/sessions/{id} shows it (rows of episode.py, ranked).
    victims: list[dict[str, Any]] = field(default_factory=list)
    aggressors: list[dict[str, Any]] = field(default_factory=list)
    # What the trigger's cgroup names (wire.Session.unit, .container); "" from agents before them.
    unit: str = ""
    container_id: str = ""
    runtime: str = ""
    pod: str = ""

    @classmethod
    def from_wire(cls, s: wire.Session) -> SessionMeta:
        """The metadata of a wire session; totals summed over its traces."""
        t = s.trigger
        pre = [x for x in s.traces if x.pre_trigger]
        return cls(
            session_id=s.session_id,
            tenant=s.tenant,
            service=s.service,
            host=s.host,
            labels=dict(s.labels),
            processes=dict(s.processes),
            resource=t.resource,
            stall=t.stall,
            threshold_us=t.threshold_us,
            window_us=t.window_us,
            cgroup=t.cgroup,
            trigger_time_ns=t.time_ns,
            pressure=t.pressure,
            start_ns=s.start_ns,
            duration_ns=s.duration_ns,
            period_ns=s.period_ns,
            kernel_release=s.kernel.release,
            on_cpu=sum(x.on_cpu for x in s.traces),
            off_cpu=sum(x.off_cpu for x in s.traces),
            off_cpu_ns=sum(x.off_cpu_ns for x in s.traces),
            trigger_kind=t.kind,
            pre_trigger_ns=s.pre_trigger_ns,
            pre_on_cpu=sum(x.on_cpu for x in pre),
            pre_off_cpu=sum(x.off_cpu for x in pre),
            pre_off_cpu_ns=sum(x.off_cpu_ns for x in pre),
            unwind=s.unwind.to_json() if s.unwind else {},
            victims=[victim_json(v) for v in s.episode.victims] if s.episode else [],
            aggressors=[aggressor_json(a) for a in s.episode.aggressors] if s.episode else [],
            unit=s.unit,
            container_id=s.container.id if s.container else "",
            runtime=s.container.runtime if s.container else "",
            pod=s.container.pod if s.container else "",
        )

    @property
    def comm(self) -> str:
        return next(iter(self.processes.values()), "")

    @property
    def pid(self) -> int:
        return next(iter(self.processes), 0)

    def to_json(self, episode_rows: bool = True) -> dict[str, Any]:
        """The session as the read API shows it; without `episode_rows` (session lists), the
        episode's victims and aggressors are left out."""
        out: dict[str, Any] = {
            "id": self.session_id,
            "tenant": self.tenant,
            "service": self.service,
            "host": self.host,
            "labels": self.labels,
            "comm": self.comm,
            "pid": self.pid,
            "processes": [{"pid": p, "comm": c} for p, c in self.processes.items()],
            "unit": self.unit,
            "container": (
                {"id": self.container_id, "runtime": self.runtime, "pod": self.pod}
                if self.container_id
                else None
            ),
            "trigger": {
                "kind": self.trigger_kind,
                "resource": self.resource,
                "stall": self.stall,
                "threshold_us": self.threshold_us,
                "window_us": self.window_us,
                "cgroup": self.cgroup,
                "time_ns": self.trigger_time_ns,
                "avg10": finite(self.pressure.avg10),
                "avg60": finite(self.pressure.avg60),
                "avg300": finite(self.pressure.avg300),
                "total_us": self.pressure.total_us,
            },
            "start_ns": self.start_ns,
            "duration_ns": self.duration_ns,
            "period_ns": self.period_ns,
            "kernel_release": self.kernel_release,
            "samples": {"on_cpu": self.on_cpu, "off_cpu": self.off_cpu, "off_cpu_ns": self.off_cpu_ns},
            "unwind": self.unwind,
            # The timeline (under the key `episode`, kept for clients) and the episode report's rows:
            # the session runs from start_ns, pre_trigger_s before trigger.time_ns; `samples` split
            # at the trigger.
            "episode": {
                "pre_trigger_s": self.pre_trigger_ns / 1e9,
                "before_trigger": {
                    "on_cpu": self.pre_on_cpu,
                    "off_cpu": self.pre_off_cpu,
                    "off_cpu_ns": self.pre_off_cpu_ns,
                },
                "after_trigger": {
                    "on_cpu": self.on_cpu - self.pre_on_cpu,
                    "off_cpu": self.off_cpu - self.pre_off_cpu,
                    "off_cpu_ns": self.off_cpu_ns - self.pre_off_cpu_ns,
                },
            },
        }
        if episode_rows:
            out["episode"]["victims"] = self.victims
            out["episode"]["aggressors"] = self.aggressors
        return out


def finite(x: float) -> float | None:
    """x, or None (JSON null) for NaN and infinities: stored before ingest refused them."""
    return x if math.isfinite(x) else None


def victim_json(v: wire.Victim) -> dict[str, Any]:
    return {
        "pid": v.pid,
        "tid": v.tid,
        "comm": v.comm,
        "on_cpu_ns": v.on_cpu_ns,
        "runqueue_ns": v.runqueue_ns,
        "blocked_ns": {"D": v.blocked_d_ns, "S": v.blocked_s_ns},
        "reclaim_ns": v.reclaim_ns,
        "stall_ns": v.stall_ns,
    }


def aggressor_json(a: wire.Aggressor) -> dict[str, Any]:
    return {
        "cgroup": a.cgroup,
        "cpu_ns": a.cpu_ns,
        "io_bytes": a.io_bytes,
        "io_ops": a.io_ops,
        "memory_bytes": a.memory_bytes,
        "reclaim_bytes": a.reclaim_bytes,
    }


@dataclass(**SLOTS)
class Profile:
    """One symbolized session, or several merged (then `meta` describes the first)."""

    meta: SessionMeta
    frames: list[Frame] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    truncated: bool = False  # a merge that left sessions out (formats.merge's bound)

    def totals(self, part: str = "all") -> tuple[int, int, int]:
        """(on_cpu, off_cpu, off_cpu_ns) summed over the samples of `part` (see PARTS)."""
        samples = self.part(part).samples
        on = sum(s.on_cpu for s in samples)
        off = sum(s.off_cpu for s in samples)
        off_ns = sum(s.off_cpu_ns for s in samples)
        return on, off, off_ns

    def part(self, part: str) -> Profile:
        """The profile of the samples before the trigger (`before`), after it (`after`), or all."""
        if part == "all":
            return self
        if part not in PARTS:
            raise ValueError(f"part {part!r} is not one of {', '.join(PARTS)}")
        before = part == "before"
        kept = [s for s in self.samples if s.pre_trigger == before]
        return Profile(self.meta, self.frames, kept, self.truncated)

    def in_state(self, state: str) -> Profile:
        """The profile of the on-CPU samples (`on_cpu`), of the waits in one state (`D`, `S`,
        `reclaim`, `runqueue`), or all (see STATES)."""
        if state == "all":
            return self
        if state not in STATES:
            raise ValueError(f"state {state!r} is not one of {', '.join(STATES)}")
        if state == "on_cpu":
            kept = [replace(s, off_cpu=0, off_cpu_ns=0) for s in self.samples if s.on_cpu]
        else:
            wait = _WAIT_BY_NAME[state]
            kept = [replace(s, on_cpu=0) for s in self.samples if s.off_cpu and s.wait == wait]
        return Profile(self.meta, self.frames, kept, self.truncated)

"""The session as values: its dataclasses, the format's version, its vocabularies and the limits the
decoder enforces (docs/wire-format.md, docs/api.md "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..compat import SLOTS
from ..pressure import PressureFigures

VERSION = 4
# A session is written in VERSION only when it holds what version 3 cannot say (Python frames, a Python
# note); any other is written as version 3, byte for byte as before, so that a symbolizer that reads up
# to 3 still takes every session of an agent that sampled no Python (docs/wire-format.md, Compatibility).
VERSION_WITHOUT_PYTHON = 3
# The request envelope's `v` says how the envelope reads, and it has not changed since 3: each session
# carries its own. A reader checks it against the versions it reads, so a 4 here would make a version-3
# symbolizer refuse a whole batch of version-3 sessions.
BATCH_VERSION = 3
# v1: no mapping names, no JIT frames (old spool files); v2: no episode, no wait states; v3: no Python
READABLE_VERSIONS = (1, 2, 3, 4)

# User frame kinds, as sent on the wire.
FRAME_RESOLVED = 0  # mapping index (build id, file name) + file offset
FRAME_VDSO = 1  # raw IP inside the process's vDSO
FRAME_UNKNOWN = 2  # raw IP in no mapping of the process
FRAME_JIT = 3  # (v2) raw IP in JIT code, named from the process's perf map (jit name index)
# (v4) a CPython frame named by the agent while the process lived (docs/python-frames.md): `name` its
# qualified name (3.11+; co_name before), `file` its co_filename, `address` its line (0: unknown)
FRAME_PYTHON = 4
FRAME_KINDS = (FRAME_RESOLVED, FRAME_VDSO, FRAME_UNKNOWN, FRAME_JIT, FRAME_PYTHON)

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
MAX_PY_NAME_CHARS = 1024  # (v4) a Python function's qualified name (Class.method.<locals>.f)
MAX_PY_FILE_CHARS = 4096  # (v4) a Python code object's file name (co_filename: a path, PATH_MAX)
MAX_PY_LINE = (1 << 31) - 1  # (v4) a Python frame's line (CPython's are C ints)
MAX_PY_NOTE_KEYS = 16  # (v4) names in unwind.python: "named" and the reasons (a few known ones)
MAX_UNIT_CHARS = 256  # a systemd unit's name (systemd's UNIT_NAME_MAX)
MAX_CONTAINER_ID_CHARS = 128  # the runtimes' ids are 64 hex digits
MAX_RUNTIME_CHARS = 32
MAX_POD_CHARS = 64  # a Kubernetes pod's uid (36 characters)

# Container runtimes a cgroup path names (host/cgroupnames.py). A reader takes any other name of at most
# MAX_RUNTIME_CHARS as it is, so that a runtime added later needs no new version.
RUNTIMES = ("docker", "containerd", "podman", "crio")


@dataclass(frozen=True, **SLOTS)
class UserFrame:
    """One user-space frame on the wire: resolved (build id, offset), JIT, Python or raw."""

    kind: int  # FRAME_*
    build_id: bytes  # empty unless kind == FRAME_RESOLVED (and empty then if the file has none)
    address: int  # file offset when resolved, the line for a Python frame, raw IP otherwise
    name: str = ""  # resolved: the mapped file's basename; jit, python: the function's name
    file: str = ""  # python: the source file (co_filename)


@dataclass(frozen=True, **SLOTS)
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


class PressureEvent(Protocol):
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
    def pressure(self) -> PressureFigures: ...


@dataclass(frozen=True, **SLOTS)
class Trigger:
    """What started a session: the PSI resource, the stall kind and the threshold crossed."""

    resource: str  # cpu | memory | io (a manual capture: the target's first resource)
    stall: str = "some"  # some | full
    threshold_us: int = 0
    window_us: int = 0
    cgroup: str = ""  # cgroup2 path relative to the mount, "/" for system-wide
    time_ns: int = 0  # wall clock of the PSI event
    # The pressure file's figures when it fired (the wire's `avg` and `total_us`).
    pressure: PressureFigures = field(default_factory=PressureFigures)
    kind: str = TRIGGER_PSI  # psi | manual

    @classmethod
    def from_psi(cls, event: PressureEvent, cgroup: str) -> Trigger:
        """A session's trigger from the PSI event that fired; `cgroup` is relative to the cgroup2
        mount, "/" for system-wide."""
        return cls(
            resource=event.resource,
            stall=event.stall,
            threshold_us=event.threshold_us,
            window_us=event.window_us,
            cgroup=cgroup,
            time_ns=event.time_ns,
            pressure=event.pressure,
        )


@dataclass(frozen=True, **SLOTS)
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


@dataclass(frozen=True, **SLOTS)
class Aggressor:
    """(v3) What one cgroup used over the episode (episode.py)."""

    cgroup: str  # relative to the cgroup2 mount
    cpu_ns: int = 0
    io_bytes: int = 0
    io_ops: int = 0
    memory_bytes: int = 0  # growth of memory.current
    reclaim_bytes: int = 0  # reclaimed from it (memory.stat pgsteal)


@dataclass(frozen=True, **SLOTS)
class Episode:
    """(v3) Who waited and who used the machine, over the session's window, ranked."""

    victims: tuple[Victim, ...] = ()
    aggressors: tuple[Aggressor, ...] = ()


@dataclass(**SLOTS)
class UnwindSummary:
    """How a session's user stacks were walked, weighted by samples: the data-quality note."""

    # user frames by how they were unwound: "table" (.eh_frame rows) or "frame_pointer"
    frames: dict[str, int] = field(default_factory=dict)
    # samples by why their user walk ended: entry (the whole stack), no_frame_pointer,
    # read_failed, max_depth, bad_frame (abi.WALK_ENDS)
    walks: dict[str, int] = field(default_factory=dict)
    # processes by JIT note (capture/jitnote.py): jvm_<perf-map request outcome>, jvm_cut_in_jit,
    # node_unnamed, jvm_not_asked; absent from sessions of agents before it
    jit: dict[str, int] = field(default_factory=dict)
    # (v4) samples of CPython processes by what their Python walk gave: "named" (Python frames in the
    # stack), or why not: the walk's end (no_thread_state, read_failed) or the process's reason
    # (cpython.discover.REASONS: version_unknown, free_threaded, ...); empty when none was sampled
    python: dict[str, int] = field(default_factory=dict)
    # What the agent's kernel lacks (bpf/features.py: no_bpf_loop, ...) -> the session's samples taken
    # without it; absent on a kernel with every feature, and ignored by readers before it
    kernel: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.frames or self.walks or self.jit or self.python or self.kernel)

    def to_json(self) -> dict[str, dict[str, int]]:
        out = {"frames": dict(self.frames), "walks": dict(self.walks)}
        if self.jit:
            out["jit"] = dict(self.jit)
        if self.python:
            out["python"] = dict(self.python)
        if self.kernel:
            out["kernel"] = dict(self.kernel)
        return out


@dataclass(frozen=True, **SLOTS)
class Container:
    """The container a session's target cgroup is, or is in (host/cgroupnames.py)."""

    id: str  # the runtime's id (64 hex digits)
    runtime: str  # RUNTIMES
    pod: str = ""  # the Kubernetes pod's uid, when the path names one


@dataclass(frozen=True, **SLOTS)
class KernelInfo:
    """The kernel a session ran on: release, build id, `_text` address and boot id."""

    release: str = ""
    build_id: bytes = b""
    text_addr: int = 0  # runtime address of _text (KASLR-corrected base)
    boot_id: bytes = b""  # /proc/sys/kernel/random/boot_id (16 bytes): its kallsyms snapshot is this boot's


@dataclass(**SLOTS)
class Session:
    """A capture on the wire: its trigger, kernel, processes, stacks and counts."""

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
    # What the trigger's cgroup names (host/cgroupnames.py): its systemd unit, its container; absent
    # from sessions of agents before them, and from a system-wide one
    unit: str = ""
    container: Container | None = None

    @property
    def total_samples(self) -> int:
        return sum(t.on_cpu + t.off_cpu for t in self.traces)

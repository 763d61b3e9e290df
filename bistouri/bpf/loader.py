"""The profiler's BPF object: found, checked against abi.py, configured and loaded.

Apart from Profiler (profiler.py) so that loading needs only the light
modules: `record` starts ObjectLoad on a thread first, and imports and sets up the
rest while libbpf parses the kernel's BTF and the verifier checks the programs
(both without the GIL). Its first sample comes that much sooner.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from .. import threads
from ..compat import SLOTS
from ..errors import BistouriError, BpfError
from . import abi, features, perf
from .handles import BpfObject, BtfFile, LibbpfSilenced, Link, NoKernelTypes

log = logging.getLogger(__name__)

OBJECT_ENV = "BISTOURI_BPF_OBJECT"
# The object of each machine (os.uname().machine, what platform.machine() says, without importing
# platform on record's start-up path): built by `make bpf`, one per architecture's vmlinux.h.
OBJECT_NAMES = {"aarch64": "bistouri.arm64.bpf.o", "arm64": "bistouri.arm64.bpf.o"}
_DEFAULT_OBJECT_NAME = "bistouri.bpf.o"  # x86-64's
_INSTALLED_DIR = "/usr/lib/bistouri"


def object_name(machine: str | None = None) -> str:
    """The file name of the object for `machine` (this one's by default)."""
    return OBJECT_NAMES.get(machine or os.uname().machine, _DEFAULT_OBJECT_NAME)


def default_object_path() -> str:
    """The precompiled object of this machine: $BISTOURI_BPF_OBJECT, the package's copy, or the system one."""
    env = os.environ.get(OBJECT_ENV)
    if env:
        return env
    name = object_name()
    # The package's own directory: importlib.resources would say the same, for ~8 ms of imports
    # on record's start-up path (libbpf needs a real file anyway, never one inside a zip).
    # Paths as strings: pathlib costs ~2 ms of imports before `record`'s first sample.
    packaged = os.path.join(os.path.dirname(__file__), "_bpfobj", name)
    installed = os.path.join(_INSTALLED_DIR, name)
    if os.path.exists(packaged) or not os.path.exists(installed):
        return packaged
    return installed


@dataclass(frozen=True, **SLOTS)
class ProfilerOptions:
    """How the profiler samples and loads: frequency, off-CPU, unwinding and their budgets."""

    freq_hz: int = 19
    offcpu: bool = True
    # Every real wait counts: on a fast disk an fsync storm blocks for tens of µs at a
    # time (CI saw all of them under 100 µs, so a 100 µs floor showed nothing while PSI
    # io said 50 %). The per-process rate limit below bounds the cost, not this floor.
    offcpu_min_ns: int = 1_000
    offcpu_interval_ns: int = 10_000_000  # at most 100 off-CPU captures/s per process
    # Run-queue wait stacks (episode report): at most 20/s per process. Each carries the delays of
    # the preemptions skipped before it; at every tick they cost the agent as much as its samples.
    runqueue_interval_ns: int = 50_000_000
    wakeup_bytes: int = 0  # 0: a quarter of the ring
    # While a session runs. Longer means fewer drains and fewer weighted samples (a repeated stack
    # is one event per drain); sessions drain the ring as they start and end (catch_up), so none
    # loses what the kernel still holds. `record` uses 0.1 s, for its progress.
    drain_interval_s: float = 0.5
    # After set_slow_drain(True): the agent while no session runs, when only its flight recorder
    # samples. Those few samples wait longer in the ring, and the agent wakes 5x less often; a
    # session drains the ring as it starts (catch_up).
    slow_drain_interval_s: float = 1.0
    # ... doubled after each drain that found nothing, up to this (Profiler._wait_ms).
    slow_drain_max_interval_s: float = 8.0
    # The flight recorder's samples (no session running) wait this long at most in the queue before
    # the main thread is woken for them (Profiler._announce); exec and error events never wait.
    recorder_announce_s: float = 5.0
    batch_budget: int = 2048
    queue_size: int = 256  # batches (each at most batch_budget events)
    object_path: str | os.PathLike[str] | None = None
    exec_discovery: bool = True
    ring_bytes: int = 0  # 0: sized from CPUs x frequency
    proc_root: str = "/proc"
    # Rows of .eh_frame tables in BPF (12 bytes each, kept 16 apart by the kernel: 16 MiB); postgres
    # and its 40 libraries need 535 k.
    unwind_rows: int = 1 << 20  # 0: frame pointers only
    unwind_cache_dir: str | None = None  # tables on disk per build id; None: built again by each agent
    unwind_cpu_share: float = 0.25  # of a core, at most, for building tables
    # Of the thread building them. Not 19: the thread shares the GIL with the ring-buffer and main
    # threads, and starved at nice 19 under CPU pressure it held them up for a second (priority
    # inversion through the GIL). The CPU share above is what keeps it off the workload.
    unwind_nice: int = 0
    episode: bool = True  # account watched threads' time by state (episode.py)
    # `record`: load a frame-pointer sampler alone (FIRST_SAMPLER) and attach it first; the other
    # programs, the table-walking sampler among them, load in a second object sharing its maps
    # (load_companion) while it samples, and the first hands over to it (hand_over).
    sampler_first: bool = False
    # Ask each watched JVM for its perf map (host/jvm.py), at most once a minute per process.
    jvm_perf_maps: bool = True
    jvm_perf_map_interval_s: float = 60.0
    # Room for raw stack copies, which the processes whose pid filter has FilterFlags.RAW_STACK send
    # until their tables are in (`record`'s targets, the agent's sessions' processes): the raw_stacks
    # ring (kernel memory), and the copies the ring thread holds until then (capture/rawstacks.py).
    # Off: a page, never written.
    raw_stacks: bool = False
    raw_ring_bytes: int = 0  # a power of two, at least a page; 0: sized from CPUs x frequency (raw_ring_size)
    raw_held_bytes: int = 32 << 20
    raw_held_records: int = 8192


# The episode hooks (bpf/episode.bpf.h) -> their tracepoint. The scheduler
# ones exist everywhere; a kernel built without memcg or compaction lacks the others, which are
# then left out (their time stays 0) rather than failing the load.
EPISODE_TRACEPOINTS = {
    "handle_episode_switch": "sched_switch",
    "handle_episode_wakeup": "sched_wakeup",
    "handle_episode_wakeup_new": "sched_wakeup_new",
    "handle_direct_reclaim_begin": "mm_vmscan_direct_reclaim_begin",
    "handle_direct_reclaim_end": "mm_vmscan_direct_reclaim_end",
    "handle_memcg_reclaim_begin": "mm_vmscan_memcg_reclaim_begin",
    "handle_memcg_reclaim_end": "mm_vmscan_memcg_reclaim_end",
    "handle_compaction_begin": "mm_compaction_begin",
    "handle_compaction_end": "mm_compaction_end",
}
EPISODE_PROGRAMS = tuple(EPISODE_TRACEPOINTS)
KERNEL_BTF = "/sys/kernel/btf/vmlinux"


def kernel_tracepoints(names: Collection[str], btf_path: str = KERNEL_BTF) -> set[str]:
    """Those of `names` the running kernel has as BTF tracepoints (typedef btf_trace_<name>)."""
    with _kernel_facts_lock:
        return set(names) & _kernel_facts(btf_path)[0]


@functools.cache
def _kernel_facts(btf_path: str) -> tuple[frozenset[str], features.KernelFeatures]:
    """Read from the kernel's BTF in one parse (~15 ms), once: the episode tracepoints it has (all
    of them if unreadable: the load then says what is missing) and its features (features.py)."""
    try:
        with BtfFile(btf_path) as f:
            return (
                frozenset(n for n in EPISODE_TRACEPOINTS.values() if f.btf.has_typedef("btf_trace_" + n)),
                features.from_btf(f.btf),
            )
    except BpfError:
        return frozenset(EPISODE_TRACEPOINTS.values()), features.from_btf(None)


def kernel_features(btf_path: str = KERNEL_BTF) -> features.KernelFeatures:
    """What the running kernel lacks: the programs loaded are chosen by it (features.program_for)."""
    with _kernel_facts_lock:  # record's threads ask at once: one parse, not two
        return _bounded_refused or _kernel_facts(btf_path)[1]


_kernel_facts_lock = threading.Lock()
_bounded_refused: features.KernelFeatures | None = None  # set by _load_twins: for the process's life


def _load_twins(load: Callable[[features.KernelFeatures], LoadedObject]) -> LoadedObject:
    """load(the kernel's features); if the verifier refuses the bounded twins (only 6.18's was
    tried: features.py), load(the frame-pointer ones) instead, and say so from then on."""
    global _bounded_refused
    kernel = kernel_features()
    try:
        return load(kernel)
    except BpfError as e:
        if kernel.suffix != features.BOUNDED_SUFFIX:
            raise
        log.warning(
            "The kernel's verifier refused the bounded stack walks: user stacks by frame pointers only. "
            "error=%s",
            str(e).splitlines()[0],
        )
        with _kernel_facts_lock:
            _bounded_refused = replace(kernel, bounded_refused=True)
        return load(_bounded_refused)


def ring_size(ncpus: int, freq_hz: int, drain_interval_s: float = 0.2) -> int:
    """A power of two between 512 KiB and 64 MiB holding 1.5 drain intervals of samples.

    The kernel maps the whole ring into the agent (data pages twice), so it counts in
    the agent's RSS: keep it no bigger than needed. Overflow is prevented by the
    forced wakeup at a quarter of the ring, well before it fills.
    """
    want = int(ncpus * freq_hz * abi.STACK_EVENT_SIZE * drain_interval_s * 1.5)
    size = 512 << 10
    while size < want and size < (64 << 20):
        size <<= 1
    return size


def raw_ring_size(ncpus: int, freq_hz: int, drain_interval_s: float) -> int:
    """A power of two between 1 and 16 MiB holding half a drain interval of raw copies (at most ~19 KiB
    each, fewer bytes when the stack's top is near; only while a process's tables are missing). Past
    that a copy is lost and its sample is sent as walked (Counter.RAW_STACK_LOST).

    Half, not more: the sampler wakes the ring thread once a quarter of the ring is queued, so the
    rest is only for that thread's latency; and the kernel maps the whole ring into `record` (data
    pages twice), where 1.5 intervals (8 MiB on 2 CPUs at 999 Hz) were a third of its RSS. No copy was
    lost at 2 MiB on 2 CPUs at 999 Hz (python3.11, first run)."""
    want = int(ncpus * freq_hz * ctypes.sizeof(abi.RawStack) * drain_interval_s * 0.5)
    size = 1 << 20
    while size < want and size < (16 << 20):
        size <<= 1
    return size


def counts_size(ncpus: int, freq_hz: int, drain_interval_s: float) -> int:
    """Entries of `on_cpu_counts`, a power of two between 1 024 and 16 384.

    Every drain reads and deletes the whole map in one batch, and the kernel walks each of its
    buckets to do it (~15 ns a bucket: 16 384 of them were most of the ring thread's time at
    999 Hz). One drain interval brings at most one new repeat key per sample, and a key not yet
    drained waits one more interval: twice the samples of an interval is enough. Past that, the
    kernel sends a repeat whole rather than counting it: nothing is lost.
    """
    want = 2 * ncpus * freq_hz * drain_interval_s
    size = 1024
    while size < want and size < 16384:
        size <<= 1
    return size


# The on-CPU sampler, which walks user stacks from the unwind tables; and `record`'s first one
# (ProfilerOptions.sampler_first): frame pointers only and no kernel struct read, so the verifier
# passes it ~5x sooner and libbpf needs no kernel BTF; it passes every sample on to SAMPLER once
# the companion has loaded that (hand_over). On a kernel without the table walk's features, SAMPLER's
# compat twin is loaded in its place (features.program_for).
SAMPLER = "handle_perf"
FIRST_SAMPLER = "handle_perf_fp"
# Maps only the companion's programs use, and Profiler only once they are attached: with
# sampler_first the first object leaves them to the companion, which lends them back (load_companion).
COMPANION_MAPS = (
    "rule_cache",
    "stack_copies",
    "offcpu_pending",
    "offcpu_skipped",
    "thread_times",
    "episode_counters",
    "wait_pending",
    "runqueue_last",
    "reclaim_pending",
    "episode_scratch",
    "recorder_waits",
    "recorder_scratch",
    "recorder_counters",
)
# What the first sampler (handle_perf_fp) uses: all its object creates before the load that
# record's first sample waits for. The rest (but COMPANION_MAPS) it creates right after its sampler
# is attached and armed (_create_late_maps), before Profiler sees the object: the unwind tables
# among them, so that Profiler.start() fills them while the first sampler runs and the table walk
# has the target's tables from its first sample (created with the companion, they were filled only
# ~0.3 s into a capture). They were ~3 ms of the first load: 16 MiB of rows the kernel zeroes.
FIRST_SAMPLER_MAPS = frozenset(
    {
        "pid_filter",
        "scratch",
        "counters",
        "error_events",
        "map_counts",
        "known_samples",
        "on_cpu_counts",
        "stack_events",
        "raw_stacks",
        "raw_scratch",
        "sampler_handoff",
    }
)


def _late_maps(obj: BpfObject) -> tuple[str, ...]:
    """The maps sampler_first's first object creates after its load (internal ones, `.rodata` and
    the like, never: libbpf writes their contents at load)."""
    return tuple(
        n for n in obj.maps if n not in FIRST_SAMPLER_MAPS and n not in COMPANION_MAPS and "." not in n
    )


@dataclass(frozen=True, **SLOTS)
class LoadedObject:
    """A loaded object, with what was decided while configuring it."""

    obj: BpfObject
    path: str
    cpus: tuple[int, ...]  # online CPUs: one perf event each
    ring_bytes: int
    programs: tuple[str, ...]  # loaded in this object, to attach (episode hooks: those this kernel has)
    pending: tuple[str, ...] = ()  # left for load_companion()
    sampler_links: tuple[Link, ...] = ()  # the sampler's, when attach_sampler() attached it already
    handoff: str = ""  # loaded, not attached: the first sampler passes its samples on to it (hand_over)
    # What the kernel lacks, and so the twins loaded instead of the full programs (features.py). FULL
    # in sampler_first's first object, which does not read it: its load_companion() does, off the
    # path of record's first sample (the kernel's BTF takes ~15 ms to parse).
    kernel: features.KernelFeatures = features.FULL


def wanted_programs(o: ProfilerOptions, kernel: features.KernelFeatures | None = None) -> tuple[str, ...]:
    """Every program the options ask for (of the episode hooks, those this kernel can run), each
    its twin where the kernel lacks the full one's features (`kernel`: the running one's)."""
    kernel = kernel or kernel_features()
    episode: tuple[str, ...] = ()
    if o.episode:
        present = kernel_tracepoints(EPISODE_TRACEPOINTS.values())
        episode = tuple(n for n, tp in EPISODE_TRACEPOINTS.items() if tp in present)
        missing = sorted(set(EPISODE_TRACEPOINTS.values()) - present)
        if missing:
            log.info(
                "Kernel lacks tracepoints: their episode times stay 0. tracepoints=%s", ",".join(missing)
            )
    programs = [SAMPLER]
    programs += ["handle_sched_switch", "handle_offcpu_wakeup"] if o.offcpu else []
    programs += ["handle_exec"] if o.exec_discovery else []
    return tuple(features.program_for(p, kernel) for p in (*programs, *episode))


def _configure(
    obj: BpfObject,
    o: ProfilerOptions,
    ring: int,
    ncpus: int,
    programs: tuple[str, ...],
    deferred: tuple[str, ...] = (),
) -> None:
    """`deferred`: maps this load does not create (another object will)."""
    cfg = abi.Config(
        offcpu_min_ns=o.offcpu_min_ns,
        offcpu_interval_ns=o.offcpu_interval_ns,
        runqueue_interval_ns=o.runqueue_interval_ns,
        wakeup_bytes=o.wakeup_bytes or ring // 4,
        tp_btf_skip=2,  # the BPF program itself and bpf_trace_run4
    )
    obj.write_rodata("cfg", bytes(cfg))
    for name, prog in obj.programs.items():
        prog.set_autoload(name in programs)
    for name in deferred:
        obj.maps[name].set_autocreate(False)
    obj.maps["stack_events"].set_max_entries(ring)
    if not o.raw_stacks:
        raw = os.sysconf("SC_PAGE_SIZE")
    else:
        raw = o.raw_ring_bytes or raw_ring_size(ncpus, o.freq_hz, o.drain_interval_s)
    obj.maps["raw_stacks"].set_max_entries(raw)
    obj.maps["on_cpu_counts"].set_max_entries(counts_size(ncpus, o.freq_hz, o.drain_interval_s))
    obj.maps["unwind_rows"].set_max_entries(max(o.unwind_rows, 1))


def load_object(o: ProfilerOptions, arm: Mapping[int, int] | None = None) -> LoadedObject:
    """Open, check, configure and load the object (with sampler_first, its sampler only, attached
    and `arm`'s pids armed before the maps it does not use are created). On failure nothing is
    left behind."""
    path = os.fspath(o.object_path) if o.object_path else default_object_path()
    if not o.sampler_first:
        return _load_twins(lambda kernel: _load(o, path, wanted_programs(o, kernel), None, kernel))
    loaded = _load_first(o, path)
    try:
        if arm is not None:
            loaded = attach_sampler(loaded, o.freq_hz, arm)
        for name in _late_maps(loaded.obj):
            loaded.obj.maps[name].create()
    except BaseException:
        for link in loaded.sampler_links:
            link.close()
        loaded.obj.close()
        raise
    return loaded


def _load_first(o: ProfilerOptions, path: str) -> LoadedObject:
    try:
        # The first sampler reads no kernel struct (no CO-RE relocation, no tp_btf): libbpf need
        # not parse the kernel's BTF. record's first sample waits for this load alone: libbpf's
        # log only if it fails.
        with LibbpfSilenced(), NoKernelTypes() as btf:
            return _load(o, path, (FIRST_SAMPLER,), btf, features.FULL)
    except (BpfError, OSError) as e:  # OSError: no memfd here (a seccomp filter, say)
        log.info("The first sampler did not load without kernel types; loading it with them. error=%s", e)
        # Again, with libbpf's log to explain a failure.
        return _load(o, path, (FIRST_SAMPLER,), None, features.FULL)


def _load(
    o: ProfilerOptions, path: str, programs: tuple[str, ...], btf: str | None, kernel: features.KernelFeatures
) -> LoadedObject:
    """`kernel`: what `programs` were chosen for (FULL for sampler_first's first object)."""
    obj = BpfObject(path, btf_custom_path=btf)
    try:
        problems = abi.abi_mismatches(obj.btf)
        if problems:
            raise BistouriError(
                f"the BPF object {path} does not match this agent's structures: "
                + "; ".join(problems)
                + ". Rebuild it (`make bpf`) or reinstall the package"
            )
        cpus = tuple(perf.online_cpus())
        ring = o.ring_bytes or ring_size(len(cpus), o.freq_hz, o.drain_interval_s)
        deferred = (*COMPANION_MAPS, *_late_maps(obj)) if o.sampler_first else ()
        _configure(obj, o, ring, len(cpus), programs, deferred)
        obj.load()
    except BaseException:
        obj.close()
        raise
    # sampler_first: the full programs' names, load_companion() chooses among their twins.
    pending = (
        tuple(p for p in wanted_programs(o, features.FULL) if p not in programs) if o.sampler_first else ()
    )
    return LoadedObject(obj, path, cpus, ring, programs, pending, kernel=kernel)


def load_companion(first: LoadedObject, o: ProfilerOptions) -> LoadedObject:
    """The programs `first` left pending, in a second object from the same file whose maps are
    first's own (the kernel's, shared): they see the same filter, rings and counters. The maps
    first left to it (COMPANION_MAPS) it creates, and first's handles then share them too."""
    return _load_twins(lambda kernel: _load_companion(first, o, kernel))


def _load_companion(first: LoadedObject, o: ProfilerOptions, kernel: features.KernelFeatures) -> LoadedObject:
    programs = tuple(features.program_for(p, kernel) for p in first.pending)
    obj = BpfObject(first.path)
    try:
        _configure(obj, o, first.ring_bytes, len(first.cpus), programs)
        for name, m in obj.maps.items():
            if name not in COMPANION_MAPS:
                m.reuse(first.obj.maps[name])
        obj.load()
        for name in COMPANION_MAPS:
            first.obj.maps[name].reuse(obj.maps[name])
    except BaseException:
        obj.close()
        raise
    sampler = features.program_for(SAMPLER, kernel)
    attached = tuple(p for p in programs if p != sampler)
    handoff = sampler if sampler in programs else ""
    return LoadedObject(
        obj, first.path, first.cpus, first.ring_bytes, attached, handoff=handoff, kernel=kernel
    )


def hand_over(first: BpfObject, companion: LoadedObject) -> None:
    """From now on the first sampler passes every sample on to the companion's (a tail call through
    sampler_handoff): no perf event is detached or opened again, no sample falls in between."""
    if companion.handoff:
        fd = companion.obj.programs[companion.handoff].fd
        first.maps["sampler_handoff"].update(struct.pack("<I", 0), struct.pack("<I", fd))


def sampler_of(loaded: LoadedObject) -> str:
    """The perf_event program `loaded` attaches: the first sampler if it has it."""
    return FIRST_SAMPLER if FIRST_SAMPLER in loaded.programs else features.program_for(SAMPLER, loaded.kernel)


def attach_sampler(loaded: LoadedObject, freq_hz: int, armed: Mapping[int, int]) -> LoadedObject:
    """Attach the on-CPU sampler to every CPU and arm `armed` (pid -> filter flags) right away,
    on the loading thread: `record`'s first sample does not wait for the rest of its set-up.
    Profiler adopts the links, and set_pid_filter() later does its bookkeeping."""
    links: list[Link] = []
    try:
        prog = loaded.obj.programs[sampler_of(loaded)]
        for cpu in loaded.cpus:
            links.append(prog.attach_perf_event(perf.open_cpu_clock(cpu, freq_hz)))
        pid_filter = loaded.obj.maps["pid_filter"]
        for pid, flags in armed.items():
            pid_filter.update(struct.pack("<I", pid), struct.pack("<I", flags))
    except BaseException:
        for link in links:
            link.close()
        raise
    log.debug("Sampler attached and armed. pids=%s", ",".join(map(str, armed)))
    return replace(loaded, sampler_links=tuple(links))


class ObjectLoad:
    """load_object() (or, given `first`, load_companion()) on its own thread; result() hands
    the object over, once.

    With sampler_first, the companion's load starts on its own thread as soon as the first is
    loaded and armed (take_companion() hands it over), and the companion takes over the first's
    samples as soon as it is loaded (hand_over): the table walk waits for neither the caller's
    imports nor attach_rest()."""

    def __init__(
        self,
        options: ProfilerOptions,
        first: LoadedObject | None = None,
        arm: Mapping[int, int] | None = None,
    ) -> None:
        """`arm` (pid -> filter flags): attach the sampler and arm these as soon as it is loaded."""
        self.options = options
        self._first = first
        self._arm = arm
        self._loaded: LoadedObject | None = None
        self._companion: ObjectLoad | None = None
        self._error: BaseException | None = None
        self._thread = threads.start("load", self._run)

    def wait(self) -> None:
        """Until the load (and the arming) is over, failed or not."""
        self._thread.join()

    def _run(self) -> None:
        try:
            if self._first is not None:
                loaded = load_companion(self._first, self.options)
                self._loaded = loaded  # close() releases it, even if the hand-over failed
                hand_over(self._first.obj, loaded)
                log.debug("Companion loaded, samples handed over. to=%s", loaded.handoff or "-")
            else:
                loaded = load_object(self.options, self._arm)
                self._loaded = loaded
                if loaded.pending:  # the rest loads at once, while the first samples
                    self._companion = ObjectLoad(self.options, first=loaded)
        except BaseException as e:  # raised again by result(), on the caller's thread
            self._error = e

    def result(self) -> LoadedObject:
        self._thread.join()
        if self._error is not None:
            raise self._error
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            raise BistouriError("the BPF object was already handed over")
        return loaded

    def take_companion(self) -> ObjectLoad | None:
        """The companion's load started after this one (sampler_first), handed over once."""
        self._thread.join()
        companion, self._companion = self._companion, None
        return companion

    def close(self) -> None:
        """Release the object (and the companion's) if it was not handed over."""
        self._thread.join()
        if self._companion is not None:  # first: it shares the first object's maps
            self._companion.close()
            self._companion = None
        if self._loaded is not None:
            for link in self._loaded.sampler_links:
                link.close()
            self._loaded.obj.close()
            self._loaded = None

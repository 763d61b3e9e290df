"""The profiler's BPF object: found, checked against abi.py, configured and loaded.

Apart from ProfilerAgent (profiler.py) so that loading needs only the light
modules: `record` starts ObjectLoad on a thread first, and imports and sets up the
rest while libbpf parses the kernel's BTF and the verifier checks the programs
(both without the GIL). Its first sample comes that much sooner.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from . import abi, perf, threads
from .bpf import BpfObject, BtfFile
from .errors import BistouriError, BpfError

log = logging.getLogger(__name__)

OBJECT_ENV = "BISTOURI_BPF_OBJECT"
_INSTALLED_OBJECT = "/usr/lib/bistouri/bistouri.bpf.o"


def default_object_path() -> Path:
    """The precompiled object: $BISTOURI_BPF_OBJECT, the package's copy, or the system one."""
    env = os.environ.get(OBJECT_ENV)
    if env:
        return Path(env)
    # The package's own directory: importlib.resources would say the same, for ~8 ms of imports
    # on record's start-up path (libbpf needs a real file anyway, never one inside a zip).
    packaged = Path(__file__).parent / "_bpfobj" / "bistouri.bpf.o"
    if packaged.exists() or not Path(_INSTALLED_OBJECT).exists():
        return packaged
    return Path(_INSTALLED_OBJECT)


@dataclass(frozen=True, slots=True)
class ProfilerOptions:
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
    aggregate: bool = True  # count repeated on-CPU samples in the kernel (one event per stack per drain)
    wakeup_bytes: int = 0  # 0: a quarter of the ring
    # While a session runs. Longer means fewer drains and fewer weighted samples (a repeated stack
    # is one event per drain); sessions drain the ring as they start and end (catch_up), so none
    # loses what the kernel still holds. `record` uses 0.1 s, for its progress.
    drain_interval_s: float = 0.5
    # After set_slow_drain(True): the agent while no session runs, when only its flight recorder
    # samples. Those few samples wait longer in the ring, and the agent wakes 5x less often; a
    # session drains the ring as it starts (catch_up).
    slow_drain_interval_s: float = 1.0
    batch_budget: int = 2048
    queue_size: int = 256  # batches (each at most batch_budget events)
    object_path: Path | None = None
    exec_discovery: bool = True
    ring_bytes: int = 0  # 0: sized from CPUs x frequency
    proc_root: str = "/proc"
    # Rows of .eh_frame tables in BPF (12 bytes each: 12 MiB); postgres and its 40 libraries need 535 k.
    unwind_rows: int = 1 << 20  # 0: frame pointers only
    unwind_cache_dir: str | None = None  # tables on disk per build id; None: built again by each agent
    unwind_cpu_share: float = 0.25  # of a core, at most, for building tables
    # Of the thread building them. Not 19: the thread shares the GIL with the ring-buffer and main
    # threads, and starved at nice 19 under CPU pressure it held them up for a second (priority
    # inversion through the GIL). The CPU share above is what keeps it off the workload.
    unwind_nice: int = 0
    episode: bool = True  # account watched threads' time by state (episode.py)


# The episode hooks (bpf/bistouri.bpf.c, "Episode report") -> their tracepoint. The scheduler
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
    try:
        with BtfFile(btf_path) as f:
            return {n for n in names if f.btf.has_typedef("btf_trace_" + n)}
    except BpfError:
        return set(names)  # unreadable here: let the load say what is missing


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


@dataclass(frozen=True, slots=True)
class LoadedObject:
    """The loaded object, with what was decided while configuring it."""

    obj: BpfObject
    path: Path
    cpus: tuple[int, ...]  # online CPUs: one perf event each
    ring_bytes: int
    episode_programs: tuple[str, ...]  # the episode hooks this kernel can run, loaded


def load_object(o: ProfilerOptions) -> LoadedObject:
    """Open, check, configure and load the object. On failure nothing is left behind."""
    path = o.object_path or default_object_path()
    obj = BpfObject(path)
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
        cfg = abi.Config(
            offcpu_min_ns=o.offcpu_min_ns,
            offcpu_interval_ns=o.offcpu_interval_ns,
            runqueue_interval_ns=o.runqueue_interval_ns,
            wakeup_bytes=o.wakeup_bytes or ring // 4,
            tp_btf_skip=2,  # the BPF program itself and bpf_trace_run4
            aggregate=1 if o.aggregate else 0,
        )
        obj.write_rodata("cfg", bytes(cfg))
        obj.programs["handle_sched_switch"].set_autoload(o.offcpu)
        obj.programs["handle_exec"].set_autoload(o.exec_discovery)
        episode: tuple[str, ...] = ()
        if o.episode:
            present = kernel_tracepoints(EPISODE_TRACEPOINTS.values())
            episode = tuple(n for n, tp in EPISODE_TRACEPOINTS.items() if tp in present)
            missing = sorted(set(EPISODE_TRACEPOINTS.values()) - present)
            if missing:
                log.info(
                    "Kernel lacks tracepoints: their episode times stay 0. tracepoints=%s", ",".join(missing)
                )
        for name in EPISODE_PROGRAMS:
            obj.programs[name].set_autoload(name in episode)
        obj.maps["stack_events"].set_max_entries(ring)
        obj.maps["on_cpu_counts"].set_max_entries(counts_size(len(cpus), o.freq_hz, o.drain_interval_s))
        obj.maps["unwind_rows"].set_max_entries(max(o.unwind_rows, 1))
        obj.load()
    except BaseException:
        obj.close()
        raise
    return LoadedObject(obj, Path(path), cpus, ring, episode)


class ObjectLoad:
    """load_object() on its own thread; result() hands the object over, once."""

    def __init__(self, options: ProfilerOptions) -> None:
        self.options = options
        self._loaded: LoadedObject | None = None
        self._error: BaseException | None = None
        self._thread = threads.start("load", self._run)

    def _run(self) -> None:
        try:
            self._loaded = load_object(self.options)
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

    def close(self) -> None:
        """Release the object if it was not handed over."""
        self._thread.join()
        if self._loaded is not None:
            self._loaded.obj.close()
            self._loaded = None

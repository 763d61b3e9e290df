"""Profiler: loads the BPF object, attaches it, and drains its ring buffers on one thread.

Lifecycle: open → configure (.rodata, autoload) → load → attach → run → close,
always in that order; a failure at any step releases everything acquired so
far. The programs are blind until user space fills `pid_filter` (what to
sample) and `comm_rules` (which execs to report).

The drain thread (`bistouri-ringbuf`) waits on libbpf's epoll fd plus a stop
eventfd, with a bounded timeout, consumes in bounded batches, reads the on-CPU
counts the kernel kept since the last drain (`events.py` says how records and
counts become samples), maps user IPs to files (`procmaps.py`; a sample whose process's
mappings changed wakes this thread at once, which re-reads them while the process
lives), and hands decoded events to a bounded queue. A full queue drops the event and
counts it: the kernel side is never blocked. Raw stack copies (the samples of `record`'s
targets and of the agent's sessions' processes taken before their tables were in) wait in
`rawstacks.RawStacks` until the tables are, then come out as ordinary stack events.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import select
import struct
import threading
import time
from collections.abc import Callable, Collection

from .. import compat, threads
from ..bpf import abi, features, perf
from ..bpf.handles import BpfObject, Link, Map, RingBuffer
from ..bpf.loader import (
    EPISODE_PROGRAMS,
    LoadedObject,
    ObjectLoad,
    ProfilerOptions,
    default_object_path,
    kernel_features,
    kernel_tracepoints,
    load_object,
    ring_size,
    sampler_of,
)
from ..cpython.discover import Interpreter, record
from ..cpython.processes import TRANSIENT_REASONS, PythonProcesses, PythonStack
from ..errors import BistouriError, BpfError
from ..host.jvm import JvmPerfMaps, NoJvmPerfMaps
from ..host.procmaps import ProcMaps
from ..unwind.rawwalk import MappedRules
from ..unwind.tables import NoUnwind, UnwindTables
from .events import (
    Event,
    ResolvedStacks,
    SentSamples,
    counted_sample_key,
    decode_error,
    decode_exec,
    decode_stack,
)
from .flight import Recorded
from .rawstacks import RawStacks, event_of, pid_of

log = logging.getLogger(__name__)

# The flight recorder's entries in the kernel (abi.RecorderKey -> abi.RecordedWait).
_RECORDER_KEY_PID = struct.Struct("<I")
_RECORDER_KEY_PID_AT = abi.RecorderKey.user_key.offset + abi.UserStackKey.pid.offset
_RECORDER_SLOT = struct.Struct("<IIQ")  # abi.RecorderSlot
_RECORDER_EVENT_AT = abi.RecordedWait.event.offset
_SECOND_NS = 1_000_000_000  # a slot's span (RECORDER_SLOT_NS)
# How long close() waits for a drain thread stop() left running: its last drain is bounded (the
# rings' contents and at most RawStacks.max_records copies).
_LAST_DRAIN_WAIT_S = 30.0


class Profiler:
    """Owns the BPF object, every link, the ring buffers and the drain thread."""

    def __init__(
        self,
        options: ProfilerOptions,
        notify: Callable[[], None] | None = None,
        loading: ObjectLoad | None = None,
    ) -> None:
        """`loading`: the object already being loaded on a thread (ObjectLoad of the same options)."""
        self.options = options
        self._loading = loading
        # Batches, not single events: one queue operation per consume() instead of per sample.
        self.events: queue.Queue[list[Event]] = queue.Queue(maxsize=options.queue_size)
        self._batch: list[Event] = []
        self.dropped = 0  # events lost because the queue was full
        # Ring-buffer thread (and the capture, for file names): user IPs mapped to files.
        self.maps = ProcMaps(options.proc_root)
        self.resolved = ResolvedStacks()
        # Ring-buffer thread only: the samples the kernel counts repeats of, and counts whose
        # sample is not here yet (sent after the ring was read).
        self.sent = SentSamples(forget=self._forgetter("known_samples"))
        self._pending_counts: dict[bytes, int] = {}
        self.orphaned = 0  # samples counted in the kernel whose stack never arrived
        self.drains = 0  # times the ring was read: the agent's wakeups while it samples
        self._notify = notify
        self._obj: BpfObject | None = None
        self.object_path: str | None = None  # the object's file, once loaded
        self.kernel_features = features.FULL  # once loaded: what the kernel lacks (its programs are compat)
        self._companion: ObjectLoad | None = None  # sampler_first: the other programs, loading
        self._companion_obj: BpfObject | None = None  # ... and loaded (sharing _obj's maps)
        self._links: list[Link] = []
        self._rb: RingBuffer | None = None
        self._thread: threading.Thread | None = None
        self._stop_fd = -1
        self._thread_error: BaseException | None = None
        self._filter_lock = threading.Lock()
        self._filtered: set[int] = set()
        self._slow_drain = False
        self._drain_lock = threading.Lock()  # the ring thread's timer, or catch_up() from another
        self._poll_ms: int | None = None  # the ring thread's wait between drains (_set_poll_ms)
        self._kick_fd = -1
        # The ring thread's, at the slow interval: drains in a row that found nothing (each doubles
        # the wait, see _wait_ms), and what the main thread has not been told of yet (_announce).
        self._empty_drains = 0
        self._untold_since: float | None = None  # monotonic time of the oldest batch not announced
        self._untold_urgent = False  # an exec or error event among them
        self.unwind: UnwindTables | NoUnwind = NoUnwind()
        # JVMs asked for their perf maps when they are first sampled and when a session starts.
        self.jvm: JvmPerfMaps | NoJvmPerfMaps = NoJvmPerfMaps()
        if options.jvm_perf_maps:
            self.jvm = JvmPerfMaps(
                options.proc_root,
                min_interval_s=options.jvm_perf_map_interval_s,
                on_result=self._perf_map_written,
            )
        # The CPython processes among the sampled ones (their record in `python_procs`, where the BPF
        # walk reads it); their frames are named by it as they arrive. Under _python_lock: described
        # by the threads that set the pid filter, naming on the one that drains the ring (never waits
        # for _filter_lock: taken inside it).
        self.python = PythonProcesses(options.proc_root)
        self._python_lock = threading.Lock()
        self._describe_again: set[int] = set()  # sampled processes whose mappings changed (an exec?)
        self.maps.on_reread = self._maps_reread
        # Raw stack copies (ProfilerOptions.raw_stacks): held on the ring thread until the tables of
        # their process are in (_raw_ready, added to by the unwind thread), then walked.
        self.raw = RawStacks(options.raw_held_records, options.raw_held_bytes)
        self._raw_ready: set[int] = set()
        self._raw_filters: dict[int, int] = {}  # pid -> its filter value, while it asks for copies
        # sampler_first: False until attach_rest(), when the table walk has taken over. Until then a
        # sample is walked by frame pointers even once its tables are in: it keeps asking for copies.
        self._walk_attached = True
        self._raw_rules: dict[int, MappedRules] = {}  # the ring thread's, for one drain

    # -- lifecycle --------------------------------------------------------------
    def open(self) -> None:
        """Open, configure, load and attach. On failure nothing is left behind."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        o = self.options
        loading, self._loading = self._loading, None
        loaded = loading.result() if loading is not None else load_object(o)
        # sampler_first: the rest, loading since the first was (close() releases it from here on)
        self._companion = loading.take_companion() if loading is not None else None
        obj = self._obj = loaded.obj
        self.object_path = loaded.path
        # sampler_first's first object has not read them (LoadedObject.kernel): its companion has
        # (attach_rest), or will.
        self.kernel_features = kernel_features() if loaded.pending else loaded.kernel
        self._walk_attached = not loaded.pending
        if o.unwind_rows:
            self.unwind = UnwindTables(
                obj.maps,
                proc_root=o.proc_root,
                cache_dir=o.unwind_cache_dir,
                cpu_share=o.unwind_cpu_share,
                nice=o.unwind_nice,
            )
            self.unwind.jit_code = self.maps.jit_code  # a JVM's compiled frames get rows (unwind/hotspot.py)
            if o.raw_stacks:
                self.unwind.on_published = self._tables_in

        self._attach(loaded)
        if loaded.pending and self._companion is None:  # sampler_first: the rest loads while it samples
            self._companion = ObjectLoad(o, first=loaded)

        rings: list[tuple[Map, Callable[[bytes], None]]] = [
            (obj.maps["stack_events"], self._on_stack),
            (obj.maps["exec_events"], self._on_exec),
            (obj.maps["error_events"], self._on_error),
        ]
        if o.raw_stacks:
            rings.append((obj.maps["raw_stacks"], self._on_raw_stack))
        self._rb = RingBuffer(rings)
        log.info(
            "BPF programs loaded and attached. object=%s freq_hz=%d offcpu=%s cpus=%d",
            loaded.path,
            o.freq_hz,
            o.offcpu,
            len(loaded.cpus),
        )

    def _attach(self, loaded: LoadedObject) -> None:
        for name in loaded.programs:
            prog = loaded.obj.programs[name]
            if name == sampler_of(loaded) and loaded.sampler_links:  # attached on the loading thread
                self._links.extend(loaded.sampler_links)
            elif name == sampler_of(loaded):
                for cpu in loaded.cpus:
                    self._links.append(prog.attach_perf_event(perf.open_cpu_clock(cpu, self.options.freq_hz)))
            else:
                self._links.append(prog.attach())

    def attach_rest(self) -> None:
        """With sampler_first: wait for the other programs (off-CPU, discovery, episode hooks)
        and attach them; the first sampler already hands its samples on to the table walk (the
        loading thread did it). Without it, or called again: nothing to do."""
        companion, self._companion = self._companion, None
        if companion is None:
            return
        loaded = companion.result()
        self._companion_obj = loaded.obj
        self.kernel_features = loaded.kernel  # the companion's programs are the ones chosen for it
        self._attach(loaded)
        with self._filter_lock:
            self._walk_attached = True
            for pid in self._raw_ready & self._raw_filters.keys():  # tables in before the walk was
                self._stop_raw_copies(pid)
        log.info(
            "BPF programs attached. programs=%s sampler=%s", ",".join(loaded.programs), loaded.handoff or "-"
        )

    def start(self) -> None:
        """Start the drain thread."""
        if self._rb is None:
            raise BistouriError("Profiler.start() before open()")
        self._stop_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
        self._kick_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
        self._thread = threads.start("ringbuf", self._drain_loop)
        self.jvm.start()
        # With sampler_first too: the tables are in the first object, filled while it samples.
        self.unwind.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the table builder and the drain thread, which drains the rings a last time. The maps
        stay readable (thread_times: the episodes of sessions flushed at shutdown). Idempotent."""
        self.unwind.close(min(timeout, 0.5))
        self.unwind = NoUnwind()
        self.jvm.close(min(timeout, 0.5))
        if self._thread is not None:
            compat.eventfd_write(self._stop_fd, 1)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the ring-buffer thread did not stop within %.1fs", timeout)
                return  # kept: close() waits for it before freeing what it reads
            self._thread = None

    def close(self, timeout: float = 2.0) -> None:
        """Stop, free the ring buffer, detach, close the object. Idempotent."""
        self.stop(timeout)
        if self._thread is not None:
            # Its last drain still runs (walking raw copies took longer under arm64 emulation):
            # the ring buffer and maps freed under it crashed the process (SIGSEGV).
            self._thread.join(_LAST_DRAIN_WAIT_S)
            if self._thread.is_alive():
                log.error("the ring-buffer thread is still running: its ring buffer and maps are left open")
                return
            self._thread = None
        for fd in (self._stop_fd, self._kick_fd):
            if fd >= 0:
                os.close(fd)
        self._stop_fd = self._kick_fd = -1
        if self._rb is not None:
            self._rb.close()
            self._rb = None
        for link in reversed(self._links):
            link.close()
        self._links.clear()
        if self._companion is not None:  # its programs never attached
            self._companion.close()
            self._companion = None
        if self._companion_obj is not None:
            self._companion_obj.close()
            self._companion_obj = None
        if self._obj is not None:
            self._obj.close()
            self._obj = None
        if self._loading is not None:  # never opened: the object loaded for it goes too
            self._loading.close()
            self._loading = None
        with self._python_lock:
            self.python.close()

    def __enter__(self) -> Profiler:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_thread(self) -> None:
        """Re-raise on the owning thread an exception that killed the drain thread."""
        if self._thread_error is not None:
            err, self._thread_error = self._thread_error, None
            raise err

    # -- maps -----------------------------------------------------------------------
    def _require(self) -> BpfObject:
        if self._obj is None:
            raise BistouriError("the BPF object is not loaded")
        return self._obj

    def set_pid_filter(self, pid: int, flags: int) -> None:
        """Start (flags != 0) or stop (flags == 0) sampling a process."""
        m = self._require().maps["pid_filter"]
        key = struct.pack("<I", pid)
        with self._filter_lock:
            before = self._poll_ms
            new = bool(flags) and pid not in self._filtered
            if flags & abi.FilterFlags.RAW_STACK and (
                not isinstance(self.unwind, UnwindTables)  # no tables to walk copies with, ever
                or (pid in self._raw_ready and self._walk_attached)  # its tables are in already
            ):
                flags &= ~abi.FilterFlags.RAW_STACK
            if flags & abi.FilterFlags.RAW_STACK:
                self._raw_filters[pid] = flags  # until its tables are in (_tables_in)
            else:
                self._raw_filters.pop(pid, None)
            if flags:
                if pid not in self._filtered:
                    # Waits skipped in an earlier capture must not be weighed into this one.
                    self._require().maps["offcpu_last"].delete(key)
                    self._describe_python(pid, key)
                m.update(key, struct.pack("<I", flags))
                self._filtered.add(pid)
                self.maps.track(pid)  # its mappings from now on, even if it exits early
                self.unwind.want(pid)  # frame pointers until its tables are loaded
                self.request_perf_maps((pid,))
            else:
                m.delete(key)
                self._filtered.discard(pid)
                self._raw_ready.discard(pid)  # a process under this pid later waits for its own tables
                self._require().maps["python_procs"].delete(key)
                with self._python_lock:
                    self.python.remove(pid)
                self.unwind.forget(pid)
                self._forget_thread_times(pid)
            self._set_poll_ms(before, new)

    def _tables_in(self, pid: int) -> None:
        """The unwind thread published every table of `pid`: its samples need no more raw copies, and
        those held are walked at the next drain."""
        with self._filter_lock:
            # First, and under the lock: attach_rest() sees it, or stops them here; and the ring thread
            # never sees the process neither ready nor asking (_on_raw_stack).
            self._raw_ready.add(pid)
            if self._walk_attached:  # else attach_rest() stops them: the first sampler cannot walk
                self._stop_raw_copies(pid)

    def _stop_raw_copies(self, pid: int) -> None:
        """Under _filter_lock: `pid`'s samples are walked in BPF from now on, no copy."""
        flags = self._raw_filters.pop(pid, None)
        if flags is not None and pid in self._filtered and self._obj is not None:
            value = flags & ~abi.FilterFlags.RAW_STACK
            self._obj.maps["pid_filter"].update(struct.pack("<I", pid), struct.pack("<I", value))

    def wait_raw_stacks(self, timeout: float) -> bool:
        """With raw stack copies held: wait up to `timeout` for the tables they wait for (the next
        drain walks them; stop() drains last). Whether none is left waiting."""
        return not len(self.raw) or self.unwind.wait_idle(timeout)

    def request_perf_maps(self, pids: Collection[int]) -> None:
        """The JVMs among `pids` write their perf maps (on the `bistouri-jvm` thread, at most once a
        `jvm_perf_map_interval_s` each): when first sampled, and when a session starts (what was
        compiled since). Only processes whose maps, as last read, map libjvm.so (jvm.py checks
        again before it signals anything)."""
        for pid in pids:
            if self.maps.runtime(pid)[0] == "jvm":
                self.jvm.request(pid)

    def refresh_perf_maps(self, pids: Collection[int]) -> None:
        """The same now, on the calling thread and without the rate limit (`record`, before it
        names its capture: what was compiled during it)."""
        self.jvm.refresh([pid for pid in pids if self.maps.runtime(pid)[0] == "jvm"])

    def _describe_python(self, pid: int, key: bytes) -> None:
        """A CPython process gets its record for the BPF walk of its frames (docs/python-frames.md);
        another keeps its native frames, and a CPython one we cannot walk says why. Nothing to do for
        a process described before that is still the same program. Under _filter_lock."""
        with self._python_lock:
            before = self.python.known(pid)
            found = self.python.add(pid)
        if found is before:
            return
        procs = self._require().maps["python_procs"]
        if isinstance(found, Interpreter):
            self.unwind.python_record(pid, True)  # first: its unwind entry must not say "not Python"
            procs.update(key, bytes(record(found)))
            log.info("Python frames of a CPython process walked. pid=%d version=%s", pid, found.version_text)
            return
        procs.delete(key)
        self.unwind.python_record(pid, False)  # its samples skip the Python walk's lookup
        if found.reason != "not_python":
            # Unreadable is most often a process that exited meanwhile: not worth a line at INFO.
            level = logging.DEBUG if found.reason == "unreadable" else logging.INFO
            log.log(
                level,
                "Python frames of a process not walked. pid=%d reason=%s detail=%s",
                pid,
                found.reason,
                found.detail,
            )

    def set_slow_drain(self, slow: bool) -> None:
        """Drain at the slow interval (no session runs) or the usual one."""
        if slow == self._slow_drain:
            return
        with self._filter_lock:
            before = self._poll_ms
            self._slow_drain = slow
            self._set_poll_ms(before)

    def _set_poll_ms(self, before: int | None, new_pid: bool = False) -> None:
        """The ring thread's wait between drains, from what is sampled; None: until an event wakes it.
        `new_pid`: a process joined the filter (its samples end a wait lengthened by empty drains)."""
        interval = None
        if self._filtered:
            o = self.options
            interval = int((o.slow_drain_interval_s if self._slow_drain else o.drain_interval_s) * 1000)
        self._poll_ms = interval
        sooner = interval is not None and (
            before is None or interval < before or (new_pid and self._empty_drains > 0)
        )
        if sooner and self._kick_fd >= 0:
            compat.eventfd_write(self._kick_fd, 1)  # leave the longer wait: samples are coming sooner

    def catch_up(self, release: Collection[int] = ()) -> None:
        """Drain the ring now, from the calling thread: a session about to start gets the samples
        its processes' flight recorder still had in the kernel (up to a slow drain interval old),
        and one about to end those still in the kernel. The raw stack copies still held of
        `release` (an ending session's processes) come too, as the BPF walk left them: their tables
        are not in, and the session will not wait for them."""
        if self._rb is not None and self._thread is not None:
            self.drain(release=release)

    def _perf_map_written(self, pid: int, outcome: str) -> None:
        """A perf-map request to a JVM ended (on the bistouri-jvm thread): its names are read anew,
        and its code cache gets unwind rows for what the new map lists."""
        self.maps.perf_map_requested(pid, outcome)
        if outcome == "ok" and pid in self._filtered:
            self.unwind.want(pid)

    def _maps_reread(self, pid: int) -> None:
        """A sampled process's mappings changed (dlopen, exec): tables for its new files, and after an
        exec a description (into Python: its frames walked; out of it: its record deleted). Called
        under the maps' lock, maybe inside set_pid_filter: the description waits for _on_stack."""
        if pid in self._filtered:
            self.unwind.want(pid)
            self._describe_again.add(pid)

    def _name_python(self, pid: int, raw: bytes, status: int) -> PythonStack:
        with self._python_lock:
            stack = self.python.stack(pid, raw, status)
            # Refused while it was starting (no thread key yet...): described again once its samples
            # come after RETRY_S, whether or not its mappings change again.
            if not raw and stack.note in TRANSIENT_REASONS and self.python.retry_due(pid):
                self._describe_again.add(pid)
            return stack

    def _redescribe(self) -> None:
        """Describe again the sampled processes whose mappings changed (PythonProcesses.add: two system
        calls when the process is the same program)."""
        while self._describe_again:
            pid = self._describe_again.pop()
            with self._filter_lock:
                if pid in self._filtered:
                    self._describe_python(pid, struct.pack("<I", pid))

    def thread_times(self, pids: Collection[int]) -> dict[int, abi.ThreadTimes]:
        """The cumulative times by state of the threads of `pids` (tid -> times), as the episode
        hooks count them; empty without them."""
        if not self.options.episode or not pids:
            return {}
        m = self._require().maps["thread_times"]
        out = {}
        for key in m.keys():  # noqa: SIM118 - Map.keys() iterates a BPF map
            val = m.lookup(key)
            if val is None:
                continue  # the thread's entry was evicted meanwhile
            t = abi.ThreadTimes.from_buffer_copy(val)
            if t.pid in pids:
                out[t.tid] = t
        return out

    def _forget_thread_times(self, pid: int) -> None:
        """Drop the episode times of a process no longer watched: the state each thread was last
        seen in goes stale while unwatched, and would be timed as lasting until its next switch
        once watched again. Threads already gone keep no state (their last switch cleared it).
        Their pending wait stacks go too (a run-queue one would carry the gap), and the process's
        run-queue rate limit."""
        if not self.options.episode:
            return
        maps = self._require().maps
        maps["runqueue_last"].delete(struct.pack("<I", pid))
        try:
            tids = os.listdir(os.path.join(self.options.proc_root, str(pid), "task"))
        except OSError:
            return  # the process is gone: its threads' entries age out of the LRU map
        for tid in tids:
            if tid.isdigit():
                key = struct.pack("<I", int(tid))
                maps["thread_times"].delete(key)
                maps["wait_pending"].delete(key)

    def recorded_waits(self, pids: Collection[int], since_ns: int) -> list[Recorded]:
        """The waits of `pids` the kernel counted for the flight recorder (bpf/recorder.bpf.h) that
        ended since `since_ns` (CLOCK_MONOTONIC, as time.monotonic_ns and bpf_ktime_get_ns): one
        sample per thread, wait kind, stack and second, standing for that second's waits, timed at
        the second's start (not before since_ns). The entries stay: a later session may want them.

        Run when a session starts: one system call per entry of the map, two for one of `pids`."""
        if not pids:
            return []
        m = self._require().maps["recorder_waits"]
        wanted = set(pids)
        entries = []
        for key in m.keys():  # noqa: SIM118 - Map.keys() iterates a BPF map
            if _RECORDER_KEY_PID.unpack_from(key, _RECORDER_KEY_PID_AT)[0] not in wanted:
                continue
            value = m.lookup(key)
            if value is not None:  # else evicted meanwhile
                entries.append(value)
        out: list[Recorded] = []
        first_second = since_ns // _SECOND_NS
        with self._drain_lock:  # the ring thread's caches (self.resolved) are used here too
            for value in entries:
                slots = [
                    (second, waits, blocked)
                    for second, waits, blocked in _RECORDER_SLOT.iter_unpack(value[:_RECORDER_EVENT_AT])
                    if waits and second >= first_second
                ]
                if not slots:
                    continue
                # A CPython process's thread without Python frames gets its note as through the ring.
                sample = decode_stack(value[_RECORDER_EVENT_AT:], self.maps, self.resolved, self._name_python)
                for second, waits, blocked in slots:
                    at_ns = max(second * _SECOND_NS, since_ns)
                    timed = dataclasses.replace(sample, blocked_ns=blocked // waits, weight=waits)
                    out.append(Recorded(at_ns, timed))
        out.sort(key=lambda r: r.at_ns)
        return out

    def recorder_counters(self) -> dict[abi.RecorderCounter, int]:
        """The kernel recorder's counters summed over CPUs (bpf/recorder.bpf.h)."""
        m = self._require().maps["recorder_counters"]
        return {c: sum(m.lookup_percpu_u64(struct.pack("<I", c))) for c in abi.RecorderCounter}

    def episode_counters(self) -> dict[abi.EpisodeCounter, int]:
        """Episode-hook counters summed over CPUs (zero without the hooks)."""
        if not self.options.episode:
            return dict.fromkeys(abi.EpisodeCounter, 0)
        m = self._require().maps["episode_counters"]
        return {c: sum(m.lookup_percpu_u64(struct.pack("<I", c))) for c in abi.EpisodeCounter}

    def set_comm_rules(self, entries: list[tuple[bytes, int]]) -> None:
        """Make the LPM trie hold exactly `entries` (key bytes, rule id): add new, then drop stale."""
        m = self._require().maps["comm_rules"]
        wanted = dict(entries)
        for key, rule_id in wanted.items():
            m.update(key, struct.pack("<I", rule_id))
        for key in list(m.keys()):
            if key not in wanted:
                m.delete(key)

    def _forgetter(self, map_name: str) -> Callable[[bytes], None]:
        """For a cache of the ring thread: a key it let go is deleted from `map_name`, so the
        kernel sends that stack or sample whole again."""

        def forget(key: bytes) -> None:
            if self._obj is None:
                return
            try:
                self._obj.maps[map_name].delete(key)
            except BpfError as e:  # never fatal for the drain thread: at worst data stays raw
                log.debug("Could not delete a key from %s: %s", map_name, e)

        return forget

    def counters(self) -> dict[abi.Counter, int]:
        """BPF-side counters summed over CPUs."""
        m = self._require().maps["counters"]
        return {c: sum(m.lookup_percpu_u64(struct.pack("<I", c))) for c in abi.Counter}

    # -- ring-buffer thread --------------------------------------------------------
    def _on_stack(self, data: bytes) -> None:
        sample = decode_stack(data, self.maps, self.resolved, self._name_python)
        if self._describe_again:  # a mapping changed meanwhile: the next samples see the new program
            self._redescribe()
        self._batch.append(sample)
        if (key := counted_sample_key(data, sample)) is not None:
            # The kernel counts this sample's repeats under its key: keep it to weigh them on.
            self.sent.remember(key, sample)

    def _on_raw_stack(self, data: bytes) -> None:
        self.raw.stats.received += 1
        pid = pid_of(data)
        if pid in self._raw_ready:  # sent before the filter was cleared
            self._on_walked(self.raw.walk(data, self._rules(pid)))
        elif pid not in self._raw_filters:
            # Sent before its session ended (and released what it held): nobody waits for its tables,
            # and held it would sit in the bounds for the agent's life.
            self.raw.stats.unwalked += 1
            self._on_walked(event_of(data))
        elif not self.raw.hold(data):
            self._on_walked(event_of(data))

    def _on_walked(self, event: bytes) -> None:
        """A stack event from a raw copy: never counted in the kernel, so not remembered."""
        self._batch.append(decode_stack(event, self.maps, self.resolved, self._name_python))

    def _rules(self, pid: int) -> MappedRules:
        rules = self._raw_rules.get(pid)
        if rules is None:
            assert self._obj is not None
            rules = self._raw_rules[pid] = MappedRules(self._obj.maps, pid)
        return rules

    def _walk_raw(self, final: bool, release: Collection[int] = ()) -> None:
        """Walk the copies whose tables are in; send those of `release` (all with `final`) on as
        they came."""
        for pid in self.raw.held_pids() & self._raw_ready:
            rules = self._rules(pid)
            for copy in self.raw.take(pid):
                self._on_walked(self.raw.walk(copy, rules))
        if final or release:
            for event in self.raw.release(None if final else release):
                self._on_walked(event)
        self._raw_rules.clear()  # the tables may change before the next drain

    def _on_exec(self, data: bytes) -> None:
        self._batch.append(decode_exec(data))
        self._untold_urgent = True

    def _on_error(self, data: bytes) -> None:
        self._batch.append(decode_error(data))
        self._untold_urgent = True

    def _flush_batch(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        try:
            self.events.put_nowait(batch)
        except queue.Full:
            self.dropped += len(batch)

    def take(self, timeout: float | None = None) -> list[Event]:
        """The decoded events waiting now (blocking up to `timeout` for the first batch)."""
        out: list[Event] = []
        try:
            out.extend(self.events.get(timeout=timeout) if timeout else self.events.get_nowait())
            while True:
                out.extend(self.events.get_nowait())
        except queue.Empty:
            pass
        return out

    def drain(self, final: bool = False, release: Collection[int] = ()) -> int:
        """Consume everything available now, in bounded batches. Returns records handled. `final`:
        the last drain, raw stack copies still held are sent on as they are; `release`: those of
        these processes are."""
        rb = self._rb
        if rb is None:
            return 0
        with self._drain_lock:
            self.drains += 1
            return self._drain(rb, final, release)

    def _drain(self, rb: RingBuffer, final: bool = False, release: Collection[int] = ()) -> int:
        total = 0
        try:
            while True:
                n = rb.consume(self.options.batch_budget)
                total += n
                self._flush_batch()
                if n < self.options.batch_budget:
                    break
            total += self._take_counts()
            if len(self.raw) or self._raw_rules:
                self._walk_raw(final, release)
            return total
        finally:
            self._flush_batch()

    def _take_counts(self) -> int:
        """Weigh the samples sent whole by the repeats the kernel counted since the last drain.

        A count whose sample is not here yet (sent after the ring was read) waits one drain
        for it; then it is dropped, counted (`orphaned`), and its key forgotten in the kernel.
        """
        assert self._obj is not None
        counts_map = self._obj.maps["on_cpu_counts"]
        # Most drains of a dormant agent find no count: asking for the first key is a lookup
        # without locks, where the batch read takes every bucket's lock. A count that lands
        # after either is read at the next drain alike.
        empty = next(counts_map.keys(), None) is None
        if empty and not self._pending_counts:
            return 0
        counts: dict[bytes, int] = self._pending_counts
        self._pending_counts = {}
        late = set(counts)
        for key, raw in () if empty else counts_map.take_all():
            counts[key] = counts.get(key, 0) + int.from_bytes(raw, "little")
        handled = 0
        now_ns = time.monotonic_ns()  # the kernel's clock (bpf_ktime_get_ns): when the repeats were known
        for key, n in counts.items():
            sample = self.sent.get(key)
            if sample is not None:
                if n:
                    self._batch.append(sample.weighed(n, now_ns))
                    handled += 1
            elif key in late:
                self.orphaned += n
                self.sent.forget(key)
            else:
                self._pending_counts[key] = n
        return handled

    def _wait_ms(self) -> int | None:
        """The ring thread's next wait. At the slow interval (only the flight recorder samples) each
        drain in a row that found nothing doubles it, up to slow_drain_max_interval_s: idle watched
        processes send nothing for long spells, and the first sample after one is timed by the
        kernel (flight.py), not by when it is read. Anything found brings it back."""
        ms = self._poll_ms
        if ms is None or not self._slow_drain or not self._empty_drains:
            return ms
        longest = int(self.options.slow_drain_max_interval_s * 1000)
        return max(ms, min(ms << min(self._empty_drains, 16), longest))

    def _announce(self, handled: int, now: float) -> bool:
        """Whether to wake the main thread for what the drains queued. A session's samples, exec and
        error events: at once. The flight recorder's alone wait in the queue (the recorder times
        them by the kernel's clock) until a quarter of the queue or recorder_announce_s: the main
        thread then wakes a few times a minute for them instead of at every drain."""
        if handled and self._untold_since is None:
            self._untold_since = now
        if self._untold_since is None:
            return False
        if (
            not self._slow_drain
            or self._untold_urgent
            or self.events.qsize() * 4 >= self.options.queue_size
            or now - self._untold_since >= self.options.recorder_announce_s
        ):
            self._untold_since = None
            self._untold_urgent = False
            return True
        return False

    def _drain_loop(self) -> None:
        assert self._rb is not None
        poller = select.poll()
        poller.register(self._rb.epoll_fd(), select.POLLIN)
        poller.register(self._stop_fd, select.POLLIN)
        poller.register(self._kick_fd, select.POLLIN)
        try:
            while True:
                # Stack events are submitted without wakeup and drained on a timer while a
                # process is sampled; when none is, only exec/error events (which do wake
                # the epoll fd) can arrive: block until then, at no cost.
                ready = poller.poll(self._wait_ms())
                if any(fd == self._kick_fd for fd, _ in ready):
                    self._empty_drains = 0  # sampling changed: the usual interval again
                    try:
                        compat.eventfd_read(self._kick_fd)
                    except BlockingIOError:
                        pass
                if any(fd == self._stop_fd for fd, _ in ready):
                    self.drain(final=True)  # what is already in the ring is not lost at shutdown
                    if self._notify:
                        self._notify()
                    return
                handled = self.drain()
                self._empty_drains = 0 if handled else self._empty_drains + 1
                if self._announce(handled, time.monotonic()) and self._notify:
                    self._notify()
        except BaseException as e:  # surfaced to the main thread by check_thread()
            log.error("the ring-buffer thread failed: %s", e)
            self._thread_error = e
            if self._notify:
                self._notify()


__all__ = [
    "EPISODE_PROGRAMS",
    "BpfError",
    "ObjectLoad",
    "Profiler",
    "ProfilerOptions",
    "default_object_path",
    "kernel_tracepoints",
    "ring_size",
]

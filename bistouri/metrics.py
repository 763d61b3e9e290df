"""Prometheus metrics of the agent (port 9464). docs/metrics.csv is the catalogue.

Labels are resource/kind/reason-class only: never pid or comm (unbounded).
BPF-side counters are read from the `counters` map at scrape time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from . import abi
from .procmaps import ProcMapsStats
from .unwind import UnwindStats

log = logging.getLogger(__name__)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        r = registry
        self.sessions_started = Counter(
            "bistouri_sessions_started_total",
            "Capture sessions opened, by PSI resource",
            ["resource"],
            registry=r,
        )
        self.sessions_completed = Counter(
            "bistouri_sessions_completed_total",
            "Sessions finished with samples and spooled",
            ["resource"],
            registry=r,
        )
        self.sessions_empty = Counter(
            "bistouri_sessions_empty_total", "Sessions finished without any sample", ["resource"], registry=r
        )
        self.sessions_dropped = Counter(
            "bistouri_sessions_dropped_total",
            "Sessions not started or lost, by reason",
            ["reason"],
            registry=r,
        )
        self.sessions_active = Gauge("bistouri_sessions_active", "Capture sessions running now", registry=r)
        self.samples = Counter(
            "bistouri_samples_total", "Stack samples aggregated into sessions, by kind", ["kind"], registry=r
        )
        self.samples_unmatched = Counter(
            "bistouri_samples_unmatched_total", "Samples of a process with no running session", registry=r
        )
        self.user_frames = Counter(
            "bistouri_user_frames_total",
            "User frames by class (resolved, vdso, jit; unmapped by reason: jit_unnamed, no_mapping, "
            "process_gone, no_access, corrupted)",
            ["kind"],
            registry=r,
        )
        self.traces_dropped = Counter(
            "bistouri_traces_dropped_total", "Distinct stacks dropped because a session was full", registry=r
        )
        self.ringbuf_queue_dropped = Counter(
            "bistouri_ringbuf_queue_dropped_total",
            "Events dropped because the queue between the ring-buffer thread and the main loop was full",
            registry=r,
        )
        self.exec_events = Counter(
            "bistouri_exec_events_total", "Exec events from the BPF comm trie", registry=r
        )
        self.stale_events = Counter(
            "bistouri_stale_events_total",
            "Exec events whose rule no longer matches (reload race)",
            registry=r,
        )
        self.processes = Gauge("bistouri_processes_matched", "Processes matching a target now", registry=r)
        self.config_reloads = Counter(
            "bistouri_config_reloads_total", "Successful config reloads", registry=r
        )
        self.config_reload_failures = Counter(
            "bistouri_config_reload_failures_total",
            "Rejected config reloads (the old config stays)",
            registry=r,
        )
        self.proc_walk_duration = Histogram(
            "bistouri_proc_walk_duration_seconds",
            "Duration of the periodic /proc walk",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.session_samples = Histogram(
            "bistouri_session_samples",
            "Samples per finished session",
            buckets=(1, 10, 50, 100, 500, 1000, 5000, 20000),
            registry=r,
        )


class BpfCountersCollector(Collector):
    """Reads the BPF `counters` map at scrape time."""

    def __init__(
        self,
        read: Callable[[], dict[abi.Counter, int]],
        caches: Callable[[], tuple[ProcMapsStats, int]],
        unwind: Callable[[], UnwindStats] = UnwindStats,
    ) -> None:
        self._read = read
        self._caches = caches  # the profiler's address maps and its orphaned samples
        self._unwind = unwind  # its unwind tables

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        try:
            c = self._read()
        except Exception as e:  # the object may be closing: report nothing rather than fail the scrape
            log.debug("BPF counters unavailable: %s", e)
            return
        lost = CounterMetricFamily(
            "bistouri_ringbuf_dropped",
            "Events the BPF programs could not submit (ring buffer full)",
            labels=["ring"],
        )
        lost.add_metric(["stack"], c[abi.Counter.STACK_RESERVE_FAILED])
        lost.add_metric(["exec"], c[abi.Counter.EXEC_RESERVE_FAILED])
        yield lost
        errs = CounterMetricFamily(
            "bistouri_stack_fetch_errors", "bpf_get_stack failures, by address space", labels=["space"]
        )
        errs.add_metric(["kernel"], c[abi.Counter.KERNEL_STACK_ERROR])
        errs.add_metric(["user"], c[abi.Counter.USER_STACK_ERROR])
        yield errs
        off = CounterMetricFamily(
            "bistouri_offcpu_skipped", "Off-CPU waits not captured, by reason", labels=["reason"]
        )
        off.add_metric(["rate_limited"], c[abi.Counter.OFFCPU_RATE_LIMITED])
        off.add_metric(["too_short"], c[abi.Counter.OFFCPU_TOO_SHORT])
        off.add_metric(["pending_full"], c[abi.Counter.OFFCPU_PENDING_FULL])
        yield off
        emitted = CounterMetricFamily(
            "bistouri_bpf_events", "Events emitted by the BPF programs, by kind", labels=["kind"]
        )
        emitted.add_metric(["on_cpu"], c[abi.Counter.ON_CPU_SAMPLES])
        emitted.add_metric(["off_cpu"], c[abi.Counter.OFF_CPU_SAMPLES])
        emitted.add_metric(["exec"], c[abi.Counter.EXEC_MATCHES])
        emitted.add_metric(["map_change"], c[abi.Counter.MAP_CHANGES])
        yield emitted
        frames = CounterMetricFamily(
            "bistouri_user_frames_unwound",
            "User frames walked in BPF, by how: an .eh_frame table or the frame pointer",
            labels=["unwound_by"],
        )
        frames.add_metric(["table"], c[abi.Counter.FRAMES_BY_TABLE])
        frames.add_metric(["frame_pointer"], c[abi.Counter.FRAMES_BY_FP])
        yield frames
        stops = CounterMetricFamily(
            "bistouri_user_walks_stopped", "User stack walks in BPF, by why they ended", labels=["reason"]
        )
        stops.add_metric(["entry"], c[abi.Counter.WALK_END])
        stops.add_metric(["no_frame_pointer"], c[abi.Counter.WALK_NO_FP])
        stops.add_metric(["read_failed"], c[abi.Counter.WALK_READ_FAILED])
        stops.add_metric(["max_depth"], c[abi.Counter.WALK_DEPTH])
        stops.add_metric(["bad_frame"], c[abi.Counter.WALK_BAD_FRAME])
        yield stops
        u = self._unwind()
        yield GaugeMetricFamily(
            "bistouri_unwind_rows",
            "Rows of unwind tables loaded in the BPF array (12 bytes each)",
            value=u.loaded_rows,
        )
        built = CounterMetricFamily(
            "bistouri_unwind_tables", "Unwind tables obtained, by source (or failed)", labels=["source"]
        )
        built.add_metric(["built"], u.built)
        built.add_metric(["disk_cache"], u.cache_hits)
        built.add_metric(["failed"], u.failed)
        yield built
        yield CounterMetricFamily(
            "bistouri_unwind_build_cpu_seconds", "CPU time spent building unwind tables", value=u.build_cpu_s
        )
        yield CounterMetricFamily(
            "bistouri_unwind_tables_evicted",
            "Files whose unwind rows were evicted from BPF for room (frame pointers for them meanwhile)",
            value=u.evicted,
        )
        maps, orphaned = self._caches()
        yield GaugeMetricFamily(
            "bistouri_proc_maps_tables", "Processes whose address maps the agent holds", value=maps.tables
        )
        yield GaugeMetricFamily(
            "bistouri_proc_maps_bytes",
            "Estimated bytes of the address maps and perf maps held",
            value=maps.bytes,
        )
        reads = CounterMetricFamily(
            "bistouri_proc_maps_reads", "Reads of /proc/PID/maps and perf maps, by file", labels=["file"]
        )
        reads.add_metric(["maps"], maps.reads)
        reads.add_metric(["perf_map"], maps.perf_map_reads)
        yield reads
        yield CounterMetricFamily(
            "bistouri_proc_maps_evicted",
            "Address maps dropped to stay within the byte bound (late samples of them map as unmapped)",
            value=maps.evicted,
        )
        yield CounterMetricFamily(
            "bistouri_proc_maps_files_over_bound",
            "Mappings of files past the bound of distinct files (65 536): their frames keep only an offset",
            value=maps.files_over_bound,
        )
        yield CounterMetricFamily(
            "bistouri_perf_maps_truncated",
            "Perf maps that reached their byte bound: JIT code generated after that stays unnamed",
            value=maps.perf_map_truncated,
        )
        yield CounterMetricFamily(
            "bistouri_samples_orphaned",
            "On-CPU samples counted in the kernel whose stack never reached the agent (dropped)",
            value=orphaned,
        )

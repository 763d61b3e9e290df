"""Prometheus metrics of the agent (port 9464) and the server that exposes them.

docs/metrics.csv is the catalogue. Labels are resource/kind/reason-class only:
never pid or comm (unbounded). BPF-side counters are read from the `counters`
map at scrape time.
"""

from __future__ import annotations

import gzip
import ipaddress
import json
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

try:
    from prometheus_client.registry import Collector
except ImportError:  # prometheus_client < 0.14 (Debian 11's 0.9): any object with collect() is one
    Collector = object  # type: ignore[misc,assignment]

from .. import compat
from ..bpf import abi
from ..capture.metrics import CaptureMetrics
from ..capture.rawstacks import RawStacks
from ..compat import SLOTS
from ..cpython.discover import REASONS
from ..cpython.processes import PythonStats
from ..host import jvm, safeopen
from ..host.procmaps import ProcMapsStats
from ..unwind.ehframe import BOUND_REASONS
from ..unwind.tables import UnwindStats

log = logging.getLogger(__name__)


class AgentMetrics(CaptureMetrics):
    """The agent's metrics: the capture layer's (capture/metrics.py) and the daemon's own."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        super().__init__(registry)
        r = registry
        # Build info, Prometheus' way: 1, with what a fleet view groups by in labels.
        self.info = Gauge(
            "bistouri_agent_info",
            "The agent's version, kernel release and sampling frequency (always 1)",
            ["version", "kernel_release", "frequency_hz"],
            registry=r,
        )
        self.episode_dropped = Counter(
            "bistouri_episode_dropped_total",
            "Episode report rows left out: cgroups_scan_limit, victims, aggressors",
            ["reason"],
            registry=r,
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
        self.exec_gone = Counter(
            "bistouri_exec_events_gone_total",
            "Exec events whose process had exited (or left its cgroup's view) before it could be matched",
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
        self.scrape_connections_dropped = Counter(
            "bistouri_metrics_connections_dropped_total",
            "Connections to the metrics port closed unanswered, by reason (timeout, overflow, too_large)",
            ["reason"],
            registry=r,
        )


class BpfCountersCollector(Collector):
    """Reads the BPF `counters` map at scrape time."""

    def __init__(
        self,
        read: Callable[[], dict[abi.Counter, int]],
        caches: Callable[[], tuple[ProcMapsStats, int]],
        unwind: Callable[[], UnwindStats] = UnwindStats,
        python: Callable[[], PythonStats] = PythonStats,
        raw: Callable[[], RawStacks] = RawStacks,
    ) -> None:
        self._read = read
        self._caches = caches  # the profiler's address maps and its orphaned samples
        self._unwind = unwind  # its unwind tables
        self._python = python  # its CPython processes
        self._raw = raw  # the raw stack copies it holds until their tables are in

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
        yield CounterMetricFamily(
            "bistouri_unwind_rule_cache_hits",
            "User frames whose unwind rule (or lack of one) came from the BPF per-CPU rule cache",
            value=c[abi.Counter.RULE_CACHE_HITS],
        )
        stops = CounterMetricFamily(
            "bistouri_user_walks_stopped", "User stack walks in BPF, by why they ended", labels=["reason"]
        )
        for counter, reason in abi.WALK_ENDS.items():
            stops.add_metric([reason], c[abi.Counter(counter)])
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
        built.add_metric(["jvm_jit"], u.jit_tables)  # a JVM's code cache (unwind/hotspot.py)
        yield built
        refused = CounterMetricFamily(
            "bistouri_unwind_tables_refused",
            "Files without an unwind table, by reason: malformed, unreadable, or a bound of the CFI parser",
            labels=["reason"],
        )
        for reason in ("malformed", "unreadable", *BOUND_REASONS):
            refused.add_metric([reason], u.refused.get(reason, 0))
        yield refused
        yield CounterMetricFamily(
            "bistouri_unwind_build_cpu_seconds", "CPU time spent building unwind tables", value=u.build_cpu_s
        )
        yield CounterMetricFamily(
            "bistouri_unwind_tables_evicted",
            "Files whose unwind rows were evicted from BPF for room (frame pointers for them meanwhile)",
            value=u.evicted,
        )
        yield CounterMetricFamily(
            "bistouri_unwind_requests_dropped",
            "Requests to load or prepare a process's unwind tables lost to a full queue (4 096)",
            value=u.requests_dropped,
        )
        yield from self._raw_stacks(c)
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
            "bistouri_perf_maps_stale",
            "Perf maps last written before their process started (an earlier process's, same pid): not read",
            value=maps.perf_map_stale,
        )
        yield CounterMetricFamily(
            "bistouri_proc_maps_mappings_over_bound",
            "Executable mappings past the per-process bound (16 384) in one read of its maps: not kept",
            value=maps.mappings_over_bound,
        )
        refused = CounterMetricFamily(
            "bistouri_files_refused",
            "Files of watched processes not read (perf maps, mapped files, uploads), by reason",
            labels=["reason"],
        )
        for reason in safeopen.REASONS:
            refused.add_metric([reason], safeopen.REFUSED[reason])
        yield refused
        perf_maps = CounterMetricFamily(
            "bistouri_jvm_perf_maps",
            "Perf maps asked of watched processes through HotSpot's attach (jvm.py), by outcome",
            labels=["reason"],
        )
        for reason in jvm.REASONS:
            perf_maps.add_metric([reason], jvm.RESULTS[reason])
        yield perf_maps
        py = self._python()
        yield CounterMetricFamily(
            "bistouri_python_processes_walked",
            "CPython processes made targets whose Python frames the BPF walk reads",
            value=py.walked,
        )
        not_walked = CounterMetricFamily(
            "bistouri_python_processes_not_walked",
            "CPython processes made targets that keep only their native frames, by reason",
            labels=["reason"],
        )
        for reason in REASONS:
            if reason != "not_python":
                not_walked.add_metric([reason], py.not_walked.get(reason, 0))
        yield not_walked
        yield CounterMetricFamily(
            "bistouri_samples_orphaned",
            "On-CPU samples counted in the kernel whose stack never reached the agent (dropped)",
            value=orphaned,
        )

    def _raw_stacks(self, c: dict[abi.Counter, int]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The raw stack copies of samples taken before their process's tables were in: sent, walked
        once the tables came, or left as the BPF walk cut them, by why (ring thread's counts, read
        without its lock: each a single int)."""
        raw = self._raw()
        st = raw.stats
        yield CounterMetricFamily(
            "bistouri_raw_stacks",
            "On-CPU samples sent as raw stack copies: cut short before their process's unwind tables were in",
            value=c[abi.Counter.RAW_STACKS],
        )
        walked = CounterMetricFamily(
            "bistouri_raw_stacks_walked",
            "Raw stack copies walked in user space once their tables were in, by result",
            labels=["result"],
        )
        walked.add_metric(["whole"], st.whole)
        walked.add_metric(["cut_short"], st.walked - st.whole)
        yield walked
        dropped = CounterMetricFamily(
            "bistouri_raw_stacks_dropped",
            "Samples left as the BPF walk cut them instead of walked from a raw copy, by reason",
            labels=["reason"],
        )
        dropped.add_metric(["ring_full"], c[abi.Counter.RAW_STACK_LOST])
        dropped.add_metric(["memory"], st.dropped)
        dropped.add_metric(["tables_late"], st.unwalked)
        yield dropped
        yield GaugeMetricFamily(
            "bistouri_raw_stacks_held_bytes",
            "Bytes of raw stack copies held until their tables are in",
            value=raw.nbytes,
        )
        yield CounterMetricFamily(
            "bistouri_raw_stacks_walk_cpu_seconds",
            "CPU time of the ring thread walking raw stack copies",
            value=st.walk_cpu_s,
        )


# -- the /metrics endpoint


@dataclass(**SLOTS)
class _Conn:
    sock: socket.socket
    deadline: float  # monotonic: the request must be read and the answer sent by then
    inbox: bytearray = field(default_factory=bytearray)
    outbox: memoryview | None = None  # set once the request is read
    loopback: bool = False  # the peer is this host: it may ask for a capture


# Capture now: service id -> (HTTP status, JSON body). Runs on the metrics thread: must not block.
CaptureHandler = Callable[[str], tuple[int, dict[str, Any]]]
CAPTURE_PATH = "/v1/capture"


def _is_loopback(peer: Any) -> bool:
    try:
        ip = ipaddress.ip_address(peer[0])
    except (ValueError, TypeError, IndexError):
        return False  # AF_UNIX and friends are not served here
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class MetricsAndControlServer:
    """Answers scrapes from one thread that sleeps on a selector: nothing runs while idle.

    Every socket is non-blocking, so an idle or slow client holds nobody up (a blocking
    server stalled every scrape behind one idle TCP connection). Each connection gets
    `request_timeout_s` to send a request head of at most MAX_REQUEST_BYTES and take the
    answer; at most `max_connections` are open, the oldest is closed to make room. Every
    connection closed unanswered is counted with its reason.

    With a `capture` handler it also answers `POST /v1/capture?service=<service_id>` (capture
    now), from loopback peers only whatever the listen address: asking for a session is an
    operator's action on the host, not something the network may do.
    """

    MAX_REQUEST_BYTES = 8192
    _DROP_TIMEOUT = "timeout"
    _DROP_OVERFLOW = "overflow"
    _DROP_TOO_LARGE = "too_large"

    def __init__(
        self,
        addr: str,
        port: int,
        registry: CollectorRegistry,
        dropped: Counter,
        *,
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
        capture: CaptureHandler | None = None,
    ) -> None:
        self.registry = registry
        self._capture = capture
        self._dropped = dropped
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._wake = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest

    def stop(self) -> None:
        """Make serve() return (from any thread)."""
        compat.eventfd_write(self._wake, 1)

    def close(self) -> None:
        """Release the sockets once serve() has returned."""
        for c in list(self._conns.values()):
            c.sock.close()
        self._conns.clear()
        self._listener.close()
        os.close(self._wake)

    def serve(self) -> None:
        """Serve until stop(). Blocks in select() with no timeout while no connection is open."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ, "accept")
            sel.register(self._wake, selectors.EVENT_READ, "stop")
            while True:
                timeout = None
                if self._conns:
                    first = min(c.deadline for c in self._conns.values())
                    timeout = max(0.0, first - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.data == "stop":
                        return
                    if key.data == "accept":
                        self._accept(sel)
                    else:
                        self._service(sel, key.data)
                self._expire(sel, time.monotonic())

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: the client waits in the backlog meanwhile
                log.warning("metrics: cannot accept a connection: %s", e.strerror)
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._drop(sel, next(iter(self._conns.values())), self._DROP_OVERFLOW)
            conn = _Conn(sock, time.monotonic() + self.request_timeout_s, loopback=_is_loopback(peer))
            self._conns[sock] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _service(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            if conn.outbox is None:
                data = conn.sock.recv(4096)
                if not data:
                    self._close(sel, conn)
                    return
                conn.inbox += data
                end = conn.inbox.find(b"\r\n\r\n")
                if end < 0:
                    if len(conn.inbox) > self.MAX_REQUEST_BYTES:
                        self._drop(sel, conn, self._DROP_TOO_LARGE)
                    return
                try:
                    answer = self._answer(bytes(conn.inbox[:end]), conn.loopback)
                except Exception:  # a failing collector must not end the endpoint
                    log.exception("metrics: cannot build the answer")
                    answer = _http(500, [], b"cannot collect the metrics\n")
                conn.outbox = memoryview(answer)
                sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            sent = conn.sock.send(conn.outbox)
            conn.outbox = conn.outbox[sent:]
            if not conn.outbox:
                self._close(sel, conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the peer
            self._close(sel, conn)

    def _answer(self, head: bytes, loopback: bool = False) -> bytes:
        """The whole HTTP/1.0-style answer (the connection closes after it)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) == 3 and parts[0] == "POST" and urlsplit(parts[1]).path == CAPTURE_PATH:
            return self._answer_capture(parts[1], loopback)
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            return _http(405, [("Allow", "GET, HEAD")], b"only GET and HEAD\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        registry: CollectorRegistry = self.registry
        names = parse_qs(urlsplit(parts[1]).query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)  # type: ignore[assignment]
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(registry)
        extra = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            extra.append(("Content-Encoding", "gzip"))
        return _http(200, extra, body, head_only=parts[0] == "HEAD")

    def _answer_capture(self, target: str, loopback: bool) -> bytes:
        if self._capture is None:
            return _json(404, {"error": "capture now is not enabled on this endpoint"})
        if not loopback:
            return _json(403, {"error": "capture now is only accepted from this host (loopback)"})
        services = parse_qs(urlsplit(target).query).get("service", [])
        if len(services) != 1 or not services[0]:
            return _json(400, {"error": "give the target as ?service=<service_id> (once)"})
        status, body = self._capture(services[0])
        return _json(status, body)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(sel, conn, self._DROP_TIMEOUT)

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn, reason: str) -> None:
        self._dropped.labels(reason).inc()
        self._close(sel, conn)

    def _close(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        sel.unregister(conn.sock)
        del self._conns[conn.sock]
        conn.sock.close()


_REASONS = {
    200: "OK",
    202: "Accepted",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
    500: "Internal Server Error",
}


def _json(status: int, body: dict[str, Any]) -> bytes:
    return _http(status, [("Content-Type", "application/json")], json.dumps(body).encode() + b"\n")


def _http(status: int, headers: list[tuple[str, str]], body: bytes, head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


@dataclass(frozen=True)
class CounterFamily:
    """One counter family read from a BPF counters map: a label value per map index."""

    name: str
    doc: str
    label: str
    rows: tuple[tuple[str, int], ...]  # (label value, map index)


class MapCountersCollector(Collector):
    """Reads a BPF counters map (`read`: index -> count) at scrape time into `families`."""

    def __init__(
        self, what: str, read: Callable[[], dict[Any, int]], families: tuple[CounterFamily, ...]
    ) -> None:
        self._what = what
        self._read = read
        self._families = families

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            c = self._read()
        except Exception as e:  # the object may be closing: report nothing rather than fail the scrape
            log.debug("BPF %s counters unavailable: %s", self._what, e)
            return
        for f in self._families:
            family = CounterMetricFamily(f.name, f.doc, labels=[f.label])
            for value, index in f.rows:
                family.add_metric([value], c[index])
            yield family


RECORDER_COUNTER_FAMILIES = (
    CounterFamily(
        "bistouri_recorder_kernel_waits",
        "Waits of processes only the flight recorder watches, counted in the kernel instead of "
        "sent (kept), entries created for them (created), waits the full map refused (refused)",
        "outcome",
        (
            ("kept", abi.RecorderCounter.KEPT),
            ("created", abi.RecorderCounter.ENTRIES),
            ("refused", abi.RecorderCounter.REFUSED),
        ),
    ),
)

EPISODE_COUNTER_FAMILIES = (
    CounterFamily(
        "bistouri_episode_hook_events",
        "Transitions of watched threads the episode hooks timed",
        "kind",
        (
            ("switch", abi.EpisodeCounter.SWITCHES),
            ("wakeup", abi.EpisodeCounter.WAKEUPS),
            ("reclaim", abi.EpisodeCounter.RECLAIMS),
            ("runqueue_stack", abi.EpisodeCounter.RUNQUEUE_STACKS),
            ("stack_reused", abi.EpisodeCounter.STACKS_REUSED),
        ),
    ),
    CounterFamily(
        "bistouri_episode_hook_dropped",
        "What the episode hooks did not record, by reason",
        "reason",
        (
            ("threads_full", abi.EpisodeCounter.THREADS_FULL),
            ("stack_rate_limited", abi.EpisodeCounter.STACKS_LIMITED),
        ),
    ),
)

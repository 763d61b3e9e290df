"""The agent daemon: phases, the main loop, signals, threads.

Start-up runs in phases — preflight, prepare (targets file, spool, PSI loop),
load (BPF), activate (tries filled, walk started) — and stops at the first one
that cannot complete, saying why. The main thread runs one `select.poll` loop
over PSI watch fds, the signal wakeup fd, the inotify fd and two eventfds
(ring-buffer events, walk results). Other threads: bistouri-ringbuf,
bistouri-walk, bistouri-exporter, bistouri-metrics. A capture-now request
(POST /v1/capture on the metrics port, loopback only) is queued by the metrics
thread and started by the main loop.
"""

from __future__ import annotations

import gzip
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from .. import __version__, compat, threads
from ..bpf import abi
from ..capture.episode import EpisodeProbe
from ..capture.events import BpfErrorEvent, Event, ExecMatch, StackSample
from ..capture.profiler import Profiler, ProfilerOptions
from ..capture.rawstacks import RawStacks
from ..capture.sessions import FILTER_FLAGS, SessionCapture
from ..cpython.processes import PythonStats
from ..errors import BistouriError, ConfigError
from ..host.cgroupfs import find_mounts
from ..host.kernel import KernelMeta, read_kallsyms, read_kernel_meta
from ..host.procmaps import ProcMapsStats
from ..host.psi import PsiLoop
from ..unwind.tables import UnwindStats
from ..wire.snapshot import loaded_code_digest
from . import preflight
from .config import TargetsConfig, load_targets_config
from .confwatch import ConfigWatcher
from .discovery import Walker
from .metrics import (
    EPISODE_COUNTER_FAMILIES,
    RECORDER_COUNTER_FAMILIES,
    AgentMetrics,
    BpfCountersCollector,
    MapCountersCollector,
    MetricsAndControlServer,
)
from .settings import AgentSettings
from .spool import Spool
from .watcher import Watcher

if TYPE_CHECKING:
    from .exporter import Exporter

log = logging.getLogger(__name__)

# What must hold for the agent to start; the rest of `bistouri check` only warns.
_BLOCKING_CHECKS = (
    preflight.check_kernel,
    preflight.check_btf,
    preflight.check_libbpf,
    preflight.check_kernel_features,  # warnings only: what an older kernel costs, logged
    preflight.check_psi,
    preflight.check_capabilities,
)

# The main loop's longest sleep. Everything else wakes it through its fds or a deadline (sessions'
# ends, the flight recorder's samples aging out once none arrive); the ring thread wakes it for the
# recorder's samples a few times a minute (Profiler._announce). Each wake-up polls every PSI fd (two
# per watched cgroup): a dormant agent sleeps long.
_IDLE_WAKEUP_S = 60.0

# The raw stack copies' ring (kernel memory, held while the agent runs): at the agent's 19 Hz a copy
# is at most 19.6 KiB (the event and 16 KiB of stack), the ring thread is woken once a quarter is
# queued (~6 copies), and the rest holds ~19 more: a second of one busy CPU's copies, 0.25 s of four
# (docs/benchmarks.md, "The agent's sessions whole from their first second").
_RAW_RING_BYTES = 512 << 10
# A copy is at least its event (3.2 KiB): one copy held per 4 KiB of --raw-stacks-max-bytes at most,
# the ratio of `record`'s bounds (8 192 copies, 32 MiB).
_RAW_COPY_MIN_BYTES = 4096


def profiler_options(s: AgentSettings) -> ProfilerOptions:
    """The agent's profiler: sampling as set, tables built at its CPU share into its disk cache, raw
    stack copies of its sessions' processes held until their tables are in (unless turned off)."""
    return ProfilerOptions(
        freq_hz=s.freq,
        offcpu=s.offcpu,
        proc_root=s.proc_path,
        # Beside the spool, in the agent's state directory (/var/lib/bistouri/unwind).
        unwind_cache_dir=os.path.join(os.path.dirname(s.spool_dir.rstrip("/")), "unwind"),
        raw_stacks=s.raw_stacks_max_bytes > 0,
        raw_ring_bytes=_RAW_RING_BYTES,
        raw_held_bytes=s.raw_stacks_max_bytes,
        raw_held_records=max(1, s.raw_stacks_max_bytes // _RAW_COPY_MIN_BYTES),
    )


def session_flags(s: AgentSettings) -> int:
    """What the agent's sessions sample their processes for: raw stack copies too, unless off."""
    return FILTER_FLAGS | (abi.FilterFlags.RAW_STACK if s.raw_stacks_max_bytes > 0 else 0)


class NoExporter:
    """No symbolizer endpoint: sessions stay in the spool, nothing is sent (and `requests` is
    not imported)."""

    def notify(self) -> None:
        pass

    def flush(self, deadline: float) -> bool:
        return False

    def stop(self, timeout: float = 5.0) -> bool:
        return True


class StartupError(BistouriError):
    def __init__(self, phase: str, what: str) -> None:
        super().__init__(f"start-up failed in phase '{phase}': {what}")


class Agent:
    def __init__(self, settings: AgentSettings, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.s = settings
        self.registry = registry
        self.metrics = AgentMetrics(registry)
        self.stop_requested = False
        self.reload_requested = False
        self.config: TargetsConfig | None = None
        self.kernel: KernelMeta | None = None
        self.profiler: Profiler | None = None
        self.exporter: Exporter | NoExporter = NoExporter()
        # Set by the phases; None until then (and close() copes with any of them missing).
        self.spool: Spool | None = None
        self.loop: PsiLoop | None = None
        self.confwatch: ConfigWatcher | None = None
        self.capture: SessionCapture | None = None
        self.watcher: Watcher | None = None
        self.walker: Walker | None = None
        # Capture-now requests (service id, session id) from the metrics thread to the main loop.
        self._capture_requests: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=16)
        self._event_fd = -1
        self._held_events: list[Event] = []  # drained by _catch_up(), handled by the next _on_bpf_events()
        self._walk_fd = -1
        self._sig_r = self._sig_w = -1
        self._metrics_server: MetricsAndControlServer | None = None
        self._metrics_thread: threading.Thread | None = None
        self._bpf_error_log_at = 0.0

    # -- phases ---------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._preflight()
            self._prepare()
            self._load()
            self._activate()
        except BaseException:
            self.close()
            raise

    def _preflight(self) -> None:
        host = preflight.Host(proc=self.s.proc_path)
        fails = []
        for check in _BLOCKING_CHECKS:
            r = check(host)
            for res in r if isinstance(r, list) else [r]:
                if res.status == preflight.FAIL:
                    fails.append(f"{res.name}: {res.detail}" + (f" ({res.fix})" if res.fix else ""))
                elif res.status == preflight.WARN:
                    log.warning("Preflight: %s: %s", res.name, res.detail)
        if fails:
            raise StartupError("preflight", "; ".join(fails) + ". Run `bistouri check` for details")
        self.kernel = read_kernel_meta(proc_root=self.s.proc_path)
        self.metrics.info.labels(__version__, self.kernel.release, str(self.s.freq)).set(1)
        if not self.kernel.text_addr:
            log.warning(
                "Kernel addresses are hidden (kptr_restrict or no CAP_SYSLOG): kernel frames stay unnamed"
            )

    def _prepare(self) -> None:
        for w in self.s.warnings:
            log.warning("%s", w)
        try:
            self.config = load_targets_config(self.s.config_path)
        except ConfigError as e:
            raise StartupError("prepare", str(e))
        except OSError as e:
            raise StartupError(
                "prepare",
                f"cannot read the targets file {self.s.config_path}: {e.strerror}. "
                "Pass --config or create it (see docs/configuration.md)",
            )
        assert self.kernel is not None
        self.spool = Spool(
            self.s.spool_dir,
            self.s.spool_max_bytes,
            registry=self.registry,
            kernel_build_id=self.kernel.build_id,
        )
        self.loop = PsiLoop(registry=self.registry)
        self._event_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
        self._walk_fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
        self.loop.add_fd(self._event_fd, lambda fd, ev: self._on_bpf_events())
        self.loop.add_fd(self._walk_fd, lambda fd, ev: self._on_walk_results())
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.loop.add_fd(self._sig_r, lambda fd, ev: self._drain_fd(fd))
        try:
            self.confwatch = ConfigWatcher(self.s.config_path)
            self.loop.add_fd(
                self.confwatch.fileno(),
                lambda fd, ev: self.confwatch.read_events(time.monotonic()) if self.confwatch else None,
            )
        except OSError as e:
            log.warning("Config changes will not be noticed (SIGHUP still reloads): %s", e)
            self.confwatch = None
        if self.s.metrics_port:
            self._start_metrics()
        log.info(
            "Agent %s preparing. config=%s targets=%d tenant=%s freq=%dHz capture=%.1fs spool=%s endpoint=%s",
            __version__,
            self.s.config_path,
            len(self.config.targets),
            self.s.tenant_id,
            self.s.freq,
            self.s.capture_duration_secs,
            self.s.spool_dir,
            self.s.symbolizer_endpoint or "(none: spool only)",
        )

    def _start_metrics(self) -> None:
        try:
            server = MetricsAndControlServer(
                self.s.metrics_addr,
                self.s.metrics_port,
                self.registry or REGISTRY,
                self.metrics.scrape_connections_dropped,
                capture=self.request_capture,
            )
        except OSError as e:
            raise StartupError(
                "prepare",
                f"cannot listen for metrics on {self.s.metrics_addr}:{self.s.metrics_port}: "
                f"{e.strerror}. Choose another --metrics-port, or 0 to disable",
            )
        self._metrics_server = server
        self._metrics_thread = threads.start("metrics", server.serve)

    def _load(self) -> None:
        assert self.kernel is not None
        self.profiler = Profiler(
            profiler_options(self.s), notify=lambda: compat.eventfd_write(self._event_fd, 1)
        )
        try:
            self.profiler.open()
        except BistouriError as e:
            raise StartupError("load", str(e))
        if self.registry is not None:
            self.registry.register(
                BpfCountersCollector(
                    self.profiler.counters,
                    self._cache_stats,
                    self._unwind_stats,
                    self._python_stats,
                    self._raw_stacks,
                )
            )
            self.registry.register(
                MapCountersCollector("episode", self.profiler.episode_counters, EPISODE_COUNTER_FAMILIES)
            )
            self.registry.register(
                MapCountersCollector("recorder", self.profiler.recorder_counters, RECORDER_COUNTER_FAMILIES)
            )

    def _unwind_stats(self) -> UnwindStats:
        return self.profiler.unwind.stats if self.profiler is not None else UnwindStats()

    def _raw_stacks(self) -> RawStacks:
        return self.profiler.raw if self.profiler is not None else RawStacks()

    def _python_stats(self) -> PythonStats:
        return self.profiler.python.stats if self.profiler is not None else PythonStats()

    def _cache_stats(self) -> tuple[ProcMapsStats, int]:
        if self.profiler is None:
            return ProcMapsStats(), 0
        return self.profiler.maps.stats, self.profiler.orphaned

    def _activate(self) -> None:
        assert self.profiler is not None and self.config is not None and self.kernel is not None
        assert self.spool is not None and self.loop is not None
        self.exporter = self._make_exporter()
        self.capture = SessionCapture(
            self.profiler,
            self.spool,
            self.metrics,
            self.kernel,
            tenant=self.s.tenant_id,
            host=socket.gethostname(),
            labels=dict(self.s.labels),
            period_ns=self.s.period_ns,
            filter_flags=session_flags(self.s),
            proc_root=self.s.proc_path,
            on_spooled=self._notify_exporter,
            catch_up=self._catch_up,
            on_start=self.profiler.request_perf_maps,
            recorded_waits=self.profiler.recorded_waits,
            degraded=self.profiler.kernel_features.names,
            max_bytes=self.s.capture_max_bytes,
            recorder_max_bytes=self.s.recorder_max_bytes,
            episode=EpisodeProbe(
                self.profiler.thread_times,
                self.s.cgroup_path,
                on_dropped=lambda reason, n: self.metrics.episode_dropped.labels(reason).inc(n),
                mounts=find_mounts(self.s.proc_path),
            ),
        )
        self.watcher = Watcher(
            self.loop,
            self.capture,
            self.profiler.set_comm_rules,
            self.metrics,
            proc_root=self.s.proc_path,
            cgroup_root=self.s.cgroup_path,
            default_capture_s=self.s.capture_duration_secs,
        )
        self.watcher.apply_config(self.config)
        self.profiler.start()
        self.walker = Walker(
            self.s.walk_interval_secs,
            self.s.proc_path,
            lambda: compat.eventfd_write(self._walk_fd, 1),
        )
        self.walker.start()
        self.walker.request(self.watcher.walk_job())
        log.info("Agent active: dormant until PSI fires. PSI watches appear as processes are found")

    def _make_exporter(self) -> Exporter | NoExporter:
        if not self.s.symbolizer_endpoint:
            return NoExporter()
        from .exporter import Exporter

        kernel = self.kernel

        def kallsyms(build_id: bytes) -> bytes | None:
            if kernel is None or build_id != kernel.build_id:
                return None
            return gzip.compress(read_kallsyms(self.s.proc_path), 6)

        assert self.spool is not None
        # Files the symbolizer asks for are read where the sampled processes mapped them.
        locate = self.profiler.maps.locate if self.profiler is not None else None
        exp = Exporter(
            self.spool,
            self.s,
            registry=self.registry,
            kallsyms_provider=kallsyms,
            file_locator=locate,
            kernel_boot=kernel.boot_id if kernel is not None else b"",
            loaded_code_digest=lambda: loaded_code_digest(read_kallsyms(self.s.proc_path)),
        )
        exp.start()
        return exp

    def _notify_exporter(self) -> None:
        self.exporter.notify()

    # -- main loop ------------------------------------------------------------------
    def request_stop(self) -> None:
        self.stop_requested = True
        if self._sig_w >= 0:
            try:
                os.write(self._sig_w, b"s")
            except OSError:
                pass

    def request_reload(self) -> None:
        self.reload_requested = True
        if self._sig_w >= 0:
            try:
                os.write(self._sig_w, b"h")
            except OSError:
                pass

    def request_capture(self, service_id: str) -> tuple[int, dict[str, Any]]:
        """Capture now (called on the metrics thread): queue a manual session of a target.

        Answers (HTTP status, JSON body). The session id is chosen here so the caller can
        look the session up; the main loop starts it with the target's live processes.
        """
        config = self.config  # replaced whole on reload: reading the reference is safe
        if config is None or config.by_service(service_id) is None:
            known = ", ".join(t.service_id for t in config.targets) if config else ""
            return 404, {"error": f"no target with service_id {service_id!r}", "known": known}
        session_id = str(uuid.uuid4())
        try:
            self._capture_requests.put_nowait((service_id, session_id))
        except queue.Full:
            return 429, {"error": "too many capture requests waiting: try again in a second"}
        if self._sig_w >= 0:
            try:
                os.write(self._sig_w, b"c")
            except OSError:
                pass
        return 202, {"session_id": session_id, "service_id": service_id}

    def _run_capture_requests(self) -> None:
        assert self.watcher is not None
        while True:
            try:
                service_id, session_id = self._capture_requests.get_nowait()
            except queue.Empty:
                return
            if self.watcher.capture_now(service_id, session_id) is None:
                log.warning(
                    "Capture now not started: no live process of the target. service=%s session=%s",
                    service_id,
                    session_id,
                )

    @staticmethod
    def _drain_fd(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass

    def run(self) -> None:
        """The main loop, until SIGTERM/SIGINT."""
        assert self.loop is not None and self.capture is not None and self.watcher is not None
        while not self.stop_requested:
            now = time.monotonic()
            deadlines = [now + _IDLE_WAKEUP_S]
            if (d := self.capture.next_deadline()) is not None:
                deadlines.append(d)
            if (d := self.capture.recorder_deadline()) is not None:
                deadlines.append(d)
            if self.confwatch and (d := self.confwatch.deadline()) is not None:
                deadlines.append(d)
            timeout_ms = max(0, int((min(deadlines) - now) * 1000) + 1)
            for ev in self.loop.poll(timeout_ms):
                self.watcher.on_psi(ev)
            if not self._capture_requests.empty():
                self._run_capture_requests()
            if self.profiler:
                self.profiler.check_thread()
            now = time.monotonic()
            self.capture.tick(now)
            if self.profiler:
                self.profiler.set_slow_drain(not self.capture.sessions)  # the recorder alone: no hurry
            if self.reload_requested:
                self.reload_requested = False
                self.reload("SIGHUP")
            elif self.confwatch and self.confwatch.changed(now):
                self.reload("file changed")

    def _on_bpf_events(self) -> None:
        self._drain_fd(self._event_fd)
        assert self.profiler is not None and self.capture is not None and self.watcher is not None
        events = self._held_events + self.profiler.take()
        self._held_events = []
        self.capture.add_samples(ev for ev in events if type(ev) is StackSample)
        for ev in events:
            if type(ev) is StackSample:
                continue
            if isinstance(ev, ExecMatch):
                self.watcher.on_exec(ev)
            elif isinstance(ev, BpfErrorEvent):
                now = time.monotonic()
                if now - self._bpf_error_log_at > 10:  # counted in metrics; logged at most every 10 s
                    self._bpf_error_log_at = now
                    log.warning("BPF reported a loss. kind=%s pid=%d code=%d", ev.kind.name, ev.pid, ev.code)
        dropped = self.profiler.dropped
        if dropped:
            self.profiler.dropped = 0
            self.metrics.ringbuf_queue_dropped.inc(dropped)

    def _catch_up(self, release: Collection[int]) -> None:
        """Before a session starts: the samples still in the kernel into the flight recorder; before
        sessions end, into them, with the raw stack copies still held of `release` (their processes).
        Other events wait for the main loop (handling an exec here could start a session within this
        one)."""
        assert self.profiler is not None and self.capture is not None
        self.profiler.catch_up(release)
        events = self.profiler.take()
        self.capture.add_samples(ev for ev in events if type(ev) is StackSample)
        others = [ev for ev in events if type(ev) is not StackSample]
        if others:
            self._held_events.extend(others)
            compat.eventfd_write(self._event_fd, 1)

    def _on_walk_results(self) -> None:
        self._drain_fd(self._walk_fd)
        assert self.walker is not None and self.watcher is not None
        while True:
            try:
                result = self.walker.results.get_nowait()
            except queue.Empty:
                return
            self.watcher.on_walk(result)
            if self.profiler is not None:
                # Tables of the watched processes to the disk cache now, before pressure samples them.
                self.profiler.unwind.prepare([(p.pid, p.starttime) for p in result.found])

    def reload(self, why: str) -> bool:
        """Swap in a new targets file; an invalid one keeps the running config."""
        assert self.config is not None and self.watcher is not None and self.walker is not None
        try:
            cfg = load_targets_config(self.s.config_path, first_rule_id=self.config.next_rule_id)
        except (ConfigError, OSError) as e:
            self.metrics.config_reload_failures.inc()
            log.error("Config reload rejected (%s), keeping the running config: %s", why, e)
            if self.confwatch:
                self.confwatch.accept()  # do not retry the same bad content in a loop
            return False
        try:
            self.watcher.apply_config(cfg)
        except BistouriError as e:
            self.metrics.config_reload_failures.inc()
            log.error("Config reload failed while updating BPF maps, keeping the running config: %s", e)
            return False
        self.config = cfg
        if self.confwatch:
            self.confwatch.accept()
        self.metrics.config_reloads.inc()
        log.info("Config reloaded (%s). targets=%d", why, len(cfg.targets))
        self.walker.request(self.watcher.walk_job())
        return True

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the PSI watches, drain the rings, spool open sessions, detach. Bounded in time."""
        t0 = time.monotonic()
        if self.loop is not None:
            self.loop.clear()
        if self.walker is not None:
            self.walker.stop(0.5)
        if self.profiler is not None:
            # Drains what is already in the rings; the maps stay open until the sessions are flushed,
            # so their episodes still read the threads' times.
            self.profiler.stop(timeout=0.5)
            if self.capture is not None and self.watcher is not None:
                self._on_bpf_events()
        if self.capture is not None:
            flushed = self.capture.flush_all()
            if flushed:
                log.info("Open sessions flushed to the spool at shutdown. sessions=%d", len(flushed))
        self.close()
        log.info("Agent stopped in %.2fs", time.monotonic() - t0)

    def close(self) -> None:
        # A short chance to send what was just flushed; the rest stays in the spool for next time.
        self.exporter.flush(time.monotonic() + 0.5)
        self.exporter.stop(timeout=0.3)
        self.exporter = NoExporter()
        if self.profiler is not None:
            self.profiler.stop(timeout=0.5)
            self.profiler = None
        if self.confwatch is not None:
            self.confwatch.close()
            self.confwatch = None
        for fd in (self._event_fd, self._walk_fd, self._sig_r, self._sig_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._event_fd = self._walk_fd = self._sig_r = self._sig_w = -1
        if self._metrics_server is not None:
            self._metrics_server.stop()
            if self._metrics_thread is not None:
                self._metrics_thread.join(2.0)
            self._metrics_server.close()
            self._metrics_server = self._metrics_thread = None


def run_agent(settings: AgentSettings) -> int:
    agent = Agent(settings)
    # Handlers only set flags and write to the wakeup pipe: PEP 475 retries poll()
    # after a handler that does not raise, so the pipe is what wakes the loop.
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: agent.request_reload())
    try:
        agent.start()
    except StartupError as e:
        log.error("%s", e)
        return 2
    try:
        agent.run()
    finally:
        agent.shutdown()
    return 0

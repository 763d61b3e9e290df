"""The agent daemon: phases, the main loop, signals, threads.

Start-up runs in phases — preflight, prepare (config, spool, watchers),
load (BPF), activate (tries filled, walk started) — and stops at the first one
that cannot complete, saying why. The main thread runs one `select.poll` loop
over PSI trigger fds, the signal wakeup fd, the inotify fd and two eventfds
(ring-buffer events, walk results). Other threads: bistouri-ringbuf,
bistouri-walk, bistouri-exporter, bistouri-metrics.
"""

from __future__ import annotations

import gzip
import logging
import os
import queue
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from . import __version__, preflight, threads
from .capture import CaptureOrchestrator
from .config import TriggerConfig, load_trigger_config
from .confwatch import ConfigWatcher
from .errors import BistouriError, ConfigError
from .events import BpfErrorEvent, ExecMatch, StackSample
from .kernel import KernelMeta, read_kallsyms, read_kernel_meta
from .metrics import AgentMetrics, BpfCountersCollector
from .procmaps import ProcMapsStats
from .profiler import ProfilerAgent, ProfilerOptions
from .psi import PsiLoop
from .settings import AgentSettings
from .spool import Spool
from .trigger import TriggerAgent, WalkResult, walk_processes
from .unwind import UnwindStats

log = logging.getLogger(__name__)

# What must hold for the agent to start; the rest of `bistouri check` only warns.
_BLOCKING_CHECKS = (
    preflight.check_kernel,
    preflight.check_btf,
    preflight.check_libbpf,
    preflight.check_psi,
    preflight.check_capabilities,
)


class StartupError(BistouriError):
    def __init__(self, phase: str, what: str) -> None:
        super().__init__(f"start-up failed in phase '{phase}': {what}")


def _serve_until_woken(server: WSGIServer, wake_fd: int) -> None:
    """Serve scrapes until `wake_fd` is written. Unlike serve_forever() (which wakes every
    0.5 s to check for shutdown: 0.02 % of a core, the largest idle cost), this sleeps
    until a scrape or the shutdown arrives."""
    with selectors.DefaultSelector() as sel:
        sel.register(server.fileno(), selectors.EVENT_READ, "scrape")
        sel.register(wake_fd, selectors.EVENT_READ, "stop")
        while True:
            for key, _ in sel.select():
                if key.data == "stop":
                    return
                server.handle_request()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class Walker:
    """The periodic /proc walk on its own thread; results go to a queue and wake the main loop."""

    def __init__(
        self,
        interval_s: float,
        proc_root: str,
        wake: Callable[[], None],
    ) -> None:
        self.interval_s = interval_s
        self.proc_root = proc_root
        self._wake = wake
        self.results: queue.Queue[WalkResult] = queue.Queue(maxsize=4)
        self._now = threading.Event()
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self._job: tuple | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threads.start("walk", self._run)

    def request(self, matcher: object, generation: int) -> None:
        """Walk now with this matcher; an in-flight walk of an older config is cancelled."""
        with self._lock:
            self._job = (matcher, generation)
        self._cancel.set()
        self._now.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._now.wait(self.interval_s)
            self._now.clear()
            if self._stop.is_set():
                return
            with self._lock:
                job = self._job
                self._cancel.clear()
            if job is None:
                continue
            try:
                result = walk_processes(job[0], self.proc_root, job[1], self._cancel)
            except Exception as e:  # a broken walk must not kill discovery for good
                log.error("Process walk failed: %s", e)
                continue
            if self._cancel.is_set():
                continue
            try:
                self.results.put_nowait(result)
            except queue.Full:
                pass
            self._wake()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._cancel.set()
        self._now.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)


class Agent:
    def __init__(self, settings: AgentSettings, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.s = settings
        self.registry = registry
        self.metrics = AgentMetrics(registry)
        self.stop_requested = False
        self.reload_requested = False
        self.config: TriggerConfig | None = None
        self.kernel: KernelMeta | None = None
        self.profiler: ProfilerAgent | None = None
        self.exporter: object | None = None
        self._closers: list[Callable[[], None]] = []
        self._event_fd = -1
        self._walk_fd = -1
        self._sig_r = self._sig_w = -1
        self._metrics_server: WSGIServer | None = None
        self._metrics_thread: threading.Thread | None = None
        self._metrics_wake = -1
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
        if not self.kernel.text_addr:
            log.warning(
                "Kernel addresses are hidden (kptr_restrict or no CAP_SYSLOG): kernel frames stay unnamed"
            )

    def _prepare(self) -> None:
        for w in self.s.warnings:
            log.warning("%s", w)
        try:
            self.config = load_trigger_config(self.s.config_path)
        except ConfigError as e:
            raise StartupError("prepare", str(e))
        except OSError as e:
            raise StartupError(
                "prepare",
                f"cannot read the trigger file {self.s.config_path}: {e.strerror}. "
                "Pass --config or create it (see docs/configuration.md)",
            )
        self.spool = Spool(self.s.spool_dir, self.s.spool_max_bytes, registry=self.registry)
        self.loop = PsiLoop(registry=self.registry)
        self._event_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._walk_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.loop.add_fd(self._event_fd, lambda fd, ev: self._on_bpf_events())
        self.loop.add_fd(self._walk_fd, lambda fd, ev: self._on_walk_results())
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.loop.add_fd(self._sig_r, lambda fd, ev: self._drain_fd(fd))
        try:
            self.confwatch: ConfigWatcher | None = ConfigWatcher(self.s.config_path)
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
        app = make_wsgi_app(self.registry or REGISTRY)
        try:
            server = make_server(self.s.metrics_addr, self.s.metrics_port, app, handler_class=_QuietHandler)
        except OSError as e:
            raise StartupError(
                "prepare",
                f"cannot listen for metrics on {self.s.metrics_addr}:{self.s.metrics_port}: "
                f"{e.strerror}. Choose another --metrics-port, or 0 to disable",
            )
        self._metrics_server = server
        wake = self._metrics_wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._metrics_thread = threads.start("metrics", lambda: _serve_until_woken(server, wake))

    def _load(self) -> None:
        assert self.kernel is not None
        opts = ProfilerOptions(
            freq_hz=self.s.freq,
            offcpu=self.s.offcpu,
            proc_root=self.s.proc_path,
            # Beside the spool, in the agent's state directory (/var/lib/bistouri/unwind).
            unwind_cache_dir=os.path.join(os.path.dirname(self.s.spool_dir.rstrip("/")), "unwind"),
        )
        self.profiler = ProfilerAgent(opts, notify=lambda: os.eventfd_write(self._event_fd, 1))
        try:
            self.profiler.open()
        except BistouriError as e:
            raise StartupError("load", str(e))
        if self.registry is not None:
            self.registry.register(
                BpfCountersCollector(self.profiler.counters, self._cache_stats, self._unwind_stats)
            )

    def _unwind_stats(self) -> UnwindStats:
        unwind = self.profiler.unwind if self.profiler is not None else None
        return unwind.stats if unwind is not None else UnwindStats()

    def _cache_stats(self) -> tuple[ProcMapsStats, int]:
        if self.profiler is None:
            return ProcMapsStats(), 0
        return self.profiler.maps.stats, self.profiler.orphaned

    def _activate(self) -> None:
        assert self.profiler is not None and self.config is not None and self.kernel is not None
        self.exporter = self._make_exporter()
        self.orch = CaptureOrchestrator(
            self.profiler,
            self.spool,
            self.metrics,
            self.kernel,
            tenant=self.s.tenant_id,
            host=socket.gethostname(),
            labels=dict(self.s.labels),
            period_ns=self.s.period_ns,
            proc_root=self.s.proc_path,
            on_spooled=self._notify_exporter,
        )
        self.trigger = TriggerAgent(
            self.loop,
            self.orch,
            self.profiler.set_comm_rules,
            self.metrics,
            proc_root=self.s.proc_path,
            cgroup_root=self.s.cgroup_path,
            default_capture_s=self.s.capture_duration_secs,
        )
        self.trigger.apply_config(self.config)
        self.profiler.start()
        self.walker = Walker(
            self.s.walk_interval_secs,
            self.s.proc_path,
            lambda: os.eventfd_write(self._walk_fd, 1),
        )
        self.walker.start()
        self.walker.request(self.trigger.matcher, self.trigger.generation)
        log.info("Agent active: dormant until PSI fires. watchers appear as processes are found")

    def _make_exporter(self) -> object | None:
        if not self.s.symbolizer_endpoint:
            return None
        from .exporter import Exporter

        kernel = self.kernel

        def kallsyms(build_id: bytes) -> bytes | None:
            if kernel is None or build_id != kernel.build_id:
                return None
            return gzip.compress(read_kallsyms(self.s.proc_path), 6)

        exp = Exporter(self.spool, self.s, registry=self.registry, kallsyms_provider=kallsyms)
        exp.start()
        return exp

    def _notify_exporter(self) -> None:
        if self.exporter is not None:
            self.exporter.notify()  # type: ignore[attr-defined]

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

    @staticmethod
    def _drain_fd(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass

    def run(self) -> None:
        """The main loop, until SIGTERM/SIGINT."""
        while not self.stop_requested:
            now = time.monotonic()
            deadlines = [now + 5.0]  # everything else wakes the loop through its fds
            if (d := self.orch.next_deadline()) is not None:
                deadlines.append(d)
            if self.confwatch and (d := self.confwatch.deadline()) is not None:
                deadlines.append(d)
            timeout_ms = max(0, int((min(deadlines) - now) * 1000) + 1)
            for ev in self.loop.poll(timeout_ms):
                self.trigger.on_psi(ev)
            if self.profiler:
                self.profiler.check_thread()
            now = time.monotonic()
            self.orch.tick(now)
            if self.reload_requested:
                self.reload_requested = False
                self.reload("SIGHUP")
            elif self.confwatch and self.confwatch.changed(now):
                self.reload("file changed")

    def _on_bpf_events(self) -> None:
        self._drain_fd(self._event_fd)
        assert self.profiler is not None
        events = self.profiler.take()
        self.orch.add_samples(ev for ev in events if type(ev) is StackSample)
        for ev in events:
            if type(ev) is StackSample:
                continue
            if isinstance(ev, ExecMatch):
                self.trigger.on_exec(ev)
            elif isinstance(ev, BpfErrorEvent):
                now = time.monotonic()
                if now - self._bpf_error_log_at > 10:  # counted in metrics; logged at most every 10 s
                    self._bpf_error_log_at = now
                    log.warning("BPF reported a loss. kind=%s pid=%d code=%d", ev.kind.name, ev.pid, ev.code)
        dropped = self.profiler.dropped
        if dropped:
            self.profiler.dropped = 0
            self.metrics.ringbuf_queue_dropped.inc(dropped)

    def _on_walk_results(self) -> None:
        self._drain_fd(self._walk_fd)
        while True:
            try:
                result = self.walker.results.get_nowait()
            except queue.Empty:
                return
            self.trigger.on_walk(result)
            unwind = self.profiler.unwind if self.profiler is not None else None
            if unwind is not None:
                # Tables of the watched processes to the disk cache now, before pressure samples them.
                unwind.prepare([p.pid for p in result.found])

    def reload(self, why: str) -> bool:
        """Swap in a new trigger config; an invalid one keeps the running config."""
        assert self.config is not None
        try:
            cfg = load_trigger_config(self.s.config_path, first_rule_id=self.config.next_rule_id)
        except (ConfigError, OSError) as e:
            self.metrics.config_reload_failures.inc()
            log.error("Config reload rejected (%s), keeping the running config: %s", why, e)
            if self.confwatch:
                self.confwatch.accept()  # do not retry the same bad content in a loop
            return False
        try:
            self.trigger.apply_config(cfg)
        except BistouriError as e:
            self.metrics.config_reload_failures.inc()
            log.error("Config reload failed while updating BPF maps, keeping the running config: %s", e)
            return False
        self.config = cfg
        if self.confwatch:
            self.confwatch.accept()
        self.metrics.config_reloads.inc()
        log.info("Config reloaded (%s). targets=%d", why, len(cfg.targets))
        self.walker.request(self.trigger.matcher, self.trigger.generation)
        return True

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop triggers, drain the rings, spool open sessions, detach. Bounded in time."""
        t0 = time.monotonic()
        if hasattr(self, "loop"):
            self.loop.clear()
        if hasattr(self, "walker"):
            self.walker.stop(0.5)
        if self.profiler is not None:
            self.profiler.close(timeout=0.5)  # drains what is already in the rings
            if hasattr(self, "orch"):
                self._on_bpf_events()
        if hasattr(self, "orch"):
            flushed = self.orch.flush_all()
            if flushed:
                log.info("Open sessions flushed to the spool at shutdown. sessions=%d", len(flushed))
        self.close()
        log.info("Agent stopped in %.2fs", time.monotonic() - t0)

    def close(self) -> None:
        if self.exporter is not None:
            # A short chance to send what was just flushed; the rest stays in the spool for next time.
            self.exporter.flush(time.monotonic() + 0.5)  # type: ignore[attr-defined]
            self.exporter.stop(timeout=0.3)  # type: ignore[attr-defined]
            self.exporter = None
        if self.profiler is not None:
            self.profiler.close(timeout=0.5)
            self.profiler = None
        if getattr(self, "confwatch", None):
            self.confwatch.close()  # type: ignore[union-attr]
            self.confwatch = None
        for fd in (self._event_fd, self._walk_fd, self._sig_r, self._sig_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._event_fd = self._walk_fd = self._sig_r = self._sig_w = -1
        if self._metrics_server is not None:
            os.eventfd_write(self._metrics_wake, 1)
            if self._metrics_thread is not None:
                self._metrics_thread.join(2.0)
            self._metrics_server.server_close()
            os.close(self._metrics_wake)
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

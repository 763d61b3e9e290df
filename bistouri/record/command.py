"""`bistouri record`: profile now, on this host, with no symbolizer service.

Targets: `--pid`, `--cgroup`, `--comm`, or `-- COMMAND ARGS` (started and
followed until it exits). Optionally waits for PSI first (`--on-pressure
cpu:10,io:5`). Captures on-CPU and off-CPU stacks with the same BPF programs and
capture code as the agent, symbolizes in-process with the symbolizer's resolver
and the binaries of this host (through the persistent symbol cache,
`symcache.py`), and writes the outputs chosen with `--format`: flamegraph.html,
profile.pb.gz (pprof), profile.folded (+ profile.offcpu.folded),
profile.speedscope.json, summary.json, profile.otlp.pb (OTLP Profiles).

Start-up is on the critical path (someone looks at a process *now*). Only what
loading needs is imported first; then the on-CPU sampler alone is loaded,
attached and its targets armed (`loader.ObjectLoad` with `sampler_first` and
`arm`): a frame-pointer sampler that reads no kernel struct, so libbpf loads it
without parsing the kernel's BTF. The profiler, the capture code, the metrics and
the symbolizer are imported after, while the ring buffer already holds samples;
the table-walking sampler and the off-CPU program load meanwhile into a second
object sharing the maps, and the first sampler hands over to the second as soon
as it is loaded. The target's unwind tables are built (or read from the disk
cache) and loaded from `Profiler.start()` on, while the first sampler runs, so
the table walk has them from its first sample. The off-CPU program is attached
by `Profiler.attach_rest`; a command target is started only once it is.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

from ..bpf import abi
from ..bpf.loader import ObjectLoad, ProfilerOptions
from ..compat import SLOTS
from ..errors import BistouriError
from ..gckeep import kept
from ..host import procfs
from .outputs import BuildIdTree, OutputDir, default_cache_dir

# Not `from typing import ...`: typing costs ~2 ms of imports before the first sample, and
# type checkers read a module-level TYPE_CHECKING as theirs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

    from .. import wire
    from ..capture.events import StackSample
    from ..capture.profiler import Profiler
    from ..host.kernel import KernelMeta
    from ..symbolizer.model import Profile

log = logging.getLogger(__name__)

# --format name -> the file it writes
FORMATS = {
    "html": "flamegraph.html",
    "pprof": "profile.pb.gz",
    "folded": "profile.folded",  # and profile.offcpu.folded when off-CPU waits were seen
    "speedscope": "profile.speedscope.json",
    "summary": "summary.json",
    "otlp": "profile.otlp.pb",  # an OTLP Profiles ExportProfilesServiceRequest (also a ProfilesData)
}
DEFAULT_FORMATS = ("html", "pprof", "folded", "speedscope")
# How long the capture's set-up waits for the target's unwind tables (see _capture): a first
# run on a 35 MB C++ binary builds them in ~0.5 s of CPU.
_TABLES_FIRST_S = 1.5
# How long the end of a capture waits for the tables its raw stack copies need (the samples taken
# before the tables were in, kept as copies of their stacks: capture/rawstacks.py). Under load a
# large binary's table came ~7 s into a 5 s capture; perf's own copies wait for `perf script`.
_TABLES_LAST_S = 10.0
# How long the end of a capture waits for the ring thread's last drain, the copies still held
# walked in it: its samples are the capture's (2 s was short for ~1 000 copies under emulation).
_LAST_DRAIN_S = 30.0


@dataclass(frozen=True, **SLOTS)
class PressureRule:
    """One `--on-pressure` rule: a PSI resource and the stall share that starts the capture."""

    resource: str
    threshold: float


def parse_on_pressure(text: str) -> list[PressureRule]:
    from ..pressure import RESOURCES

    rules = []
    for part in text.split(","):
        res, _, thr = part.strip().partition(":")
        if res not in RESOURCES:
            raise argparse.ArgumentTypeError(
                f"{res!r} is not a resource; use cpu, memory or io (e.g. cpu:10,io:5)"
            )
        try:
            value = float(thr) if thr else 10.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"threshold {thr!r} of {res} is not a number")
        if not 0 < value < 100:
            raise argparse.ArgumentTypeError(f"threshold of {res} must be a percentage between 0 and 100")
        rules.append(PressureRule(res, value))
    return rules


def parse_formats(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in FORMATS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown format {', '.join(bad) or text!r}; choose among {', '.join(FORMATS)} (e.g. html,folded)"
        )
    return names


def add_record_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (one of)")
    t.add_argument("--pid", type=int, action="append", default=[], help="a process id (repeatable)")
    t.add_argument("--cgroup", help="a cgroup2 path, e.g. /system.slice/nginx.service (all its processes)")
    t.add_argument("--comm", help="processes whose name (comm) is this; a trailing * matches a prefix")
    t.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS: start it and follow it")
    p.add_argument(
        "-d",
        "--duration",
        type=float,
        default=None,
        help="seconds to capture (default 10; with a command: until it exits)",
    )
    p.add_argument("-F", "--freq", type=int, default=99, help="on-CPU sampling frequency in Hz (default 99)")
    p.add_argument("--no-offcpu", dest="offcpu", action="store_false", help="skip off-CPU (D-state) waits")
    p.add_argument(
        "--on-pressure",
        type=parse_on_pressure,
        metavar="RES:PCT,...",
        help="wait until PSI of the target's cgroup exceeds these thresholds, e.g. cpu:10,io:5",
    )
    p.add_argument(
        "--wait-timeout", type=float, default=0, help="give up waiting for pressure after N seconds"
    )
    p.add_argument(
        "-o",
        "--output",
        help="output directory (default: a new ./bistouri-record-DATE; an existing one is used only "
        "when named here)",
    )
    p.add_argument(
        "--format",
        type=parse_formats,
        default=DEFAULT_FORMATS,
        metavar="LIST",
        help=f"outputs to write, comma-separated among {', '.join(FORMATS)} "
        f"(default {','.join(DEFAULT_FORMATS)})",
    )
    p.add_argument("--top", type=int, default=15, help="functions to print (default 15)")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal (default: on a terminal only)",
    )
    p.add_argument(
        "--cache-dir",
        help="symbol cache directory (default $XDG_CACHE_HOME/bistouri, else ~/.cache/bistouri)",
    )
    p.add_argument("--no-cache", dest="cache", action="store_false", help="do not use the symbol cache")
    p.add_argument(
        "--no-jvm-perfmap",
        dest="jvm_perfmap",
        action="store_false",
        help="do not ask a JVM target for its perf map (HotSpot's attach, as `jcmd PID Compiler.perfmap`, "
        "at the start and the end of the capture): its JIT frames stay unnamed unless it writes one",
    )
    p.add_argument("--debug-dir", action="append", default=[], help="extra .build-id debug tree (repeatable)")
    p.add_argument(
        "--debuginfod-url",
        action="append",
        default=None,
        help="debuginfod server (repeatable; default $DEBUGINFOD_URLS)",
    )
    p.add_argument(
        "--no-host-debuginfo",
        dest="host_debuginfo",
        action="store_false",
        help="do not read this host's debug files (/usr/lib/debug: its .build-id tree and path mirror) "
        "nor ask $DEBUGINFOD_URLS",
    )
    p.add_argument("--proc-path", default="/proc", help=argparse.SUPPRESS)


class Progress:
    """One status line on stderr: redrawn in place on a terminal; on anything else silent,
    unless asked (`--progress`), then a line now and then. Outcomes (`done`) always print."""

    def __init__(self, stream: Any = sys.stderr, show: bool = False) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.show = show or self.tty
        self._last = 0.0

    def update(self, text: str, force: bool = False) -> None:
        if not self.show:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        elif force or now - self._last >= 5:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last = now

    def done(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


class _NoSink:
    """Record takes its one session from `SessionCapture.finish_session`: nothing is encoded."""

    def put(self, session_id: str, data: bytes) -> None:
        raise AssertionError("record's session is never finished through the sink")


class Targets:
    """The processes to sample now; re-evaluated while capturing (forks, new members)."""

    def __init__(
        self, args: argparse.Namespace, child: subprocess.Popen | None, cgroup_root: str | None
    ) -> None:
        self.args = args
        self.child = child
        self.proc = args.proc_path
        self.cgroup_dir = None
        if args.cgroup:
            if cgroup_root is None:
                raise BistouriError(
                    "--cgroup needs a cgroup2 mount, and none was found in /proc/self/mountinfo"
                )
            self.cgroup_dir = procfs.cgroup_dir(cgroup_root, args.cgroup)
            if not self.cgroup_dir or not os.path.isdir(self.cgroup_dir):
                raise BistouriError(f"cgroup {args.cgroup} not found under {cgroup_root}")

    def current(self) -> dict[int, str]:
        pids: list[int] = []
        if self.args.pid:
            pids = list(self.args.pid)
        elif self.cgroup_dir:
            pids = procfs.cgroup_procs(self.cgroup_dir)
        elif self.args.comm:
            want = self.args.comm
            prefix = want.endswith("*")
            want = want.rstrip("*")
            pids = [
                st.pid
                for st in procfs.iter_processes(self.proc)
                if not st.is_kernel_thread and (st.comm.startswith(want) if prefix else st.comm == want)
            ]
        elif self.child is not None:
            pids = self._descendants(self.child.pid)
        out = {}
        for pid in pids:
            comm = procfs.read_comm(pid, self.proc)
            if comm is not None:
                out[pid] = comm
        return out

    def _descendants(self, root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for st in procfs.iter_processes(self.proc):
            children.setdefault(st.ppid, []).append(st.pid)
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out


def _wait_for_pressure(
    rules: list[PressureRule], targets: Targets, cgroup_root: str | None, args, progress
) -> wire.Trigger:
    from .. import wire
    from ..host.psi import PsiLoop
    from ..pressure import PressureThreshold

    pids = targets.current()
    cgroup = "/"
    if pids and cgroup_root:
        cgroup = procfs.read_cgroup2_path(next(iter(pids)), args.proc_path) or "/"
    if args.cgroup:
        cgroup = args.cgroup
    loop = PsiLoop(registry=None)
    for r in rules:
        if cgroup == "/" or cgroup_root is None:
            path = os.path.join(args.proc_path, "pressure", r.resource)
        else:
            d = procfs.cgroup_dir(cgroup_root, cgroup)
            path = os.path.join(d or cgroup_root, f"{r.resource}.pressure")
        loop.add_watch(r.resource, path, PressureThreshold(r.resource, r.threshold, window_ms=1000), 0)
    want = ", ".join(f"{r.resource} > {r.threshold:g}%" for r in rules)
    t0 = time.monotonic()
    while True:
        waited = time.monotonic() - t0
        progress.update(f"Waiting for pressure in cgroup {cgroup} ({want}): {waited:.0f} s, Ctrl-C to stop")
        if args.wait_timeout and waited > args.wait_timeout:
            loop.clear()
            raise BistouriError(f"no pressure ({want}) within {args.wait_timeout:g} s")
        if targets.child is not None and targets.child.poll() is not None:
            loop.clear()
            raise BistouriError("the command exited before any pressure")
        for ev in loop.poll(500):
            if not ev.dead:
                loop.clear()
                progress.done(f"Pressure: {ev.resource} avg10={ev.pressure.avg10:.2f}% after {waited:.1f} s")
                return wire.Trigger.from_psi(ev, cgroup)


def _kernel_meta(proc_root: str) -> KernelMeta:
    """Like `kernel.read_kernel_meta`, without reading all of /proc/kallsyms for `_text` (~40 ms of
    kernel time): it is among the first lines."""
    from ..host.kernel import KernelMeta, build_id_from_notes, parse_text_address, read_kernel_meta

    try:
        with open(f"{proc_root}/kallsyms", "rb") as f:
            text = parse_text_address(f.read(64 << 10).rpartition(b"\n")[0])
        with open("/sys/kernel/notes", "rb") as f:
            build_id = build_id_from_notes(f.read()) or b""
    except OSError:
        text = None
    if text is None:
        return read_kernel_meta(proc_root=proc_root)
    return KernelMeta(release=os.uname().release, build_id=build_id, text_addr=text)


@dataclass(**SLOTS)
class Usage:
    """What record cost, for the summary: peak RSS of each phase, CPU time (self and children)."""

    capture_rss_bytes: int = 0
    symbolize_rss_bytes: int = 0
    cpu_s: float = 0.0
    children_cpu_s: float = 0.0


def _peak_rss(reset: bool = False) -> int:
    """VmHWM of this process in bytes; with `reset`, start a new peak from now (Linux >= 4.0)."""
    peak = 0
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    peak = int(line.split()[1]) * 1024
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
    except (OSError, ValueError):
        pass
    return peak


@dataclass(**SLOTS)
class Capture:
    """What the capture loop produced."""

    session: wire.Session | None
    samples: int
    first_sample_ns: int  # CLOCK_MONOTONIC of the earliest sample (bpf_ktime_get_ns), 0 if none
    seconds: float
    processes: int


def _filter_flags(args: argparse.Namespace) -> int:
    """What the targets are sampled for: on-CPU, and off-CPU unless --no-offcpu; the on-CPU samples
    cut short before their tables are in sent as raw stack copies (the profiler clears that bit
    once they are)."""
    on_cpu = abi.FilterFlags.ON_CPU | abi.FilterFlags.RAW_STACK
    return on_cpu | (abi.FilterFlags.OFF_CPU if args.offcpu else 0)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _fixed_malloc_thresholds() -> None:
    """Large blocks mmap'd and given back when freed, for the whole run. By default glibc raises its
    mmap threshold to the size of the largest block freed: after libbpf's first parse of the kernel's
    BTF (~5.5 MB, read and copied) was freed, the next parses (the companion object's load) came
    from a thread's heap and stayed resident once freed: 16 MB held, 0.4 MB of it in use, at
    record's peak."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)  # glibc's default, now fixed
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 10)
    except AttributeError:  # not glibc
        pass


def cmd_record(args: argparse.Namespace) -> int:
    command = [a for a in (args.command or []) if a != "--"] if args.command else []
    chosen = sum(bool(x) for x in (args.pid, args.cgroup, args.comm, command))
    if chosen != 1:
        print("error: give exactly one target: --pid, --cgroup, --comm or -- COMMAND", file=sys.stderr)
        return 2
    if args.log_level == "info":  # the default: progress lines say enough
        logging.getLogger("bistouri").setLevel(logging.WARNING)
    _fixed_malloc_thresholds()
    cache_dir = args.cache_dir or default_cache_dir()
    options = ProfilerOptions(
        freq_hz=args.freq,
        offcpu=args.offcpu,
        exec_discovery=False,
        drain_interval_s=0.1,
        # Someone is waiting for this profile: unwind tables are built at full speed
        # (not under a CPU share, as the agent does) and kept between runs.
        unwind_cache_dir=os.path.join(cache_dir, "unwind") if args.cache else None,
        unwind_cpu_share=1.0,
        unwind_nice=0,
        # The episode hooks only for --on-pressure's report: each costs load time.
        episode=bool(args.on_pressure),
        # Someone waits for the first sample: the on-CPU sampler is attached first, alone, and
        # the off-CPU program after (with --on-pressure, sampling starts at the pressure instead).
        sampler_first=not args.on_pressure,
        jvm_perf_maps=args.jvm_perfmap,
        raw_stacks=True,
    )
    progress = Progress(show=args.progress)
    # Read only where a cgroup is named or its pressure watched: mountinfo and the module that
    # parses it are ~1 ms of CPU before a --pid's first sample.
    cgroup_root = None
    if args.cgroup or args.on_pressure:
        from ..host import mounts

        cgroup_root = mounts.find_cgroup2_mount(args.proc_path)
    targets = Targets(args, None, cgroup_root)
    procs = targets.current()
    if not command and not procs:
        print("error: no process matches the target", file=sys.stderr)
        return 2
    # The sampler is loaded, attached and armed (with --on-pressure: only loaded, sampling
    # waits for the pressure) before the rest is imported: on a busy host, importing at the
    # same time took CPU from the load and delayed the first sample by ~10 ms.
    loading = ObjectLoad(options, arm=None if args.on_pressure else dict.fromkeys(procs, _filter_flags(args)))
    try:
        loading.wait()
        with kept():
            import signal  # not before either: its enums are ~0.4 ms of CPU

            from ..capture.profiler import Profiler
            from ..elf import HOST_DEBUG_DIR  # not before: elf imports lzma

            out = OutputDir.open(args.output)
            tree = BuildIdTree(args.proc_path, mirror=HOST_DEBUG_DIR if args.host_debuginfo else None)
    except BaseException:
        loading.close()
        raise
    profiler = Profiler(options, loading=loading)
    stop: list[bool] = []
    old = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        trigger = None
        if args.on_pressure:
            targets.child = _start(command) if command else None
            trigger = _wait_for_pressure(args.on_pressure, targets, cgroup_root, args, progress)
        profiler.open()
        if command and targets.child is None:
            profiler.attach_rest()
            targets.child = _start(command)  # attached first: sampled from its first instruction
        capture = _capture(args, profiler, targets, tree, trigger, progress, stop)
        gc.freeze()  # the session lives to the end: the collections that follow need not walk it
        usage = Usage(capture_rss_bytes=_peak_rss(reset=True))
        progress.done(
            f"Captured {capture.samples} samples of {capture.processes} processes in {capture.seconds:.1f} s"
        )
        if capture.session is None:
            print(
                "No sample was captured: the target did not run on a CPU during the capture",
                file=sys.stderr,
            )
            return 1
        profile, stats = _symbolize(args, capture.session, tree.root, progress)
        _write_outputs(args, out, profile, command, capture, stats, usage)
        print_top(profile, args.top)
        from ..capture.jitnote import note_lines

        for line in note_lines(capture.session.unwind.jit):
            print(f"note: {line}")
        for line in profiler.kernel_features.lines():
            print(f"note: {line}")
        if capture.session.episode is not None:
            from ..capture.episode import summary_lines

            print("\nEpisode (the window of the capture, after the pressure):")
            print("\n".join(summary_lines(capture.session.episode)))
        print(f"\nWrote {out.path}/: {', '.join(out.written)}")
        return 0
    finally:
        signal.signal(signal.SIGINT, old)
        profiler.close()
        out.close()
        child = targets.child
        if child is not None and child.poll() is None and args.duration is not None:
            child.terminate()
        if child is not None:
            import subprocess  # imported already: the child was started with it

            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
        tree.remove()
        # The process ends after this: the interpreter's collection at exit need not walk every
        # object the run made (~20 ms of CPU of a warm run's ~0.35 s; freed with the process).
        gc.freeze()


def _start(command: list[str]) -> subprocess.Popen:
    import subprocess  # only for a command target: not on the start-up path of the others

    try:
        return subprocess.Popen(command)
    except OSError as e:
        raise BistouriError(f"cannot start {command[0]}: {e.strerror}")


def _capture(
    args: argparse.Namespace,
    profiler: Profiler,
    targets: Targets,
    tree: BuildIdTree,
    trigger: wire.Trigger | None,
    progress: Progress,
    stop: list[bool],
) -> Capture:
    """Arm the targets at once, then set up the capture code while the ring fills, and sample
    until the duration is over, the command exits or Ctrl-C."""
    from ..capture.events import StackSample

    procs = targets.current()
    flags = _filter_flags(args)
    if trigger is not None:  # --on-pressure: the episode report (victims by state, aggressors)
        flags |= abi.EpisodeFilter.ON
    for pid in procs:
        profiler.set_pid_filter(pid, flags)
    profiler.start()
    log.debug("Sampling. pids=%s", ",".join(map(str, procs)))
    t0 = time.monotonic()
    # The off-CPU program, loading meanwhile, and the table walk taking over once it has: waited
    # for here, so that the imports below do not take the CPU from its load (on a busy host the
    # hand-over came ~270 ms after start() with them running meanwhile, ~160 ms without: medians
    # of 6 runs each on python3.11).
    profiler.attach_rest()
    # The same for the target's unwind tables (built on their own thread, every sample cut short
    # until they are in): the imports below would share the GIL with their build. Waited for up
    # to _TABLES_FIRST_S: the samples wait in the profiler's queue meanwhile.
    while not stop and time.monotonic() - t0 < _TABLES_FIRST_S and not profiler.unwind.wait_idle(0.05):
        pass

    # Sampling runs: what follows may take its time (imports, /proc reads).
    with kept():
        from .. import wire
        from ..capture.episode import NO_EPISODE_PROBE, EpisodeProbe
        from ..capture.sessions import SessionCapture
        from ..discard import Discarded

        if trigger is not None:  # the cgroups' readers: the episode's aggressors only
            from ..host import mounts
            from ..host.cgroupfs import find_mounts

    child = targets.child
    duration = args.duration if args.duration is not None else (None if child else 10.0)
    sessions = SessionCapture(
        profiler,
        _NoSink(),
        Discarded(),  # record reports no metric
        _kernel_meta(args.proc_path),
        tenant="",
        host=os.uname().nodename,
        labels={},
        period_ns=1_000_000_000 // args.freq,
        filter_flags=flags,
        degraded=profiler.kernel_features.names,
        proc_root=args.proc_path,
        episode=EpisodeProbe(
            profiler.thread_times,
            mounts.find_cgroup2_mount(args.proc_path),
            mounts=find_mounts(args.proc_path),
        )
        if trigger is not None
        else NO_EPISODE_PROBE,
    )
    trigger = trigger or wire.Trigger("cpu", time_ns=time.time_ns())
    sid = sessions.start_session(trigger, "record", {}, procs, 1e9)
    if sid is None:
        raise BistouriError("no process to sample")
    known = dict(procs)
    tree.add(list(known))
    n_samples = 0
    first_ns = 0
    last_refresh = t0

    def count(stacks: list[StackSample]) -> None:
        nonlocal n_samples, first_ns
        if stacks:
            sessions.add_samples(stacks)
            n_samples += sum(s.weight for s in stacks)
            first = min(s.timestamp_ns for s in stacks)
            first_ns = min(first_ns, first) if first_ns else first

    while not stop:
        elapsed = time.monotonic() - t0
        if duration is not None and elapsed >= duration:
            break
        if child is not None and child.poll() is not None:
            break
        profiler.check_thread()
        count([ev for ev in profiler.take(timeout=0.2) if type(ev) is StackSample])
        if time.monotonic() - last_refresh > 1.0:  # new processes, mapped files, progress
            last_refresh = time.monotonic()
            new = {p: c for p, c in targets.current().items() if p not in known}
            if new:
                sessions.extend_session(sid, new)
                known.update(new)
            tree.add(list(known))
            total = f" of {duration:g}" if duration else ""
            progress.update(
                f"Capturing at {args.freq} Hz: {elapsed:.1f}{total} s, {n_samples} samples, "
                f"{len(known)} processes"
            )
    tree.add(list(known))
    profiler.refresh_perf_maps(list(known))  # what the JVMs compiled during the capture named too
    seconds = time.monotonic() - t0
    if len(profiler.raw):
        progress.update(f"Waiting for the unwind tables of {len(profiler.raw)} samples", force=True)
        t1 = time.monotonic()
        stops = len(stop)  # one more Ctrl-C: no more waiting, those samples stay cut short
        done = False
        while not done and len(stop) == stops and time.monotonic() - t1 < _TABLES_LAST_S:
            done = profiler.wait_raw_stacks(0.1)
        log.debug("Unwind tables waited for. seconds=%.2f done=%s", time.monotonic() - t1, done)
    profiler.stop(_LAST_DRAIN_S)  # drains the rings a last time; the maps stay readable (episode report)
    count([ev for ev in profiler.take() if type(ev) is StackSample])
    raw = profiler.raw.stats
    if raw.received:
        log.info(
            "Raw stack copies. received=%d walked=%d whole=%d left_copy=%d unwalked=%d dropped=%d lost=%d "
            "walk_cpu_s=%.3f",
            raw.received, raw.walked, raw.whole, raw.left_copy, raw.unwalked, raw.dropped,
            profiler.counters()[abi.Counter.RAW_STACK_LOST], raw.walk_cpu_s,
        )  # fmt: skip
    session = sessions.finish_session(sid)
    profiler.close()
    return Capture(session if session.traces else None, n_samples, first_ns, seconds, len(known))


def _has_debug_file(root: str, build_id: bytes) -> bool:
    hexid = build_id.hex()
    return bool(hexid) and os.path.exists(os.path.join(root, ".build-id", hexid[:2], hexid[2:] + ".debug"))


def _symbolize(
    args: argparse.Namespace, session: wire.Session, tree: str, progress: Progress
) -> tuple[Profile, Any]:
    from ..elf import HOST_DEBUG_DIR
    from . import symcache

    cache = None
    if args.cache:
        try:
            cache = symcache.SymbolCache(args.cache_dir or default_cache_dir())
        except symcache.CacheUnusable as e:
            print(f"warning: {e}; symbolizing without it (--cache-dir to choose another)", file=sys.stderr)
    kernel_key = symcache.kernel_boot_key(session.kernel.build_id, args.proc_path)
    kernels = symcache.CachedKallsyms(session.kernel.build_id, kernel_key, cache, args.proc_path)
    debug_dirs = [tree, *args.debug_dir]
    # The host's own debug files, as perf and gdb find them (docs/record.md, "Debug info").
    host_dirs = [HOST_DEBUG_DIR] if args.host_debuginfo and os.path.isdir(HOST_DEBUG_DIR) else []
    debug_dirs += host_dirs
    if args.debuginfod_url is not None or not args.host_debuginfo:
        servers = args.debuginfod_url or []
    else:
        from ..symbolizer.sources import urls_from_env

        servers = urls_from_env()

    def open_resolver(file_lines: bool, known_symbols: Any) -> Any:
        from typing import cast

        from ..symbolizer.kallsyms import KallsymsStore
        from ..symbolizer.resolve import Resolver
        from ..symbolizer.sources import DebugSources
        from .dwarfpool import DwarfFirstPool

        sources = DebugSources(
            debug_dirs,
            [],
            servers,
            cache_dir=os.path.join(tree, "debuginfod"),
            registry=None,
        )
        # Same has()/get() as the service's store of uploaded snapshots, for this host's kernel only.
        # DWARF is read in process (dwarfpool.py); llvm-symbolizer is found on first use, for what that
        # reader leaves: most runs start none (finding it runs it twice).
        llvm = DwarfFirstPool(
            cache, debug_dirs=[os.path.dirname(d) for d in sources.debug_dirs], registry=None
        )
        kallsyms = cast(KallsymsStore, kernels)
        resolver = Resolver(
            sources,
            kallsyms,
            llvm if file_lines else None,
            use_llvm=file_lines,
            registry=None,
            known_symbols=known_symbols,
        )
        resolvers.append(resolver)
        return resolver

    resolvers: list[Any] = []  # to read their helpers' peak memory once they are closed

    t1 = time.monotonic()
    progress.update("Symbolizing…", force=True)
    # A vmlinux with DWARF could only come from --debug-dir, --debuginfod-url or the host's debug tree
    # (linux-image-*-dbg): without them, kallsyms. $DEBUGINFOD_URLS alone is not asked for the
    # kernel's (hundreds of MB) unless named on the command line.
    kdebug = any(_has_debug_file(d, session.kernel.build_id) for d in host_dirs)
    direct = None if (args.debug_dir or args.debuginfod_url or kdebug) else kernels
    profile, stats = symcache.symbolize(
        session,
        cache,
        open_resolver,
        kernel_key,
        debug_dirs,
        lambda text: progress.update(text, force=True),
        kallsyms=direct,
    )
    kernels.check()
    stats.seconds = time.monotonic() - t1
    stats.helpers_rss_bytes = max((r.llvm.peak_rss_bytes for r in resolvers if r.llvm is not None), default=0)
    progress.done(
        f"Symbolized {stats.addresses} addresses ({stats.cached} from the cache) in {stats.seconds:.2f} s"
    )
    return profile, stats


def _write_outputs(
    args: argparse.Namespace,
    out: OutputDir,
    profile: Profile,
    command: list[str],
    capture: Capture,
    stats: Any,
    usage: Usage,
) -> None:
    import json

    from ..symbolizer import formats

    title = f"bistouri record: {' '.join(command) if command else args.comm or args.cgroup or args.pid}"
    want = set(args.format)
    if "html" in want:
        from ..symbolizer import report

        trees = {v: formats.flamegraph(profile, v) for v in ("on_cpu", "off_cpu", "off_cpu_ns")}
        out.write(FORMATS["html"], report.flamegraph_html(trees, profile.meta.to_json(), title))
    if "pprof" in want:
        out.write(FORMATS["pprof"], formats.pprof(profile))
    if "folded" in want:
        out.write(FORMATS["folded"], formats.folded(profile, "on_cpu"))
        if any(s.off_cpu for s in profile.samples):
            out.write("profile.offcpu.folded", formats.folded(profile, "off_cpu_ns"))
    if "speedscope" in want:
        out.write(FORMATS["speedscope"], json.dumps(formats.speedscope(profile, title)))
    if "otlp" in want:
        from ..symbolizer import otlp

        out.write(FORMATS["otlp"], otlp.export_request(profile))
    usage.symbolize_rss_bytes = _peak_rss()
    t = os.times()
    usage.cpu_s, usage.children_cpu_s = t.user + t.system, t.children_user + t.children_system
    helpers = stats.helpers_rss_bytes
    progress_line = (
        f"Peak RSS: capture {usage.capture_rss_bytes / 2**20:.1f} MB, "
        f"symbolization {usage.symbolize_rss_bytes / 2**20:.1f} MB"
        + (f" (+ {helpers / 2**20:.1f} MB in llvm-symbolizer)" if helpers else "")
        + f"; CPU {usage.cpu_s:.2f} s (+{usage.children_cpu_s:.2f} s in helpers)"
    )
    print(progress_line, file=sys.stderr)
    if "summary" in want:
        on, off, off_ns = profile.totals()
        summary = {
            "command": command,
            "samples": {"on_cpu": on, "off_cpu": off, "off_cpu_ns": off_ns},
            "capture": {
                "seconds": round(capture.seconds, 3),
                "processes": capture.processes,
                "first_sample_monotonic_ns": capture.first_sample_ns,
                "peak_rss_bytes": usage.capture_rss_bytes,
            },
            "symbolization": {
                "addresses": stats.addresses,
                "cached": stats.cached,
                "seconds": round(stats.seconds, 3),
                "peak_rss_bytes": usage.symbolize_rss_bytes,
                "helpers_peak_rss_bytes": helpers,  # llvm-symbolizer's, alongside record's own
                "kallsyms_child_peak_rss_bytes": 0,  # no such child since /proc/kallsyms is read in place
            },
            "cpu_seconds": {"self": round(usage.cpu_s, 3), "children": round(usage.children_cpu_s, 3)},
        }
        out.write(FORMATS["summary"], json.dumps(summary, indent=1) + "\n")


def function_shares(profile, value: str = "on_cpu") -> tuple[Counter, Counter, int]:
    """Self (leaf) and total (inclusive) samples per function name, and the total."""
    from ..symbolizer.formats import display_name

    self_c: Counter = Counter()
    total_c: Counter = Counter()
    total = 0
    name_of = [display_name(f) for f in profile.frames]  # once per frame, not per stack entry (~11 000)
    for s in profile.samples:
        v = getattr(s, value)
        if not v or not s.stack:
            continue
        total += v
        names = [name_of[i] for i in s.stack]
        self_c[names[-1]] += v
        for n in set(names):
            total_c[n] += v
    return self_c, total_c, total


def print_top(profile, n: int) -> None:
    self_c, total_c, total = function_shares(profile)
    if not total:
        return
    print(f"\nTop functions by on-CPU samples ({total} samples):")
    print(f"{'self':>7} {'total':>7}  function")
    for name, v in self_c.most_common(n):
        print(f"{v / total:>7.1%} {total_c[name] / total:>7.1%}  {name}")

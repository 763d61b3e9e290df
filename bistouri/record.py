"""`bistouri record`: profile now, on this host, with no symbolizer service.

Targets: `--pid`, `--cgroup`, `--comm`, or `-- COMMAND ARGS` (started and
followed until it exits). Optionally waits for PSI first (`--on-pressure
cpu:10,io:5`). Captures on-CPU and off-CPU stacks with the same BPF programs and
capture code as the agent, symbolizes in-process with the symbolizer's resolver
and the binaries of this host, and writes flamegraph.html, profile.pb.gz
(pprof), profile.folded and profile.speedscope.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import procfs, wire
from .capture import CaptureOrchestrator
from .errors import BistouriError
from .events import StackSample
from .kernel import read_kallsyms, read_kernel_meta
from .metrics import AgentMetrics
from .profiler import ProfilerAgent, ProfilerOptions
from .psi import PsiLoop

RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True, slots=True)
class PressureRule:
    resource: str
    threshold: float


def parse_on_pressure(text: str) -> list[PressureRule]:
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
    p.add_argument("-o", "--output", help="output directory (default ./bistouri-record-DATE)")
    p.add_argument("--top", type=int, default=15, help="functions to print (default 15)")
    p.add_argument("--debug-dir", action="append", default=[], help="extra .build-id debug tree (repeatable)")
    p.add_argument("--debuginfod-url", action="append", default=None, help="debuginfod server (repeatable)")
    p.add_argument("--proc-path", default="/proc", help=argparse.SUPPRESS)


class Progress:
    """One status line, redrawn in place on a terminal, printed sparingly otherwise."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last = 0.0

    def update(self, text: str, force: bool = False) -> None:
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


class _ListSink:
    def __init__(self) -> None:
        self.sessions: list[bytes] = []

    def put(self, session_id: str, data: bytes) -> None:
        self.sessions.append(data)


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
                raise BistouriError("--cgroup needs a cgroup2 mount, and none was found in /proc/mounts")
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


def _build_id_tree(pids: list[int], proc_root: str, into: Path) -> int:
    """Link the ELF files mapped by the targets into a .build-id tree the resolver can read."""
    from .symbolizer.elf import read_build_id

    seen: set[str] = set()
    n = 0
    for pid in pids:
        try:
            maps = Path(proc_root, str(pid), "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or "x" not in parts[1] or not parts[5].startswith("/"):
                continue
            path = parts[5].removesuffix(" (deleted)")
            if path in seen:
                continue
            seen.add(path)
            real = f"{proc_root}/{pid}/root{path}"
            try:
                bid = read_build_id(real)
            except (OSError, ValueError):
                continue
            if not bid:
                continue
            hexid = bid.hex()
            link = into / ".build-id" / hexid[:2] / hexid[2:]
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(os.path.realpath(real))
                n += 1
    return n


def _wait_for_pressure(
    rules: list[PressureRule], targets: Targets, cgroup_root: str | None, args, progress
) -> wire.Trigger:
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
        loop.add_watcher(r.resource, path, r.resource, "some", r.threshold, 1000, 0)
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
                progress.done(f"Pressure: {ev.resource} avg10={ev.avg10:.2f}% after {waited:.1f} s")
                return ev.to_trigger(cgroup)


def cmd_record(args: argparse.Namespace) -> int:
    from .symbolizer import formats, report
    from .symbolizer.kallsyms import KallsymsStore
    from .symbolizer.resolve import Resolver
    from .symbolizer.sources import DebugSources

    command = [a for a in (args.command or []) if a != "--"] if args.command else []
    chosen = sum(bool(x) for x in (args.pid, args.cgroup, args.comm, command))
    if chosen != 1:
        print("error: give exactly one target: --pid, --cgroup, --comm or -- COMMAND", file=sys.stderr)
        return 2
    if args.log_level == "info":  # the default: progress lines say enough
        import logging

        logging.getLogger("bistouri").setLevel(logging.WARNING)
    progress = Progress()
    cgroup_root = procfs.find_cgroup2_mount(args.proc_path)
    out_dir = Path(args.output or f"bistouri-record-{time.strftime('%Y%m%d-%H%M%S')}")
    child = None
    if command:
        try:
            child = subprocess.Popen(command)
        except OSError as e:
            print(f"error: cannot start {command[0]}: {e.strerror}", file=sys.stderr)
            return 2
    duration = args.duration if args.duration is not None else (None if child else 10.0)
    targets = Targets(args, child, cgroup_root)
    if not child and not targets.current():
        print("error: no process matches the target", file=sys.stderr)
        return 2

    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    old = signal.signal(signal.SIGINT, on_signal)
    kernel = read_kernel_meta(proc_root=args.proc_path)
    trigger = wire.Trigger("cpu", time_ns=time.time_ns())
    sink = _ListSink()
    agent = ProfilerAgent(
        ProfilerOptions(freq_hz=args.freq, offcpu=args.offcpu, exec_discovery=False, drain_interval_s=0.1)
    )
    tree = Path(os.environ.get("TMPDIR", "/tmp")) / f"bistouri-record-{os.getpid()}"
    try:
        if args.on_pressure:
            trigger = _wait_for_pressure(args.on_pressure, targets, cgroup_root, args, progress)
        agent.open()
        agent.start()
        orch = CaptureOrchestrator(
            agent,
            sink,
            AgentMetrics(registry=None),
            kernel,
            tenant="",
            host=os.uname().nodename,
            labels={},
            period_ns=1_000_000_000 // args.freq,
            proc_root=args.proc_path,
        )
        procs = targets.current()
        sid = orch.start_session(trigger, "record", {}, procs, 1e9)
        if sid is None:
            raise BistouriError("no process to sample")
        known = dict(procs)
        n_samples = 0
        t0 = time.monotonic()
        last_refresh = t0
        while not stop:
            elapsed = time.monotonic() - t0
            if duration is not None and elapsed >= duration:
                break
            if child is not None and child.poll() is not None:
                break
            agent.check_thread()
            stacks = [ev for ev in agent.take(timeout=0.2) if type(ev) is StackSample]
            orch.add_samples(stacks)
            n_samples += len(stacks)
            if time.monotonic() - last_refresh > 0.5:
                last_refresh = time.monotonic()
                new = {p: c for p, c in targets.current().items() if p not in known}
                if new:
                    orch.extend_session(sid, new)
                    known.update(new)
                _build_id_tree(list(known), args.proc_path, tree)
                total = f" of {duration:g}" if duration else ""
                progress.update(
                    f"Capturing at {args.freq} Hz: {elapsed:.1f}{total} s, {n_samples} samples, "
                    f"{len(known)} processes"
                )
        _build_id_tree(list(known), args.proc_path, tree)
        agent.close()  # drains the rings
        stacks = [ev for ev in agent.take() if type(ev) is StackSample]
        orch.add_samples(stacks)
        n_samples += len(stacks)
        orch.flush_all()
        progress.done(f"Captured {n_samples} samples in {time.monotonic() - t0:.1f} s")
        if not sink.sessions:
            print(
                "No sample was captured: the target did not run (or is not built with frame pointers?)",
                file=sys.stderr,
            )
            return 1
        session = wire.decode_session(sink.sessions[0])

        progress.update("Symbolizing…", force=True)
        t1 = time.monotonic()
        kernels = KallsymsStore(str(tree / "state"))
        if kernel.build_id:
            import gzip

            kernels.put(kernel.build_id, gzip.compress(read_kallsyms(args.proc_path), 1))
        sources = DebugSources(
            [str(tree), *args.debug_dir],
            [],
            args.debuginfod_url or [],
            cache_dir=str(tree / "debuginfod"),
            registry=None,
        )
        with Resolver(sources, kernels, registry=None) as resolver:
            profile = resolver.symbolize(session)
        progress.done(f"Symbolized {len(profile.frames)} distinct frames in {time.monotonic() - t1:.1f} s")

        out_dir.mkdir(parents=True, exist_ok=True)
        trees = {v: formats.flamegraph(profile, v) for v in ("on_cpu", "off_cpu", "off_cpu_ns")}
        meta = profile.meta.to_json()
        title = f"bistouri record: {' '.join(command) if command else args.comm or args.cgroup or args.pid}"
        (out_dir / "flamegraph.html").write_text(report.flamegraph_html(trees, meta, title))
        (out_dir / "profile.pb.gz").write_bytes(formats.pprof(profile))
        (out_dir / "profile.folded").write_text(formats.folded(profile, "on_cpu"))
        if any(s.off_cpu for s in profile.samples):
            (out_dir / "profile.offcpu.folded").write_text(formats.folded(profile, "off_cpu_ns"))
        (out_dir / "profile.speedscope.json").write_text(json.dumps(formats.speedscope(profile, title)))
        print_top(profile, args.top)
        print(
            f"\nWrote {out_dir}/flamegraph.html (open it in a browser), profile.pb.gz (go tool pprof), "
            "profile.folded, profile.speedscope.json"
        )
        return 0
    finally:
        signal.signal(signal.SIGINT, old)
        agent.close()
        if child is not None and child.poll() is None and args.duration is not None:
            child.terminate()
        if child is not None:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
        import shutil

        shutil.rmtree(tree, ignore_errors=True)


def function_shares(profile, value: str = "on_cpu") -> tuple[Counter, Counter, int]:
    """Self (leaf) and total (inclusive) samples per function name, and the total."""
    from .symbolizer.formats import display_name

    self_c: Counter = Counter()
    total_c: Counter = Counter()
    total = 0
    for s in profile.samples:
        v = getattr(s, value)
        if not v or not s.stack:
            continue
        total += v
        names = [display_name(profile.frames[i]) for i in s.stack]
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

"""JIT code named from perf maps, on real runtimes: node --perf-basic-prof, and JVMs (OpenJDK 17,
Temurin 25) whose perf map the profiler asks for itself (host/jvm.py): nobody runs `jcmd`.

Before perf maps were read, 0 % of these samples named the hot function (the frames were
`[unknown]+0x7f…`); perf -g names it in ~87 % (node) and ~99 % (java, after a manual jcmd) of
samples here.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import socket
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from bistouri.bpf import abi
from bistouri.capture.events import StackSample, split_stacks
from bistouri.capture.profiler import Profiler, ProfilerOptions
from bistouri.host import jvm
from bistouri.host.procmaps import FrameStatus
from testkit.helpers import wait_until
from tests.integration.test_record import record
from tests.pprof_proto import compile_profile_proto

pytestmark = pytest.mark.bpf

WORKLOADS_SRC = Path(__file__).resolve().parents[1] / "fixtures" / "workloads"
NODE = shutil.which("node")
JDKS = {
    "openjdk17": Path("/usr/lib/jvm/java-17-openjdk-amd64/bin/java"),
    "temurin25": Path("/usr/lib/jvm/temurin-25-jdk-amd64/bin/java"),
}


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return compile_profile_proto(tmp_path_factory.mktemp("pb"))


# PrintCompilation's line for the standard (not OSR) tier-4 compile of a method.
_COMPILED = r"\s4\s+{}::{} \("


def _jdk(name: str) -> Path:
    if not JDKS[name].exists():
        pytest.skip(f"{JDKS[name]} is not installed")
    return JDKS[name]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM first: a JVM then removes its attach socket (SIGKILL leaves it in /tmp)."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def _running(argv: list[str], cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        _stop(proc)
        Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)


@dataclass(frozen=True)
class _Jvm:
    proc: subprocess.Popen[bytes]
    pid: int  # the JVM's, as this pid namespace sees it

    def poll(self) -> int | None:
        return self.proc.poll()


@contextmanager
def _hot_jvm(
    java: Path,
    cwd: Path,
    *flags: str,
    program: str = "Hot",
    method: str = "hotLoop",
    container: bool = False,
) -> Iterator[_Jvm]:
    """`program`.java running, its hot method compiled at tier 4 (what a long-running service is):
    the perf map asked for from now on names it. `container`: as pid 1 of its own pid namespace,
    with its own /tmp (its JIT names are found in /proc/PID/root/tmp/perf-1.map)."""
    source = str(WORKLOADS_SRC / f"{program}.java")
    argv = [str(java), "-XX:+PrintCompilation", *flags, source, "120"]
    if container:
        # SIGTERM to unshare: its child, the JVM, gets it too; the namespace and its /tmp go with them.
        # The source is opened before the new /tmp hides the checkout (CI clones into /tmp) and copied
        # into it.
        unshare = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
        inside = f"/tmp/{program}.java"
        script = f'exec 3<"$0" && mount -t tmpfs tmpfs /tmp && cat <&3 > {inside} && exec 3<&- && exec "$@"'
        argv = [*unshare, "sh", "-c", script, source, *argv[:-2], inside, "120"]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE)
    done = re.compile(_COMPILED.format(program, method).encode())
    compiled = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # read to the end: a full pipe would stop the JVM
            if done.search(line):
                compiled.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pid = proc.pid
    try:
        assert compiled.wait(90), f"{program}.{method} compiled at tier 4"
        if container:  # the JVM is unshare's child
            pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        yield _Jvm(proc, pid)
    finally:
        _stop(proc)
        reader.join(5)
        Path(f"/tmp/perf-{pid}.map").unlink(missing_ok=True)


def _nspid(pid: int) -> int:
    """The pid of `pid` in its own namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError("no NSpid")


def _perf_map_has(pid: int, text: str) -> bool:
    """Whether the perf map of `pid` (in its own /tmp, named with its own namespace's pid) holds `text`."""
    try:
        nspid = _nspid(pid)
        return text in Path(f"/proc/{pid}/root/tmp/perf-{nspid}.map").read_text(errors="replace")
    except OSError:
        return False


def _share_naming(
    pid: int, function: str, samples: int, *, leaf: bool = False, wait_map: str | None = None
) -> tuple[float, int, str | None]:
    """Profile `pid` until `samples` samples arrived; the share in which a JIT frame of the user
    stack (with `leaf`: its leaf) is named `function`, that sample count, and the outcome of the
    profiler's perf-map request. With `wait_map`, sampling counts once the perf map holds it."""
    named = total = 0
    with Profiler(ProfilerOptions(freq_hz=199, offcpu=False, exec_discovery=False)) as agent:
        agent.start()
        agent.set_pid_filter(pid, abi.FilterFlags.ON_CPU)
        if wait_map is not None:
            # Written by the JVM when the profiler's request reached it: no one else asks here.
            assert wait_until(lambda: _perf_map_has(pid, wait_map), 60.0), "the map the profiler asked for"
            agent.take(timeout=0.1)  # what was sampled before it was written

        def enough() -> bool:
            nonlocal named, total
            agent.check_thread()
            for e in agent.take(timeout=0.1):
                if not (isinstance(e, StackSample) and e.pid == pid):
                    continue
                user = split_stacks(e.stacks, e.kernel_len)[1]
                names = [
                    agent.maps.jit_name(pid, ip if i == 0 else ip - 1) if status == FrameStatus.ANON else None
                    for i, (status, _ref, ip) in enumerate(user)
                ]
                total += e.weight
                if any(n and function in n for n in (names[:1] if leaf else names)):
                    named += e.weight
            return total >= samples

        assert wait_until(enough, 120.0, step=0), (named, total)
        outcome = agent.jvm.outcome(pid)
    return named / total, total, outcome


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_node_hot_js_function_is_named_from_its_perf_map(tmp_path: Path):
    assert NODE is not None
    argv = [NODE, "--perf-basic-prof", str(WORKLOADS_SRC / "hot.js"), "120"]
    with _running(argv, tmp_path) as proc:
        assert wait_until(lambda: _perf_map_has(proc.pid, "JS:*hotLoop"), 60.0), "V8 optimized hotLoop"
        share, total, outcome = _share_naming(proc.pid, "hotLoop", 600)
    # hotLoop runs ~3/4 of the time (perf -g names it in ~87 % of samples here).
    assert share >= 0.6, (share, total)
    assert outcome is None  # its maps map no libjvm.so: never looked at, never signalled


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_record_of_node_without_a_perf_map_says_how_to_name_its_jit_frames(tmp_path: Path):
    assert NODE is not None
    proc = subprocess.Popen(
        [NODE, "--trace-opt", str(WORKLOADS_SRC / "hot.js"), "120"], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        # Optimized (TurboFan): its code is in anonymous memory, unnamed without --perf-basic-prof.
        while b"completed compiling" not in (line := proc.stdout.readline()) or b"hotLoop" not in line:
            assert line, "hotLoop optimized"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # the pipe never fills
        r = record("--pid", str(proc.pid), "-d", "2", "-o", str(tmp_path / "o"), "--format", "folded")
    finally:
        _stop(proc)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "start node with --perf-basic-prof" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("jdk", sorted(JDKS))
def test_java_hot_method_is_named_as_leaf_without_jcmd_or_frame_pointers(tmp_path: Path, jdk: str):
    """No -XX:+PreserveFramePointer, no jcmd: the profiler asks for the perf map when it starts
    sampling the JVM, and the leaf JIT frame is named from its IP."""
    with _hot_jvm(_jdk(jdk), tmp_path) as proc:
        share, total, outcome = _share_naming(proc.pid, "Hot.hotLoop", 600, leaf=True, wait_map="Hot.hotLoop")
        assert proc.poll() is None
    assert outcome == jvm.OK
    # hotLoop is nearly all the work: the target is >= 90 % of its samples named as leaf.
    assert share >= 0.85, (share, total)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed")
def test_a_jvm_in_its_own_namespaces_is_asked_there(tmp_path: Path):
    """A container's JVM: pid 1 of its pid namespace, its own /tmp. The attach goes through its root
    with its namespace's pid, and the perf map it writes there names its frames."""
    with _hot_jvm(_jdk("openjdk17"), tmp_path, container=True) as proc:
        assert _nspid(proc.pid) == 1
        share, total, outcome = _share_naming(proc.pid, "Hot.hotLoop", 400, leaf=True, wait_map="Hot.hotLoop")
        assert Path(f"/proc/{proc.pid}/root/tmp/perf-1.map").exists()
        assert not Path(f"/tmp/perf-{proc.pid}.map").exists()
    assert outcome == jvm.OK
    assert share >= 0.85, (share, total)


def test_java_with_frame_pointers_is_named_through_its_callers(tmp_path: Path):
    with _hot_jvm(_jdk("openjdk17"), tmp_path, "-XX:+PreserveFramePointer") as proc:
        share, total, outcome = _share_naming(proc.pid, "Hot.hotLoop", 600, wait_map="Hot.hotLoop")
    assert outcome == jvm.OK
    # perf -g names it in ~99 % of samples here, after a manual jcmd.
    assert share >= 0.85, (share, total)


def _thread_stacks(
    pprof: Path, profile_pb2: ModuleType, thread: str, skip_tid: int
) -> Counter[tuple[str, ...]]:
    """On-CPU samples of the threads named `thread` (but `skip_tid`) in record's pprof: their stacks,
    leaf first, as function names (a location's inlined lines innermost first, as pprof puts them)."""
    msg = profile_pb2.Profile()
    msg.ParseFromString(gzip.decompress(pprof.read_bytes()))
    st = msg.string_table
    names = {f.id: st[f.name] for f in msg.function}
    frames = {loc.id: [names[line.function_id] for line in loc.line] for loc in msg.location}
    stacks: Counter[tuple[str, ...]] = Counter()
    for s in msg.sample:
        labels = {st[lb.key]: st[lb.str] if lb.str else lb.num for lb in s.label}
        if labels.get("thread_name") != thread or labels.get("tid") == skip_tid or not s.value[0]:
            continue
        stacks[tuple(n for lid in s.location_id for n in frames[lid])] += s.value[0]
    return stacks


def test_record_pid_of_a_jvm_names_its_hot_method_and_walks_through_it(
    tmp_path: Path, profile_pb2: ModuleType
):
    """A JIT method that uses rbp as a register: without -XX:+PreserveFramePointer a frame-pointer walk
    stops at it. Its name comes from the perf map record asks for, and its frame size from its prologue
    (unwind/hotspot.py): the walk goes on to the thread's entry (tests/bpf/test_jit_walk.py).

    Counted on the thread that runs `main` (the launcher's second thread, also named `java`; the first
    waits for it), by its pprof label, not by what the walk found: the compiler and GC threads take more
    samples on a busy host, and are not what is asked here."""
    with _hot_jvm(_jdk("temurin25"), tmp_path, program="Registers", method="mix") as proc:
        out = tmp_path / "o"
        r = record("--pid", str(proc.pid), "-d", "4", "-F", "199", "-o", str(out), "--format", "pprof")
        assert proc.poll() is None
    assert r.returncode == 0, r.stdout + r.stderr
    stacks = _thread_stacks(out / "profile.pb.gz", profile_pb2, "java", skip_tid=proc.pid)
    total = sum(stacks.values())
    leaf = sum(n for stack, n in stacks.items() if stack and "Registers.mix" in stack[0])
    whole = sum(
        n for stack, n in stacks.items() if any(f.startswith(("start_thread", "__clone3")) for f in stack)
    )
    # The main thread is in mix nearly all its time (199 Hz for 4 s: ~800 samples on a quiet host).
    assert total >= 100, (total, r.stdout[-2000:])
    assert leaf / total >= 0.85, (leaf, total, stacks.most_common(5))
    assert whole / total >= 0.85, (whole, total, stacks.most_common(5))


def test_record_without_the_jvm_perf_map_says_how_to_get_names(tmp_path: Path):
    with _hot_jvm(_jdk("openjdk17"), tmp_path) as proc:
        out = str(tmp_path / "o")
        r = record("--pid", str(proc.pid), "-d", "2", "--no-jvm-perfmap", "-o", out, "--format", "folded")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not Path(f"/tmp/perf-{proc.pid}.map").exists()
    assert "jcmd PID Compiler.perfmap" in r.stdout, r.stdout[-2000:]


def test_a_jvm_that_does_not_catch_sigquit_is_never_signalled(tmp_path: Path):
    # -Xrs: no SIGQUIT handler (SIGQUIT would dump core); no attach listener either.
    java = _jdk("openjdk17")
    argv = [str(java), "-Xrs", "-XX:+DisableAttachMechanism", str(WORKLOADS_SRC / "Hot.java"), "120"]
    with _running(argv, tmp_path) as proc:
        assert wait_until(lambda: "libjvm.so" in Path(f"/proc/{proc.pid}/maps").read_text(), 30.0)
        before = jvm.RESULTS[jvm.NO_SIGQUIT_HANDLER]
        maps = jvm.JvmPerfMaps()
        assert maps.attempt(proc.pid) == jvm.NO_SIGQUIT_HANDLER
        maps.request(proc.pid)  # not again within the interval (again after it: it costs no signal)
        assert maps._queue.empty()
        assert jvm.RESULTS[jvm.NO_SIGQUIT_HANDLER] == before + 1
        assert proc.poll() is None
        assert not list(tmp_path.glob(".attach_pid*")) and not Path(f"/tmp/.attach_pid{proc.pid}").exists()


def test_a_process_that_is_not_a_jvm_is_never_signalled(tmp_path: Path):
    # It catches SIGQUIT (as a JVM does) and says so if it ever gets one.
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGQUIT, lambda *_: (print('SIGQUIT', flush=True), sys.exit(3)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(["python3", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert jvm.attach_perf_map(proc.pid).reason == jvm.NOT_JVM
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_planted_attach_socket_is_refused(tmp_path: Path):
    """Someone sharing the JVM's /tmp plants `.java_pid<pid>` before it: another user's socket, a
    symlink, or a socket of root's served by another process. None is spoken to as the JVM."""
    with _running([str(_jdk("openjdk17")), str(WORKLOADS_SRC / "Hot.java"), "120"], tmp_path) as proc:
        assert wait_until(lambda: "libjvm.so" in Path(f"/proc/{proc.pid}/maps").read_text(), 30.0)
        path = f"/tmp/.java_pid{proc.pid}"
        planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            planted.bind(path)
            planted.listen(1)
            os.chown(path, 65534, 65534)
            assert jvm.attach_perf_map(proc.pid).reason == jvm.REFUSED  # another user's
            os.chown(path, 0, 0)
            r = jvm.attach_perf_map(proc.pid)  # root's, but served by this test, not the JVM
            assert (r.reason, r.detail) == (jvm.REFUSED, f"socket served by pid {os.getpid()}")
            os.unlink(path)
            os.symlink("/run/some.sock", path)
            assert jvm.attach_perf_map(proc.pid).reason == jvm.REFUSED
        finally:
            planted.close()
            Path(path).unlink(missing_ok=True)
        # The socket in its place was never the JVM's: it was not signalled, and lives on.
        assert proc.poll() is None

"""JVM perf maps asked for by the agent: HotSpot's dynamic attach, what `jcmd PID Compiler.perfmap` does.

A JVM names its JIT code only on demand: `Compiler.perfmap` (JDK 17+) writes the code cache
as it is now to `/tmp/perf-<pid>.map` (its pid and /tmp in its own namespaces), which
`procmaps.py` reads. This module asks for it without `jcmd`:

- the attach socket `/tmp/.java_pid<nspid>` (reached as `/proc/PID/root/tmp/…`) is used if
  present; else `.attach_pid<nspid>` is created in the JVM's cwd (or its /tmp), owned by its
  user (HotSpot ignores another user's), SIGQUIT sent, the socket awaited, the file removed;
- request, protocol v1: `1\\0jcmd\\0Compiler.perfmap\\0\\0\\0`; reply `<code>\\n<output>`.

The target, and whoever shares its /tmp, is not trusted: a process that does not catch SIGQUIT
(`-Xrs`, or not a JVM: libjvm.so not mapped) is never signalled, since SIGQUIT's default action
dumps core; the attach file is created O_EXCL|O_NOFOLLOW; the socket is opened O_PATH without
following a link, must be a socket owned by the JVM's user or root, is connected through that
descriptor, and its peer must be the JVM itself (SO_PEERCRED); every wait and read is bounded.
Attaches run on one worker thread (`JvmPerfMaps`), at most one per process every
`min_interval_s` (a process found at its exec maps libjvm.so a moment later: asked again at its
next session); one too old is not tried again, one that did not answer the signal (a JVM stalled
in a long pause, or -XX:+DisableAttachMechanism, which prints a thread dump instead) is tried
again at most MAX_ATTACH_TIMEOUTS times in all, `retry_after_s` apart; none still starting is
signalled (no "Signal Dispatcher" thread yet).
Outcomes are counted by reason (`RESULTS`).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import signal
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .. import threads
from ..compat import SLOTS
from . import safeopen

log = logging.getLogger(__name__)

# Outcomes (metric bistouri_jvm_perf_maps_total{reason}).
OK = "ok"  # the JVM wrote its perf map
NOT_JVM = "not_jvm"  # libjvm.so not mapped: never signalled
OLD_JVM = "old_jvm"  # before JDK 17: no Compiler.perfmap
NO_SIGQUIT_HANDLER = "no_sigquit_handler"  # -Xrs (or an embedder): SIGQUIT would kill it
ATTACH_TIMEOUT = "attach_timeout"  # signalled, no socket came (-XX:+DisableAttachMechanism, a stuck VM)
REFUSED = "refused"  # a socket or file in its place that is not the JVM's
FAILED = "failed"  # gone meanwhile, an error reply, or an I/O error
REASONS = (OK, NOT_JVM, OLD_JVM, NO_SIGQUIT_HANDLER, ATTACH_TIMEOUT, REFUSED, FAILED)
# Not tried again for the same process: nothing will change while it lives.
# (no_sigquit_handler is looked at again, which sends nothing: a JVM found early in its start has
# mapped libjvm.so but not yet installed its handlers.)
_FINAL = frozenset((OLD_JVM,))
# A signal that got no answer: tried again later, a few times in all (each one is a SIGQUIT, which
# a JVM without the attach mechanism answers with a thread dump on its stdout).
MAX_ATTACH_TIMEOUTS = 3
RESULTS: Counter[str] = Counter()  # read at scrape time, like safeopen.REFUSED

_SIGQUIT_BIT = 1 << (signal.SIGQUIT - 1)
_MAPS_MAX = 64 << 20  # of /proc/PID/maps read to find libjvm.so
_REPLY_MAX = 64 << 10
_RELEASE_MAX = 64 << 10
_TASKS_MAX = 1 << 14  # threads looked at for the signal dispatcher
_REQUEST = b"1\0jcmd\0Compiler.perfmap\0\0\0"
_SO_PEERCRED = 17
_UCRED = struct.Struct("<iII")  # pid, uid, gid


@dataclass(frozen=True, **SLOTS)
class AttachResult:
    """How an attach to a JVM ended (one of `REASONS`), with a detail for the log."""

    reason: str  # one of REASONS
    detail: str = ""  # for the log


@dataclass(frozen=True, **SLOTS)
class _Proc:
    """A process seen by the JVM attach: its pid in its namespace, credentials and caught signals."""

    nspid: int
    uid: int  # effective: what HotSpot compares with
    gid: int
    sigcgt: int


def _status(base: str) -> _Proc | None:
    fields: dict[bytes, bytes] = {}
    try:
        with open(f"{base}/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                fields[key] = value.strip()
        return _Proc(
            nspid=int(fields[b"NSpid"].split()[-1]),
            uid=int(fields[b"Uid"].split()[1]),
            gid=int(fields[b"Gid"].split()[1]),
            sigcgt=int(fields[b"SigCgt"], 16),
        )
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _libjvm(base: str) -> str | None:
    """The path of the libjvm.so the process maps, None if it maps none."""
    try:
        with open(f"{base}/maps", "rb") as f:
            data = f.read(_MAPS_MAX)
    except OSError:
        return None
    at = data.find(b"/libjvm.so\n")
    if at < 0:
        return None
    start = data.rfind(b" ", 0, at) + 1
    return data[start : at + len(b"/libjvm.so")].decode(errors="replace")


def java_major(release: bytes) -> int | None:
    """The feature version in a JDK's `release` file (JAVA_VERSION="17.0.9" → 17, "1.8.0_392" → 8)."""
    for line in release.splitlines():
        if line.startswith(b"JAVA_VERSION="):
            v = line.partition(b"=")[2].strip(b'"').split(b".")
            try:
                major = int(v[0])
                return int(v[1]) if major == 1 and len(v) > 1 else major
            except ValueError:
                return None
    return None


def _major_of(root_fd: int, libjvm: str) -> int | None:
    """From `<java home>/release` beside `lib/server/libjvm.so`, read inside the process's root."""
    home = os.path.dirname(os.path.dirname(os.path.dirname(libjvm)))
    try:
        fd = safeopen.open_in_root(root_fd, f"{home}/release", max_bytes=_RELEASE_MAX)
    except OSError:
        return None
    try:
        return java_major(os.read(fd, _RELEASE_MAX))
    finally:
        os.close(fd)


def _open_dir(root_fd: int, path: str) -> int:
    """A directory inside the process's root, as an O_PATH descriptor (no link followed)."""
    rel = path.strip("/")
    if not rel:
        return os.dup(root_fd)
    fd = os.dup(root_fd)
    try:
        for name in rel.split("/"):
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _socket_fd(tmp_fd: int, name: str, p: _Proc) -> int | None:
    """The attach socket as an O_PATH descriptor, None if absent; Refused if it is not the JVM's."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tmp_fd)
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (p.uid, 0):
        os.close(fd)
        why = (
            "a symlink"
            if stat.S_ISLNK(st.st_mode)
            else "not a socket"
            if not stat.S_ISSOCK(st.st_mode)
            else "owner"
        )
        raise safeopen.Refused(name, why)
    return fd


def _create_trigger(dir_fd: int, name: str, p: _Proc) -> bool:
    """`.attach_pid<nspid>` in `dir_fd`, owned by the JVM's user; False if it cannot be created here."""
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        os.fchown(fd, p.uid, p.gid)
    except OSError:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        return False
    os.close(fd)
    return True


def _dispatcher_started(base: str) -> bool:
    """Whether HotSpot's "Signal Dispatcher" thread runs: what takes SIGQUIT and starts the attach
    listener. Signalled earlier, in its start, the JVM may look for the attach file after it was
    removed, and print a thread dump instead."""
    try:
        tasks = os.listdir(f"{base}/task")
    except OSError:
        return False
    for tid in tasks[:_TASKS_MAX]:
        try:
            with open(f"{base}/task/{tid}/comm", "rb") as f:
                if f.read(32).startswith(b"Signal Dispatch"):
                    return True
        except OSError:
            continue
    return False


def _still_catches_sigquit(base: str) -> bool:
    p = _status(base)
    return p is not None and bool(p.sigcgt & _SIGQUIT_BIT)


def attach_perf_map(
    pid: int,
    proc_root: str = "/proc",
    *,
    attach_timeout_s: float = 5.0,
    reply_timeout_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> AttachResult:
    """Ask the JVM `pid` to write its perf map. Blocks for at most about the two timeouts."""
    base = f"{proc_root}/{pid}"
    try:
        pidfd = os.pidfd_open(pid)  # the very process checked below is the one signalled
    except OSError as e:
        return AttachResult(FAILED, f"pidfd_open: {e.strerror}")
    try:
        p = _status(base)
        if p is None:
            return AttachResult(FAILED, "gone")
        libjvm = _libjvm(base)
        if libjvm is None:
            return AttachResult(NOT_JVM)
        root_fd = safeopen.open_root(f"{base}/root")
        try:
            major = _major_of(root_fd, libjvm)
            if major is not None and major < 17:
                return AttachResult(OLD_JVM, f"java {major}")
            tmp_fd = _open_dir(root_fd, "/tmp")
        finally:
            os.close(root_fd)
        try:
            found = _socket_fd(tmp_fd, f".java_pid{p.nspid}", p)
            if found is None:
                if not p.sigcgt & _SIGQUIT_BIT:
                    return AttachResult(NO_SIGQUIT_HANDLER)
                if not _dispatcher_started(base):
                    return AttachResult(FAILED, "still starting: no signal dispatcher yet")
                started = _trigger(pidfd, base, tmp_fd, p, attach_timeout_s, clock)
                if isinstance(started, AttachResult):
                    return started
                found = started
            sock = found
            try:
                return _request(sock, pid, reply_timeout_s, clock)
            finally:
                os.close(sock)
        finally:
            os.close(tmp_fd)
    except safeopen.Refused as e:
        return AttachResult(REFUSED, f"{e.filename}: {e.reason}")
    except OSError as e:
        return AttachResult(FAILED, f"{e.filename or ''}: {e.strerror}")
    finally:
        os.close(pidfd)


def _trigger(
    pidfd: int, base: str, tmp_fd: int, p: _Proc, timeout_s: float, clock: Callable[[], float]
) -> int | AttachResult:
    """Start the JVM's attach listener: the trigger file, SIGQUIT, the socket awaited."""
    name = f".attach_pid{p.nspid}"
    try:
        cwd_fd = os.open(f"{base}/cwd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        cwd_fd = -1
    made = -1
    try:
        for d in (cwd_fd, tmp_fd):  # where HotSpot looks, in its order
            if d >= 0 and _create_trigger(d, name, p):
                made = d
                break
        if made < 0:
            return AttachResult(REFUSED, f"{name}: cannot be created")
        # Checked again just before: an exec since the first check resets the handlers.
        if not _still_catches_sigquit(base):
            return AttachResult(NO_SIGQUIT_HANDLER)
        signal.pidfd_send_signal(pidfd, signal.SIGQUIT)
        deadline = clock() + timeout_s
        delay = 0.005
        while True:
            sock = _socket_fd(tmp_fd, f".java_pid{p.nspid}", p)
            if sock is not None:
                return sock
            if clock() >= deadline:
                return AttachResult(ATTACH_TIMEOUT)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
    finally:
        if made >= 0:
            try:
                os.unlink(name, dir_fd=made)
            except OSError:
                pass
        if cwd_fd >= 0:
            os.close(cwd_fd)


def _request(sock_fd: int, pid: int, timeout_s: float, clock: Callable[[], float]) -> AttachResult:
    import socket  # only when a JVM is attached to: ~2 ms of every record's start otherwise

    deadline = clock() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            # Through the descriptor: the socket checked, whatever its name points to now.
            s.connect(safeopen.fd_path(sock_fd))
            peer, _, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, _UCRED.size))
            if peer != pid:
                return AttachResult(REFUSED, f"socket served by pid {peer}")
            s.sendall(_REQUEST)
            reply = b""
            while len(reply) < _REPLY_MAX:
                left = deadline - clock()
                if left <= 0:
                    return AttachResult(FAILED, "no reply in time")
                s.settimeout(left)
                chunk = s.recv(_REPLY_MAX - len(reply))
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            return AttachResult(FAILED, "no reply in time")
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return AttachResult(FAILED, "listener gone")
            raise
    code, _, text = reply.partition(b"\n")
    if b"Unknown diagnostic command" in text:
        return AttachResult(OLD_JVM, "no Compiler.perfmap")
    if code.strip() != b"0" or b"Exception" in text:
        return AttachResult(FAILED, f"reply {reply[:200]!r}")
    return AttachResult(OK)


class JvmPerfMaps:
    """Perf-map requests for the watched processes, done on the `bistouri-jvm` thread.

    `request(pid)` never blocks (a full queue drops the request); each process is attached to at
    most once every `min_interval_s`, never again after a final outcome (`_FINAL`), and after an
    attach timeout only `retry_after_s` later (default: ten intervals), MAX_ATTACH_TIMEOUTS in all.
    `on_result(pid, reason)` is called on the worker thread after each attempt.
    """

    _QUEUE = 256
    _REMEMBERED = 4096  # processes whose last attempt is remembered, oldest forgotten first

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        min_interval_s: float = 60.0,
        retry_after_s: float | None = None,
        on_result: Callable[[int, str], None] | None = None,
        attach: Callable[[int], AttachResult] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc_root = proc_root
        self.min_interval_s = min_interval_s
        self.retry_after_s = 10 * min_interval_s if retry_after_s is None else retry_after_s
        self.on_result = on_result
        self._attach = attach or (lambda pid: attach_perf_map(pid, proc_root))
        self._clock = clock
        self._queue: queue.Queue[int] = queue.Queue(self._QUEUE)
        self._lock = threading.Lock()
        # (pid, start time) -> (when last asked, its outcome or "" while queued, attach timeouts so far)
        self._last: OrderedDict[tuple[int, int], tuple[float, str, int]] = OrderedDict()
        self._attaching = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threads.start("jvm", self._run)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the worker; an attach under way finishes on its own (bounded), unwaited."""
        if self._thread is not None:
            self._stop.set()
            try:
                self._queue.put_nowait(-1)
            except queue.Full:
                pass
            self._thread.join(timeout)
            self._thread = None

    def request(self, pid: int) -> None:
        """Ask for `pid`'s perf map soon, unless asked lately (or pointless for this process)."""
        key = (pid, _start_time(self.proc_root, pid))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and (last[1] == "" or not self._may_ask(last, now - last[0])):
                return
            try:
                self._queue.put_nowait(pid)
            except queue.Full:
                return  # asked again at its next session
            self._last[key] = (now, "", last[2] if last is not None else 0)
            self._last.move_to_end(key)
            while len(self._last) > self._REMEMBERED:
                self._last.popitem(last=False)

    def _may_ask(self, last: tuple[float, str, int], since: float) -> bool:
        """Whether a process whose last attempt ended so, `since` seconds ago, may be asked again
        (`since` = inf: at once, if its outcome allows it)."""
        _when, outcome, timeouts = last
        if outcome in _FINAL:
            return False
        if outcome == ATTACH_TIMEOUT:
            return timeouts < MAX_ATTACH_TIMEOUTS and since >= self.retry_after_s
        return since >= self.min_interval_s

    def outcome(self, pid: int) -> str | None:
        """The last outcome for this process, None if never attempted."""
        key = (pid, _start_time(self.proc_root, pid))
        with self._lock:
            last = self._last.get(key)
        return last[1] or None if last else None

    def refresh(self, pids: Collection[int]) -> None:
        """Now, on the calling thread: `record`, before it names a capture's frames, gets what was
        compiled during the capture."""
        for pid in pids:
            # Not a JVM when first asked may be a JVM now (`java` maps libjvm.so after its start);
            # a process gone meanwhile keeps its last outcome. No rate limit, but the bounds on
            # what is never asked again, or only a few times (attach timeouts).
            key = (pid, _start_time(self.proc_root, pid))
            with self._lock:
                last = self._last.get(key)
            if last is not None and last[1] and not self._may_ask(last, float("inf")):
                continue
            if os.path.exists(f"{self.proc_root}/{pid}/maps"):
                self.attempt(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            pid = self._queue.get()
            if pid < 0:
                return
            self.attempt(pid)

    def attempt(self, pid: int) -> str:
        """One attach, now, on the calling thread (the worker's; tests)."""
        key = (pid, _start_time(self.proc_root, pid))
        try:
            with self._attaching:  # the worker and a refresh never attach at once
                result = self._attach(pid)
        except Exception as e:  # never the worker's end
            log.warning("JVM attach failed unexpectedly. pid=%d error=%r", pid, e)
            result = AttachResult(FAILED, repr(e))
        RESULTS[result.reason] += 1
        with self._lock:
            last = self._last.get(key)
            timeouts = (last[2] if last is not None else 0) + (result.reason == ATTACH_TIMEOUT)
            self._last[key] = (self._clock(), result.reason, timeouts)
        if result.reason not in (OK, NOT_JVM):
            log.info("JVM perf map not written. pid=%d reason=%s %s", pid, result.reason, result.detail)
        if self.on_result is not None:
            self.on_result(pid, result.reason)
        return result.reason


class NoJvmPerfMaps:
    """Perf maps not asked for (`record --no-jvm-perfmap`): the same methods, doing nothing."""

    def start(self) -> None:
        pass

    def close(self, timeout: float = 1.0) -> None:
        pass

    def request(self, pid: int) -> None:
        pass

    def outcome(self, pid: int) -> str | None:
        return None

    def refresh(self, pids: Collection[int]) -> None:
        pass


def _start_time(proc_root: str, pid: int) -> int:
    """The process's start time (clock ticks since boot): a reused pid is another process."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return int(data[data.rfind(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


__all__ = [
    "MAX_ATTACH_TIMEOUTS",
    "REASONS",
    "RESULTS",
    "AttachResult",
    "JvmPerfMaps",
    "NoJvmPerfMaps",
    "attach_perf_map",
    "java_major",
]

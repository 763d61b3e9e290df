"""A pool of long-running llvm-symbolizer processes: file:line and inlined frames.

Each worker is `llvm-symbolizer --output-style=JSON -i --no-demangle` fed one
`"<path>" 0x<vaddr>` line per address on stdin, answering one JSON line per
address. Requests go in chunks. Writing a large chunk before reading deadlocks
once both 64 KiB pipe buffers fill, so one `poll` loop writes (non-blocking)
and reads at the same time; every exchange has a deadline.

Workers start lazily, restart when they crash or time out, and are recycled
when their resident memory passes a budget (DWARF of a big binary fully
touched costs 6-14x its `.debug_info`). Each runs under an address-space limit
(RLIMIT_AS): crafted DWARF of a few KB once took one to 5.5 GB, and in the
service's memory cgroup that kills a neighbour, not only llvm. A file whose
request made a worker crash or time out twice is remembered (`Quarantine`, a
directory shared by the service's processes) and not sent again until it
changes or the entry expires, so one bad file does not pause file:line for
every other. A request is sharded by file path, so
each process parses each binary once. When no llvm-symbolizer is installed the
pool reports `available = False` and every request returns None: callers keep
function names from the symbol table and lose only file:line and inlines.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import resource
import select
import shutil
import subprocess
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .. import atomicfile
from ..compat import SLOTS
from ..discard import Discarded
from ..sha import sha256

# prometheus_client imported only with a registry: `record` passes none and keeps no metric
# (bistouri.discard), which spares it ~75 modules and ~5-8 MB of RSS.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

CANDIDATES = ("llvm-symbolizer-19", "llvm-symbolizer", "/usr/lib/llvm-19/bin/llvm-symbolizer")
MIN_VERSION = 14  # JSON output style

DEFAULT_WORKERS = 2
DEFAULT_CHUNK = 1000  # addresses per exchange
DEFAULT_TIMEOUT_S = 60.0  # per chunk: the first request on a vmlinux parses for seconds
DEFAULT_RSS_LIMIT = 1 << 30
# Address space of one worker: a libc lookup with full DWARF peaks at ~210 MB of it (VmPeak), a
# few hundred MB of DWARF fits; a whole vmlinux's does not (names still come from its .symtab).
DEFAULT_AS_LIMIT = 1 << 30
QUARANTINE_TTL_S = 24 * 3600.0
DEFAULT_WAIT_S = 30.0  # how long a caller waits for a busy worker
_CRASH_WINDOW_S = 60.0
_MAX_CRASHES = 5  # in the window, then the pool pauses
_PAUSE_S = 60.0
_READ_SIZE = 1 << 20


@dataclass(frozen=True, **SLOTS)
class SourceFrame:
    """One frame from DWARF, innermost first in a list. `function` is the raw linkage name."""

    function: str
    file: str
    line: int


class LlvmError(Exception):
    """An exchange with a worker failed (crash, timeout, garbage output)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


def find_llvm_symbolizer(explicit: str | None = None) -> tuple[str | None, int, str]:
    """Locate a usable llvm-symbolizer: (path, major version, help text), or (None, 0, why)."""
    cands = [explicit] if explicit else list(CANDIDATES)
    why = "none of " + ", ".join(cands) + " is installed (apt-get install llvm-19)"
    for cand in cands:
        path = cand if os.path.isabs(cand) and os.access(cand, os.X_OK) else shutil.which(cand)
        if not path:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
            helptext = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as e:
            why = f"{path} does not run: {e}"
            continue
        m = re.search(r"LLVM version (\d+)", out)
        major = int(m.group(1)) if m else 0
        if major < MIN_VERSION:
            why = f"{path} is LLVM {major or 'unknown'}, JSON output needs {MIN_VERSION}+"
            continue
        return path, major, helptext
    return None, 0, why


def parse_json_line(line: bytes) -> list[SourceFrame] | None:
    """One answer line → frames innermost first; [] when DWARF has nothing; None on an error."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "Error" in obj:
        return None
    frames = []
    for s in obj.get("Symbol") or ():
        fn = s.get("FunctionName") or ""
        file = s.get("FileName") or ""
        if not fn and not file:
            continue
        frames.append(SourceFrame(fn, file, int(s.get("Line") or 0)))
    return frames


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Gauge

        self.restarts = Counter(
            "bistouri_symbolizer_llvm_restarts_total",
            "llvm-symbolizer worker restarts, by reason (crash, timeout, rss)",
            ["reason"],
            registry=registry,
        )
        self.addresses = Counter(
            "bistouri_symbolizer_llvm_addresses_total",
            "Addresses sent to llvm-symbolizer, by result "
            "(ok, failed, busy, paused, unavailable, quarantined)",
            ["result"],
            registry=registry,
        )
        self.quarantined = Counter(
            "bistouri_symbolizer_llvm_quarantined_total",
            "Files no longer sent to llvm-symbolizer after a worker failed on them, "
            "by reason (crash, timeout)",
            ["reason"],
            registry=registry,
        )
        self.available = Gauge(
            "bistouri_symbolizer_llvm_available",
            "1 when llvm-symbolizer is installed and usable (file:line and inlines), else 0",
            registry=registry,
        )


def _peak_rss(pid: int) -> int:
    """VmHWM of a live process in bytes, 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _Worker:
    """One llvm-symbolizer process. Callers hold `lock` around `exchange`."""

    def __init__(
        self, argv: list[str], rss_limit: int, metrics: _Metrics | Discarded, name: str, as_limit: int = 0
    ) -> None:
        self.argv = argv
        self.rss_limit = rss_limit
        self.as_limit = as_limit
        self.metrics = metrics
        self.name = name
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.crashes: deque[float] = deque(maxlen=_MAX_CRASHES)
        self.paused_until = 0.0
        self.peak_rss_bytes = 0  # the largest of its processes' peaks, read when each stopped

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEBUGINFOD_")}
        proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            env=env,
        )
        if self.as_limit:
            # Set from here rather than in a preexec_fn (not safe in a threaded parent): the worker has
            # read nothing yet, it waits for its first request on stdin.
            try:
                resource.prlimit(proc.pid, resource.RLIMIT_AS, (self.as_limit, self.as_limit))
            except OSError as e:
                proc.kill()
                proc.wait()
                raise OSError(e.errno, f"cannot limit the address space of llvm-symbolizer: {e}") from e
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)
        return proc

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.peak_rss_bytes = max(self.peak_rss_bytes, _peak_rss(proc.pid))
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def _fail(self, reason: str) -> None:
        self.metrics.restarts.labels(reason).inc()
        if self.proc is not None:
            self.proc.kill()
        self.stop()
        now = time.monotonic()
        self.crashes.append(now)
        if len(self.crashes) == _MAX_CRASHES and now - self.crashes[0] < _CRASH_WINDOW_S:
            self.paused_until = now + _PAUSE_S
            self.crashes.clear()
            log.warning(
                "llvm-symbolizer keeps failing; file:line paused. worker=%s reason=%s pause_s=%d",
                self.name,
                reason,
                _PAUSE_S,
            )

    def rss(self) -> int:
        if self.proc is None:
            return 0
        try:
            with open(f"/proc/{self.proc.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def exchange(self, payload: bytes, n_lines: int, timeout_s: float) -> list[bytes]:
        """Write `payload` (n_lines requests), return the n_lines answers. Raises LlvmError."""
        if self.proc is not None and self.proc.poll() is not None:
            self._fail("crash")  # died between requests (killed, OOM): a crash all the same
        if self.proc is None:
            try:
                self.proc = self._spawn()
            except OSError as e:
                raise LlvmError("crash", f"cannot start {self.argv[0]}: {e}")
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        fd_in, fd_out = proc.stdin.fileno(), proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(fd_out, select.POLLIN)
        poller.register(fd_in, select.POLLOUT)
        view = memoryview(payload)
        written = 0
        chunks: list[bytes] = []
        seen = 0
        try:
            while seen < n_lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LlvmError("timeout", f"{seen}/{n_lines} answers after {timeout_s:.0f} s")
                for fd, ev in poller.poll(left * 1000):
                    if fd == fd_in:
                        if ev & (select.POLLERR | select.POLLHUP):
                            raise LlvmError("crash", "stdin closed")
                        try:
                            written += os.write(fd_in, view[written : written + 65536])
                        except BlockingIOError:
                            pass
                        if written == len(payload):
                            poller.unregister(fd_in)
                    else:
                        data = os.read(fd_out, _READ_SIZE)
                        if not data:
                            raise LlvmError("crash", f"exited with {proc.poll()}")
                        chunks.append(data)
                        seen += data.count(b"\n")
        except BrokenPipeError:
            raise LlvmError("crash", "stdin broken pipe")
        finally:
            view.release()
        lines = b"".join(chunks).split(b"\n")
        if seen != n_lines or lines[-1]:
            raise LlvmError("crash", f"{seen} answer lines for {n_lines} requests")
        return lines[:-1]

    def symbolize(
        self, path: str, addrs: Sequence[int], chunk: int, timeout_s: float
    ) -> tuple[list[list[SourceFrame] | None], str]:
        """Frames per address, and "" or the reason ("crash", "timeout") a chunk failed for good."""
        quoted = b'"' + os.fsencode(path) + b'" '
        out: list[list[SourceFrame] | None] = []
        failed = ""
        for i in range(0, len(addrs), chunk):
            part = addrs[i : i + chunk]
            if failed:  # the file broke a worker: the rest would too
                self.metrics.addresses.labels("failed").inc(len(part))
                out.extend([None] * len(part))
                continue
            payload = b"".join(quoted + b"0x%x\n" % a for a in part)
            for attempt in (0, 1):
                try:
                    lines = self.exchange(payload, len(part), timeout_s)
                    out.extend(parse_json_line(line) for line in lines)
                    self.metrics.addresses.labels("ok").inc(len(part))
                    break
                except LlvmError as e:
                    self._fail(e.reason)
                    # A crash may be bad luck (OOM kill): retry once. A timeout would just repeat.
                    if attempt or e.reason != "crash" or self.paused_until:
                        log.warning(
                            "llvm-symbolizer request failed; frames keep names only. "
                            "worker=%s path=%s addresses=%d error=%s",
                            self.name,
                            path,
                            len(part),
                            e,
                        )
                        self.metrics.addresses.labels("failed").inc(len(part))
                        out.extend([None] * len(part))
                        failed = e.reason
                        break
        if self.rss_limit and self.rss() > self.rss_limit:
            self.metrics.restarts.labels("rss").inc()
            self.stop()
        return out, failed


class Quarantine:
    """Files llvm-symbolizer failed on, not sent again until they change or `ttl_s` passes.

    One small file per entry in `directory` (shared by the service's processes, readable by an
    operator: the path, the reason and the file's identity); in memory when `directory` is None.
    Deleting an entry's file lifts it. Work that could kill the process itself (the OOM killer)
    runs inside `attempt()`: a marker it leaves behind quarantines the file for the next process."""

    def __init__(self, directory: str | None, ttl_s: float = QUARANTINE_TTL_S) -> None:
        self.dir = directory
        self.ttl_s = ttl_s
        self._memory: dict[str, tuple[str, float]] = {}
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    @staticmethod
    def _identity(path: str) -> str:
        try:
            st = os.stat(path)
        except OSError:
            return ""
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def _entry(self, path: str) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, sha256(os.fsencode(path)).hexdigest()[:32])

    @contextlib.contextmanager
    def attempt(self, path: str) -> Iterator[None]:
        """Mark `path` as being worked on by this process for the length of the block."""
        marker = ""
        if self.dir is not None:
            marker = f"{self._entry(path)}.busy-{os.getpid()}"
            try:
                with open(marker, "w") as f:
                    f.write(path + "\n")
            except OSError:
                marker = ""
        try:
            yield
        finally:
            if marker:
                with contextlib.suppress(OSError):
                    os.unlink(marker)

    def _died_on(self, path: str) -> bool:
        """True, and the file quarantined, when a process died inside attempt(path)."""
        died = False
        for marker in glob.glob(glob.escape(self._entry(path)) + ".busy-*"):
            try:
                pid = int(marker.rsplit("-", 1)[1])
                if pid == os.getpid():
                    continue  # another thread of ours, at work
                os.kill(pid, 0)
                continue  # alive
            except ProcessLookupError:
                died = True
            except (ValueError, PermissionError):
                continue
            with contextlib.suppress(OSError):
                os.unlink(marker)
        if died:
            self.add(path, "worker_died")
            log.warning("A process died while it read a file; the file is quarantined. path=%s", path)
        return died

    def holds(self, path: str) -> bool:
        if self.dir is None:
            got = self._memory.get(path)
            if got is None:
                return False
            identity, since = got
            if time.time() - since < self.ttl_s and identity == self._identity(path):
                return True
            del self._memory[path]
            return False
        entry = self._entry(path)
        try:
            with open(entry, "rb") as f:
                identity = f.read(512).split(b"\n", 1)[0].decode("ascii", "replace")
                since = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return self._died_on(path)
        except OSError:
            return False
        if time.time() - since < self.ttl_s and identity == self._identity(path):
            return True
        with contextlib.suppress(OSError):
            os.unlink(entry)
        return False

    def add(self, path: str, reason: str) -> None:
        identity = self._identity(path)
        if self.dir is None:
            self._memory[path] = (identity, time.time())
            return
        body = f"{identity}\n{reason}\n{path}\n".encode(errors="replace")
        try:
            atomicfile.write(self._entry(path), body)  # a cache of failures: not synced
        except OSError as e:
            log.warning("Cannot record a file llvm-symbolizer failed on. path=%s error=%s", path, e)
            self._memory[path] = (identity, time.time())


class LlvmPool:
    """Shards requests by path over a few llvm-symbolizer workers. Thread-safe."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        workers: int = DEFAULT_WORKERS,
        chunk: int = DEFAULT_CHUNK,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        wait_s: float = DEFAULT_WAIT_S,
        rss_limit: int = DEFAULT_RSS_LIMIT,
        as_limit: int = DEFAULT_AS_LIMIT,
        debug_dirs: Sequence[str] = (),
        quarantine_dir: str | None = None,
        registry: CollectorRegistry | None = None,
        lazy: bool = False,
    ) -> None:
        """`lazy`: find llvm-symbolizer on first use, not now (record opens a pool that no binary may
        need)."""
        self.metrics = _Metrics(registry) if registry is not None else Discarded()
        self.quarantine = Quarantine(quarantine_dir)
        self.chunk = max(1, chunk)
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self._workers: list[_Worker] = []
        self._setup_args = (binary, workers, rss_limit, as_limit, debug_dirs)
        self._setup_lock = threading.Lock()
        self._set_up = False
        if not lazy:
            self._setup()

    def _setup(self) -> None:
        """Find llvm-symbolizer (two runs of it, ~57 MB each while they last) and make the workers."""
        with self._setup_lock:
            if self._set_up:
                return
            binary, workers, rss_limit, as_limit, debug_dirs = self._setup_args
            path, self.version, helptext = find_llvm_symbolizer(binary)
            self.binary = path
            self._available = path is not None
            self.metrics.available.set(1 if path is not None else 0)
            self._set_up = True
            if path is None:
                log.warning(
                    "No llvm-symbolizer: frames get function names but no file:line. reason=%s", helptext
                )
                self.unavailable_reason = helptext
                return
            self.unavailable_reason = ""
            argv = [path, "--output-style=JSON", "--inlines", "--no-demangle"]
            if "--no-debuginfod" in helptext:
                argv.append("--no-debuginfod")  # sources.py fetches; the worker must not block on the network
            if "--cache-size" in helptext and rss_limit:
                argv.append(f"--cache-size={rss_limit // 2}")
            argv += [f"--debug-file-directory={d}" for d in debug_dirs]
            self.argv = argv
            self._workers = [
                _Worker(argv, rss_limit, self.metrics, f"llvm-{i}", as_limit) for i in range(max(1, workers))
            ]

    @property
    def available(self) -> bool:
        """Whether llvm-symbolizer is installed and usable (found on first use when `lazy`)."""
        self._setup()
        return self._available

    def symbolize(self, path: str, addrs: Sequence[int]) -> list[list[SourceFrame] | None]:
        """Frames (innermost first) per address of the ELF at `path`; None where unknown or failed."""
        if not addrs:
            return []
        if not self.available:
            self.metrics.addresses.labels("unavailable").inc(len(addrs))
            return [None] * len(addrs)
        if '"' in path or "\n" in path:
            return [None] * len(addrs)
        if self.quarantine.holds(path):
            self.metrics.addresses.labels("quarantined").inc(len(addrs))
            return [None] * len(addrs)
        n = len(self._workers)
        first = zlib.crc32(os.fsencode(path)) % n
        order = [self._workers[(first + i) % n] for i in range(n)]
        # The shard's own worker if free, else any idle one, else wait for the shard's.
        worker = next((w for w in order if w.lock.acquire(blocking=False)), None)
        if worker is None:
            worker = order[0]
            if not worker.lock.acquire(timeout=self.wait_s):
                self.metrics.addresses.labels("busy").inc(len(addrs))
                return [None] * len(addrs)
        try:
            if worker.paused_until > time.monotonic():
                self.metrics.addresses.labels("paused").inc(len(addrs))
                return [None] * len(addrs)
            worker.paused_until = 0.0
            with self.quarantine.attempt(path):  # llvm's memory counts in our cgroup: it may kill us
                out, failed = worker.symbolize(path, addrs, self.chunk, self.timeout_s)
        finally:
            worker.lock.release()
        if failed:
            self.quarantine.add(path, failed)
            self.metrics.quarantined.labels(failed).inc()
            log.warning(
                "A file made llvm-symbolizer fail; it is no longer sent (names only) until it changes. "
                "path=%s reason=%s ttl_s=%d",
                path,
                failed,
                self.quarantine.ttl_s,
            )
        return out

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    @property
    def peak_rss_bytes(self) -> int:
        """The largest peak RSS of a worker process stopped so far (record reports its helpers')."""
        return max((w.peak_rss_bytes for w in self._workers), default=0)

    def close(self) -> None:
        for w in self._workers:
            with w.lock:
                w.stop()

    def __enter__(self) -> LlvmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

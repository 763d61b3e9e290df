"""Helpers for tests that drive real processes, cgroups and PSI."""

from __future__ import annotations

import bisect
import functools
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from bistouri.host import mounts


def cgroup2_mount() -> Path:
    found = mounts.find_cgroup2_mount()
    if found is None:
        raise RuntimeError("no cgroup2 mount")
    return Path(found)


class Cgroup:
    """A child cgroup2 directory where tests place workloads to get per-cgroup *.pressure files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs: list[subprocess.Popen] = []

    @classmethod
    def create(cls, prefix: str = "bistouri-test") -> Cgroup:
        path = cgroup2_mount() / f"{prefix}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return cls(path)

    @property
    def rel(self) -> str:
        return "/" + str(self.path.relative_to(cgroup2_mount()))

    def spawn(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process inside this cgroup (it joins before exec)."""
        procs_file = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))

        p = subprocess.Popen(list(argv), preexec_fn=join, **kw)
        self.procs.append(p)
        return p

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def remove(self) -> None:
        self.kill_all()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def wait_until(predicate: Callable[[], object], timeout: float, step: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(step)
    return predicate()


@functools.cache
def _kernel_functions() -> tuple[list[int], list[str]]:
    rows = []
    with open("/proc/kallsyms") as f:
        for line in f:
            addr, kind, name = line.split()[:3]
            if kind in "tTwW":
                rows.append((int(addr, 16), name))
    rows.sort()
    return [a for a, _ in rows], [n for _, n in rows]


def kernel_function_names(ips: Sequence[int]) -> list[str]:
    """The kernel function holding each address, by /proc/kallsyms (root reads the addresses)."""
    addrs, names = _kernel_functions()
    return [names[bisect.bisect_right(addrs, ip) - 1] for ip in ips]


def waits_on_futex(kernel_ips: Sequence[int]) -> bool:
    """Whether a kernel stack sleeps on a futex (a lock: CPython's GIL), not in a sleep or select call."""
    return any(name.startswith("futex") for name in kernel_function_names(kernel_ips))


def symbols(binary: Path) -> dict[str, tuple[int, int]]:
    """Function symbols of an ELF: name -> (address, size), via nm."""
    out = subprocess.run(
        ["nm", "-S", "--defined-only", str(binary)], capture_output=True, text=True, check=True
    )
    syms = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in ("T", "t"):
            syms[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    return syms


def build_id(binary: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(binary)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "Build ID:" in line:
            return line.split("Build ID:")[1].strip()
    raise AssertionError(f"no build id in {binary}")


def bpf_prog_ids() -> set[int]:
    """IDs of every BPF program loaded in the kernel, via bpftool."""
    import json

    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"] for p in json.loads(out or "[]")}


def own_prog_ids() -> set[int]:
    """Ids of the BPF programs this process holds an fd of (its fdinfo says `prog_id:`): unlike
    the programs loaded on the machine, no other process can change them."""
    ids = set()
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            text = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue  # closed meanwhile
        ids |= {int(line.split()[1]) for line in text.splitlines() if line.startswith("prog_id:")}
    return ids


def bistouri_prog_ids() -> set[int]:
    import json

    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    from bistouri.capture.profiler import EPISODE_PROGRAMS

    names = {"handle_perf", "handle_perf_fp", "handle_sched_switch", "handle_exec", "handle_sched_sw"}
    names |= {"handle_offcpu_wakeup", "handle_offcpu_w"}  # full (BTF) or truncated names
    names |= {*EPISODE_PROGRAMS, *(n[:15] for n in EPISODE_PROGRAMS)}  # full (BTF) or truncated names
    return {p["id"] for p in json.loads(out or "[]") if p.get("name", "") in names}


def run_python_as_nobody(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `code` with the system python3 as `nobody`, with this checkout's package importable.

    The checkout and its virtualenv may sit where only root can traverse (root's home, a
    `mktemp -d`): nobody gets a copy of the package in a directory every user may read, and
    the system interpreter, isolated (-I -S) so that nothing of root's environment is used.
    Only the standard library is importable there."""
    import shutil
    import tempfile

    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        import pytest

        pytest.skip("needs root and setpriv to run as nobody")
    with tempfile.TemporaryDirectory(prefix="bistouri-nobody-") as tmp:
        os.chmod(tmp, 0o755)
        package = Path(__file__).resolve().parents[1] / "bistouri"
        shutil.copytree(package, Path(tmp) / "bistouri", ignore=shutil.ignore_patterns("__pycache__", "ui"))
        argv = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        argv += ["/usr/bin/python3", "-I", "-S", "-c", f"import sys; sys.path.insert(0, {tmp!r}); {code}"]
        return subprocess.run(argv, capture_output=True, text=True, cwd=tmp, timeout=timeout, check=True)


# The CPython interpreters the Python-frame tests run (bistouri/cpython): pyenv's builds (shared
# libpython) of each supported minor version, and Debian's own static /usr/bin/python3.11.
CPYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "debian-3.11")
CPYTHON_TARGET = Path(__file__).resolve().parent.parent / "tests/fixtures/workloads/cpython_target.py"


def cpython(which: str) -> Path | None:
    """The interpreter of `which` (one of CPYTHONS) on this host, None when it is absent."""
    if which == "debian-3.11":
        path = Path("/usr/bin/python3.11")
        return path if path.exists() else None
    versions = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
    try:  # another user than root may not look into /root: absent then
        found = sorted(versions.glob(f"{which}.*/bin/python{which}")) if versions.is_dir() else []
    except OSError:
        return None
    return found[-1] if found else None

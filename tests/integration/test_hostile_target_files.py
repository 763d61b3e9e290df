"""Files a watched process controls, as the real agent and `record` read them (issue 26, N5, N6).

The attacker is a real `nobody` process that runs JIT-like code (a loop in anonymous
executable memory, so the agent names its frames from its perf map) and puts at its
`/tmp/perf-PID.map` a FIFO (the agent froze for good on it) or a symlink to a root-only
file (whose content went into the profile); for `record`, it also replaces a file it
maps with a FIFO (record's build-id tree opened that path). Last, it maps a file with a
crafted `.eh_frame` (the agent parsed it whole before bounding it, and was OOM-killed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import Cgroup, wait_until
from testkit.hostile_cfi import EH_FRAME_ADDR, elf_with_eh_frame, row_bomb
from tests.integration.test_record import record

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

SECRET = "ROOT_ONLY_SECRET"

# Stdlib only, passed with -c: `nobody` may not traverse the checkout. Spins in `jmp .`
# copied to anonymous executable memory; prints its pid, waits for a line, then prints that
# address once its perf map is placed.
SPINNER = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None)
libc.prctl(15, b"jitspin")
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # shared anonymous memory is /dev/zero's
mem = mmap.mmap(-1, 4096, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
mem.write(b"\xeb\xfe")
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
mode, target = sys.argv[1], sys.argv[2]
print(os.getpid(), flush=True)
sys.stdin.readline()  # the test has removed a stale perf map of an earlier process with this pid
if mode == "private":
    libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
path = f"/tmp/perf-{os.getpid()}.map"
if mode == "fifo":
    os.mkfifo(path)
    mapped = f"{target}/mapped-{os.getpid()}"
    with open(mapped, "wb") as f:
        f.write(bytes(4096))
    with open(mapped, "rb") as f:
        keep = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
    os.unlink(mapped)
    os.mkfifo(mapped)
else:
    os.symlink(target, path)
print(hex(addr), flush=True)
ctypes.CFUNCTYPE(None)(addr)()
"""


@pytest.fixture
def nobody_dir() -> Iterator[str]:
    """A directory `nobody` may write in, outside the checkout (it may not traverse it)."""
    d = tempfile.mkdtemp(prefix="bistouri-hostile-")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d)


def _spawn(cg: Cgroup, mode: str, target: str) -> tuple[subprocess.Popen, int]:
    argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    if mode == "private":  # its own mount namespace, where it is root over its own /tmp
        argv += ["unshare", "--user", "--map-root-user", "--mount"]
    spinner = [*argv, "/usr/bin/python3", "-c", SPINNER, mode, target]
    p = cg.spawn(spinner, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    pid = int(p.stdout.readline())
    if mode != "private":
        # A perf map named for this pid before the process made one is an earlier process's (JVMs,
        # node and python -X perf leave theirs in /tmp): root's, which `nobody` could not replace.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/tmp/perf-{pid}.map")
    p.stdin.write(b"\n")
    p.stdin.flush()
    return p, int(p.stdout.readline(), 16)


@pytest.mark.parametrize("mode", ["fifo", "symlink", "private"])
def test_a_hostile_perf_map_neither_freezes_the_agent_nor_leaks_a_root_file(tmp_path, nobody_dir, mode):
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.map"
    cfg = burner_config(comm="jitspin")
    with Cgroup.create() as cg:
        # Three spinners on two CPUs: CPU pressure in their cgroup starts a session.
        spinners = [_spawn(cg, mode, nobody_dir if mode == "fifo" else str(secret)) for _ in range(3)]
        lines = "".join(f"{addr:x} 1000 {SECRET}\n" for _, addr in spinners)
        secret.write_text(lines)
        secret.chmod(0o600)
        pids = {p.pid for p, _ in spinners}
        try:
            with AgentProcess(tmp_path, cfg, walk_interval=2) as agent:
                s = agent.wait_session(
                    lambda s: s.service == "jitspin_svc" and bool(pids & set(s.processes)), 25
                )
                assert s is not None, f"no session: the agent froze?\n{agent.log()[-3000:]}"
                # The loop in anonymous memory was sampled (its perf map consulted), and left unnamed.
                addrs = {addr for _, addr in spinners}
                leaves = [t.user[0] for t in s.traces if t.pid in pids and t.user]
                assert any(f.address in addrs for f in leaves), leaves[:5]
                assert all(SECRET not in f.name for t in s.traces for f in t.user)
                assert SECRET not in agent.log()
                reason = "not_regular" if mode == "fifo" else "symlink"
                assert wait_until(
                    lambda: agent.metrics().get(f'bistouri_files_refused_total{{reason="{reason}"}}', 0) >= 1,
                    10,
                ), agent.metrics()
                t0 = time.monotonic()
                assert agent.proc is not None
                agent.signal(signal.SIGTERM)
                agent.proc.wait(10)
                assert time.monotonic() - t0 < 10
        finally:
            for p, _ in spinners:
                p.kill()
                p.wait()
            for pid in pids:
                Path(f"/tmp/perf-{pid}.map").unlink(missing_ok=True)
        assert not os.path.exists(f"/tmp/perf-{min(pids)}.map")


def test_record_does_not_hang_on_a_target_s_fifos(tmp_path, nobody_dir):
    """`record --pid` of a `nobody` process with a FIFO as its perf map and a FIFO where a file it
    maps was: it samples, writes its outputs and exits."""
    with Cgroup.create() as cg:
        p, _addr = _spawn(cg, "fifo", nobody_dir)
        try:
            r = record("--pid", str(p.pid), "-d", "2", "--no-cache", "-o", str(tmp_path / "o"), timeout=60)
        finally:
            p.kill()
            p.wait()
            Path(f"/tmp/perf-{p.pid}.map").unlink(missing_ok=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "o" / "profile.folded").exists()


# Maps the file given executable and sleeps: its unwind table is prepared as soon as the walk
# finds it (no pressure needed).
MAPPER = r"""
import ctypes, mmap, sys, time
ctypes.CDLL(None).prctl(15, b"cfibomb")
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A v1 memory cgroup of 512 MiB, as the agent's unit ships (MemoryMax=512M)."""
    path = Path("/sys/fs/cgroup/memory") / f"bistouri-test-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(512 << 20))
    yield path
    for pid in (path / "cgroup.procs").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 10)
    path.rmdir()


def test_a_hostile_eh_frame_costs_the_agent_bounded_memory(tmp_path, nobody_dir, memory_cgroup):
    """A `nobody` process maps a file with 10 MB of crafted .eh_frame (a row every 3 bytes): the
    agent, in 512 MiB, refuses it while parsing (it reached 477 MiB, then the OOM killer)."""
    bomb = Path(nobody_dir) / "cfibomb.so"
    bomb.write_bytes(elf_with_eh_frame(row_bomb(10 << 20, address=EH_FRAME_ADDR), os.urandom(20)))
    bomb.chmod(0o644)
    mapper = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c", MAPPER]
        + [str(bomb)],
        stdout=subprocess.PIPE,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline() == b"ready\n"
        agent = AgentProcess(tmp_path, burner_config(comm="cfibomb"), walk_interval=2)
        join = f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"'
        agent.argv = ["sh", "-c", join, "sh", *agent.argv]
        with agent:
            assert agent.proc is not None

            def done() -> bool:
                if agent.proc.poll() is not None:
                    return True
                try:
                    return agent.metrics()['bistouri_unwind_tables_total{source="failed"}'] >= 1
                except OSError:  # killed while answering
                    return False

            assert wait_until(done, 90), agent.log()[-3000:]
            assert agent.proc.poll() is None, f"the agent died\n{agent.log()[-3000:]}"
            assert agent.metrics()['bistouri_unwind_tables_refused_total{reason="too_many_rows"}'] == 1
            status = Path(f"/proc/{agent.proc.pid}/status").read_text()
            hwm = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
            peak = int((memory_cgroup / "memory.max_usage_in_bytes").read_text())
            assert int((memory_cgroup / "memory.failcnt").read_text()) == 0
            # The agent's own peak (about 60 MiB measured), far from its unit's 512 MiB.
            print(f"agent VmHWM {hwm >> 10} MiB, cgroup peak {peak >> 20} MiB")
            assert hwm < 150 << 10 and peak < 256 << 20, (hwm, peak)
    finally:
        mapper.kill()
        mapper.wait()

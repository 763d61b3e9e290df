"""A booted systemd-nspawn container on the VM image's tree, for package and unit tests.

systemd runs as PID 1 inside (real units, real scriptlets) on the host kernel. The tree is
mounted with --volatile=overlay, so every container starts from the pristine image and
leaves nothing behind. The host has no systemd or dbus: the container is not registered
(--register=no) and commands enter it with nsenter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

# What the agent needs from the host kernel, on top of nspawn's default capability set;
# CAP_SYS_RESOURCE cannot be granted: root on the build machines lacks it.
CAPABILITIES = "CAP_BPF,CAP_PERFMON,CAP_SYSLOG"
SYSCALLS = "bpf perf_event_open"


class Container:
    def __init__(self, rootfs: Path, name: str, binds: dict[Path, str], log: Path) -> None:
        self.rootfs, self.name, self.binds, self.log = rootfs, name, binds, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def __enter__(self) -> Container:
        argv = [
            "systemd-nspawn",
            "-D",
            str(self.rootfs),
            "-b",
            "-M",
            self.name,
            "--register=no",
            "--keep-unit",
            "--volatile=overlay",
            f"--capability={CAPABILITIES}",
            f"--system-call-filter={SYSCALLS}",
            "--console=read-only",
        ]
        argv += [f"--bind-ro={src}:{dst}" for src, dst in self.binds.items()]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_booted()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_booted(self, timeout: float = 90) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self.proc.returncode}: see {self.log}")
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            if pids:
                self.leader = int(pids[0])
                r = self.run("systemctl is-system-running --wait", check=False, timeout=60)
                if r.stdout.strip() in ("running", "degraded"):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"container {self.name} did not boot in {timeout} s: see {self.log}")

    def run(self, script: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside the container as root."""
        argv = [
            "nsenter",
            "-t",
            str(self.leader),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-C",
            "-r",
            "-w",
            "/usr/bin/env",
            "-i",
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8",
            "/bin/sh",
            "-c",
            script,
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"in container: {script}\nrc={r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # SIGTERM asks nspawn for a clean shutdown of the container; then insist.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

"""A fleet, for tests and benchmarks: symbolizer instances on one PostgreSQL behind a real
HAProxy, and simulated agents.

Each instance is a real `bistouri symbolizer` in its own memory cgroup (cgroup v1, the
1 GiB its unit ships with) and cpuacct cgroup, which count its memory peak, its OOM kills
and its CPU time. Each agent is the agent's real spool and exporter (its own thread and
HTTP session) sending real-sized sessions (`fleet_session`: 100 stacks of 16 user frames
in a real binary and a few kernel frames) and the kallsyms of its boot, one of `boots`
synthetic snapshots of the same kernel. A session is acknowledged when the exporter
deletes it from the spool: the symbolizer answered `accepted` or `duplicates` for it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.exporter import Exporter
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from testkit.symbolizer import (
    KALLSYMS,
    KERNEL_BUILD_ID,
    KERNEL_IPS,
    REPO,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    symbolizer_command,
    wait_healthy,
)

UNIT_MEMORY_BYTES = 1 << 30  # MemoryMax of the symbolizer's unit
_V1 = Path("/sys/fs/cgroup")
_FUNCTIONS_AT = 0xFFFFFFFF81010000  # after the test kernel's own symbols (conftest.KALLSYMS)


def code_offsets(binary: Path, n: int = 5000) -> list[int]:
    """`n` file offsets spread over the code of `binary`: the distinct addresses a profile has."""
    from bistouri.elf import ElfFile

    with ElfFile(binary) as elf:
        text = next(s for s in elf.segments if s.flags & 1)
    step = max(4, text.filesz // n)
    return list(range(text.offset, text.offset + text.filesz, step))


class UnitCgroups:
    """A v1 memory cgroup limited as the unit is, and a cpuacct cgroup, for one instance."""

    def __init__(self, name: str, memory_bytes: int = UNIT_MEMORY_BYTES) -> None:
        self.dirs = [_V1 / "memory" / name, _V1 / "cpuacct" / name]
        for d in self.dirs:
            d.mkdir()
        (self.dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))

    def join(self) -> None:
        """In the child before exec: itself and what it forks are in both."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def memory_peak(self) -> int:
        return int((self.dirs[0] / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        for line in (self.dirs[0] / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def cpu_seconds(self) -> float:
        return int((self.dirs[1] / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        for d in self.dirs:
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    d.rmdir()
                    break
                except OSError:  # busy until its last process is reaped
                    time.sleep(0.05)


class Instance:
    """A `bistouri symbolizer` in its unit's cgroups, on a free loopback port."""

    def __init__(self, root: Path, name: str, db: str, binary_dir: Path, workers: int) -> None:
        self.name = name
        self.port = free_port()
        self.cgroups = UnitCgroups(f"bistouri-fleet-{name}-{uuid.uuid4().hex[:8]}")
        cmd = symbolizer_command(
            listen_addr=f"127.0.0.1:{self.port}",
            state_dir=root / name,
            db=db,
            workers=workers,
            binary_dir=binary_dir,
            log_level="warning",
        )
        log_path = root / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=clean_env(),
                start_new_session=True,
                preexec_fn=self.cgroups.join,
            )
        self.url = SymbolizerURL(f"http://127.0.0.1:{self.port}")
        self.url.proc, self.url.state_dir, self.url.log_path, self.url.token = (
            proc,
            root / name,
            log_path,
            None,
        )
        wait_healthy(self.url)

    def kill9(self) -> None:
        """kill -9 of the whole instance (gunicorn's master and workers), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.url.proc.pid, signal.SIGKILL)
        self.url.proc.wait(10)

    def close(self) -> None:
        stop(self.url)
        self.cgroups.remove()


def fleet_kallsyms(boot: int, functions: int) -> str:
    """A kallsyms snapshot of the test kernel on boot number `boot`: its symbols, `functions`
    more, and a module loaded at a boot-dependent address (as modules are)."""
    lines = [line for line in KALLSYMS.decode().splitlines() if not line.endswith(" _etext")]
    lines += [f"{_FUNCTIONS_AT + 0x40 * i:016x} T fleet_fn_{i}" for i in range(functions)]
    lines.append(f"{_FUNCTIONS_AT + 0x40 * functions:016x} T _etext")
    lines.append(f"{0xFFFFFFFFC0000000 + 0x1000 * boot:016x} t fleet_mod_init\t[fleet_mod]")
    return "\n".join(lines) + "\n"


def fleet_session(
    sid: str, host: str, boot: bytes, build_id: bytes, offsets: Sequence[int], rng: random.Random
) -> bytes:
    """An encoded session of the size an agent sends for a 10 s episode of a busy service:
    100 distinct stacks, 16 user frames each (addresses in a real binary), 0-6 kernel frames."""
    kips = [*KERNEL_IPS.values(), *(_FUNCTIONS_AT + 0x40 * i + 8 for i in range(0, 4000, 37))]
    traces = []
    for j in range(100):
        user = tuple(wire.UserFrame(wire.FRAME_RESOLVED, build_id, rng.choice(offsets)) for _ in range(16))
        kernel = tuple(rng.choice(kips) for _ in range(rng.randint(0, 6)))
        traces.append(
            wire.Trace(kernel, user, 100, 100 + j % 8, on_cpu=rng.randint(1, 50), off_cpu=rng.randint(0, 3))
        )
    s = wire.Session(
        session_id=sid,
        trigger=wire.Trigger("cpu", "some", 100_000, 2_000_000, "/fleet.slice"),
        kernel=wire.KernelInfo("6.18.0-test", KERNEL_BUILD_ID, 0xFFFFFFFF81000000, boot),
        start_ns=time.time_ns(),
        duration_ns=10 * 10**9,
        period_ns=52_631_578,
        tenant="fleet",
        service=f"svc-{rng.randrange(20)}",
        host=host,
        processes={100: "fleet-demo"},
        traces=traces,
    )
    return wire.encode_session(s)


class Agent:
    """The agent's spool and exporter, sending to `url`, on boot `boot` with `kallsyms`."""

    def __init__(
        self, root: Path, index: int, url: str, boot: bytes, kallsyms: str, backoff_max_s: float
    ) -> None:
        self.host = f"host-{index:03d}"
        self.boot = boot
        self.registry = CollectorRegistry()
        self.spool = Spool(
            str(root / self.host), 256 << 20, registry=self.registry, kernel_build_id=KERNEL_BUILD_ID
        )
        self.exporter = Exporter(
            self.spool,
            AgentSettings(symbolizer_endpoint=url, tenant_id="fleet"),
            registry=self.registry,
            kallsyms_provider=lambda _bid: kallsyms,
            kernel_boot=boot,
            backoff_initial_s=0.1,
            backoff_max_s=backoff_max_s,
        )
        self.spooled: list[str] = []

    def put(self, sid: str, data: bytes) -> None:
        assert self.spool.put(sid, data)
        self.spooled.append(sid)
        self.exporter.notify()

    def metric(self, name: str) -> float:
        return sum(s.value for m in self.registry.collect() for s in m.samples if s.name == name)


class Fleet:
    """`agents` agents over `boots` boots, fed sessions at a steady rate by one thread."""

    def __init__(
        self,
        root: Path,
        url: str,
        agents: int,
        boots: int,
        build_id: bytes,
        offsets: Sequence[int],
        kallsyms_functions: int = 4000,
        backoff_max_s: float = 1.0,
    ) -> None:
        rng = random.Random(26)
        boot_ids = [rng.randbytes(16) for _ in range(boots)]
        texts = [fleet_kallsyms(b, kallsyms_functions) for b in range(boots)]
        self.agents = [
            Agent(root, i, url, boot_ids[i % boots], texts[i % boots], backoff_max_s) for i in range(agents)
        ]
        self.build_id, self.offsets = build_id, offsets
        self._feeder: threading.Thread | None = None
        self.fed = threading.Event()

    def start(self, sessions_per_agent: int, over_s: float) -> None:
        """Start the exporters, and spool `sessions_per_agent` sessions on every agent, spread
        evenly over `over_s` seconds. Sessions are encoded before the clock starts."""
        rng = random.Random(1)
        order = [(k, a) for k in range(sessions_per_agent) for a in self.agents]
        work = [
            (
                a,
                f"{a.host}-{k}",
                fleet_session(f"{a.host}-{k}", a.host, a.boot, self.build_id, self.offsets, rng),
            )
            for k, a in order
        ]
        for a in self.agents:
            a.exporter.start()

        def feed() -> None:
            t0 = time.monotonic()
            for i, (agent, sid, data) in enumerate(work):
                delay = t0 + over_s * i / len(work) - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                agent.put(sid, data)
            self.fed.set()

        self._feeder = threading.Thread(target=feed, name="bistouri-test-fleet-feeder", daemon=True)
        self._feeder.start()

    def spooled(self) -> list[str]:
        return [sid for a in self.agents for sid in a.spooled]

    def pending(self) -> int:
        return sum(len(a.spool) for a in self.agents)

    def acknowledged(self) -> int:
        return sum(len(a.spooled) for a in self.agents) - self.pending()

    def done(self) -> bool:
        return self.fed.is_set() and self.pending() == 0

    def stop(self) -> None:
        if self._feeder is not None:
            self._feeder.join(60)
        for a in self.agents:
            a.exporter.stop(5)

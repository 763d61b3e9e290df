"""Sessions for the UI tests: wire sessions whose user frames are real code of the fixture binaries.

User frames carry the build id and file offsets of functions of `burner` and
`fsyncer` (tests/fixtures/workloads), so the symbolizer names them and finds
their file:line from DWARF. Kernel frames are IPs inside the symbols of a small
kallsyms text uploaded for a made-up kernel build id, the way the agent uploads
/proc/kallsyms.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import time
from dataclasses import dataclass
from pathlib import Path

from bistouri import wire
from bistouri.elf import ElfFile
from bistouri.pressure import PressureFigures

KERNEL_BUILD_ID = bytes.fromhex("b15707e1" * 5)
KERNEL_RELEASE = "6.1.0-ui-test"
TEXT = 0xFFFFFFFF81000000

# Kernel functions of the test kallsyms, each 0x400 bytes long from _text + 0x1000.
KERNEL_FUNCS = (
    "asm_sysvec_apic_timer_interrupt",
    "sysvec_apic_timer_interrupt",
    "__sysvec_apic_timer_interrupt",
    "hrtimer_interrupt",
    "entry_SYSCALL_64_after_hwframe",
    "do_syscall_64",
    "__x64_sys_fsync",
    "do_fsync",
    "ext4_sync_file",
    "file_write_and_wait_range",
    "jbd2_complete_transaction",
    "jbd2_log_wait_commit",
    "__x64_sys_pwrite64",
    "vfs_write",
    "ext4_buffered_write_iter",
    "generic_perform_write",
    "__x64_sys_clock_gettime",
    "schedule",
    "__schedule",
    "io_schedule",
    "asm_exc_page_fault",
    "exc_page_fault",
    "handle_mm_fault",
    "__alloc_pages",
    "try_to_free_pages",
    "shrink_node",
)


def kallsyms_text() -> bytes:
    lines = [f"{TEXT:016x} T _text"]
    for i, name in enumerate(KERNEL_FUNCS):
        lines.append(f"{TEXT + 0x1000 + 0x400 * i:016x} T {name}")
    lines.append(f"{TEXT + 0x1000 + 0x400 * len(KERNEL_FUNCS):016x} T _etext")
    return ("\n".join(lines) + "\n").encode()


def kallsyms_gz() -> bytes:
    return gzip.compress(kallsyms_text())


def kip(name: str) -> int:
    """A kernel IP inside `name` (as a return address would be)."""
    return TEXT + 0x1000 + 0x400 * KERNEL_FUNCS.index(name) + 0x2A


@dataclass
class Binary:
    path: Path
    build_id: bytes
    elf: ElfFile

    @classmethod
    def open(cls, path: Path) -> Binary:
        elf = ElfFile(path)
        bid = elf.build_id
        assert bid, f"{path} has no build id"
        return cls(path, bid, elf)

    def frame(self, func: str, into: int = 8) -> wire.UserFrame:
        """A resolved user frame `into` bytes inside `func`, as a file offset."""
        vaddr = self.elf.find_symbol(func)
        assert vaddr is not None, f"{func} not in {self.path}"
        vaddr += into
        for s in self.elf.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return wire.UserFrame(wire.FRAME_RESOLVED, self.build_id, vaddr - s.vaddr + s.offset)
        raise AssertionError(f"{func} at {vaddr:#x} is in no PT_LOAD of {self.path}")


def _trace(
    user: list[wire.UserFrame],
    kernel: list[str],
    pid: int,
    on: int = 0,
    off: int = 0,
    off_ns: int = 0,
    pre: bool = False,
):
    # Wire stacks are leaf first; the lists here read root first like a flamegraph.
    return wire.Trace(
        kernel=tuple(kip(k) for k in reversed(kernel)),
        user=tuple(reversed(user)),
        pid=pid,
        tid=pid,
        on_cpu=on,
        off_cpu=off,
        off_cpu_ns=off_ns,
        pre_trigger=pre,
    )


def _session(
    sid: str,
    service: str,
    host: str,
    comm: str,
    pid: int,
    resource: str,
    start_ns: int,
    avg: tuple[float, float, float],
    traces: list[wire.Trace],
) -> wire.Session:
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger(
            resource=resource,
            stall="some",
            threshold_us=150_000,
            window_us=1_000_000,
            cgroup=f"/system.slice/{service}.service",
            time_ns=start_ns,
            pressure=PressureFigures(*avg, total_us=98_765_432),
        ),
        kernel=wire.KernelInfo(release=KERNEL_RELEASE, build_id=KERNEL_BUILD_ID, text_addr=TEXT),
        start_ns=start_ns,
        duration_ns=10_000_000_000,
        period_ns=52_631_578,  # 19 Hz
        service=service,
        host=host,
        labels={"env": "test"},
        processes={pid: comm},
        threads={pid: comm},
        traces=traces,
        unwind=wire.UnwindSummary(
            frames={"table": 900, "frame_pointer": 100}, walks={"entry": 97, "no_frame_pointer": 3}
        ),
        unit=f"{service}.service",  # as the agent names the trigger's cgroup (host/cgroupnames.py)
    )


def burner_session(
    sid: str, start_ns: int, hot: int, timer: int, avg: tuple[float, float, float]
) -> wire.Session:
    """A CPU-pressure session of `burner`: main > level1 > level2 > hot_spin, some timer interrupts."""
    b = Binary.open(WORKLOADS / "burner")
    chain = [b.frame("main", 40), b.frame("level1", 4), b.frame("level2", 4)]
    irq = [
        "asm_sysvec_apic_timer_interrupt",
        "sysvec_apic_timer_interrupt",
        "__sysvec_apic_timer_interrupt",
        "hrtimer_interrupt",
    ]
    fault = ["asm_exc_page_fault", "exc_page_fault", "handle_mm_fault", "__alloc_pages", "try_to_free_pages"]
    clock = ["entry_SYSCALL_64_after_hwframe", "do_syscall_64", "__x64_sys_clock_gettime"]
    pid = 4242
    traces = [
        _trace([*chain, b.frame("hot_spin", 12)], [], pid, on=hot),
        _trace([*chain, b.frame("hot_spin", 20)], irq, pid, on=timer),
        _trace([b.frame("main", 60)], clock, pid, on=max(1, hot // 20)),
        _trace([b.frame("main", 60)], [*clock, "schedule", "__schedule"], pid, off=12, off_ns=3_000_000),
        _trace(chain[:1], [*fault, "shrink_node"], pid, on=timer // 2, off=4, off_ns=40_000_000),
    ]
    return _session(sid, "checkout", "web-03", "burner", pid, "cpu", start_ns, avg, traces)


def fsyncer_session(sid: str, start_ns: int) -> wire.Session:
    """An I/O-pressure session of `fsyncer`: mostly blocked in fsync."""
    f = Binary.open(WORKLOADS / "fsyncer")
    main = f.frame("main", 80)
    ws = f.frame("write_and_sync", 16)
    sysc = ["entry_SYSCALL_64_after_hwframe", "do_syscall_64"]
    fsync = [*sysc, "__x64_sys_fsync", "do_fsync", "ext4_sync_file"]
    pid = 5150
    journal = [*fsync, "jbd2_complete_transaction", "jbd2_log_wait_commit", "schedule", "__schedule"]
    writeback = [*fsync, "file_write_and_wait_range", "io_schedule", "schedule", "__schedule"]
    write = [*sysc, "__x64_sys_pwrite64", "vfs_write", "ext4_buffered_write_iter", "generic_perform_write"]
    traces = [
        _trace([main, ws], journal, pid, off=180, off_ns=7_200_000_000),
        _trace([main, ws], writeback, pid, off=60, off_ns=1_900_000_000),
        _trace([main, ws], write, pid, on=35),
        _trace([main, ws], fsync, pid, on=12),
    ]
    s = _session(sid, "storage", "db-01", "fsyncer", pid, "io", start_ns, (38.5, 21.0, 9.4), traces)
    # It runs in a docker container: the trigger's cgroup is the container's scope.
    s.trigger = dataclasses.replace(s.trigger, cgroup=f"/system.slice/docker-{CONTAINER_ID}.scope")
    s.unit, s.container = f"docker-{CONTAINER_ID}.scope", wire.Container(CONTAINER_ID, "docker")
    return s


CONTAINER_ID = "4f1b9c2e7a6d5038b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e"


WORKLOADS = Path(__file__).resolve().parents[1] / "fixtures" / "build" / "workloads"

# The flight-recorder session: 5 s sampled before its trigger, 10 s after.
ONSET_PRE_NS = 5_000_000_000
ONSET_POST_NS = 10_000_000_000


def onset_session(sid: str, trigger_ns: int) -> wire.Session:
    """A memory-pressure session of `burner` with flight-recorder samples before its trigger.

    Before the trigger it faults and reclaims (main > try_to_free_pages > shrink_node); after
    it, it spins (level1 > level2 > hot_spin): the onset's flamegraph differs from the rest.
    """
    b = Binary.open(WORKLOADS / "burner")
    chain = [b.frame("main", 40), b.frame("level1", 4), b.frame("level2", 4)]
    fault = ["asm_exc_page_fault", "exc_page_fault", "handle_mm_fault", "__alloc_pages", "try_to_free_pages"]
    pid = 6161
    traces = [
        _trace(chain[:1], [*fault, "shrink_node"], pid, on=60, off=9, off_ns=90_000_000, pre=True),
        _trace([*chain, b.frame("hot_spin", 12)], [], pid, on=15, pre=True),
        _trace([*chain, b.frame("hot_spin", 12)], [], pid, on=400),
        _trace(chain[:1], [*fault, "shrink_node"], pid, on=5, off=1, off_ns=10_000_000),
    ]
    s = _session(sid, "batch", "web-07", "burner", pid, "memory", trigger_ns, (22.0, 9.5, 2.1), traces)
    s.start_ns = trigger_ns - ONSET_PRE_NS
    s.duration_ns = ONSET_PRE_NS + ONSET_POST_NS
    s.pre_trigger_ns = ONSET_PRE_NS
    return s


def manual_session(sid: str, trigger_ns: int) -> wire.Session:
    """A capture asked of the agent (capture now): no PSI figures, no flight recorder."""
    b = Binary.open(WORKLOADS / "burner")
    pid = 6262
    traces = [_trace([b.frame("main", 40), b.frame("level1", 4)], [], pid, on=50)]
    s = _session(sid, "batch", "web-07", "burner", pid, "cpu", trigger_ns, (0.0, 0.0, 0.0), traces)
    s.trigger = wire.Trigger(
        resource="cpu", cgroup="/system.slice/batch.service", time_ns=trigger_ns, kind=wire.TRIGGER_MANUAL
    )
    return s


def episode_sessions(now_ns: int | None = None) -> dict[str, wire.Session]:
    """The flight-recorder and manual sessions, by role (`onset`, `manual`), of service `batch`."""
    now = now_ns or time.time_ns()
    tag = f"{os.getpid():x}{now & 0xFFFFFF:06x}"
    return {
        "onset": onset_session(f"ui-onset-{tag}", now - 1_200_000_000_000),
        "manual": manual_session(f"ui-manual-{tag}", now - 960_000_000_000),
    }


def ui_sessions(now_ns: int | None = None) -> dict[str, wire.Session]:
    """The sessions the UI tests ingest, by role: `old` and `new` of one service (for the diff), `io`."""
    now = now_ns or time.time_ns()
    tag = f"{os.getpid():x}{now & 0xFFFFFF:06x}"
    return {
        "old": burner_session(
            f"ui-old-{tag}", now - 3_600_000_000_000, hot=300, timer=120, avg=(12.4, 8.7, 3.7)
        ),
        "new": burner_session(
            f"ui-new-{tag}", now - 600_000_000_000, hot=900, timer=60, avg=(46.2, 32.3, 13.9)
        ),
        "io": fsyncer_session(f"ui-io-{tag}", now - 1_800_000_000_000),
    }

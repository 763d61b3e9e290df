"""perf_event_open(2) for the software cpu-clock sampler, through ctypes.

cpu-clock is a software event: it works where there is no hardware PMU (VMs).
"""

from __future__ import annotations

import ctypes
import os
from ctypes import c_uint32, c_uint64

from ..errors import BpfError

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_FLAG_FD_CLOEXEC = 1 << 3
_ATTR_FLAG_FREQ = 1 << 10
_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(os.uname().machine, 298)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER8 (136 bytes)."""

    _fields_ = [
        ("type", c_uint32),
        ("size", c_uint32),
        ("config", c_uint64),
        ("sample_period_or_freq", c_uint64),
        ("sample_type", c_uint64),
        ("read_format", c_uint64),
        ("flags", c_uint64),
        ("wakeup_events", c_uint32),
        ("bp_type", c_uint32),
        ("config1", c_uint64),
        ("config2", c_uint64),
        ("branch_sample_type", c_uint64),
        ("sample_regs_user", c_uint64),
        ("sample_stack_user", c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", c_uint64),
        ("aux_watermark", c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", c_uint32),
        ("reserved_3", c_uint32),
        ("sig_data", c_uint64),
        ("config3", c_uint64),
    ]


assert ctypes.sizeof(PerfEventAttr) == 136


def online_cpus(sysfs: str = "/sys") -> list[int]:
    """CPUs listed in /sys/devices/system/cpu/online ("0-3,5")."""
    with open(os.path.join(sysfs, "devices/system/cpu/online")) as f:
        text = f.read().strip()
    cpus: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def open_cpu_clock(cpu: int, freq_hz: int) -> int:
    """A cpu-clock sampling event on one CPU, for all processes, at `freq_hz`."""
    attr = PerfEventAttr()
    attr.type = PERF_TYPE_SOFTWARE
    attr.size = ctypes.sizeof(PerfEventAttr)
    attr.config = PERF_COUNT_SW_CPU_CLOCK
    attr.sample_period_or_freq = freq_hz
    attr.flags = _ATTR_FLAG_FREQ
    fd = _libc.syscall(_NR_PERF_EVENT_OPEN, ctypes.byref(attr), -1, cpu, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise BpfError(
            f"perf_event_open(cpu-clock, cpu={cpu}, {freq_hz} Hz)",
            err,
            hint="the agent needs CAP_PERFMON (or CAP_SYS_ADMIN) and perf events enabled in the kernel",
        )
    return int(fd)

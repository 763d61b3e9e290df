"""`bistouri check`: can the agent run on this host, and what to do when it cannot.

Each check yields one line: OK, WARN or FAIL, what was found, and what to do.
Only FAIL (something that prevents the agent from running) makes the exit
status non-zero.
"""

from __future__ import annotations

import errno
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..bpf import features, perf
from ..compat import SLOTS
from ..host import kernel, mounts

if TYPE_CHECKING:
    from ..errors import BpfError

OK, WARN, FAIL = "OK", "WARN", "FAIL"

# Capability bits (linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_SYSLOG = 34
CAP_PERFMON = 38
CAP_BPF = 39
CAP_DAC_OVERRIDE = 1
CAP_SYS_PTRACE = 19

MIN_KERNEL = features.FLOOR  # the oldest kernel bistouri runs on (features.py says why)


@dataclass(frozen=True, **SLOTS)
class Result:
    status: str
    name: str
    detail: str
    fix: str = ""


@dataclass(frozen=True, **SLOTS)
class Host:
    """Where to look: overridable so the checks can run against fixture trees."""

    proc: str = "/proc"
    sys: str = "/sys"
    release: str = ""  # the kernel's (uname -r); "" for the running one's


def effective_caps(proc: str = "/proc") -> int:
    for line in Path(proc, "self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _has(caps: int, bit: int) -> bool:
    return bool(caps >> bit & 1)


def check_kernel(host: Host) -> Result:
    release = host.release or platform.release()
    if features.parse_release(release) is None:
        return Result(WARN, "kernel", f"cannot parse release {release!r}")
    refused = features.below_floor(release)
    if refused:
        return Result(FAIL, "kernel", refused, f"upgrade the kernel to {features.FLOOR_TEXT} or newer")
    return Result(OK, "kernel", f"{release} (>= {features.FLOOR_TEXT})")


def check_kernel_features(host: Host, kernel: features.KernelFeatures | None = None) -> list[Result]:
    """What this kernel's BPF lacks and what it costs (features.py): a warning each, never a refusal."""
    if kernel is None and not _kernel_btf(host).exists():
        return []  # read from the BTF: check_btf says why there is none
    if kernel is None:
        from ..bpf.loader import kernel_features

        kernel = kernel_features(str(Path(host.sys, "kernel/btf/vmlinux")))
    if not kernel.compat:
        return [
            Result(OK, "kernel features", "bpf_loop, bpf_task_pt_regs: user stacks walked from unwind tables")
        ]
    return [
        Result(WARN, f"degraded {name}", text, "a kernel >= 5.17 has the full walk")
        for name, text in kernel.costs()
    ]


def _kernel_btf(host: Host) -> Path:
    return Path(host.sys, "kernel/btf/vmlinux")


NO_BTF = "no kernel BTF: the BPF object is not loaded (see btf)"


def check_btf(host: Host) -> Result:
    path = _kernel_btf(host)
    if not path.exists():
        return Result(
            FAIL,
            "btf",
            f"{path} is missing: this kernel was built without CONFIG_DEBUG_INFO_BTF=y, and the BPF "
            "object needs its BTF (its programs attach to BTF tracepoints and are relocated to the "
            "kernel's structures, CO-RE)",
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y: Debian >= 11, Ubuntu >= 20.10, "
            "RHEL >= 8.2, Fedora and Amazon Linux 2's 5.10 kernels have it",
        )
    return Result(OK, "btf", f"{path} ({path.stat().st_size // 1024} KiB)")


def check_libbpf(host: Host) -> Result:
    from ..bpf.handles import library

    try:
        lib = library()
    except OSError as e:
        return Result(FAIL, "libbpf", str(e), "install libbpf 1.x (Debian/Ubuntu: libbpf1, RHEL: libbpf)")
    v = lib.lib.libbpf_version_string().decode()
    whose = "bistouri's own copy: the system has no libbpf >= 1.0" if lib.private else "the system's"
    return Result(OK, "libbpf", f"{v} from {lib.path} ({whose})")


def check_psi(host: Host) -> Result:
    missing = [r for r in ("cpu", "memory", "io") if not Path(host.proc, "pressure", r).exists()]
    if missing:
        return Result(
            FAIL,
            "psi",
            f"{host.proc}/pressure/{{{','.join(missing)}}} missing",
            "enable PSI: CONFIG_PSI=y, and boot with psi=1 where CONFIG_PSI_DEFAULT_DISABLED=y (Debian)",
        )
    try:
        Path(host.proc, "pressure/cpu").read_text()
    except OSError as e:
        return Result(FAIL, "psi", f"cannot read {host.proc}/pressure/cpu: {e.strerror}", "boot with psi=1")
    return Result(OK, "psi", f"{host.proc}/pressure/{{cpu,memory,io}} readable")


def check_cgroup2(host: Host) -> Result:
    mount = mounts.find_cgroup2_mount(host.proc)
    if mount is None:
        return Result(
            FAIL,
            "cgroup2",
            "no cgroup2 mount in /proc/self/mountinfo",
            "mount cgroup2 (systemd: systemd.unified_cgroup_hierarchy=1, or hybrid mode)",
        )
    if mount != "/sys/fs/cgroup":
        return Result(
            WARN,
            "cgroup2",
            f"mounted at {mount} (hybrid v1/v2 hierarchy)",
            "works: per-cgroup PSI files are read there; processes left in the v2 root share /proc/pressure",
        )
    return Result(OK, "cgroup2", f"mounted at {mount}")


def check_capabilities(host: Host) -> list[Result]:
    caps = effective_caps(host.proc)
    admin = _has(caps, CAP_SYS_ADMIN)
    out = []
    for bit, name, why in (
        (CAP_BPF, "CAP_BPF", "load BPF programs and maps"),
        (CAP_PERFMON, "CAP_PERFMON", "open cpu-clock perf events on every CPU"),
    ):
        if _has(caps, bit):
            out.append(Result(OK, f"cap {name}", "present"))
        elif admin:
            out.append(Result(OK, f"cap {name}", "absent, but CAP_SYS_ADMIN covers it"))
        else:
            out.append(
                Result(
                    FAIL,
                    f"cap {name}",
                    f"missing: needed to {why}",
                    f"run as root or grant {name} (the packaged unit does)",
                )
            )
    if _has(caps, CAP_SYS_RESOURCE):
        out.append(Result(OK, "cap CAP_SYS_RESOURCE", "present: PSI windows from 500 ms"))
    else:
        out.append(
            Result(
                WARN,
                "cap CAP_SYS_RESOURCE",
                "missing: the kernel accepts only PSI windows that are multiples of 2 s, "
                "so PSI events arrive ~2 s late",
                "grant CAP_SYS_RESOURCE (AmbientCapabilities= in the unit); "
                "bistouri falls back to 2 s windows",
            )
        )
    if _has(caps, CAP_SYSLOG):
        # Whether kallsyms really shows addresses is checked by "kernel _text" below.
        out.append(Result(OK, "cap CAP_SYSLOG", "present: lets /proc/kallsyms show addresses"))
    else:
        out.append(
            Result(
                WARN,
                "cap CAP_SYSLOG",
                "missing: /proc/kallsyms shows zeros, kernel frames stay unnamed",
                "grant CAP_SYSLOG",
            )
        )
    return out


def check_tracefs(host: Host) -> Result:
    if any(m.fstype == "tracefs" for m in mounts.read(host.proc)):
        return Result(OK, "tracefs", "mounted")
    return Result(
        WARN,
        "tracefs",
        "not mounted: classic tp/ tracepoints cannot attach",
        "nothing to do: bistouri uses tp_btf programs, which need only BTF "
        "(to mount it anyway: mount -t tracefs nodev /sys/kernel/tracing)",
    )


def check_perf_events(host: Host) -> Result:
    try:
        paranoid = Path(host.proc, "sys/kernel/perf_event_paranoid").read_text().strip()
    except OSError:
        paranoid = "?"
    try:
        cpus = perf.online_cpus(host.sys)
        fd = perf.open_cpu_clock(cpus[0], 19)
    except (OSError, IndexError) as e:
        fix = "needs CONFIG_PERF_EVENTS and CAP_PERFMON"
        if (
            isinstance(e, OSError)
            and e.errno in (errno.EACCES, errno.EPERM)
            and paranoid.lstrip("-").isdigit()
            and int(paranoid) > 2
        ):
            # Debian's kernel patch: above 2, only CAP_SYS_ADMIN may open perf events.
            fix = (
                f"kernel.perf_event_paranoid={paranoid} refuses perf events to anything without "
                "CAP_SYS_ADMIN: sysctl -w kernel.perf_event_paranoid=2 (persist it in /etc/sysctl.d; "
                "the Ansible role does)"
            )
        return Result(FAIL, "perf cpu-clock", str(e), fix)
    os.close(fd)
    return Result(
        OK,
        "perf cpu-clock",
        f"software cpu-clock opens on {len(cpus)} online CPUs (perf_event_paranoid={paranoid})",
    )


def check_kernel_symbols(host: Host) -> list[Result]:
    meta = kernel.read_kernel_meta(host.sys, host.proc)
    out = []
    if meta.build_id:
        out.append(Result(OK, "kernel build id", meta.build_id_hex))
    else:
        out.append(
            Result(
                WARN,
                "kernel build id",
                f"no GNU build-id note in {host.sys}/kernel/notes",
                "kernel frames are named from the kallsyms snapshot only",
            )
        )
    try:
        restrict = Path(host.proc, "sys/kernel/kptr_restrict").read_text().strip()
    except OSError:
        restrict = "?"
    if meta.text_addr:
        out.append(Result(OK, "kernel _text", f"{meta.text_addr:#x} (kptr_restrict={restrict})"))
    else:
        if not os.access(Path(host.proc, "kallsyms"), os.R_OK):
            out.append(
                Result(
                    WARN,
                    "kernel _text",
                    f"{host.proc}/kallsyms cannot be read",
                    "kernel frames stay unnamed: do not use ProtectKernelTunables= in the unit "
                    "(systemd hides kallsyms with it) and check the LSM policy",
                )
            )
            return out
        out.append(
            Result(
                WARN,
                "kernel _text",
                f"hidden (kptr_restrict={restrict}): /proc/kallsyms shows zeros",
                "grant CAP_SYSLOG and keep kernel.kptr_restrict <= 1; kernel frames stay unnamed otherwise",
            )
        )
    return out


def check_bpf_object(host: Host) -> Result:
    from ..bpf.loader import kernel_features
    from ..capture.profiler import default_object_path
    from ..errors import BpfError

    path = default_object_path()
    if not _kernel_btf(host).exists():
        # libbpf would only say ESRCH ("failed to find valid kernel BTF").
        return Result(FAIL, "bpf object", NO_BTF)
    kernel = kernel_features()
    try:
        loaded = _load_chosen(path, kernel)
    except BpfError as e:
        if kernel.suffix != features.BOUNDED_SUFFIX:
            return _refused(path, e)
        # As the agent does (loader._load_twins): the frame-pointer twins instead.
        kernel = replace(kernel, bounded_refused=True)
        try:
            loaded = _load_chosen(path, kernel)
        except BpfError as e2:
            return _refused(path, e2)
        return Result(
            WARN, "bpf object", f"{path} loads ({loaded} programs): {features.BOUNDED_REFUSED_COST}"
        )
    if isinstance(loaded, Result):
        return loaded
    which = f", the {kernel.suffix[1:]} twins" if kernel.compat else ""
    return Result(OK, "bpf object", f"{path} loads ({loaded} programs{which})")


def _refused(path: str, e: BpfError) -> Result:
    """The object's refusal, with the verifier's own last words: what it refused, and where."""
    lines = [line for line in e.log.splitlines() if line.strip() and not line.startswith("libbpf:")]
    why = "; ".join(lines[-3:]) if lines else "libbpf gave no verifier log"
    return Result(FAIL, "bpf object", f"{path}: {e.strerror}", f"the verifier: {why}")


def _load_chosen(path: str, kernel: features.KernelFeatures) -> int | Result:
    """Load the programs the agent would on a kernel with `kernel`: how many, or why not (ABI)."""
    from ..bpf import abi
    from ..bpf.handles import BpfObject

    with BpfObject(path) as obj:
        problems = abi.abi_mismatches(obj.btf)
        if problems:
            return Result(FAIL, "bpf object", "; ".join(problems), "rebuild (make bpf) or reinstall")
        # Each stack-taking program or one of its twins, not both.
        chosen = {features.program_for(n, kernel) for n in obj.programs if not features.is_twin(n)}
        for name, prog in obj.programs.items():
            prog.set_autoload(name in chosen)
        obj.load()
    return len(chosen)


def check_config(path: str) -> Result:
    from ..errors import ConfigError
    from .config import load_targets_config

    try:
        cfg = load_targets_config(path)
    except ConfigError as e:
        return Result(
            FAIL,
            "config",
            f"{path}: {len(e.problems)} problem(s)\n    " + "\n    ".join(e.problems),
            "fix the file; nothing was started",
        )
    except OSError as e:
        return Result(FAIL, "config", f"cannot read {path}: {e.strerror}")
    return Result(OK, "config", f"{path}: {len(cfg.targets)} target(s)")


def check_debuginfo(host: Host) -> list[Result]:
    """Which debug sources `bistouri record` reads here by default (names and file:line of libraries)."""
    from ..host import debuginfo

    return [Result(OK, f"debug {name}", detail) for name, detail in debuginfo.describe()]


CHECKS: list[Callable[[Host], Result | list[Result]]] = [
    check_kernel,
    check_btf,
    check_libbpf,
    check_kernel_features,
    check_psi,
    check_cgroup2,
    check_capabilities,
    check_tracefs,
    check_perf_events,
    check_kernel_symbols,
    check_bpf_object,
    check_debuginfo,
]


def run_checks(
    host: Host | None = None, config: str | None = None, config_only: bool = False
) -> list[Result]:
    host = host or Host()
    results: list[Result] = []
    if not config_only:
        for check in CHECKS:
            try:
                r = check(host)
            except Exception as e:  # a check that crashes is a finding, not a crash
                r = Result(FAIL, check.__name__.removeprefix("check_"), f"check failed: {e}")
            results.extend(r if isinstance(r, list) else [r])
    if config:
        results.append(check_config(config))
    return results


def format_results(results: list[Result]) -> str:
    width = max((len(r.name) for r in results), default=10)
    lines = []
    for r in results:
        lines.append(f"{r.status:<4}  {r.name:<{width}}  {r.detail}")
        if r.fix and r.status != OK:
            lines.append(f"{'':<4}  {'':<{width}}  -> {r.fix}")
    return "\n".join(lines)


def exit_status(results: list[Result]) -> int:
    return 1 if any(r.status == FAIL for r in results) else 0

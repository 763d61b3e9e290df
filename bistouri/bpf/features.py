"""What the running kernel offers the BPF programs: the floor, and what an older kernel costs.

The object holds each program that takes a stack three times (bpf/stack.bpf.h): the full one (the
user stack walked from .eh_frame tables by bpf_loop, 5.17; a blocked thread's registers by
bpf_task_pt_regs, 5.15; the Python frames), its `*_bounded` twin (the same walks as bounded loops,
fewer frames, the registers read from the kernel stack: needs global functions taking pointers,
5.12) and its `*_compat` twin (frame pointers only, no Python frames: what 5.10 has). `from_btf()`
reads which helpers the kernel has from its BTF (enum bpf_func_id: no privilege, no program loaded;
loader.kernel_features() parses it once) and names each missing one a degradation, with what it
costs; the loader then loads the twins (`program_for`), and `bistouri check`, `record` and each
session's data-quality note say the cost.

FLOOR is the oldest kernel bistouri runs on (ring buffer 5.8, tp_btf 5.5, CAP_BPF 5.8, and the
oldest kernel the compat programs were written for: 5.10, Debian 11's and Amazon Linux 2's). The
docs, `bistouri check`, the agent's and the roles' preflight and the package metadata say the same.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..compat import SLOTS

TYPE_CHECKING = False  # not typing itself (record's start-up imports)
if TYPE_CHECKING:
    from .handles import Btf

FLOOR = (5, 10)
FLOOR_TEXT = f"{FLOOR[0]}.{FLOOR[1]}"

# For testing only: a comma-separated list of degradation names (or "all") taken as missing even
# where the kernel has them, so that the compat programs run (and are tested) on a recent kernel.
FORCE_ENV = "BISTOURI_FORCE_DEGRADED"


@dataclass(frozen=True, **SLOTS)
class Degradation:
    """A BPF helper an older kernel lacks: since when it exists and what its absence costs."""

    helper: str  # the BPF helper (enum bpf_func_id's name without BPF_FUNC_) whose absence it is
    since: str  # the kernel that brought it
    cost: str  # what its absence costs, in the user's words


# Frames of the bounded walks (bpf/unwind.bpf.h BOUNDED_DEPTH, bpf/python.bpf.h PY_BOUNDED_STEPS).
BOUNDED_DEPTH = 32
PY_BOUNDED_STEPS = 32

DEGRADATIONS: Mapping[str, Degradation] = {
    # The *_bounded programs (5.12-5.16).
    "no_bpf_loop": Degradation(
        "loop",
        "5.17",
        f"user stacks walked from the unwind tables to {BOUNDED_DEPTH} frames and Python stacks to "
        f"{PY_BOUNDED_STEPS} (bounded loops, which the verifier checks iteration by iteration): deeper "
        "stacks are cut (walk end max_depth)",
    ),
    "no_task_pt_regs": Degradation(
        "task_pt_regs",
        "5.15",
        "the user registers of a thread in the kernel (off-CPU, or sampled in a system call) read from "
        "the top of its 16 KiB kernel stack: none on a kernel with larger stacks (KASAN)",
    ),
    # The *_compat programs (5.10, 5.11). bpf_check_mtu stands for its kernel, 5.12, which also let
    # global BPF functions take pointers: the bounded walks need that.
    "no_global_func_args": Degradation(
        "check_mtu",
        "5.12",
        "user stacks walked by frame pointers only (no unwind tables): a stack stops at the first "
        "function built without them (most of Debian's binaries and libraries); no Python frames",
    ),
}

# The programs that take a stack: each has a `<name>_bounded` and a `<name>_compat` twin
# (bpf/bistouri.bpf.c).
STACK_PROGRAMS = frozenset(
    {
        "handle_perf",
        "handle_sched_switch",
        "handle_episode_switch",
        "handle_direct_reclaim_begin",
        "handle_memcg_reclaim_begin",
        "handle_compaction_begin",
    }
)
BOUNDED_SUFFIX = "_bounded"
BOUNDED_REFUSED = "bounded_refused"
BOUNDED_REFUSED_COST = (
    "this kernel's verifier refused the bounded walks: user stacks walked by frame pointers only, "
    "no Python frames, as on 5.10"
)
COMPAT_SUFFIX = "_compat"


@dataclass(frozen=True, **SLOTS)
class KernelFeatures:
    """What this kernel lacks (`DEGRADATIONS` by name) and which program twins it loads."""

    degraded: tuple[str, ...] = ()  # names of DEGRADATIONS, in its order
    forced: bool = False  # some of them by FORCE_ENV (testing)
    # The kernel's verifier refused the bounded twins (loader._load_twins): the compat ones instead.
    bounded_refused: bool = False

    @property
    def compat(self) -> bool:
        """Whether twins are loaded instead of the full programs."""
        return bool(self.degraded)

    @property
    def suffix(self) -> str:
        """The twins' suffix: "" (the full programs), BOUNDED_SUFFIX or COMPAT_SUFFIX."""
        if "no_global_func_args" in self.degraded or self.bounded_refused:
            return COMPAT_SUFFIX
        return BOUNDED_SUFFIX if self.degraded else ""

    @property
    def names(self) -> tuple[str, ...]:
        """The degradations' names, and BOUNDED_REFUSED: what a session's note counts."""
        return self.degraded + ((BOUNDED_REFUSED,) if self.bounded_refused else ())

    def costs(self) -> list[tuple[str, str]]:
        """(name, what is missing and what it costs) of each degradation, for `check` and `record`."""
        forced = f", forced by {FORCE_ENV} for testing" if self.forced else ""
        out = []
        for name in self.degraded:
            d = DEGRADATIONS[name]
            out.append((name, f"no bpf_{d.helper} (kernel < {d.since}{forced}): {d.cost}"))
        if self.bounded_refused:
            out.append((BOUNDED_REFUSED, BOUNDED_REFUSED_COST))
        return out

    def lines(self) -> list[str]:
        return [f"{name}: {text}" for name, text in self.costs()]


FULL = KernelFeatures()


def forced_degradations(env: Mapping[str, str] | None = None) -> set[str]:
    """Those FORCE_ENV names (testing); unknown names are an error, not silently ignored."""
    value = (env if env is not None else os.environ).get(FORCE_ENV, "").strip()
    if not value:
        return set()
    if value == "all":
        return set(DEGRADATIONS)
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names - set(DEGRADATIONS)
    if unknown:
        raise ValueError(f"{FORCE_ENV}: unknown degradation(s) {','.join(sorted(unknown))}")
    return names


def from_helpers(helpers: Collection[str], forced: Collection[str] = ()) -> KernelFeatures:
    """The features of a kernel having `helpers` (names without BPF_FUNC_), `forced` taken as missing."""
    degraded = tuple(n for n, d in DEGRADATIONS.items() if d.helper not in helpers or n in forced)
    return KernelFeatures(degraded, forced=any(n in forced for n in degraded))


def from_btf(btf: Btf | None) -> KernelFeatures:
    """The features of the kernel whose BTF is `btf` (None: unreadable, the full programs are tried
    and their load says what is missing), with FORCE_ENV's taken as missing."""
    ids = btf.enum("bpf_func_id") if btf is not None else None
    helpers = {n.removeprefix("BPF_FUNC_") for n in ids} if ids else {d.helper for d in DEGRADATIONS.values()}
    return from_helpers(helpers, forced_degradations())


def is_twin(name: str) -> bool:
    """Whether `name` is a twin (bounded or compat) of a program taking a stack."""
    return any(
        name.endswith(x) and name.removesuffix(x) in STACK_PROGRAMS for x in (BOUNDED_SUFFIX, COMPAT_SUFFIX)
    )


def program_for(name: str, features: KernelFeatures) -> str:
    """The program to load for `name` (a full one's name) on a kernel with `features`."""
    return name + features.suffix if name in STACK_PROGRAMS else name


def parse_release(release: str) -> tuple[int, int] | None:
    """(major, minor) of a kernel release such as 5.10.0-28-amd64; None if it does not parse."""
    try:
        major, minor = release.split("-")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def below_floor(release: str) -> str | None:
    """Why a kernel `release` is refused, or None if it is at or above FLOOR (or unparsable)."""
    version = parse_release(release)
    if version is None or version >= FLOOR:
        return None
    return (
        f"kernel {release} is older than {FLOOR_TEXT}, the oldest bistouri runs on: it needs the BPF "
        f"ring buffer (5.8), CAP_BPF (5.8) and BTF tracepoints (5.5), and its programs were built "
        f"for {FLOOR_TEXT} and later"
    )

"""Shared test fixtures; what each test needs (markers that `make` targets select, skips without
root or BPF); and failing tests whose threads raised."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
BPF_OBJECT = ROOT / "bistouri" / "bpf" / "_bpfobj" / "bistouri.bpf.o"
WORKLOADS = ROOT / "tests" / "fixtures" / "build" / "workloads"


# --- What each test needs ------------------------------------------------------------
# Every test carries the markers of what it needs to run (docs/testing.md), and `make`
# targets select on them. The vocabulary (registered in pyproject.toml):
#   pure     unprivileged and self-contained: none of the needs below
#   root     root: cgroups, PSI in child cgroups, mounts, namespaces, other users
#   bpf      loads BPF programs or maps into the kernel (so root, CAP_BPF and the object)
#   service  runs bistouri's own programs (agent, symbolizer, record, symbolize, check) or
#            the servers they talk to (PostgreSQL, HAProxy) as processes
#   browser  drives headless Chromium
#   vm       builds the packages and boots the VM image (systemd-nspawn, qemu/molecule)
# `slow` (more than 5 s here) is not a need: it may go with any of them.
NEEDS = ("pure", "root", "bpf", "service", "browser", "vm")

# Spellings from before the vocabulary, read as their new names (branches written earlier).
ALIASES = {"requires_bpf": "bpf", "requires_root": "root"}

# Needs by place; the most specific entry wins (a test, then its module, then its directory).
# A test's own markers and its fixtures' needs (BY_FIXTURE) are added to it.
BY_DIRECTORY = {
    "tests/unit": {"pure"},
    "tests/bpf": {"bpf"},
    "tests/ui": {"pure"},  # the browser and the symbolizer come with their fixtures
    "tests/deploy": {"vm"},
    # tests/integration has no default: each module is listed below.
}
_AGENT = {"bpf", "service"}  # the agent as a process (testkit/agent_harness.py)
_SYMBOLIZER = {"service"}  # the symbolizer as a process (gunicorn), with PostgreSQL or HAProxy
BY_MODULE = {
    "tests/bpf/test_check_command.py": {"bpf", "service"},  # `bistouri check` as a process
    "tests/bpf/test_compat.py": {"bpf", "service"},  # `bistouri record` as a process, fallbacks forced
    "tests/deploy/test_roles.py": {"pure"},  # ansible-lint and syntax checks, no VM
    "tests/ui/test_token.py": {"browser", "service"},  # its own guarded symbolizer
    "tests/integration/test_agent.py": _AGENT,
    "tests/integration/test_agent_log.py": _AGENT,
    "tests/integration/test_agent_jvm.py": _AGENT,
    "tests/integration/test_agent_reload.py": _AGENT,
    "tests/integration/test_cgroup_labels.py": _AGENT,
    "tests/integration/test_end_to_end.py": _AGENT,
    "tests/integration/test_flight_recorder.py": _AGENT,
    "tests/integration/test_hostile_target_files.py": _AGENT,
    "tests/integration/test_outage.py": _AGENT,
    "tests/integration/test_record.py": {"bpf", "service"},  # `bistouri record` as users run it
    "tests/integration/test_episode_report.py": {"bpf"},  # BPF in this process
    "tests/integration/test_session_catch_up.py": {"bpf"},
    "tests/integration/test_recorded_waits.py": {"bpf"},
    "tests/integration/test_psi_cgroup.py": {"root"},
    "tests/integration/test_unit_targets.py": {"root"},
    "tests/integration/test_attacks_input.py": _SYMBOLIZER,
    "tests/integration/test_ingest_failures.py": _SYMBOLIZER,
    "tests/integration/test_exports.py": _SYMBOLIZER,
    "tests/integration/test_postgres.py": _SYMBOLIZER,
    "tests/integration/test_slow_clients.py": _SYMBOLIZER,
    "tests/integration/test_spool_recovery.py": _SYMBOLIZER,
    "tests/integration/test_symbolize_spool_file.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_episode.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_episode_report.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_service.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_labels.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_python.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_token.py": _SYMBOLIZER,
    "tests/integration/test_symbolizer_tokens.py": _SYMBOLIZER,
    "tests/integration/test_upload_quota.py": _SYMBOLIZER,
    "tests/integration/test_upload_trust.py": _SYMBOLIZER,
    "tests/integration/test_upload_trust_postgres.py": _SYMBOLIZER,
    "tests/integration/test_uploads.py": _SYMBOLIZER,
    # Its instances in v1 memory (and cpuacct) cgroups, as the unit ships.
    "tests/integration/test_fleet_load.py": {"service", "root"},
    "tests/integration/test_symbolizer_bounds.py": {"service", "root"},
    "tests/integration/test_kernel_snapshots.py": {"service", "bpf"},
    "tests/integration/test_resolve.py": {"pure"},  # llvm and a debuginfod server in this process
    "tests/integration/test_dwarf_llvm.py": {"pure"},  # the host's binaries against llvm-symbolizer
    "tests/integration/test_cpython.py": {"pure"},  # the host's interpreters, as our children
}
# Tests that need other than their module, by module.
BY_TEST = {
    "tests/unit/symbolizer/test_kallsyms.py": {
        "test_real_proc_kallsyms_parses_fast_enough": {"root"},  # only root sees the addresses
    },
    "tests/unit/test_capture.py": {
        "test_maps_the_agent_may_not_read_are_counted_apart": {"root"},  # runs Python as `nobody`
    },
    "tests/integration/test_ingest_failures.py": {  # these two mount a small tmpfs and fill it
        "test_a_full_database_disk_answers_503_and_loses_nothing": {"service", "root"},
        "test_a_full_kallsyms_cache_answers_503_symbolize_failed": {"service", "root"},
    },
    "tests/integration/test_uploads.py": {
        "test_binary_visible_only_in_a_private_mount_namespace": {"service", "root"},
        "test_a_worker_that_looked_before_the_upload_names_the_session_after_it": {"pure"},  # in process
    },
    # The service's application or its file reader in this process.
    "tests/integration/test_kernel_snapshots.py": {
        "test_each_session_names_module_frames_from_its_own_boots_snapshot": {"pure"},
    },
    "tests/integration/test_symbolizer_episode.py": {
        "test_blobs_stored_before_the_flag_read_as_after_the_trigger": {"pure"},
    },
    "tests/integration/test_symbolize_spool_file.py": {
        "test_read_session_file_bounds_decompression": {"pure"},
    },
}
# The shared fixtures that bring a need to whichever test uses them (directly or not).
BY_FIXTURE = {
    "symbolizer_server": {"service"},
    "postgres": {"service"},
    "symbolizer_url": {"service"},
    "browser": {"browser"},
    "cgroup2": {"root"},
}
# Tests over 5 s on two busy cores that their files do not mark `slow`, by module.
SLOW = {
    "tests/unit/test_ehframe_bounds.py": {"test_a_10_mb_row_bomb_costs_little_memory_and_is_refused"},
    "tests/unit/symbolizer/test_bounds.py": {"test_gnu_debugdata_of_millions_of_symbols_is_bounded"},
    "tests/unit/test_hostile_input.py": {"test_kallsyms_bomb_is_refused_in_bounded_memory"},
    "tests/deploy/test_roles.py": {"test_ansible_lint_is_clean"},
}


def _key(item: pytest.Item) -> tuple[str, str]:
    """(module path from the repository root, test function name without parameters)."""
    # resolve(): ROOT is resolved, a path given on the command line may go through a symlink.
    return item.path.resolve().relative_to(ROOT).as_posix(), getattr(item, "originalname", item.name)


def needs_of(item: pytest.Item) -> set[str]:
    """What `item` needs to run, by the rules above; empty if nothing says."""
    module, name = _key(item)
    base = BY_TEST.get(module, {}).get(name) or BY_MODULE.get(module)
    if base is None:
        base = next(
            (BY_DIRECTORY[str(d)] for d in PurePosixPath(module).parents if str(d) in BY_DIRECTORY), set()
        )
    marked = {ALIASES.get(m.name, m.name) for m in item.iter_markers()} & set(NEEDS)
    needs = set(base) | marked
    for fixture in getattr(item, "fixturenames", ()):
        needs |= BY_FIXTURE.get(fixture, set())
    if "bpf" in needs:
        needs.add("root")  # the suite loads BPF as root only (_bpf_skip_reason)
    if needs - {"pure"}:
        if "pure" in marked:
            raise pytest.UsageError(f"{item.nodeid} is marked pure but needs {sorted(needs - {'pure'})}")
        needs.discard("pure")
    return needs


def _stale_entries() -> list[str]:
    """Table entries that name no test any more (a renamed module or function)."""
    stale = []
    entries = [(module, "") for module in BY_MODULE]
    entries += [(module, name) for table in (BY_TEST, SLOW) for module in table for name in table[module]]
    for module, name in entries:
        path = ROOT / module
        if not path.is_file() or (name and f"def {name}(" not in path.read_text()):
            stale.append(f"{module}::{name}" if name else module)
    return stale


def _cap_eff() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _bpf_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF programs are loaded into the kernel)"
    caps = _cap_eff()
    if not (caps >> 39 & 1 or caps >> 21 & 1):
        return "needs CAP_BPF or CAP_SYS_ADMIN"
    if not BPF_OBJECT.exists():
        return f"{BPF_OBJECT} is not built (run `make bpf`)"
    return None


# First, so that `-m pure` and the like select on the markers given here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bpf_reason = _bpf_skip_reason()
    root_reason = None if os.geteuid() == 0 else "needs root (cgroups, PSI triggers, mounts, other users)"
    unclassified = []
    for item in items:
        needs = needs_of(item)
        if not needs:
            unclassified.append(item.nodeid)
        have = {m.name for m in item.iter_markers()}
        for need in sorted(needs - have):
            item.add_marker(need)
        module, name = _key(item)
        if name in SLOW.get(module, ()) and "slow" not in have:
            item.add_marker("slow")
        if bpf_reason and "bpf" in needs:
            item.add_marker(pytest.mark.skip(reason=bpf_reason))
        elif root_reason and "root" in needs:
            item.add_marker(pytest.mark.skip(reason=root_reason))
    stale = _stale_entries()
    if unclassified or stale:
        lines = ["Every test says what it needs (docs/testing.md)."]
        if unclassified:
            lines.append(
                "Mark these (pytest.mark.pure, root, bpf, service, browser or vm) or list their "
                "module in tests/conftest.py BY_MODULE:"
            )
            lines += [f"  {nodeid}" for nodeid in unclassified]
        if stale:
            lines.append("These entries of tests/conftest.py name no test:")
            lines += [f"  {entry}" for entry in stale]
        raise pytest.UsageError("\n".join(lines))


@pytest.fixture(autouse=True)
def fail_on_thread_exception():
    """A worker thread that raised fails the test that started it (nothing swallowed)."""
    errors: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = errors.append
    try:
        yield
    finally:
        threading.excepthook = previous
    if errors:
        e = errors[0]
        raise AssertionError(
            f"thread {e.thread.name if e.thread else '?'} raised {e.exc_type.__name__}: {e.exc_value}"
        )


@pytest.fixture(scope="session")
def workloads() -> Path:
    """The frame-pointer fixture binaries built by `make fixtures`."""
    if not (WORKLOADS / "burner").exists():
        pytest.fail(f"fixtures not built: run `make fixtures` ({WORKLOADS})")
    return WORKLOADS


@pytest.fixture
def cgroup2(tmp_path):
    """A fresh child cgroup of the cgroup2 mount, removed afterwards (processes killed)."""
    from testkit.helpers import Cgroup

    with Cgroup.create() as cg:
        yield cg


def have(binary: str) -> bool:
    return shutil.which(binary) is not None

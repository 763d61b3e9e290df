"""Shared test fixtures: skips for root/BPF tests, and failing tests whose threads raised."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BPF_OBJECT = ROOT / "bistouri" / "bpf" / "_bpfobj" / "bistouri.bpf.o"
WORKLOADS = ROOT / "tests" / "fixtures" / "build" / "workloads"


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bpf_reason = _bpf_skip_reason()
    root_reason = None if os.geteuid() == 0 else "needs root (cgroups, PSI triggers)"
    for item in items:
        if bpf_reason and "requires_bpf" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=bpf_reason))
        elif root_reason and "requires_root" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=root_reason))


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
    from tests.helpers import Cgroup

    with Cgroup.create() as cg:
        yield cg


def have(binary: str) -> bool:
    return shutil.which(binary) is not None

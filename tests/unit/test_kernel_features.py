"""The kernel floor and the degradations (bistouri/bpf/features.py), with faked kernels."""

from __future__ import annotations

import errno

import pytest

from bistouri.agent import daemon, preflight
from bistouri.bpf import features, loader
from bistouri.errors import BpfError

ALL_HELPERS = {d.helper for d in features.DEGRADATIONS.values()} | {"ringbuf_output", "get_stack"}


def test_a_kernel_with_every_helper_runs_the_full_programs(monkeypatch):
    monkeypatch.delenv(features.FORCE_ENV, raising=False)
    k = features.from_helpers(ALL_HELPERS)
    assert not k.compat and k.lines() == []
    assert features.program_for("handle_perf", k) == "handle_perf"


def test_debian_11s_510_takes_the_frame_pointer_twins():
    k = features.from_helpers(ALL_HELPERS - {"loop", "task_pt_regs", "check_mtu"})
    assert k.degraded == ("no_bpf_loop", "no_task_pt_regs", "no_global_func_args") and not k.forced
    assert features.program_for("handle_perf", k) == "handle_perf_compat"
    assert features.program_for("handle_episode_switch", k) == "handle_episode_switch_compat"
    assert features.program_for("handle_exec", k) == "handle_exec"  # takes no stack: one version
    assert features.program_for("handle_perf_fp", k) == "handle_perf_fp"
    # Each degradation says what is missing, since when, and what it costs.
    assert any("frame pointers only" in line and "5.12" in line for line in k.lines())


def test_ubuntu_22_04s_515_lacks_only_bpf_loop_and_takes_the_bounded_twins():
    k = features.from_helpers(ALL_HELPERS - {"loop"})
    assert k.degraded == ("no_bpf_loop",) and k.compat
    assert features.program_for("handle_sched_switch", k) == "handle_sched_switch_bounded"
    assert f"to {features.BOUNDED_DEPTH} frames" in k.lines()[0]


def test_a_514_kernel_reads_the_registers_from_the_kernel_stack():
    k = features.from_helpers(ALL_HELPERS - {"loop", "task_pt_regs"})
    assert k.suffix == features.BOUNDED_SUFFIX and "kernel stack" in k.lines()[1]


def test_the_testing_knob_forces_degradations_and_says_so(monkeypatch):
    monkeypatch.setenv(features.FORCE_ENV, "no_bpf_loop")
    k = features.from_btf(None)
    assert k.degraded == ("no_bpf_loop",) and k.forced and k.suffix == "_bounded"
    assert "forced by " + features.FORCE_ENV in k.lines()[0]
    monkeypatch.setenv(features.FORCE_ENV, "all")
    assert features.from_btf(None).degraded == tuple(features.DEGRADATIONS)
    assert features.from_btf(None).suffix == "_compat"
    monkeypatch.setenv(features.FORCE_ENV, "no_such_thing")
    with pytest.raises(ValueError, match="no_such_thing"):
        features.from_btf(None)


def test_twins_are_only_those_of_stack_programs():
    assert features.is_twin("handle_perf_compat") and features.is_twin("handle_perf_bounded")
    assert not features.is_twin("handle_perf") and not features.is_twin("handle_exec_compat")


def test_wanted_programs_are_the_twins_on_an_old_kernel(monkeypatch):
    monkeypatch.setattr(loader, "kernel_tracepoints", lambda names, *a: set(names))
    old = features.from_helpers(set())
    programs = loader.wanted_programs(loader.ProfilerOptions(), old)
    assert "handle_perf_compat" in programs and "handle_perf" not in programs
    assert "handle_sched_switch_compat" in programs and "handle_offcpu_wakeup" in programs
    assert loader.wanted_programs(loader.ProfilerOptions(), features.FULL)[0] == "handle_perf"


@pytest.mark.parametrize(
    ("release", "status"),
    [
        ("5.4.0-150-generic", preflight.FAIL),  # Ubuntu 20.04: below the floor
        ("5.8.0-63-generic", preflight.FAIL),
        ("5.10.0-28-amd64", preflight.OK),  # Debian 11
        ("5.15.0-91-generic", preflight.OK),
        ("6.18.44-fc-v657", preflight.OK),
    ],
)
def test_the_floor_is_5_10(release, status):
    r = preflight.check_kernel(preflight.Host(release=release))
    assert r.status == status
    if status == preflight.FAIL:
        assert "older than 5.10" in r.detail and "ring buffer" in r.detail and "5.10" in r.fix


def test_the_agent_refuses_a_kernel_below_the_floor_with_the_reason(monkeypatch):
    # The agent's preflight runs check_kernel on the running kernel: faked here.
    monkeypatch.setattr(preflight.platform, "release", lambda: "5.4.0-150-generic")
    assert preflight.check_kernel in daemon._BLOCKING_CHECKS
    r = preflight.check_kernel(preflight.Host())
    assert r.status == preflight.FAIL and "5.4.0-150-generic is older than 5.10" in r.detail


def test_check_warns_each_degradation_and_never_refuses():
    old = features.from_helpers(ALL_HELPERS - {"loop"})
    results = preflight.check_kernel_features(preflight.Host(), old)
    assert [r.name for r in results] == ["degraded no_bpf_loop"]
    assert results[0].status == preflight.WARN and "to 32 frames" in results[0].detail
    assert preflight.check_kernel_features(preflight.Host(), features.FULL)[0].status == preflight.OK
    assert preflight.check_kernel_features in daemon._BLOCKING_CHECKS  # logged as warnings at start


def test_the_floor_stated_is_the_floor_tested():
    """docs, the role's preflight and the package metadata say the floor check_kernel enforces."""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    floor = features.FLOOR_TEXT
    said = {
        "docs/agent.md": f"kernel ≥ {floor}",
        "docs/check.md": f"older than {floor}",
        "docs/deployment.md": f"the kernel is >= {floor}",
        "ansible/roles/bistouri_agent/vars/main.yml": f'_bistouri_agent_min_kernel: "{floor}"',
        "ansible/roles/bistouri_agent/meta/argument_specs.yml": f"kernel >= {floor}",
        "packaging/nfpm/bistouri-agent.yaml": f"Linux >= {floor}",
    }
    for path, text in said.items():
        assert text in (root / path).read_text(), path
    assert preflight.MIN_KERNEL == features.FLOOR


def test_a_verifier_that_refuses_the_bounded_walks_gets_the_frame_pointer_ones(monkeypatch):
    """Only 6.18's verifier was tried on the bounded twins: an older one that refuses them costs the
    table walk, not the agent, and the cost is said from then on."""
    k515 = features.from_helpers(ALL_HELPERS - {"loop"})
    monkeypatch.setattr(loader, "_kernel_facts", lambda path: (frozenset(), k515))
    monkeypatch.setattr(loader, "_bounded_refused", None)
    tried = []

    def load(kernel: features.KernelFeatures) -> str:
        tried.append(features.program_for("handle_perf", kernel))
        if kernel.suffix == features.BOUNDED_SUFFIX:
            raise BpfError("loading BPF object", errno.EACCES, log="back-edge")
        return "loaded"

    assert loader._load_twins(load) == "loaded"  # type: ignore[arg-type]
    assert tried == ["handle_perf_bounded", "handle_perf_compat"]
    now = loader.kernel_features()
    assert now.bounded_refused and now.names == ("no_bpf_loop", "bounded_refused")
    assert "refused the bounded walks" in now.lines()[-1]
    # A failure of the full programs, or of the compat ones, is the load's own: raised.
    monkeypatch.setattr(loader, "_bounded_refused", None)
    monkeypatch.setattr(loader, "_kernel_facts", lambda path: (frozenset(), features.FULL))
    with pytest.raises(BpfError):
        loader._load_twins(lambda kernel: (_ for _ in ()).throw(BpfError("load", errno.EINVAL)))

from __future__ import annotations

from pathlib import Path

from bistouri.agent import preflight


def _host(tmp_path: Path, caps: int, pressure: bool = True, mounts: str = "") -> preflight.Host:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/status").write_text(f"Name:\tx\nCapEff:\t{caps:016x}\n")
    (proc / "self/mountinfo").write_text(
        mounts or "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    if pressure:
        (proc / "pressure").mkdir()
        for r in ("cpu", "memory", "io"):
            (proc / "pressure" / r).write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    return preflight.Host(proc=str(proc), sys=str(tmp_path / "sys"))


def test_missing_sys_resource_is_a_warning_with_guidance(tmp_path):
    caps = 1 << preflight.CAP_BPF | 1 << preflight.CAP_PERFMON | 1 << preflight.CAP_SYSLOG
    results = {r.name: r for r in preflight.check_capabilities(_host(tmp_path, caps))}
    r = results["cap CAP_SYS_RESOURCE"]
    assert r.status == preflight.WARN and "2 s" in r.detail and "AmbientCapabilities" in r.fix
    assert results["cap CAP_BPF"].status == preflight.OK


def test_missing_bpf_capability_fails(tmp_path):
    results = {r.name: r for r in preflight.check_capabilities(_host(tmp_path, 0))}
    assert results["cap CAP_BPF"].status == preflight.FAIL
    assert preflight.exit_status(list(results.values())) == 1


def test_sys_admin_covers_bpf_and_perfmon(tmp_path):
    results = {r.name: r for r in preflight.check_capabilities(_host(tmp_path, 1 << preflight.CAP_SYS_ADMIN))}
    assert results["cap CAP_BPF"].status == preflight.OK


def test_psi_missing_says_boot_with_psi_1(tmp_path):
    r = preflight.check_psi(_host(tmp_path, 0, pressure=False))
    assert r.status == preflight.FAIL and "psi=1" in r.fix


def test_unmounted_tracefs_is_a_warning_that_needs_no_action(tmp_path):
    r = preflight.check_tracefs(_host(tmp_path, 0))
    assert r.status == preflight.WARN and "tp_btf" in r.fix


def test_warnings_do_not_change_the_exit_status():
    results = [preflight.Result(preflight.WARN, "x", "y"), preflight.Result(preflight.OK, "z", "w")]
    assert preflight.exit_status(results) == 0
    text = preflight.format_results(results)
    assert text.splitlines()[0].startswith("WARN")


def test_refused_perf_event_under_debian_paranoid_3_says_set_it_to_2(tmp_path, monkeypatch):
    host = _host(tmp_path, 1 << preflight.CAP_PERFMON)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/perf_event_paranoid").write_text("3\n")
    monkeypatch.setattr(preflight.perf, "online_cpus", lambda _sys: [0])

    def refuse(cpu: int, freq: int) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(preflight.perf, "open_cpu_clock", refuse)
    r = preflight.check_perf_events(host)
    assert r.status == preflight.FAIL
    assert "perf_event_paranoid=3" in r.fix and "kernel.perf_event_paranoid=2" in r.fix


def test_unreadable_kallsyms_names_the_cause(tmp_path, monkeypatch):
    host = _host(tmp_path, 1 << preflight.CAP_SYSLOG)
    monkeypatch.setattr(
        preflight.kernel,
        "read_kernel_meta",
        lambda _sys, _proc: preflight.kernel.KernelMeta(release="6.1", build_id=b"", text_addr=0),
    )
    results = {r.name: r for r in preflight.check_kernel_symbols(host)}
    r = results["kernel _text"]
    assert r.status == preflight.WARN and "kallsyms cannot be read" in r.detail
    assert "ProtectKernelTunables" in r.fix


def test_a_kernel_without_btf_is_refused_with_the_reason_and_nothing_else_is_tried(tmp_path):
    host = _host(tmp_path, 0)  # its sys tree has no kernel/btf/vmlinux
    r = preflight.check_btf(host)
    assert r.status == preflight.FAIL and "CONFIG_DEBUG_INFO_BTF=y" in r.detail and "Debian >= 11" in r.fix
    # Not "full walk" from a BTF that is not there, nor libbpf's bare ESRCH.
    assert preflight.check_kernel_features(host) == []
    r = preflight.check_bpf_object(host)
    assert r.status == preflight.FAIL and r.detail == preflight.NO_BTF


def test_a_refused_object_is_reported_with_the_verifiers_last_words():
    """5.10's refusal of a raw-copy read, as libbpf hands it over: the FAIL line says what the
    verifier refused (its last lines), not a flag that does not exist."""
    import errno

    from bistouri.agent.preflight import FAIL, _refused
    from bistouri.errors import BpfError

    log = (
        "[handle_perf_fp]\n426: (85) call bpf_probe_read_user#112\n"
        "invalid access to map value, value_size=23672 off=19575 size=16380\n"
        "R1 max value is outside of the allowed memory range\n"
        "processed 478 insns (limit 1000000) max_states_per_insn 1 total_states 38\n"
    )
    r = _refused("/x.bpf.o", BpfError("loading BPF object /x.bpf.o", errno.EACCES, log=log))
    assert r.status == FAIL and "Permission denied" in r.detail and "--- libbpf" not in r.detail
    assert "invalid access to map value" in r.fix and "processed 478 insns" in r.fix
    assert "--verbose" not in r.fix
    assert "no verifier log" in _refused("/x", BpfError("loading", errno.EACCES)).fix

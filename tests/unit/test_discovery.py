"""Discovery on fixture trees: a unit's cgroup is found by name, cgroup targets take their members."""

from __future__ import annotations

import threading
from pathlib import Path

from bistouri.agent.config import parse_targets_config
from bistouri.agent.discovery import WalkJob, find_unit_cgroup, walk_processes
from bistouri.agent.matcher import CommMatcher


def _process(proc: Path, pid: int, comm: str, cgroup: str) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = " ".join(["0"] * 10 + ["1", "0", "4242"] + ["0"] * 20)
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 {rest}\n")
    (d / "comm").write_text(f"{comm}\n")  # what the walk reads first
    (d / "cgroup").write_text(f"0::{cgroup}\n")


def _cgroup(root: Path, rel: str, pids: list[int]) -> None:
    d = root / rel.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


def test_a_unit_is_the_shallowest_cgroup_of_its_name(tmp_path):
    _cgroup(tmp_path, "/user.slice/user-1000.slice/user@1000.service/app.slice/db.service", [])
    _cgroup(tmp_path, "/system.slice/db.service/db.service", [])  # a child of the same name
    assert find_unit_cgroup(str(tmp_path), "db.service") == "/system.slice/db.service"
    assert (
        find_unit_cgroup(str(tmp_path), "user@1000.service")
        == "/user.slice/user-1000.slice/user@1000.service"
    )
    assert find_unit_cgroup(str(tmp_path), "absent.service") is None
    assert find_unit_cgroup(str(tmp_path / "nothing"), "db.service") is None


def test_the_walk_takes_every_member_of_a_cgroup_or_unit_target_whatever_its_comm(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _process(proc, 10, "nginx", "/system.slice/nginx.service")
    _process(proc, 11, "worker", "/system.slice/nginx.service/sub")
    _process(proc, 12, "sshd", "/system.slice/ssh.service")
    _process(proc, 13, "burner", "/batch")
    _cgroup(cg, "/system.slice/nginx.service", [10])
    _cgroup(cg, "/system.slice/nginx.service/sub", [11])
    _cgroup(cg, "/system.slice/ssh.service", [12])
    _cgroup(cg, "/batch", [13])
    cfg = parse_targets_config(
        "targets:\n"
        "  - {rule: {type: Exact, comm: burner}, service_id: a, resources: [{resource: cpu, threshold: 1}]}\n"
        "  - {unit: nginx.service, service_id: b, resources: [{resource: cpu, threshold: 1}]}\n"
        "  - {cgroup: /batch, service_id: c, resources: [{resource: io, threshold: 1}]}\n"
        "  - {unit: gone.service, service_id: d, resources: [{resource: cpu, threshold: 1}]}\n"
    )
    job = WalkJob(CommMatcher(cfg.targets), 1, tuple(t for t in cfg.targets if t.rule is None), str(cg))
    result = walk_processes(job, str(proc), threading.Event())
    found = {p.pid: (p.comm, p.cgroup, p.rule_ids) for p in result.found}
    assert found == {
        10: ("nginx", "/system.slice/nginx.service", (2,)),
        11: ("worker", "/system.slice/nginx.service/sub", (2,)),
        13: ("burner", "/batch", (1, 3)),  # by its comm and by its cgroup
    }
    assert result.target_cgroups == {2: "/system.slice/nginx.service", 3: "/batch"}


def test_the_walk_reads_the_stat_of_named_processes_only_and_skips_kernel_threads(tmp_path, monkeypatch):
    """Names first: a process no target names costs its `comm` read; a kernel thread of a matching
    name, or a process gone before its `stat` was read, is not taken."""
    from bistouri.host import procfs

    proc = tmp_path / "proc"
    _process(proc, 10, "burner", "/a")
    _process(proc, 11, "sshd", "/b")
    _process(proc, 12, "burner", "/")  # a kernel thread of that name
    stat = proc / "12" / "stat"
    stat.write_text(stat.read_text().replace(" 4194304 ", f" {procfs.PF_KTHREAD} "))
    _process(proc, 13, "burner", "/c")
    (proc / "13" / "stat").unlink()  # exited after its comm was read
    (proc / "14").mkdir()  # gone at once: no comm either
    read: list[int] = []
    read_stat = procfs.read_stat
    monkeypatch.setattr(procfs, "read_stat", lambda pid, root: read.append(pid) or read_stat(pid, root))
    cfg = parse_targets_config(
        "targets:\n"
        "  - {rule: {type: Exact, comm: burner}, service_id: a, resources: [{resource: cpu, threshold: 1}]}\n"
    )
    result = walk_processes(WalkJob(CommMatcher(cfg.targets), 1), str(proc), threading.Event())
    assert [(p.pid, p.comm, p.cgroup, p.starttime) for p in result.found] == [(10, "burner", "/a", 4242)]
    assert read == [10, 12, 13]


def test_where_a_unit_was_found_is_checked_first_and_forgotten_when_gone(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _process(proc, 10, "nginx", "/a.slice/nginx.service")
    _cgroup(cg, "/a.slice/nginx.service", [10])
    cfg = parse_targets_config(
        "targets:\n  - {unit: nginx.service, service_id: b, resources: [{resource: cpu, threshold: 1}]}\n"
    )
    job = WalkJob(CommMatcher(cfg.targets), 1, cfg.targets, str(cg))
    units: dict[str, str] = {}
    assert walk_processes(job, str(proc), threading.Event(), units=units).target_cgroups == {
        1: "/a.slice/nginx.service"
    }
    assert units == {"nginx.service": "/a.slice/nginx.service"}
    # The unit restarts in another slice: the remembered place is gone, it is searched again.
    (cg / "a.slice" / "nginx.service" / "cgroup.procs").unlink()
    (cg / "a.slice" / "nginx.service").rmdir()
    _cgroup(cg, "/b.slice/nginx.service", [10])
    assert walk_processes(job, str(proc), threading.Event(), units=units).target_cgroups == {
        1: "/b.slice/nginx.service"
    }
    assert units == {"nginx.service": "/b.slice/nginx.service"}


def test_a_unit_is_looked_for_through_slices_only(tmp_path):
    """Below a service or a scope, cgroups belong to the unit's processes (Delegate=): a directory
    named like a unit there is never the unit."""
    _cgroup(tmp_path, "/user.slice/user-1000.slice/user@1000.service/app.slice/db.service", [])
    _cgroup(tmp_path, "/system.slice/docker.service/nginx.service", [])
    assert find_unit_cgroup(str(tmp_path), "db.service") is None
    assert find_unit_cgroup(str(tmp_path), "nginx.service") is None
    _cgroup(tmp_path, "/a.slice/a-b.slice/nginx.service", [])
    assert find_unit_cgroup(str(tmp_path), "nginx.service") == "/a.slice/a-b.slice/nginx.service"

"""procfs parsers against the fixture trees in tests/fixtures/{proc,cgroup}, plus the live /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bistouri.host import procfs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROC = str(FIXTURES / "proc")
CGROUP = str(FIXTURES / "cgroup")


def test_iter_pids_lists_numeric_entries_only():
    assert list(procfs.iter_pids(PROC)) == [2, 100, 200, 300, 400, 500]


def test_iter_processes_skips_vanished():
    stats = {s.pid: s for s in procfs.iter_processes(PROC)}
    assert sorted(stats) == [2, 100, 200, 400, 500]  # 300 has no stat any more


def test_read_comm_and_missing():
    assert procfs.read_comm(100, PROC) == "nginx"
    assert procfs.read_comm(300, PROC) is None
    assert procfs.read_comm(999, PROC) is None


def test_read_stat_fields():
    st = procfs.read_stat(100, PROC)
    assert st == procfs.ProcStat(
        pid=100, comm="nginx", state="S", ppid=1, flags=0x400140, num_threads=2, starttime=4242
    )
    assert not st.is_kernel_thread


def test_read_stat_comm_with_parenthesis_uses_last_paren():
    st = procfs.read_stat(200, PROC)
    assert st is not None
    assert st.comm == "a) b (c"
    assert (st.state, st.ppid, st.starttime) == ("R", 100, 5000)


def test_kernel_thread_flag():
    st = procfs.read_stat(2, PROC)
    assert st is not None and st.is_kernel_thread


@pytest.mark.parametrize(
    "data",
    [b"", b"12 (x", b"12 (x) S 1 2", b"12 (x) S one 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"],
)
def test_parse_stat_malformed_is_none(data):
    assert procfs.parse_stat(data) is None


def test_read_cgroup2_path():
    assert procfs.read_cgroup2_path(100, PROC) == "/system.slice/nginx.service"
    assert procfs.read_cgroup2_path(200, PROC) == "/"
    assert procfs.read_cgroup2_path(400, PROC) is None  # v1 only
    assert procfs.read_cgroup2_path(999, PROC) is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/", CGROUP),
        ("/system.slice/nginx.service", os.path.join(CGROUP, "system.slice", "nginx.service")),
        ("/a//b/./c", os.path.join(CGROUP, "a", "b", "c")),
        ("/../../outside", None),
    ],
)
def test_cgroup_dir(path, expected):
    assert procfs.cgroup_dir(CGROUP, path) == expected


def test_cgroup_procs():
    assert procfs.cgroup_procs(CGROUP) == [1, 2, 200]
    svc = procfs.cgroup_dir(CGROUP, "/system.slice/nginx.service")
    assert svc is not None
    assert procfs.cgroup_procs(svc) == [100]
    assert procfs.cgroup_procs(os.path.join(CGROUP, "system.slice")) == []
    assert procfs.cgroup_procs(os.path.join(CGROUP, "gone")) == []


def test_threads():
    assert list(procfs.iter_tids(100, PROC)) == [100, 101]
    assert procfs.thread_name(100, 101, PROC) == "nginx-worker"
    assert procfs.thread_name(100, 102, PROC) is None
    assert list(procfs.iter_tids(999, PROC)) == []


# -- the live /proc of this machine


def test_live_self():
    me = os.getpid()
    st = procfs.read_stat(me)
    assert st is not None and st.pid == me and st.ppid == os.getppid()
    assert procfs.read_comm(me) == st.comm
    assert me in list(procfs.iter_pids())
    assert procfs.read_cgroup2_path(me) is not None


def test_live_vanished_process_is_none():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert procfs.read_stat(p.pid) is None
    assert procfs.read_comm(p.pid) is None
    assert procfs.read_cgroup2_path(p.pid) is None


def test_live_thread_names():
    import threading

    ready = threading.Event()
    done = threading.Event()

    def run():
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write("bistouri-probe")
        ready.set()
        done.wait(5)

    t = threading.Thread(target=run, name="bistouri-probe")
    t.start()
    try:
        ready.wait(5)
        tids = list(procfs.iter_tids(os.getpid()))
        assert t.native_id in tids
        assert procfs.thread_name(os.getpid(), t.native_id) == "bistouri-probe"
    finally:
        done.set()
        t.join()

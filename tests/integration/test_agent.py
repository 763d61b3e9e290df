"""The agent end to end: real BPF, real PSI in child cgroups, real workloads, spooled sessions."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.bpf import abi
from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import Cgroup, bistouri_prog_ids, build_id, symbols, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def _frames_in(session: wire.Session, binary: Path) -> Counter:
    """On-CPU samples by function of `binary` at the leaf of its own frames."""
    bid = bytes.fromhex(build_id(binary))
    syms = symbols(binary)
    out: Counter = Counter()
    for t in session.traces:
        own = [f for f in t.user if f.kind == wire.FRAME_RESOLVED and f.build_id == bid]
        if not own:
            continue
        off = own[0].address
        name = next((n for n, (a, s) in syms.items() if a <= off < a + s), "?")
        out[name] += t.on_cpu
    return out


def test_cpu_pressure_yields_a_session_in_the_hot_function(tmp_path, workloads):
    # The burners are past the loader (no frame pointers there) before the agent starts, so
    # every frame it samples walks and the "none unmapped" check below holds by design.
    with Cgroup.create() as cg:
        for _ in range(3):
            p = cg.spawn([str(workloads / "burner"), "25"], stdout=subprocess.PIPE, env={"BURNER_READY": "1"})
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        with AgentProcess(tmp_path, burner_config()) as agent:
            t0 = time.monotonic()
            _check_cpu_session(agent, cg, workloads, t0)


def _check_cpu_session(agent: AgentProcess, cg: Cgroup, workloads: Path, t0: float) -> None:
    # The rule matches the comm `burner` host-wide: the session of this test's cgroup, not another one's.
    s = agent.wait_session(
        lambda s: s.trigger.cgroup == cg.rel and s.trigger.resource == "cpu" and s.total_samples > 0, 15
    )
    elapsed = time.monotonic() - t0
    assert s is not None, f"no CPU session within 15 s\n{agent.log()[-3000:]}"
    assert elapsed <= 15
    assert s.service == "burner_svc" and s.tenant == "test"
    assert (
        s.trigger.cgroup == cg.rel
        and s.trigger.pressure.avg10 >= 0
        and s.trigger.window_us in (1_000_000, 2_000_000)
    )
    assert len(s.processes) == 3 and set(s.processes.values()) == {"burner"}
    assert s.kernel.release and s.kernel.build_id and s.period_ns == 1_000_000_000 // 19
    by_fn = _frames_in(s, workloads / "burner")
    # The data-quality note travels with the session: every sample with a user stack was walked
    # (by table once the nice-19 builder has loaded them, by frame pointer before).
    walks = sum(s.unwind.walks.values())
    assert 0 < walks <= s.total_samples and set(s.unwind.walks) <= set(abi.WALK_ENDS.values()), s.unwind
    assert sum(s.unwind.frames.values()) >= walks and set(s.unwind.frames) <= {"table", "frame_pointer"}
    assert by_fn["hot_spin"] >= 0.8 * sum(by_fn.values()), by_fn
    assert set(s.threads.values()) == {"burner"}
    # The episode report: the three burners timed by state over the session, their cgroup named.
    assert s.episode is not None
    timed = [v for v in s.episode.victims if v.pid in s.processes]
    assert {v.pid for v in timed} == set(s.processes) and all(v.on_cpu_ns > 0 for v in timed), s.episode
    assert cg.rel in [a.cgroup for a in s.episode.aggressors], s.episode.aggressors
    m = agent.metrics()
    assert m['bistouri_sessions_started_total{resource="cpu"}'] >= 1
    assert m['bistouri_psi_events_total{resource="cpu"}'] >= 1
    assert m['bistouri_episode_hook_events_total{kind="switch"}'] > 0, (
        m
    )  # the episode hooks timed the burners
    # User IPs mapped from the targets' maps, every frame a file frame (none unmapped).
    assert m["bistouri_proc_maps_tables"] >= 3 and m['bistouri_proc_maps_reads_total{file="maps"}'] >= 3, m
    assert m['bistouri_user_frames_total{kind="resolved"}'] > 0, m
    unnamed = {k: v for k, v in m.items() if k.startswith("bistouri_user_frames_total") and v}
    assert set(unnamed) <= {
        'bistouri_user_frames_total{kind="resolved"}',
        'bistouri_user_frames_total{kind="vdso"}',  # clock_gettime
    }, unnamed
    assert m["bistouri_samples_orphaned_total"] == 0, m
    assert agent.proc is not None
    names = {p.read_text().strip() for p in Path(f"/proc/{agent.proc.pid}/task").glob("*/comm")}
    assert {"ringbuf", "walk", "metrics"} <= names, names  # what `top -H` shows


def test_io_pressure_yields_off_cpu_samples_with_blocked_time(tmp_path, workloads):
    cfg = burner_config(comm="fsyncer", resource="io", threshold=5)
    with AgentProcess(tmp_path, cfg) as agent, Cgroup.create() as cg:
        cg.spawn([str(workloads / "fsyncer"), str(tmp_path / "fsync.dat"), "25"])
        s = agent.wait_session(lambda s: s.trigger.resource == "io" and any(t.off_cpu for t in s.traces), 20)
        assert s is not None, f"no io session with off-CPU samples\n{agent.log()[-3000:]}"
        off = [t for t in s.traces if t.off_cpu and t.wait == wire.WAIT_D]
        # Each D wait is timed from switch-out to wakeup, and a rate-limited capture carries the
        # time of the waits it stands for, so the traces' D time is the time the kernel's own
        # accounting (the episode report's, over a window the session's holds) saw fsyncer in D;
        # how much that is depends on the machine's load, not on us. The exact comparison, over
        # one window, is tests/bpf/test_profiler.py's.
        assert s.episode is not None
        kernel_d = sum(v.blocked_d_ns for v in s.episode.victims if v.comm == "fsyncer")
        blocked = sum(t.off_cpu_ns for t in off)
        assert 0.5 * kernel_d <= blocked < s.duration_ns, (blocked, kernel_d, s.duration_ns)
        assert all(t.kernel for t in off), "off-CPU waits carry kernel frames"


def test_memory_pressure_from_page_cache_thrash(tmp_path, workloads):
    memcg = Path("/sys/fs/cgroup/memory")
    if not (memcg / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller to limit the workload (see environment notes)")
    v1 = memcg / f"bistouri-test-{tmp_path.name[-8:]}"
    v1.mkdir()
    try:
        (v1 / "memory.limit_in_bytes").write_text(str(64 << 20))
        cfg = burner_config(comm="thrasher", resource="memory", threshold=1)
        with AgentProcess(tmp_path, cfg) as agent, Cgroup.create() as cg:
            procs_v1 = str(v1 / "cgroup.procs")
            procs_v2 = str(cg.path / "cgroup.procs")

            def join_both() -> None:
                import os

                for f in (procs_v2, procs_v1):
                    with open(f, "w") as fh:
                        fh.write(str(os.getpid()))

            p = subprocess.Popen(
                [str(workloads / "thrasher"), str(tmp_path / "thrash.dat"), "200", "40"], preexec_fn=join_both
            )
            cg.procs.append(p)
            s = agent.wait_session(lambda s: s.trigger.resource == "memory", 40)
            assert s is not None, f"no memory session\n{agent.log()[-3000:]}"
            assert "thrasher" in s.processes.values()
    finally:
        for _ in range(50):
            try:
                v1.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_every_process_is_captured_including_older_and_forked_ones(tmp_path, workloads):
    """Two processes with one comm in one cgroup, one started before the agent, and a fork without exec."""
    cfg = burner_config() + burner_config(comm="fork-child").replace("targets:\n", "")
    with Cgroup.create() as cg:
        early = cg.spawn([str(workloads / "burner"), "40"])  # before the agent: only the walk finds it
        time.sleep(0.3)
        with AgentProcess(tmp_path, cfg, walk_interval=2) as agent:
            late = cg.spawn([str(workloads / "burner"), "40"])  # found by the exec hook
            cg.spawn([str(workloads / "forker"), "fork-child", "40"])  # the child never execs
            cg.spawn([str(workloads / "burner"), "40"])

            def both(s: wire.Session) -> bool:
                return s.service == "burner_svc" and {early.pid, late.pid} <= set(s.processes)

            s = agent.wait_session(both, 25)
            assert s is not None, (
                f"sessions: {[sorted(x.processes) for x in agent.sessions()]}\n{agent.log()[-3000:]}"
            )
            pids_with_samples = {t.pid for t in s.traces}
            assert {early.pid, late.pid} <= pids_with_samples
            forked = agent.wait_session(lambda s: s.service == "fork_child_svc", 25)
            assert forked is not None, agent.log()[-3000:]
            assert set(forked.processes.values()) == {"fork-child"}
            assert any(t.on_cpu for t in forked.traces)


def test_reload_changes_watches_and_keeps_the_config_when_invalid(tmp_path, workloads):
    with (
        Cgroup.create() as cg,
        AgentProcess(tmp_path, burner_config(comm="nothing-here"), walk_interval=2) as agent,
    ):
        cg.spawn([str(workloads / "burner"), "60"])
        time.sleep(3)
        assert agent.metrics()["bistouri_psi_watchers"] == 0
        info = [k for k in agent.metrics() if k.startswith("bistouri_agent_info{")]
        assert len(info) == 1 and f'kernel_release="{os.uname().release}"' in info[0], info
        assert 'frequency_hz="' in info[0] and 'version="' in info[0]
        # An atomic rename, as config management does it.
        new = tmp_path / "trigger.yaml.new"
        new.write_text(burner_config())
        new.rename(agent.config_path)
        assert wait_until(lambda: agent.metrics().get("bistouri_config_reloads_total", 0) >= 1, 10), (
            agent.log()
        )
        assert wait_until(lambda: agent.metrics()["bistouri_psi_watchers"] == 1, 10), agent.log()[-2000:]
        # An invalid file keeps the running config and counts the failure.
        agent.config_path.write_text("targets:\n  - rule: {type: Exact, comm: x}\n    bogus: 1\n")
        assert wait_until(lambda: agent.metrics().get("bistouri_config_reload_failures_total", 0) >= 1, 10)
        assert agent.metrics()["bistouri_psi_watchers"] == 1
        assert "keeping the running config" in agent.log()
        # SIGHUP reloads (the file is valid again, same content as the running one).
        agent.config_path.with_suffix(".tmp").write_text(burner_config(comm="other"))
        agent.config_path.with_suffix(".tmp").rename(agent.config_path)
        time.sleep(0.1)
        before = agent.metrics()["bistouri_config_reloads_total"]
        agent.signal(signal.SIGHUP)
        assert wait_until(lambda: agent.metrics()["bistouri_config_reloads_total"] > before, 10)
        assert wait_until(lambda: agent.metrics()["bistouri_psi_watchers"] == 0, 10)


def test_sigterm_during_capture_flushes_and_detaches(tmp_path, workloads):
    before = bistouri_prog_ids()
    with Cgroup.create() as cg:
        agent = AgentProcess(tmp_path, burner_config(capture=30)).start()
        try:
            for _ in range(3):
                cg.spawn([str(workloads / "burner"), "30"])
            assert wait_until(lambda: "Capture started" in agent.log(), 15), agent.log()[-2000:]
            time.sleep(1.0)
            took = agent.stop()
        finally:
            agent.stop()
        assert agent.proc is not None and agent.proc.returncode == 0, agent.log()[-2000:]
        assert took <= 2.0, f"exit took {took:.2f}s"
        sessions = agent.sessions()
        assert sessions and sessions[0].total_samples > 0, agent.log()[-2000:]
        assert sessions[0].duration_ns < 30e9
        # The episode is read before the BPF object is closed: the burners' threads are its victims.
        episode = sessions[0].episode
        assert episode is not None and episode.victims, agent.log()[-2000:]
        assert sum(v.on_cpu_ns for v in episode.victims) > 0
    assert wait_until(lambda: bistouri_prog_ids() <= before, 10), "BPF programs left in the kernel"

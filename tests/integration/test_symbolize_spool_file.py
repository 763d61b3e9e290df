"""`bistouri symbolize` on the files the agent's spool really writes (framed, with the kernel build id)."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bistouri import wire
from bistouri.agent.spool import Spool
from bistouri.errors import WireError
from bistouri.symbolizer.resolve import read_session_file
from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import Cgroup
from testkit.symbolizer import KALLSYMS, KERNEL_BUILD_ID, REPO, clean_env
from tests.integration.conftest import DemoBinary, make_session


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bistouri", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=REPO,
        timeout=60,
    )


def _spooled(tmp_path: Path, sid: str, binary: DemoBinary) -> Path:
    spool = Spool(str(tmp_path / "spool"), 1 << 20, registry=None, kernel_build_id=KERNEL_BUILD_ID)
    name = spool.put(sid, wire.encode_session(make_session(sid, binary)))
    assert name is not None
    return tmp_path / "spool" / name


def test_symbolize_reads_a_real_spool_file(tmp_path: Path, demo_binary: DemoBinary) -> None:
    path = _spooled(tmp_path, "spooled-1", demo_binary)
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_bytes(KALLSYMS)
    r = _run(
        "symbolize",
        str(path),
        "--binary-dir",
        str(demo_binary.dir),
        "--kallsyms",
        str(kallsyms),
        "--format",
        "folded",
        "--value",
        "off_cpu",
    )
    # It said "extra data" before: the spool's header was never removed.
    assert r.returncode == 0, r.stderr
    assert r.stdout == "main;entry_SYSCALL_64_[k];ksys_read_[k];io_schedule_[k] 5\n"


def test_symbolize_writes_otlp(tmp_path: Path, demo_binary: DemoBinary) -> None:
    pb = pytest.importorskip("opentelemetry.proto.profiles.v1development.profiles_pb2")
    path = _spooled(tmp_path, "spooled-otlp", demo_binary)
    out = tmp_path / "s.otlp.pb"
    r = _run("symbolize", str(path), "--binary-dir", str(demo_binary.dir), "--format", "otlp", "-o", str(out))
    assert r.returncode == 0, r.stderr
    data = pb.ProfilesData()
    data.ParseFromString(out.read_bytes())
    s = list(data.dictionary.string_table)
    profiles = data.resource_profiles[0].scope_profiles[0].profiles
    totals = {s[p.sample_type.type_strindex]: sum(x.values[0] for x in p.samples) for p in profiles}
    assert totals == {"on_cpu": 53, "off_cpu": 5, "off_cpu_time": 7_000_000}  # make_session's counts


def test_symbolize_names_the_python_frames_of_a_version_4_spool_file(
    tmp_path: Path, demo_binary: DemoBinary
) -> None:
    """`bistouri symbolize FILE` on a session with Python frames: each with its file and line."""
    from tests.integration.test_symbolizer_python import APP, python_session

    spool = Spool(str(tmp_path / "spool"), 1 << 20, registry=None, kernel_build_id=KERNEL_BUILD_ID)
    name = spool.put("py-1", wire.encode_session(python_session("py-1", demo_binary)))
    assert name is not None
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_bytes(KALLSYMS)
    base = ("symbolize", str(tmp_path / "spool" / name), "--binary-dir", str(demo_binary.dir))
    r = _run(*base, "--kallsyms", str(kallsyms), "--format", "folded")
    assert r.returncode == 0, r.stderr
    assert f"main;middle_step;<module> ({APP}:12);driver ({APP}:9);Worker.hot_loop ({APP}:7) 4\n" in r.stdout


def test_a_damaged_spool_file_is_a_clear_error(tmp_path: Path, demo_binary: DemoBinary) -> None:
    path = _spooled(tmp_path, "spooled-2", demo_binary)
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    r = _run("symbolize", str(path), "--format", "json")
    assert r.returncode == 2, r.stderr
    assert "checksum mismatch" in r.stderr and "Traceback" not in r.stderr


def test_read_session_file_bounds_decompression(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip.compress(bytes(64 << 20)))  # 64 MiB of zeros in ~64 KiB
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(WireError, match="inflates to more than"):
        read_session_file(bomb, max_bytes=1 << 20)


@pytest.mark.bpf
@pytest.mark.slow
def test_symbolize_reads_what_a_real_agent_spooled(tmp_path: Path, workloads: Path) -> None:
    # The rule matches the comm `burner` on the whole host: another `burner` (another checkout's test
    # run: the same source built elsewhere, another build id, not in --binary-dir) has sessions of its
    # own, and the first CPU session in the spool was once one of them. A decoy of that name (another
    # program) has its session spooled first here: the one read is that of the cgroup of this test.
    decoy = tmp_path / "decoy" / "burner"
    decoy.parent.mkdir()
    shutil.copy(workloads / "shares", decoy)

    def of(cg: Cgroup) -> Callable[[wire.Session], bool]:
        return lambda s: s.trigger.cgroup == cg.rel and s.trigger.resource == "cpu" and s.total_samples > 0

    with AgentProcess(tmp_path, burner_config()) as agent:
        with Cgroup.create() as other:
            for _ in range(3):
                other.spawn([str(decoy), "20"])
            assert agent.wait_session(of(other), 15) is not None, agent.log()[-3000:]
        with Cgroup.create() as cg:
            for _ in range(3):
                cg.spawn([str(workloads / "burner"), "20"])
            s = agent.wait_session(of(cg), 15)
            assert s is not None, agent.log()[-3000:]
    [path] = [p for p in agent.spool_dir.glob("*.bses") if s.session_id in p.name]
    assert wire.unframe_session(path.read_bytes()).kernel_build_id == s.kernel.build_id
    r = _run("symbolize", str(path), "--binary-dir", str(workloads), "--format", "folded")
    assert r.returncode == 0, r.stderr
    assert "hot_spin" in r.stdout, r.stdout[:2000]

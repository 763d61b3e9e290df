"""`bistouri record`, run as a user runs it, against real workloads."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bistouri.compat import zip_strict
from testkit.helpers import Cgroup

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def record(
    *args: str,
    timeout: float = 120,
    cwd: Path | None = None,
    python: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *python, "-m", "bistouri", "record", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(env or {})},
    )


def shares(stdout: str) -> dict[str, float]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+([\d.]+)%\s+(\S+)", line)
        if m:
            out[m.group(3)] = float(m.group(1))
    return out


WORK_SHARES = (("work_seventy", 70), ("work_twenty", 20), ("work_ten", 10))


def work_shares(leaves: dict[str, float]) -> dict[str, float]:
    """`shares`' three functions' shares of the samples in them: kernel leaves (an interrupt
    handled in the process's time, many on a busy host) are not the workload's split."""
    total = sum(leaves.get(fn, 0) for fn, _ in WORK_SHARES) or 1
    return {fn: 100 * leaves.get(fn, 0) / total for fn, _ in WORK_SHARES}


def test_command_mode_reports_the_true_shares_and_stops_with_the_child(tmp_path, workloads):
    t0 = time.monotonic()
    # 999 Hz: thousands of samples even on a loaded machine, so ±5 points is many standard deviations.
    r = record("-F", "999", "-o", str(tmp_path / "out"), "--", str(workloads / "shares"), "6")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    got = work_shares(shares(r.stdout))
    for fn, want in WORK_SHARES:
        assert abs(got[fn] - want) <= 5, (fn, got)
    # No --duration: it follows the child and stops when the child exits (6 s), not at a default timer.
    assert took < 6 + 40, took
    out = tmp_path / "out"
    html = (out / "flamegraph.html").read_text()
    assert "work_seventy" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert gzip.decompress((out / "profile.pb.gz").read_bytes())
    folded = (out / "profile.folded").read_text()
    assert re.search(r"main;work_seventy \d+", folded), folded[:500]
    speedscope = json.loads((out / "profile.speedscope.json").read_text())
    assert speedscope["$schema"].startswith("https://www.speedscope.app/")


def test_pid_mode_with_duration(tmp_path, workloads):
    p = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        r = record("--pid", str(p.pid), "-d", "3", "-o", str(tmp_path / "o"))
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    assert shares(r.stdout).get("hot_spin", 0) > 80, r.stdout


def test_on_pressure_waits_for_psi_in_the_cgroup(tmp_path, workloads):
    with Cgroup.create() as cg:
        for _ in range(3):
            cg.spawn([str(workloads / "burner"), "40"])
        r = record(
            "--cgroup",
            cg.rel,
            "--on-pressure",
            "cpu:5",
            "--wait-timeout",
            "30",
            "-d",
            "3",
            "-o",
            str(tmp_path / "o"),
        )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Pressure: cpu" in r.stderr
    assert shares(r.stdout).get("hot_spin", 0) > 80, r.stdout
    # The episode summary: the three burners by state, their cgroup among the aggressors by CPU.
    episode = r.stdout[r.stdout.index("Episode (") :]
    victims = [line for line in episode.splitlines() if "burner (pid" in line]
    assert len(victims) == 3, episode
    assert all(float(line.split()[0]) > 0 and float(line.split()[1]) > 0 for line in victims), episode
    assert f"  {cg.rel}\n" in episode, episode


def test_bad_target_is_a_clear_error():
    r = record("--pid", "999999999", "-d", "1")
    assert r.returncode == 2 and "no process matches" in r.stderr
    r = record("-d", "1")
    assert r.returncode == 2 and "exactly one target" in r.stderr
    r = record("--comm", "x", "--on-pressure", "disk:5")
    assert r.returncode == 2 and "not a resource" in r.stderr


def folded(path: Path) -> dict[str, int]:
    """Leaf function -> count, from a folded file."""
    leaves: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        leaves[leaf] = leaves.get(leaf, 0) + int(n)
    return leaves


def test_comm_mode_finds_the_process_by_name(tmp_path, workloads):
    # A private copy under a name no other process has (comm: the first 15 bytes of the name).
    name = f"brn{os.getpid() % 100000:05d}"
    binary = tmp_path / name
    shutil.copy(workloads / "burner", binary)
    p = subprocess.Popen([str(binary), "30"])
    try:
        r = record("--comm", name, "-d", "2", "-o", str(tmp_path / "o"), "--no-cache")
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    assert shares(r.stdout).get("hot_spin", 0) > 80, r.stdout
    r = record("--comm", name[:4] + "*", "-d", "1", "--no-cache", cwd=tmp_path)
    assert r.returncode == 2 and "no process matches" in r.stderr


def test_off_cpu_waits_are_written_as_their_own_outputs(tmp_path, workloads):
    """fsync in a loop: the thread waits in D state; record writes those waits (in ns) apart."""
    p = subprocess.Popen([str(workloads / "fsyncer"), str(tmp_path / "data"), "30"])
    out = tmp_path / "o"
    try:
        r = record("--pid", str(p.pid), "-d", "3", "-o", str(out), "--format", "folded,html,summary")
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    assert sorted(f.name for f in out.iterdir()) == [
        "flamegraph.html",
        "profile.folded",
        "profile.offcpu.folded",
        "summary.json",
    ]
    waits = (out / "profile.offcpu.folded").read_text()
    # (libc's fsync keeps no frame pointer: until libc's unwind table is in the kernel, the
    # frame-pointer walk skips its caller write_and_sync; main is there either way.)
    assert re.search(r"main;(write_and_sync;)?fsync;.*;schedule_\[k\].* \d+$", waits, re.M), waits[:1000]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"]["off_cpu"] > 0 and summary["samples"]["off_cpu_ns"] > 0, summary
    assert '"off_cpu_ns"' in (out / "flamegraph.html").read_text()


def test_format_chooses_the_outputs(tmp_path, workloads):
    out = tmp_path / "o"
    r = record("--format", "pprof", "-o", str(out), "--", str(workloads / "shares"), "1")
    assert r.returncode == 0, r.stderr
    assert [f.name for f in out.iterdir()] == ["profile.pb.gz"]
    r = record("--format", "html,svg", "--", str(workloads / "shares"), "1")
    assert r.returncode == 2 and "unknown format 'svg'" in r.stderr and "choose among html" in r.stderr


def test_otlp_output_carries_the_true_shares(tmp_path, workloads):
    """`--format otlp` writes an OTLP Profiles request, read here by opentelemetry-proto's classes."""
    pb = pytest.importorskip("opentelemetry.proto.profiles.v1development.profiles_pb2")
    out = tmp_path / "o"
    r = record("-F", "999", "--format", "otlp", "-o", str(out), "--", str(workloads / "shares"), "4")
    assert r.returncode == 0, r.stderr
    data = pb.ProfilesData()
    data.ParseFromString((out / "profile.otlp.pb").read_bytes())
    d, s = data.dictionary, list(data.dictionary.string_table)
    on_cpu = next(
        p
        for p in data.resource_profiles[0].scope_profiles[0].profiles
        if s[p.sample_type.type_strindex] == "on_cpu"
    )
    leaf: dict[str, int] = {}
    for smp in on_cpu.samples:
        loc = d.location_table[d.stack_table[smp.stack_index].location_indices[0]]
        name = s[d.function_table[loc.lines[0].function_index].name_strindex]
        leaf[name] = leaf.get(name, 0) + smp.values[0]
    got = work_shares(leaf)
    for fn, want in WORK_SHARES:
        assert abs(got[fn] - want) <= 5, (fn, leaf)


def test_progress_only_on_a_terminal_or_when_asked(tmp_path, workloads):
    # 3 s: the capture line is drawn each second, so at least once before the command ends.
    cmd = ("-o", str(tmp_path / "a"), "--no-cache", "--", str(workloads / "shares"), "3")
    quiet = record(*cmd)
    assert quiet.returncode == 0, quiet.stderr
    assert "Capturing at" not in quiet.stderr and "Symbolizing…" not in quiet.stderr
    assert "Captured" in quiet.stderr  # outcomes always print
    asked = record(
        "--progress", "-o", str(tmp_path / "b"), "--no-cache", "--", str(workloads / "shares"), "3"
    )
    assert asked.returncode == 0, asked.stderr
    assert "Capturing at" in asked.stderr and "Symbolizing" in asked.stderr


def test_progress_is_redrawn_in_place_on_a_terminal(tmp_path, workloads):
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "bistouri", "record", "-o", str(tmp_path / "o"), "--no-cache", "--",
             str(workloads / "shares"), "3"],
            stdout=subprocess.DEVNULL, stderr=slave,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )  # fmt: skip
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            out += chunk
        assert p.wait(60) == 0, out
    finally:
        os.close(master)
    text = out.decode(errors="replace")
    assert "\r\x1b[KCapturing at" in text and "\r\x1b[KSymbolizing" in text, text


def test_nothing_heavy_is_imported_before_the_targets_are_sampled(tmp_path, workloads):
    """The symbolizer, msgpack, HTTP, metrics and YAML come after sampling started (start-up time)."""
    p = subprocess.Popen([str(workloads / "burner"), "30"])
    try:
        r = record(
            "--pid", str(p.pid), "-d", "0.5", "-o", str(tmp_path / "o"),
            python=("-X", "importtime"), env={"BISTOURI_LOG_LEVEL": "debug"},
        )  # fmt: skip
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    before, sep, _ = r.stderr.partition("Sampling. pids=")
    assert sep, r.stderr[-2000:]
    imported = {
        line.split("|")[-1].strip() for line in before.splitlines() if line.startswith("import time:")
    }
    assert "bistouri.capture.profiler" in imported
    # The sampler alone was loaded, attached and armed before the profiler was even imported;
    # the off-CPU program came after, from its own object.
    armed = before.find(f"Sampler attached and armed. pids={p.pid}")
    assert 0 <= armed < before.find("bistouri.capture.profiler\n"), before[-3000:]
    # Nor typing (~2 ms) or lzma (the ELF reader's) before the sampler was armed: both crept in once;
    # nor what only later steps use (signal's enums, the mount table's parser: a --pid names no cgroup).
    early = {
        line.split("|")[-1].strip() for line in before[:armed].splitlines() if line.startswith("import time:")
    }
    late = {"typing", "lzma", "bistouri.elf", "signal", "bistouri.host.mounts"}
    assert not late & early, late & early
    assert "programs=handle_sched_switch" in r.stderr
    heavy = {"msgpack", "requests", "prometheus_client", "yaml", "bistouri.capture.sessions"}
    assert not heavy & imported, heavy & imported
    # Of the symbolizer, only the ELF reader: user addresses are mapped to build ids while sampling.
    symbolizer = {m for m in imported if m.startswith("bistouri.symbolizer.")}
    assert symbolizer <= {"bistouri.elf"}, symbolizer


def test_symbol_cache_answers_a_rerun(tmp_path, workloads):
    from bistouri.record import symcache
    from testkit.helpers import build_id

    cache = tmp_path / "cache"
    runs = []
    kept = []  # addresses of `shares` in the cache after each run
    for i in range(2):
        out = tmp_path / f"o{i}"
        r = record(
            "-F", "999", "--format", "folded,summary", "-o", str(out), "--cache-dir", str(cache),
            "--", str(workloads / "shares"), "2",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs.append((json.loads((out / "summary.json").read_text()), folded(out / "profile.folded")))
        entry = symcache.SymbolCache(cache).frames(build_id(workloads / "shares"))
        assert entry is not None and entry.file_lines
        kept.append(set(entry.keys()))
    # Each run adds to what the runs before it left (the temporary build-id tree changes every run).
    assert kept[0] <= kept[1], kept
    (first, leaves1), (second, leaves2) = runs
    assert first["symbolization"]["cached"] == 0
    assert second["symbolization"]["cached"] > 0, second
    for leaves in (leaves1, leaves2):
        assert abs(work_shares(leaves)["work_seventy"] - 70) <= 5, leaves
    # A damaged cache file is dropped and rebuilt, never trusted: a changed byte in each (its
    # entries' checksums), or a truncated one.
    for n, f in enumerate(sorted(cache.iterdir())):
        if f.suffix in (".frames", ".kallsyms"):
            data = f.read_bytes()
            f.write_bytes(data[:-7] + b"garbage" if n % 2 else data[:-1])
    out = tmp_path / "o3"
    r = record(
        "--format", "folded", "-o", str(out), "--cache-dir", str(cache), "--", str(workloads / "shares"), "1"
    )
    assert r.returncode == 0, r.stderr
    assert "work_seventy" in folded(out / "profile.folded")


def test_output_paths_are_never_followed_or_reused(tmp_path, workloads):
    """As root: no write through a planted link, no existing default directory reused (issue 14 M7)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "flamegraph.html").write_text("precious")
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    # Every default name of the next minute, planted as links to the victim.
    now = time.time()
    for s in range(60):
        name = time.strftime("bistouri-record-%Y%m%d-%H%M%S", time.localtime(now + s))
        (run_dir / name).symlink_to(victim)
    r = record("--format", "html", "--no-cache", "--", str(workloads / "shares"), "1", cwd=run_dir)
    assert r.returncode == 0, r.stderr
    made = [d for d in run_dir.iterdir() if not d.is_symlink()]
    assert len(made) == 1 and (made[0] / "flamegraph.html").stat().st_size > 1000, made
    assert sorted(f.name for f in victim.iterdir()) == ["flamegraph.html"]
    assert (victim / "flamegraph.html").read_text() == "precious"
    # An existing directory named with -o is used, but a link planted in it is replaced, not followed.
    out = tmp_path / "named"
    out.mkdir()
    (out / "flamegraph.html").symlink_to(victim / "flamegraph.html")
    r = record("--format", "html", "-o", str(out), "--no-cache", "--", str(workloads / "shares"), "1")
    assert r.returncode == 0, r.stderr
    assert (
        not (out / "flamegraph.html").is_symlink() and (victim / "flamegraph.html").read_text() == "precious"
    )
    # -o naming a link to a directory is refused, with the reason.
    r = record("-o", str(run_dir / name), "--no-cache", "--", str(workloads / "shares"), "1")
    assert r.returncode == 2 and "cannot use" in r.stderr and "symlink" in r.stderr, r.stderr
    assert sorted(f.name for f in victim.iterdir()) == ["flamegraph.html"]


PYTHON312 = Path("/root/.pyenv/versions/3.12.1/bin/python3.12")


# os.access, not exists(): under /root, Path.exists() raises for other users (collection as nobody).
@pytest.mark.skipif(not os.access(PYTHON312, os.X_OK), reason="pyenv's Python 3.12 is not installed")
def test_a_python312_perf_command_is_named_to_its_python_functions_after_it_exited(tmp_path):
    """`record -- python3.12 -X perf`: the child is gone when its stacks are symbolized, and its
    Python frames were named while it ran (docs/python-frames.md), with file and line, in place of
    the eval loop's frames; the perf trampolines (`py::fib:…`) that only repeat them are left out.
    The frames between are libpython's frameless ones, walked by .eh_frame tables."""
    script = tmp_path / "busy.py"
    script.write_text(
        "import time\n"
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "end = time.process_time() + 4\n"
        "while time.process_time() < end:\n    fib(20)\n"
    )
    cache = tmp_path / "cache"
    for run in ("cold", "warm"):  # the second run finds libpython's table in the cache
        out = tmp_path / run
        r = record("-F", "199", "--format", "folded", "--cache-dir", str(cache), "-o", str(out), "--",
                   str(PYTHON312), "-X", "perf", str(script))  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    counts = {}
    for line in (out / "profile.folded").read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        counts[stack] = counts.get(stack, 0) + int(n)
    total = sum(counts.values())
    fib = f"fib ({script}:"  # folded's Python frame: 'name (file:line)'
    named = sum(n for stack, n in counts.items() if fib in stack and stack.startswith("_start;"))
    assert not any("py::" in stack for stack in counts), "a perf trampoline doubles a Python frame"
    assert total > 300 and named >= 0.9 * total, (
        named,
        total,
        sorted(counts.items(), key=lambda x: -x[1])[:5],
    )


def _speedscope_stacks(out: Path) -> list[tuple[list[dict], int]]:
    """(frames root first, samples) of each stack of a record's speedscope output."""
    doc = json.loads((out / "profile.speedscope.json").read_text())
    frames = doc["shared"]["frames"]
    prof = doc["profiles"][0]
    return [([frames[i] for i in s], w) for s, w in zip_strict(prof["samples"], prof["weights"])]


@pytest.mark.parametrize("ldflags", [(), ("-s", "-w")], ids=["plain", "stripped"])
def test_a_go_program_is_named_with_file_and_line(tmp_path, ldflags):
    """A Go program built here by Debian's golang-go (no GNU build id; -s -w: no .symtab, no DWARF):
    its hot function is named with file:line from its pclntab, its caller kept (the leaf keeps no
    frame), and its goroutine stacks end at runtime.goexit, not at an [unknown] address."""
    from testkit.gobuild import go_build

    binary = go_build("gohot", tmp_path, *ldflags)
    proc = subprocess.Popen([str(binary)], stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None and proc.stderr.readline() == b"ready\n"
        cache = tmp_path / "cache"
        # The second run has the unwind table at once (the first walks by frame pointer until it is built).
        for run in ("cold", "warm"):
            r = record("--pid", str(proc.pid), "-d", "4", "-F", "99", "--format", "speedscope,folded",
                       "--cache-dir", str(cache), "-o", str(tmp_path / run))  # fmt: skip
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        proc.kill()
        proc.wait()
    stacks = _speedscope_stacks(tmp_path / "warm")
    total = sum(w for _, w in stacks)
    src = Path(__file__).resolve().parents[1] / "fixtures/go/gohot/main.go"
    hot = sum(
        w
        for fr, w in stacks
        if any(f["name"] == "main.hotLoop" and f.get("file") == str(src) and f.get("line") for f in fr)
    )
    chain = sum(
        w for fr, w in stacks if [f["name"] for f in fr][:5] == [
            "runtime.goexit", "main.main.func1", "main.outer", "main.middle", "main.hotLoop"]
    )  # fmt: skip
    goexit_root = sum(w for fr, w in stacks if fr and fr[0]["name"] == "runtime.goexit")
    # Shares, not counts: a busy host gives the program less CPU (79 samples of 4 s seen), not other stacks.
    assert total > 40 and hot >= 0.95 * total, (hot, total, stacks[:5])
    assert goexit_root >= 0.95 * total, (goexit_root, total, stacks[:5])
    # The process's unwind table is loaded ~0.3 s into the run (from the cache, by the builder thread):
    # until then the frame pointer walks, and the frameless hotLoop hides main.middle (~7 % of 4 s).
    assert chain >= 0.8 * total, (chain, total)


def test_the_hosts_debug_files_are_read_with_no_flag(tmp_path, workloads):
    """With Debian's libc6-dbg installed, record names libc's __libc_start_call_main from
    /usr/lib/debug with no --debug-dir; --no-host-debuginfo turns it off."""
    from bistouri.elf import read_build_id

    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    bid = read_build_id(libc) if libc.exists() else None
    hexid = bid.hex() if bid else ""
    if not hexid or not Path(f"/usr/lib/debug/.build-id/{hexid[:2]}/{hexid[2:]}.debug").exists():
        pytest.skip("libc6-dbg is not installed (make deps installs it)")
    for flags, want in (((), True), (("--no-host-debuginfo",), False)):
        out = tmp_path / ("on" if want else "off")
        r = record("--no-cache", "-d", "2", "--format", "folded", "-o", str(out), *flags, "--",
                   str(workloads / "burner"), "2")  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        stacks = [line.rpartition(" ") for line in (out / "profile.folded").read_text().splitlines()]
        total = sum(int(n) for _, _, n in stacks)
        named = sum(int(n) for stack, _, n in stacks if "__libc_start_call_main;main;" in stack)
        assert (named >= 0.5 * total) is want, (named, total, stacks[:3])

"""`make demo` (`python -m tests.demo`): the whole pipeline on this machine in about a minute. It lives
beside the tests, not in the package, because it runs their fixture workloads.

Starts the symbolizer (SQLite) and the agent with a demo trigger config, runs a
CPU-bound workload and then an fsync-bound one, each in its own cgroup so PSI
reports their pressure, waits until both sessions are stored, downloads their
profiles, and prints where to look. Everything it started is stopped at the end
unless --keep is given. Needs root (BPF, cgroups) and the built fixtures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests

from bistouri.host import mounts

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "fixtures" / "build" / "workloads"

DEMO_CONFIG = """\
# Demo trigger config: profile the demo workloads when their cgroup stalls.
targets:
  - rule: {type: Exact, comm: burner}
    service_id: demo_cpu
    labels: {demo: "true"}
    resources:
      - {resource: cpu, threshold: 10}
    capture_duration_secs: 5
  - rule: {type: Exact, comm: fsyncer}
    service_id: demo_io
    labels: {demo: "true"}
    resources:
      - {resource: io, threshold: 5}
    capture_duration_secs: 5
"""


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def free_port(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])


def cgroup2_mount() -> Path:
    found = mounts.find_cgroup2_mount()
    if found is None:
        raise SystemExit("no cgroup2 mount: the demo needs cgroup v2 (see `bistouri check`)")
    return Path(found)


class Demo:
    def __init__(self, workdir: Path, keep: bool) -> None:
        self.dir = workdir
        self.keep = keep
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[Path] = []
        self.port = free_port(8470)
        self.url = f"http://127.0.0.1:{self.port}"

    def start_symbolizer(self) -> subprocess.Popen:
        with open(self.dir / "symbolizer.log", "wb") as log:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bistouri",
                    "symbolizer",
                    "--listen-addr",
                    f"127.0.0.1:{self.port}",
                    "--workers",
                    "2",
                    "--state-dir",
                    str(self.dir / "symbolizer"),
                    "--binary-dir",
                    str(WORKLOADS),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(f"the symbolizer exited; see {self.dir / 'symbolizer.log'}")
            try:
                if requests.get(self.url + "/healthz", timeout=1).ok:
                    return p
            except requests.RequestException:
                time.sleep(0.2)
        raise SystemExit(f"the symbolizer did not answer on {self.url}")

    def start_agent(self) -> subprocess.Popen:
        cfg = self.dir / "trigger.yaml"
        cfg.write_text(DEMO_CONFIG)
        with open(self.dir / "agent.log", "wb") as log:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bistouri",
                    "agent",
                    "--config",
                    str(cfg),
                    "--tenant-id",
                    "demo",
                    "--label",
                    "env=demo",
                    "--symbolizer-endpoint",
                    self.url,
                    "--spool-dir",
                    str(self.dir / "spool"),
                    "--metrics-port",
                    str(free_port(9464)),
                    "--metrics-addr",
                    "127.0.0.1",
                    "--freq",
                    "99",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(f"the agent exited; see {self.dir / 'agent.log'}")
            if "Agent active" in (self.dir / "agent.log").read_text(errors="replace"):
                return p
            time.sleep(0.2)
        raise SystemExit("the agent did not become active")

    def cgroup(self, name: str) -> Path:
        path = cgroup2_mount() / f"bistouri-demo-{name}-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        self.cgroups.append(path)
        return path

    def run_in(self, cg: Path, argv: list[str]) -> subprocess.Popen:
        procs = str(cg / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        p = subprocess.Popen(argv, preexec_fn=join)
        self.procs.append(p)
        return p

    def sessions(self) -> list[dict]:
        try:
            return requests.get(self.url + "/v1/sessions", params={"limit": 50}, timeout=5).json()["sessions"]
        except (requests.RequestException, ValueError, KeyError):
            return []

    def wait_session(self, resource: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for s in self.sessions():
                if s["trigger"]["resource"] == resource:
                    return s
            time.sleep(0.5)
        return None

    def download(self, session: dict) -> Path:
        out = self.dir / "profiles" / f"{session['service']}-{session['id'][:8]}"
        out.mkdir(parents=True, exist_ok=True)
        base = f"{self.url}/v1/sessions/{session['id']}"
        for name, path in (
            ("profile.pb.gz", "/pprof"),
            ("profile.folded", "/folded"),
            ("profile.offcpu.folded", "/folded?value=off_cpu_ns"),
            ("profile.speedscope.json", "/speedscope"),
        ):
            r = requests.get(base + path, timeout=30)
            if r.ok:
                (out / name).write_bytes(r.content)
        return out

    def cleanup(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM) if p.pid == os.getpgid(p.pid) else p.terminate()
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for cg in self.cgroups:
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "out" / "demo"), help="where logs, state and profiles go")
    ap.add_argument("--keep", action="store_true", help="leave the symbolizer running to browse the UI")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("make demo needs root: it loads BPF programs and creates cgroups", file=sys.stderr)
        return 2
    if not (WORKLOADS / "burner").exists():
        print("the demo workloads are not built: run `make fixtures`", file=sys.stderr)
        return 2
    workdir = Path(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    demo = Demo(workdir, args.keep)
    t0 = time.monotonic()
    symbolizer = None
    try:
        say(f"starting the symbolizer on {demo.url} (SQLite in {workdir / 'symbolizer'})")
        symbolizer = demo.start_symbolizer()
        say("starting the agent: it stays dormant until PSI reports pressure")
        demo.start_agent()

        say("CPU pressure: 3 burners share 2 CPUs in their own cgroup")
        cg = demo.cgroup("cpu")
        burners = [demo.run_in(cg, [str(WORKLOADS / "burner"), "25"]) for _ in range(3)]
        cpu = demo.wait_session("cpu", 60)
        for b in burners:
            b.kill()
        say(f"  CPU session stored: {cpu['id']}" if cpu else "  no CPU session (see out/demo/agent.log)")

        say("I/O pressure: an fsync loop in its own cgroup")
        cg = demo.cgroup("io")
        fs = demo.run_in(cg, [str(WORKLOADS / "fsyncer"), str(workdir / "fsync.dat"), "30"])
        io = demo.wait_session("io", 60)
        fs.kill()
        say(f"  I/O session stored: {io['id']}" if io else "  no I/O session (see out/demo/agent.log)")

        print()
        print(f"Done in {time.monotonic() - t0:.0f} s. What the symbolizer stored:")
        for s in demo.sessions():
            print(
                f"  {s['service']:<9} {s['trigger']['resource']:<3} pid {s['pid']:<7} "
                f"on-CPU {s['samples']['on_cpu']:<5} off-CPU {s['samples']['off_cpu']:<4} "
                f"{demo.url}/ui/session.html?id={s['id']}"
            )
        for stored in (cpu, io):
            if stored:
                print(f"  profiles: {demo.download(stored)}/  (pprof: profile.pb.gz, folded, speedscope)")
        print(f"  logs: {workdir}/agent.log, {workdir}/symbolizer.log")
        if args.keep:
            print(f"\nThe UI stays up at {demo.url}/ui/ — stop it with: kill {symbolizer.pid}")
            demo.procs = [p for p in demo.procs if p is not symbolizer]
        else:
            print(
                "\nEverything started by the demo is stopped now. To browse the UI, run again with "
                "`make demo DEMO_ARGS=--keep`, or start it yourself:\n"
                f"  .venv/bin/bistouri symbolizer --listen-addr 127.0.0.1:{demo.port} "
                f"--state-dir {workdir / 'symbolizer'}\n  and open {demo.url}/ui/"
            )
        return 0 if cpu and io else 1
    finally:
        demo.cleanup()


if __name__ == "__main__":
    sys.exit(main())

"""Forwarding cost and backlog drain of the symbolizer (issue 24 targets).

1. Export CPU per session against ingest CPU per session, for each session shape:
   - ingest: the service's CPU per session (all of it: HTTP, gunzip, decode, checks, symbolization,
     store) with no endpoint configured; then with OTLP and Pyroscope endpoints down (503), which
     adds what ingest does for forwarding (a queue row per endpoint, in the session's transaction);
   - export: that service's queue drained by the service's own sender (exports.Exporter, the same
     code) run in a child process against the same database, its thread's CPU time only (the
     endpoint runs in this process, keeping connections alive as collectors do): reading each
     session, encoding, compressing, posting, the queue's writes. OTLP alone, then Pyroscope alone
     (its /ingest, a session a request, then its push API, `--pyroscope-api push`, batched);
     with `--baseline DIR` (another tree's `bistouri` package), that tree's sender drains the same
     queue too, just before: before and after under the same load.
   Shapes: `real` (default), stacks of real programs (libpython3.11 under libc, with libc's DWARF:
   file:line and inlined frames), 100 distinct stacks of 8-40 frames under 0-6 kernel frames, drawn
   from a Zipf law over 3 600 addresses; `small`, bench_ingest's (50 stacks of 12 frames of a tiny C
   binary). Target: at most 10 % of ingest.
2. Backlog drain: a service ingests `--backlog` sessions while its endpoint answers 503, is stopped,
   and started again with the endpoint up; from the first session accepted to the last, sessions per
   second and per CPU-second of the service. Target: at least 200 sessions/s per core.

   With `--postgres`, the services share a PostgreSQL server started here (as fleets run) instead of
   SQLite files; its own processes' CPU is not counted, for ingest as for export.

    .venv/bin/python -m bench.bench_export --sessions 300 --backlog 0           # the CPU comparison
    .venv/bin/python -m bench.bench_export --shapes "" --backlog 10000          # the drain
    git archive <rev> bistouri | tar -x -C /tmp/base    # then --baseline /tmp/base: before and after
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# --drain's child: the sender of another tree's `bistouri` package (--baseline), found before this one's.
CODE = os.environ.get("BISTOURI_BENCH_CODE")
if CODE:
    sys.path.insert(0, CODE)
    import bistouri  # noqa: F401  (now: the bench modules imported below put this tree first again)

from bench.bench_ingest import build_binary, cpu_seconds, make_sessions  # noqa: E402
from bench.bench_symbolize import _pick  # noqa: E402
from bistouri import wire  # noqa: E402
from bistouri.elf import PF_X, ElfFile  # noqa: E402
from bistouri.symbolizer.service.exports import (  # noqa: E402
    OTLP,
    PYROSCOPE,
    Endpoint,
    ExportConfig,
    Exporter,
)
from bistouri.symbolizer.service.metrics import Metrics  # noqa: E402
from bistouri.symbolizer.service.store import Store  # noqa: E402
from bistouri.symbolizer.sources import DEBUGINFO, DebugSources  # noqa: E402
from testkit.pg import running_postgres  # noqa: E402
from testkit.sink import Received, Sink  # noqa: E402
from testkit.symbolizer import (  # noqa: E402
    KALLSYMS,
    KERNEL_BUILD_ID,
    KERNEL_IPS,
    SymbolizerURL,
    clean_env,
    free_port,
    stop,
    symbolizer_command,
    wait_healthy,
)

RESULTS = REPO / "bench" / "results"
# exports.PUSH and PUSH_PATH, spelled here: a baseline's sender (--baseline) may predate them.
PUSH = "push"
PUSH_PATH = "/push.v1.PusherService/Push"
OTLP_PATH = "/v1development/profiles"
DEBUG_DIR = "/usr/lib/debug"
# Real programs: (path, addresses drawn from); libc's DWARF from libc6-dbg gives file:line and inlines.
LIBPYTHON = "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


class Pool:
    """Addresses inside a real binary's functions, drawn with a Zipf law (a profile's hot few)."""

    def __init__(self, path: str, n: int, seed: int) -> None:
        with ElfFile(path) as f:
            bid = f.build_id
            segments = [s for s in f.segments if s.flags & PF_X and s.filesz]
        assert bid, path
        self.build_id = bid
        dbg = DebugSources([DEBUG_DIR], [], debuginfod_urls=[]).find(bid, DEBUGINFO)
        with ElfFile(dbg.path if dbg else path) as f:
            index = f.symbol_index()
        _, self.offsets = _pick(index, segments, n, seed)
        random.Random(seed).shuffle(self.offsets)
        total, self.cum = 0.0, []
        for r in range(n):
            total += 1.0 / (r + 1) ** 1.1
            self.cum.append(total)

    def frames(self, rng: random.Random, k: int) -> list[wire.UserFrame]:
        return [
            wire.UserFrame(0, self.build_id, o) for o in rng.choices(self.offsets, cum_weights=self.cum, k=k)
        ]


def real_sessions(n: int, stacks: int, seed: int, python: Pool, libc: Pool) -> list[bytes]:
    """Sessions of a Python service: interpreter frames under libc's, under kernel frames."""
    rng = random.Random(seed)
    kips = list(KERNEL_IPS.values())
    out = []
    for i in range(n):
        traces = []
        for j in range(stacks):
            user = tuple(libc.frames(rng, rng.randint(0, 3)) + python.frames(rng, rng.randint(8, 40)))
            kernel = tuple(rng.choice(kips) for _ in range(rng.randint(0, 6)))
            off = rng.randint(0, 3)
            traces.append(
                wire.Trace(
                    kernel,
                    user,
                    100 + j % 4,
                    100 + j % 16,
                    on_cpu=rng.randint(1, 30),
                    off_cpu=off,
                    off_cpu_ns=off * rng.randint(10**5, 10**7),
                )
            )
        s = wire.Session(
            session_id=f"real-{seed}-{i}",
            trigger=wire.Trigger("cpu"),
            kernel=wire.KernelInfo("6.18", KERNEL_BUILD_ID, 0xFFFFFFFF81000000),
            start_ns=time.time_ns() - i,
            duration_ns=10**10,
            period_ns=52_631_578,
            service="bench",
            host=f"h{i % 10}",
            processes={100 + k: "python3" for k in range(4)},
            traces=traces,
        )
        out.append(wire.encode_session(s))
    return out


def start(d: Path, name: str, binary_dirs: list[Path], **flags: Any) -> SymbolizerURL:
    port = free_port()
    cmd = symbolizer_command(
        listen_addr=f"127.0.0.1:{port}", binary_dir=binary_dirs, log_level="warning", **flags
    )
    log = d / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
        )
    url = SymbolizerURL(f"http://127.0.0.1:{port}")
    url.proc, url.log_path = proc, log
    wait_healthy(url)
    return url


def post_all(url: str, bodies: list[bytes], clients: int) -> None:
    headers = {"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"}
    r = requests.put(f"{url}/v1/kernels/{KERNEL_BUILD_ID.hex()}", data=gzip.compress(KALLSYMS), timeout=60)
    assert r.status_code in (200, 204), r.text
    todo = list(bodies)
    lock = threading.Lock()

    def client() -> None:
        http = requests.Session()
        while True:
            with lock:
                if not todo:
                    return
                body = todo.pop()
            http.post(url + "/v1/sessions", data=body, headers=headers, timeout=300).raise_for_status()

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def otlp_sessions(r: Received) -> list[bytes]:
    """The profile ids of the sessions in one OTLP request, read with the official classes."""
    from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
        ExportProfilesServiceRequest,
    )

    req = ExportProfilesServiceRequest()
    req.ParseFromString(r.body)
    return [rp.scope_profiles[0].profiles[0].profile_id for rp in req.resource_profiles]


def sessions_at(sink: Sink) -> list[bytes]:
    return [p for r in sink.accepted(OTLP_PATH) for p in otlp_sessions(r)]


def save_queue(db: str, state: Path) -> None:
    """A copy of the queue as ingest left it: each drain (endpoint, code) sends the same rows."""
    store = Store.for_state_dir(db, state)
    store._exec("CREATE TABLE bench_queue AS SELECT * FROM export_queue")
    store.close()


def drain_in_child(
    sink: Sink, db: str, state: Path, ep: Endpoint, n: int, code: Path, api: str = ""
) -> tuple[float, list[Received]]:
    """The sender's thread CPU per session to send `n` queued sessions to one endpoint: the sender of
    the `bistouri` package in `code` (this tree's or --baseline's), run in a child process
    (`--drain`) on the queue as ingest left it; `api` the Pyroscope API ("": the sender's default, the
    only one a baseline without --pyroscope-api has)."""
    store = Store.for_state_dir(db, state)
    store._exec("DELETE FROM export_queue")
    store._exec("INSERT INTO export_queue SELECT * FROM bench_queue")
    store.close()
    sink.received.clear()
    args = json.dumps({"db": db, "state": str(state), "kind": ep.kind, "url": ep.url, "api": api})
    env = {**os.environ, "BISTOURI_BENCH_CODE": str(code)}
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_export", "--drain", args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    used = float(json.loads(out.stdout.splitlines()[-1])["cpu_s"])
    if ep.kind == OTLP:
        got = len(set(sessions_at(sink)))
    elif api == PUSH:
        got = len({sid for r in sink.accepted(PUSH_PATH) for sid, _, _ in push_series(r)})
    else:
        got = len(sink.accepted("/ingest"))
    assert got == n, f"{ep.kind} ({code}): {got} of {n} sessions at the endpoint"
    return used / n, list(sink.received)


def push_series(r: Received) -> list[tuple[str, str, bytes]]:
    """A push request's series, decoded with Pyroscope's push messages (protoc-generated from
    tests/fixtures/pyroscope/push.proto): (session id, the /ingest name its labels make, the pprof)."""
    from tests.pprof_proto import compile_push_proto

    global _PUSH_PB2
    if _PUSH_PB2 is None:
        with tempfile.TemporaryDirectory() as d:
            _PUSH_PB2 = compile_push_proto(Path(d))
    req = _PUSH_PB2.PushRequest()
    req.ParseFromString(r.body)
    out = []
    reserved = {"__name__", "__delta__", "service_name", "pyroscope_spy"}
    for series in req.series:
        labels = {p.name: p.value for p in series.labels}
        rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in reserved)
        name = f"{labels['service_name']}{{{rest}}}"
        out.append((labels["session_id"], name, series.samples[0].raw_profile))
    return out


_PUSH_PB2: Any = None


def otlp_views(received: list[Received]) -> Counter[str]:
    """Each session of OTLP requests as it reads through its request's dictionary (names, files,
    lines and attributes, no index: tests/unit/test_otlp.py's view, with the official classes)."""
    from tests.unit.test_otlp import Decoded, _session_view

    views: Counter[str] = Counter()
    for r in received:
        dec = Decoded(r.body)
        for rp in dec.req.resource_profiles:
            views[repr(_session_view(dec, rp))] += 1
    return views


def same_payloads(kind: str, before: list[Received], after: list[Received], api: str = "") -> str:
    """Whether the baseline's and this tree's sender sent the same: OTLP the same bytes or each session
    decoded equal (otlp_views), Pyroscope pprofs that decode equal (tests/unit/test_pprof_reference.
    resolved, pprof's own profile.proto), pushed ones under the labels that make the name /ingest had."""
    if kind == OTLP:
        if Counter(r.body for r in before) == Counter(r.body for r in after):
            return "same bytes"
        # Each session read through its request's dictionary (the official classes): no index left.
        views_before, views_after = otlp_views(before), otlp_views(after)
        equal = sum((views_before & views_after).values())
        return f"{equal} of {sum(views_after.values())} sessions decoded equal"
    from tests.pprof_proto import compile_profile_proto
    from tests.unit.test_pprof_reference import resolved

    with tempfile.TemporaryDirectory() as d:
        pb2 = compile_profile_proto(Path(d))
    by_name = {r.query["name"]: resolved(pb2, r.body) for r in before}
    if api == PUSH:
        pushed = [(name, raw) for r in after for _, name, raw in push_series(r)]
        equal = sum(by_name.get(name) == resolved(pb2, raw) for name, raw in pushed)
        return f"{equal} of {len(pushed)} pushed pprofs decoded equal, under the same names"
    equal = sum(by_name.get(r.query["name"]) == resolved(pb2, r.body) for r in after)
    return f"{equal} of {len(after)} pprofs decoded equal"


def drain(args: str) -> None:
    """--drain: send one endpoint's queue with the service's sender (exports.Exporter) in this
    process; print its thread's CPU time."""
    a = json.loads(args)
    code = Path(CODE or REPO).resolve()
    sender_file = Path(sys.modules[Exporter.__module__].__file__ or "").resolve()
    assert sender_file.is_relative_to(code), f"the sender of {sender_file}, not of {code}"
    store = Store.for_state_dir(a["db"], Path(a["state"]))
    ep = Endpoint(a["kind"], a["url"], **({"api": a["api"]} if a["api"] else {}))
    sender = Exporter(store, ExportConfig((ep,)), Metrics(lambda: store))
    sender._next_bounds = float("inf")  # the bounds' pass is not a send's cost
    # Due now: the failed sends' backoff, or the wait of a session missing symbols, is not measured.
    store._exec("UPDATE export_queue SET next_ns = 0, attempts = 0")
    c0 = time.thread_time()
    while sender.run_once():
        pass
    used = time.thread_time() - c0
    left = store.export_backlog()
    sender.close()
    assert not left.get(ep.key), f"{ep.kind}: {left}"
    print(json.dumps({"cpu_s": used}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=500, help="sessions of each CPU comparison")
    ap.add_argument("--backlog", type=int, default=10_000, help="sessions of the drain (0: skip it)")
    ap.add_argument("--shapes", default="real,small", help="session shapes of the comparison: real, small")
    ap.add_argument("--drain-shape", default="real", help="session shape of the drain")
    ap.add_argument(
        "--batch", type=int, default=20, help="sessions per ingest request when they come in bulk (a backlog)"
    )
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument(
        "--postgres", action="store_true", help="a PostgreSQL server (as fleets run) instead of SQLite files"
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another tree's `bistouri` package (`git archive <rev> bistouri | tar -x "
        "-C DIR`): its sender drains the same queue too, side by side",
    )
    ap.add_argument("--drains", type=int, default=1, help="drains of each queue (the median is given)")
    ap.add_argument("--drain", help=argparse.SUPPRESS)  # the child of drain_in_child
    args = ap.parse_args()
    if args.drain:
        drain(args.drain)
        return 0
    result: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shapes": {},
    }

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bistouri-bench-export-"))
        sink = stack.enter_context(Sink())
        pg = stack.enter_context(running_postgres()) if args.postgres else None
        run(args, Path(tmp), sink, pg.url if pg else "", result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def fresh_database(db: str) -> None:
    """An empty PostgreSQL database for the next service (SQLite: a new state directory each)."""
    if not db:
        return
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE IF EXISTS sessions, kernels, pending_builds, upload_files, upload_parts, "
            "export_queue, schema_version"
        )


def run(args: argparse.Namespace, d: Path, sink: Sink, db: str, result: dict[str, Any]) -> None:
    binary, bid, offsets = build_binary(d, None)
    libs = d / "libs"
    libs.mkdir()
    for lib in (LIBPYTHON, LIBC):
        os.symlink(lib, libs / os.path.basename(lib))
    python, libc = Pool(LIBPYTHON, 3000, 1), Pool(LIBC, 600, 2)
    bins = [binary.parent, libs]
    common: dict[str, Any] = {"workers": 1, "debug_dir": DEBUG_DIR, "db": db or None}

    def bodies(shape: str, n: int, seed: int, batch: int | None = None) -> list[bytes]:
        if shape == "real":
            enc = real_sessions(n, 100, seed, python, libc)
        else:
            enc = make_sessions(n, 50, 12, bid, offsets, seed=seed)
        step = batch or args.batch
        return [gzip.compress(wire.encode_batch(enc[i : i + step])) for i in range(0, n, step)]

    def warm(url: SymbolizerURL, shape: str) -> None:
        # The resolver's caches in steady state (a fleet's symbolizer has seen these binaries).
        post_all(url, bodies(shape, 100, seed=99), args.clients)

    otlp_ep = Endpoint(OTLP, sink.url + OTLP_PATH)
    pyro_ep = Endpoint(PYROSCOPE, sink.url)
    n = args.sessions
    for k, shape in enumerate(filter(None, args.shapes.split(","))):
        row: dict[str, Any] = {}
        # Ingest alone: a session a request, as an agent posts each session when it ends, then in
        # bulk (an agent back from an outage); then a session a request with both endpoints down
        # (their queue rows written, the sends failing and backing off).
        both = {"otlp_endpoint": otlp_ep.url, "pyroscope_url": pyro_ep.url}
        for name, batch, flags in (
            ("ingest", 1, {}),
            ("ingest_bulk", args.batch, {}),
            ("ingest_queued", 1, both),
        ):
            sink.status = 503
            state = d / f"{shape}-{name}"
            fresh_database(db)
            url = start(d, f"{shape}-{name}", bins, state_dir=state, **common, **flags)
            try:
                warm(url, shape)
                work = bodies(shape, n, seed=10 * k + len(row) + 1, batch=batch)
                c0 = cpu_seconds(url.proc.pid)
                post_all(url, work, args.clients)
                time.sleep(1.5)  # an idle sender's poll
                row[name] = (cpu_seconds(url.proc.pid) - c0) / n * 1000
            finally:
                stop(url)
        # The queued sessions (and the warm-up's) sent by the service's sender, in a child; with
        # --baseline, by the baseline's too, each endpoint's drains one after the other.
        sink.status = 200
        queued = n + 100
        save_queue(db, state)
        # --drains times each, baseline and this tree in turn (a shared machine's load moves between
        # drains: the median of several in turn is what holds up).
        for kind, ep in (("otlp", otlp_ep), ("pyroscope", pyro_ep)):
            codes = {f"{kind}_baseline": (args.baseline, "")} if args.baseline else {}
            codes[kind] = (REPO, "")
            if kind == "pyroscope":
                codes["pyroscope_push"] = (REPO, PUSH)
            cpu: dict[str, list[float]] = {name: [] for name in codes}
            sent: dict[str, list[Received]] = {}
            for _ in range(args.drains):
                for name, (code, api) in codes.items():
                    used, sent[name] = drain_in_child(sink, db, state, ep, queued, code, api)
                    cpu[name].append(used * 1000)
            for name, runs in cpu.items():
                row[name] = statistics.median(runs)
                row[f"{name}_runs"] = runs
            if args.baseline:
                for name in codes:
                    if name != f"{kind}_baseline":
                        same = same_payloads(ep.kind, sent[f"{kind}_baseline"], sent[name], codes[name][1])
                        print(f"  {shape} {name}: baseline and this tree: {same}")
        print(
            f"{shape}: ingest CPU a session {row['ingest']:.2f} ms one a request, "
            f"{row['ingest_bulk']:.2f} ms {args.batch} a request, "
            f"{row['ingest_queued']:.2f} ms one a request with the queue rows"
        )
        for kind in ("otlp", "pyroscope", "pyroscope_push"):
            for name in (f"{kind}_baseline", kind) if args.baseline and kind != "pyroscope_push" else (kind,):
                shares = ", ".join(
                    f"{100 * row[name] / row[base]:.1f} % of {base}" for base in ("ingest", "ingest_bulk")
                )
                runs = " ".join(f"{x:.3f}" for x in row[f"{name}_runs"])
                print(f"  export {name}: {row[name]:.3f} ms a session = {shares} (target <= 10 %); {runs}")
        result["shapes"][shape] = row

    if args.backlog:
        # 2. Backlog drain: queued while the endpoint is down, sent after a restart with it up.
        sink.received.clear()
        sink.status = 503
        otlp_only = {"otlp_endpoint": otlp_ep.url}
        state = d / "drain"
        fresh_database(db)
        url = start(d, "drain", bins, state_dir=state, **common, **otlp_only)
        try:
            t0 = time.perf_counter()
            post_all(url, bodies(args.drain_shape, args.backlog, seed=9), args.clients)
            print(f"backlog of {args.backlog} ingested in {time.perf_counter() - t0:.1f} s, endpoint down")
        finally:
            stop(url)
        sink.received.clear()
        sink.status = 200
        url = start(d, "drain", bins, state_dir=state, **common, **otlp_only)
        try:
            sink.wait_for(lambda s: bool(s.accepted()), 120, "the first session")
            c0, t0 = cpu_seconds(url.proc.pid), time.perf_counter()
            first = len(sessions_at(sink))
            sink.wait_for(lambda s: len(sessions_at(s)) >= args.backlog, 1800, "the backlog")
            wall, used = time.perf_counter() - t0, cpu_seconds(url.proc.pid) - c0
        finally:
            stop(url)
        ids = sessions_at(sink)
        rate, per_core = (args.backlog - first) / wall, (args.backlog - first) / used
        print(
            f"drain: {args.backlog} sessions ({args.drain_shape}) at {rate:.0f} sessions/s, "
            f"{per_core:.0f} per CPU-second of the service (target >= 200 per core); "
            f"{len(ids)} received, {len(set(ids))} distinct, in {len(sink.accepted())} requests"
        )
        result.update(drain_rate=rate, drain_per_cpu_second=per_core, drain_distinct=len(set(ids)))


if __name__ == "__main__":
    sys.exit(main())

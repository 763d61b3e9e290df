"""A fleet's load on two symbolizer instances: sessions/s per core and ingest latency.

The setup of tests/integration/test_fleet_load.py: two `bistouri symbolizer` instances on
one PostgreSQL behind a real HAProxy, each in its unit's 1 GiB memory cgroup and a cpuacct
cgroup; simulated agents (the agent's real spool and exporter) on `--boots` boots post
real-sized sessions (100 stacks of 16 user frames in a small C binary, 0-6 kernel frames)
spread over `--over-s` seconds, and upload their boot's kallsyms. Reports the sessions
stored per second, per CPU-second of both instances (all processes: gunicorn, workers),
the p50/p99 of `POST /v1/sessions` as HAProxy timed them, and each unit's memory peak.
`--kill` kill -9s one instance when 30 % of the sessions are acknowledged.

    .venv/bin/python -m bench.bench_fleet --agents 200 --boots 50 --sessions 5 --workers 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_ingest import build_binary  # noqa: E402
from testkit.fleet import Fleet, Instance  # noqa: E402
from testkit.helpers import wait_until  # noqa: E402
from testkit.loadbalancer import HAProxy  # noqa: E402
from testkit.pg import running_postgres  # noqa: E402


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--boots", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=5, help="sessions per agent")
    ap.add_argument("--over-s", type=float, default=0.0, help="spread sessions over this (0: at once)")
    ap.add_argument("--workers", type=int, default=2, help="gunicorn workers per instance")
    ap.add_argument("--kill", action="store_true", help="kill -9 one instance at 30 %% acknowledged")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/fleet.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bistouri-bench-fleet-") as tmp, running_postgres(100) as pg:
        d = Path(tmp)
        binary, build_id, offsets = build_binary(d, None)
        instances = [Instance(d, name, pg.url, binary.parent, args.workers) for name in ("a", "b")]
        lb = HAProxy(d, [i.port for i in instances])
        fleet = Fleet(d, lb.url, args.agents, args.boots, build_id, offsets)
        total = args.agents * args.sessions
        try:
            assert wait_until(lambda: lb.up_servers() == 2, timeout=10)
            cpu0 = sum(i.cgroups.cpu_seconds() for i in instances)
            t0 = time.perf_counter()
            fleet.start(args.sessions, args.over_s)  # encodes every session first
            encoded = time.perf_counter()
            if args.kill:
                assert wait_until(lambda: fleet.acknowledged() >= 0.3 * total, timeout=600)
                cpu_killed = instances[0].cgroups.cpu_seconds()
                instances[0].kill9()
            assert wait_until(fleet.done, timeout=600, step=0.02), f"{fleet.pending()} not acknowledged"
            wall = time.perf_counter() - encoded
            cpu = sum(i.cgroups.cpu_seconds() for i in instances) - cpu0
            if args.kill:  # a dead cgroup's counter may be gone with it: what it had used by then
                cpu = cpu_killed + instances[1].cgroups.cpu_seconds() - cpu0
            units = {i.name: i.cgroups.memory_peak() for i in instances}
            oom_kills = sum(i.cgroups.oom_kills() for i in instances)
        finally:
            fleet.stop()
            lb.close()
            for i in instances:
                i.close()
        posts = lb.request_times("POST", "/v1/sessions")
        ok = [t for status, t, _ in posts if status == 200]
        results = {
            "agents": args.agents,
            "boots": args.boots,
            "sessions": total,
            "workers_per_instance": args.workers,
            "killed_one": args.kill,
            "encode_s": encoded - t0,
            "wall_s": wall,
            "cpu_s": cpu,
            "sessions_per_s": total / wall,
            "sessions_per_cpu_s": total / cpu,
            "posts": len(posts),
            "posts_failed": len(posts) - len(ok),
            "post_statuses": {f"{s} {v}": n for (s, v), n in Counter((s, v) for s, _, v in posts).items()},
            "post_p50_s": _quantile(ok, 0.50),
            "post_p99_s": _quantile(ok, 0.99),
            "memory_peak_bytes": units,
            "oom_kills": oom_kills,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(
        f"{total} sessions from {args.agents} agents on {args.boots} boots, "
        f"2 instances x {args.workers} workers{', one killed at 30 %' if args.kill else ''}"
    )
    print(
        f"wall {wall:.1f} s: {total / wall:.0f} sessions/s; instances' CPU {cpu:.1f} s: "
        f"{total / cpu:.0f} sessions per CPU-second"
    )
    print(
        f"POST /v1/sessions: {len(posts)} requests (statuses {results['post_statuses']}), "
        f"p50 {results['post_p50_s'] * 1000:.0f} ms, p99 {results['post_p99_s'] * 1000:.0f} ms"
    )
    print(f"memory peaks (MiB): { ({k: round(v / 2**20) for k, v in units.items()}) }, OOM kills {oom_kills}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

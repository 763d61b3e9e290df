"""A real PostgreSQL server for tests and benchmarks, started from Debian's binaries.

initdb and the server run as the `postgres` user when we are root (they refuse root),
with fsync off, on a free loopback port, in a directory under /tmp (pytest's are private
to root). `running_postgres()` raises PgUnavailable, with the reason, where it cannot run.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from testkit.symbolizer import free_port


class PgUnavailable(Exception):
    """No PostgreSQL here: the reason, to skip with."""


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PgServer:
    def __init__(self, bindir: Path, root: Path, port: int, run_as: list[str]) -> None:
        self.bindir, self.root, self.port, self.run_as = bindir, root, port, run_as
        self.data = root / "data"
        self.url = f"postgresql://bistouri@127.0.0.1:{port}/bistouri"

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.run_as, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=120
        )


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-30:])
    except OSError:
        return ""


@contextlib.contextmanager
def running_postgres(max_connections: int = 50) -> Iterator[PgServer]:
    """A server with an empty `bistouri` database, stopped and removed on exit."""
    import psycopg

    bindir = _pg_bin()
    if bindir is None:
        raise PgUnavailable(
            "PostgreSQL binaries not found in /usr/lib/postgresql/*/bin: apt-get install -y postgresql"
        )
    run_as: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            raise PgUnavailable("running as root and there is no `postgres` user to run the server as")
        run_as = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="bistouri-pg-"))
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    pg = PgServer(bindir, root, free_port(), run_as)
    try:
        r = pg.run("initdb", "-D", str(pg.data), "-U", "bistouri", "--auth=trust", "-E", "UTF8", "--no-sync")
        assert r.returncode == 0, f"initdb failed:\n{r.stdout}\n{r.stderr}"
        opts = (
            f"-p {pg.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            f"-c max_connections={max_connections}"
        )
        log = str(root / "server.log")
        r = pg.run("pg_ctl", "-D", str(pg.data), "-o", opts, "-l", log, "-w", "-t", "60", "start")
        assert r.returncode == 0, (
            f"pg_ctl start failed:\n{r.stdout}\n{r.stderr}\n{_tail(root / 'server.log')}"
        )
        with psycopg.connect(f"postgresql://bistouri@127.0.0.1:{pg.port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE bistouri")
        yield pg
    finally:
        if (pg.data / "postmaster.pid").exists():
            pg.run("pg_ctl", "-D", str(pg.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)

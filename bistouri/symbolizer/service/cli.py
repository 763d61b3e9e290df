"""`bistouri symbolizer` (the service) and `bistouri symbolize` (offline, spooled session files).

`register(subparsers)` adds both to the `bistouri` command. Every flag of the
service can also come from the environment as `BISTOURI_SYMBOLIZER_<FLAG>`
(dashes become underscores; repeatable flags take a list separated by spaces
or commas). Errors the operator can fix exit with status 2 and one sentence.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ...elf import HOST_DEBUG_DIR
from ...errors import BistouriError
from . import tokens

log = logging.getLogger(__name__)

ENV_PREFIX = "BISTOURI_SYMBOLIZER_"
DEFAULT_LISTEN = "0.0.0.0:8470"
DEFAULT_STATE_DIR = "/var/lib/bistouri-symbolizer"
FORMATS = ("folded", "pprof", "speedscope", "json", "flamegraph", "otlp")
THREADS_PER_WORKER = 8


class UsageError(BistouriError):
    """A flag, file or address the operator gave cannot be used."""


# ---------------------------------------------------------------------------
# Argument parsing


def _size(text: str) -> int:
    """A byte count: plain, or with a K/M/G suffix (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in "KMG":
        mult = 1 << (10 * ("KMG".index(t[-1]) + 1))
        t = t[:-1]
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 16777216 or 16M)")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return n


_N = TypeVar("_N", int, float)


def _positive(text: str, convert: Callable[[str], _N], what: str) -> _N:
    try:
        n = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return n


def _positive_int(text: str) -> int:
    return _positive(text, int, "an integer")


def _port(text: str) -> int:
    n = _positive_int(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port")
    return n


def _days(text: str) -> float:
    return _positive(text, float, "a number of days")


def _hours(text: str) -> float:
    return _positive(text, float, "a number of hours")


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("debug-info sources")
    g.add_argument(
        "--debuginfod-url",
        action="append",
        metavar="URL",
        help="debuginfod server to fetch debug info from by build id (repeatable; default: $DEBUGINFOD_URLS)",
    )
    g.add_argument(
        "--debug-dir", action="append", metavar="DIR", help="directory holding a .build-id tree (repeatable)"
    )
    g.add_argument(
        "--binary-dir",
        action="append",
        metavar="DIR",
        help="directory of binaries, indexed by their build ids (repeatable)",
    )


def _add_export_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("forwarding (docs/deployment.md)")
    g.add_argument(
        "--otlp-endpoint",
        action="append",
        metavar="URL",
        help="send every stored session as OTLP Profiles (OTLP/HTTP protobuf) to this URL, in full "
        "(e.g. http://collector:4318/v1development/profiles); repeatable",
    )
    g.add_argument(
        "--otlp-headers-file", metavar="PATH", help="headers for the OTLP endpoints, 'Name: value' a line"
    )
    g.add_argument(
        "--pyroscope-url", metavar="URL", help="push every stored session as pprof to this Pyroscope server"
    )
    g.add_argument("--pyroscope-tenant", metavar="TENANT", help="Pyroscope tenant (X-Scope-OrgID)")
    g.add_argument(
        "--pyroscope-api",
        choices=("ingest", "push"),
        help="Pyroscope's API: ingest (/ingest, a session a request, any version; the default) or push "
        "(/push.v1.PusherService/Push, Pyroscope 1.x: up to 32 sessions a request, less CPU a session)",
    )
    g.add_argument(
        "--pyroscope-headers-file",
        metavar="PATH",
        help="headers for Pyroscope (e.g. 'Authorization: Bearer …'), 'Name: value' a line",
    )
    g.add_argument(
        "--export-max-sessions",
        type=_positive_int,
        metavar="N",
        help="sessions waiting per endpoint; past it the oldest are dropped (default 100000)",
    )
    g.add_argument(
        "--export-max-bytes",
        type=_size,
        metavar="BYTES",
        help="stored bytes of the sessions waiting per endpoint; past it the oldest are dropped (default 1G)",
    )
    g.add_argument(
        "--export-max-age-hours",
        type=_hours,
        metavar="HOURS",
        help="a session not sent within this is dropped (default 24)",
    )


def export_config(args: argparse.Namespace) -> Any:
    """The forwarding configuration of the flags; headers files are read here (UsageError if bad)."""
    from .exports import OTLP, PYROSCOPE, Endpoint, ExportConfig, read_headers

    def headers(flag: str, path: str | None) -> dict[str, str]:
        if not path:
            return {}
        try:
            return read_headers(path)
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot read it: {e.strerror}")
        except ValueError as e:
            raise UsageError(f"{flag}: {e}")

    def url(flag: str, text: str) -> str:
        if not text.startswith(("http://", "https://")):
            raise UsageError(f"{flag} {text!r}: an http:// or https:// URL")
        return text

    otlp_headers = headers("--otlp-headers-file", args.otlp_headers_file)
    endpoints = [Endpoint(OTLP, url("--otlp-endpoint", u), otlp_headers) for u in args.otlp_endpoint]
    if args.pyroscope_url:
        ph = headers("--pyroscope-headers-file", args.pyroscope_headers_file)
        if args.pyroscope_tenant:
            ph["X-Scope-OrgID"] = args.pyroscope_tenant
        api = getattr(args, "pyroscope_api", None) or "ingest"
        if api not in ("ingest", "push"):
            raise UsageError(f"{ENV_PREFIX}PYROSCOPE_API={api!r}: ingest or push")
        endpoints.append(Endpoint(PYROSCOPE, url("--pyroscope-url", args.pyroscope_url), ph, api))
    defaults = ExportConfig()
    return ExportConfig(
        endpoints=tuple(endpoints),
        max_rows=args.export_max_sessions or defaults.max_rows,
        max_bytes=args.export_max_bytes or defaults.max_bytes,
        max_age_s=args.export_max_age_hours * 3600 if args.export_max_age_hours else defaults.max_age_s,
    )


def register(subparsers: Any) -> None:
    """Add `symbolizer` and `symbolize` to the `bistouri` command's subparsers."""
    p = subparsers.add_parser(
        "symbolizer",
        help="run the symbolizer service",
        description="Run the symbolizer service: ingest agent sessions, symbolize, store, serve. "
        f"Each flag may also be set as {ENV_PREFIX}<FLAG> in the environment.",
    )
    p.add_argument(
        "--listen-addr", metavar="HOST:PORT", help=f"address to serve on (default {DEFAULT_LISTEN})"
    )
    p.add_argument("--workers", type=_positive_int, metavar="N", help="worker processes (default 2)")
    p.add_argument(
        "--metrics-port", type=_port, metavar="PORT", help="also serve /metrics alone on this port"
    )
    _add_source_flags(p)
    p.add_argument(
        "--db", metavar="PATH|URL", help="SQLite file or postgresql:// URL (default: STATE_DIR/bistouri.db)"
    )
    p.add_argument("--state-dir", metavar="DIR", help=f"state directory (default {DEFAULT_STATE_DIR})")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where debuginfod downloads are kept (default STATE_DIR/debuginfod; the unit gives /var/cache)",
    )
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding a shared write token (any tenant), also good for reads (see --write-tokens-file)",
    )
    p.add_argument(
        "--read-token", action="store_true", default=None, help="require a token on read endpoints too"
    )
    p.add_argument(
        "--write-tokens-file",
        metavar="PATH",
        help="agents' write tokens, one 'TENANT TOKEN' a line ('*': any tenant); a tenant's token stores "
        "and uploads for that tenant only",
    )
    p.add_argument(
        "--read-token-file", metavar="PATH", help="read tokens, one a line; reads then need a token"
    )
    p.add_argument(
        "--admin-token-file",
        metavar="PATH",
        help="admin tokens, one a line: everything, and DELETE of uploads",
    )
    p.add_argument(
        "--max-request-bytes", type=_size, metavar="BYTES", help="largest request body accepted (default 16M)"
    )
    p.add_argument(
        "--max-upload-bytes",
        type=_size,
        metavar="BYTES",
        help="largest ELF file an agent may upload, uncompressed (default 1G)",
    )
    p.add_argument(
        "--upload-quota-bytes",
        type=_size,
        metavar="BYTES",
        help="uploads kept in all, uncompressed; the least recently used make room (default 10G)",
    )
    p.add_argument(
        "--upload-quota-files",
        type=_positive_int,
        metavar="N",
        help="uploaded files kept in all (default 10000)",
    )
    p.add_argument(
        "--tenant-upload-quota-bytes",
        type=_size,
        metavar="BYTES",
        help="uploads kept per tenant (default: --upload-quota-bytes)",
    )
    p.add_argument(
        "--tenant-upload-quota-files",
        type=_positive_int,
        metavar="N",
        help="uploaded files kept per tenant (default: --upload-quota-files)",
    )
    p.add_argument(
        "--upload-claim-seconds",
        type=_positive_int,
        metavar="S",
        help="how long an agent's claim of an upload holds before another may take it (default 600)",
    )
    p.add_argument("--retention-days", type=_days, metavar="DAYS", help="delete sessions older than this")
    p.add_argument(
        "--max-db-bytes",
        type=_size,
        metavar="BYTES",
        help="above this, delete unused kallsyms, then uploads (least recently used), then old sessions",
    )
    _add_export_flags(p)
    p.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)"
    )
    p.set_defaults(func=run_symbolizer, _env_parser=p)

    q = subparsers.add_parser(
        "symbolize",
        help="symbolize spooled session files locally",
        description="Symbolize session files (as spooled by the agent) with the resolver of the service. "
        "Several files are merged into one profile.",
    )
    q.add_argument("files", nargs="+", metavar="FILE", help="session file (msgpack, as spooled)")
    q.add_argument("-o", "--output", metavar="OUT", help="output file (default: standard output)")
    q.add_argument("--format", choices=FORMATS, default="folded", help="output format (default folded)")
    q.add_argument(
        "--value",
        choices=("on_cpu", "off_cpu", "off_cpu_ns"),
        default="on_cpu",
        help="value for folded/flamegraph",
    )
    q.add_argument(
        "--kallsyms", metavar="FILE", help="/proc/kallsyms snapshot (text or .gz) of the sessions' kernel"
    )
    q.add_argument("--state-dir", metavar="DIR", help="resolver cache directory (default: a temporary one)")
    _add_source_flags(q)
    q.set_defaults(func=run_symbolize)


def _env(name: str) -> str | None:
    v = os.environ.get(ENV_PREFIX + name)
    return v if v not in (None, "") else None


def _env_list(name: str) -> list[str] | None:
    v = _env(name)
    return [x for x in v.replace(",", " ").split() if x] if v is not None else None


def apply_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill flags not given on the command line from BISTOURI_SYMBOLIZER_* and the defaults."""

    def typed(flag: str, conv: Callable[[str], Any], text: str) -> Any:
        try:
            return conv(text)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{ENV_PREFIX}{flag}: {e}")

    scalars: dict[str, tuple[Callable[[str], Any], Any]] = {
        "listen_addr": (str, DEFAULT_LISTEN),
        "workers": (_positive_int, 2),
        "metrics_port": (_port, None),
        "db": (str, ""),
        "state_dir": (str, DEFAULT_STATE_DIR),
        "cache_dir": (str, None),
        "token_file": (str, None),
        "write_tokens_file": (str, None),
        "read_token_file": (str, None),
        "admin_token_file": (str, None),
        "upload_quota_bytes": (_size, None),
        "upload_quota_files": (_positive_int, None),
        "tenant_upload_quota_bytes": (_size, None),
        "tenant_upload_quota_files": (_positive_int, None),
        "upload_claim_seconds": (_positive_int, None),
        "max_request_bytes": (_size, None),
        "max_upload_bytes": (_size, None),
        "retention_days": (_days, None),
        "max_db_bytes": (_size, None),
        "log_level": (str, "info"),
        "otlp_headers_file": (str, None),
        "pyroscope_url": (str, None),
        "pyroscope_tenant": (str, None),
        "pyroscope_api": (str, "ingest"),
        "pyroscope_headers_file": (str, None),
        "export_max_sessions": (_positive_int, None),
        "export_max_bytes": (_size, None),
        "export_max_age_hours": (_hours, None),
    }
    for name in ("TOKEN_FILE", "WRITE_TOKENS_FILE", "READ_TOKEN_FILE", "ADMIN_TOKEN_FILE"):
        if getattr(args, name.lower()) is None and os.environ.get(ENV_PREFIX + name) == "":
            # Set but empty is a mistake (a template without its value), not a wish to run open.
            raise UsageError(
                f"{ENV_PREFIX}{name} is set but empty: give the path of the token file, "
                "or remove the variable to run without a token"
            )
    for dest, (conv, default) in scalars.items():
        if getattr(args, dest, None) is None:
            text = _env(dest.upper())
            setattr(args, dest, typed(dest.upper(), conv, text) if text is not None else default)
    if args.otlp_endpoint is None:
        args.otlp_endpoint = _env_list("OTLP_ENDPOINT") or []
    if args.read_token is None:
        text = _env("READ_TOKEN")
        args.read_token = text is not None and text.lower() in ("1", "true", "yes", "on")
    if args.log_level not in ("debug", "info", "warning", "error"):
        raise UsageError(f"{ENV_PREFIX}LOG_LEVEL={args.log_level!r}: one of debug, info, warning, error")
    _apply_source_env(args)


def _apply_source_env(args: argparse.Namespace) -> None:
    for dest in ("debuginfod_url", "debug_dir", "binary_dir"):
        if getattr(args, dest) is None:
            setattr(args, dest, _env_list(dest.upper()) or [])
    if not args.debuginfod_url:
        args.debuginfod_url = os.environ.get("DEBUGINFOD_URLS", "").split()


# ---------------------------------------------------------------------------
# Checks that turn into clear errors before gunicorn starts


def debug_dirs_in_use(dirs: list[str], host_dir: str = HOST_DEBUG_DIR) -> list[str]:
    """The --debug-dir list without the host's debug tree when it does not exist: it is the
    package's default, and a host without debug packages has none yet (any other is checked)."""
    return [d for d in dirs if d != host_dir or Path(d).is_dir()]


def parse_listen(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--listen-addr {addr!r}: expected HOST:PORT, e.g. 0.0.0.0:8470 or [::1]:8470")
    try:
        n = int(port)
    except ValueError:
        raise UsageError(f"--listen-addr {addr!r}: port {port!r} is not a number")
    if not 0 < n < 65536:
        raise UsageError(f"--listen-addr {addr!r}: port {n} is outside 1..65535")
    return host.strip("[]"), n


def check_bind(host: str, port: int, flag: str) -> None:
    """Bind and release the address, so that "in use" is one clear line rather than gunicorn's retries."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"{flag}: cannot resolve {host!r}: {e.strerror}")
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise UsageError(
                f"{flag}: cannot listen on {host}:{port}: {e.strerror}. "
                "Stop whatever uses the port or choose another one"
            )


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def read_token(path: str) -> str:
    try:
        return tokens.read_single(path, "--token-file")
    except tokens.TokenFileError as e:
        raise UsageError(str(e))


def read_tokens(args: argparse.Namespace) -> tokens.Tokens:
    """Every kind of token the flags give (tokens.py); UsageError for a file that cannot be used."""
    for flag in ("token_file", "write_tokens_file", "read_token_file", "admin_token_file"):
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag.replace('_', '-')} is empty: give the path of the token file")
    try:
        legacy = tokens.read_single(args.token_file, "--token-file") if args.token_file else None
        write = tokens.read_write_tokens(args.write_tokens_file) if args.write_tokens_file else {}
        read = tokens.read_list(args.read_token_file, "--read-token-file") if args.read_token_file else ()
        admin = tokens.read_list(args.admin_token_file, "--admin-token-file") if args.admin_token_file else ()
        found = tokens.Tokens(legacy, write, read, admin, reads_need_token=bool(args.read_token or read))
        tokens.check_distinct(found)
    except tokens.TokenFileError as e:
        raise UsageError(str(e))
    if args.read_token and not (legacy or read or admin):
        raise UsageError("--read-token needs --token-file or --read-token-file: no token exists for reads")
    return found


def _prepare_state_dir(path: Path, flag: str = "--state-dir") -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {path}: not writable: {e.strerror}. Create it or choose another")


def _setup_multiprocess_metrics(state_dir: Path) -> None:
    """Point prometheus_client at a fresh multi-process directory shared by the gunicorn workers."""
    mp = state_dir / "prometheus"
    shutil.rmtree(mp, ignore_errors=True)
    mp.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(mp)
    # prometheus_client < 0.10 (Debian 11's 0.9) reads the lower-case spelling, later ones the upper.
    os.environ["prometheus_multiproc_dir"] = str(mp)  # noqa: SIM112
    # prometheus_client picks its value class at import: redo it in case it was imported already.
    from prometheus_client import values

    get_value_class = getattr(values, "get_value_class", None)
    if get_value_class is not None:
        values.ValueClass = get_value_class()


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def _error(cmd: str, e: Exception) -> int:
    print(f"bistouri {cmd}: error: {e}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------
# Resolver


def resolver_factory(args: argparse.Namespace, state_dir: Path) -> Callable[[Any], Any]:
    """A callable building the shared Resolver from the source flags (called in each worker, with
    the worker's one KallsymsStore)."""
    debug_dirs = [Path(d) for d in args.debug_dir]
    binary_dirs = [Path(d) for d in args.binary_dir]
    urls = list(args.debuginfod_url)
    cache_dir = getattr(args, "cache_dir", None)

    def make(kernels: Any) -> Any:
        from ..resolve import Resolver

        return Resolver.from_options(
            state_dir=state_dir,
            kernels=kernels,
            debug_dirs=debug_dirs,
            binary_dirs=binary_dirs,
            debuginfod_urls=urls,
            cache_dir=cache_dir,
            # Files agents uploaded (uploads.py): per tenant, after every operator source.
            uploads_dir=state_dir / "uploads",
        )

    return make


# ---------------------------------------------------------------------------
# Running the service under gunicorn


def _child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Imported by serve() beforehand: this hook runs in the master's SIGCHLD handler, where a
        # first import could fail or wait (seen: a traceback at stop, the unit left "failed").
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def _worker_exit(server: Any, worker: Any) -> None:
    close = getattr(getattr(worker, "wsgi", None), "close", None)
    if callable(close):
        close()


def serve(
    config: Any,
    resolver_factory: Callable[[Any], Any],
    binds: list[str],
    workers: int,
    log_level: str = "info",
) -> None:
    """Run the service under gunicorn until a signal stops it. Exits the process (gunicorn's way)."""
    from gunicorn.app.base import BaseApplication

    from .server import SymbolizerApp

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        import prometheus_client.multiprocess  # noqa: F401  (for _child_exit, in a signal handler)

    options: dict[str, Any] = {
        "bind": binds,
        "workers": workers,
        # Threads, so that /healthz and reads are answered while a batch is symbolized; request
        # headers are read by the worker's poller, so slow clients hold no thread (worker.py).
        "worker_class": "bistouri.symbolizer.service.worker.HeaderGateWorker",
        "threads": THREADS_PER_WORKER,
        # The worker's main loop beats even while a thread symbolizes; a request stuck longer is a bug.
        "timeout": 120,
        "graceful_timeout": 20,
        # No keep-alive: agents post every few seconds, and a client reusing a connection the
        # server is closing for idleness gets a spurious connection error.
        "keepalive": 0,
        "loglevel": log_level.lower(),
        "errorlog": "-",
        "accesslog": "-" if log_level.lower() == "debug" else None,
        "proc_name": "bistouri-symbolizer",
        "child_exit": _child_exit,
        "worker_exit": _worker_exit,
        # Each worker builds its app (resolver, database connection) after the fork.
        "preload_app": False,
    }

    # Newer gunicorn opens a control socket in $HOME, shared by every instance of the user: not wanted.
    optional = {"control_socket_disable": True}

    class _Gunicorn(BaseApplication):
        def load_config(self) -> None:
            for k, v in options.items():
                self.cfg.set(k, v)
            for k, v in optional.items():
                if k in self.cfg.settings:  # absent from bookworm's gunicorn 20.1
                    self.cfg.set(k, v)

        def load(self) -> SymbolizerApp:
            return SymbolizerApp(config, resolver_factory)

    _Gunicorn().run()


# ---------------------------------------------------------------------------
# Commands


def run_symbolizer(args: argparse.Namespace) -> int:
    from .server import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
    from .store import Store, StoreError
    from .uploads import (
        CLAIM_LEASE_S,
        DEFAULT_MAX_UPLOAD_BYTES,
        DEFAULT_QUOTA_BYTES,
        DEFAULT_QUOTA_FILES,
        Quota,
    )

    try:
        apply_env(args, args._env_parser)
        _configure_logging(args.log_level)
        state_dir = Path(args.state_dir)
        _prepare_state_dir(state_dir)
        if args.cache_dir:
            _prepare_state_dir(Path(args.cache_dir), "--cache-dir")
        access = read_tokens(args)
        host, port = parse_listen(args.listen_addr)
        check_bind(host, port, "--listen-addr")
        binds = [args.listen_addr]
        if args.metrics_port:
            if args.metrics_port == port:
                raise UsageError("--metrics-port must differ from the --listen-addr port")
            check_bind(host, args.metrics_port, "--metrics-port")
            binds.append(f"{args.listen_addr.rpartition(':')[0]}:{args.metrics_port}")
        args.debug_dir = debug_dirs_in_use(args.debug_dir)
        for d in [*args.debug_dir, *args.binary_dir]:
            if not Path(d).is_dir():
                raise UsageError(f"{d}: no such directory (given as --debug-dir or --binary-dir)")
        config = ServerConfig(
            state_dir=state_dir,
            db=args.db,
            tokens=access,
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            max_upload_bytes=args.max_upload_bytes or DEFAULT_MAX_UPLOAD_BYTES,
            upload_quota=Quota(
                total_bytes=args.upload_quota_bytes or DEFAULT_QUOTA_BYTES,
                total_files=args.upload_quota_files or DEFAULT_QUOTA_FILES,
                tenant_bytes=args.tenant_upload_quota_bytes,
                tenant_files=args.tenant_upload_quota_files,
            ),
            claim_lease_s=args.upload_claim_seconds or CLAIM_LEASE_S,
            retention_days=args.retention_days,
            max_db_bytes=args.max_db_bytes,
            metrics_port=args.metrics_port,
            export=export_config(args),
        )
        # Migrate once, here in the master, before any worker opens the database.
        store = Store.for_state_dir(config.db, state_dir)
        before = store.migrate()
        store.close()
        _setup_multiprocess_metrics(state_dir)
    except (UsageError, StoreError) as e:
        return _error("symbolizer", e)
    log.info(
        "symbolizer starting. listen=%s workers=%d db=%s state_dir=%s cache_dir=%s schema_from=%d token=%s "
        "read_token=%s write_tokens=%d read_tokens=%d admin_tokens=%d debug_dirs=%s binary_dirs=%s "
        "debuginfod=%s export=%s",
        ",".join(binds),
        args.workers,
        store.display,
        state_dir,
        args.cache_dir or state_dir / "debuginfod",
        before,
        "yes" if access.legacy else "no",
        access.reads_need_token,
        len(access.write),
        len(access.read),
        len(access.admin),
        args.debug_dir,
        args.binary_dir,
        args.debuginfod_url,
        ",".join(e.key for e in config.export.endpoints) or "none",  # URLs only: headers hold tokens
    )
    if not access.writes_need_token and not _is_loopback(host):
        log.warning(
            "NO TOKEN on a listener reachable from the network: anyone who reaches %s can store "
            "sessions and read every profile. Set --token-file (BISTOURI_SYMBOLIZER_TOKEN_FILE), "
            "or listen on 127.0.0.1",
            args.listen_addr,
        )
    serve(config, resolver_factory(args, state_dir), binds, args.workers, args.log_level)
    return 0


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP stop `bistouri symbolize` as Ctrl-C does: by unwinding (SystemExit), not
    where it stands. Killed there, a run that was reading a build id's files left the marker of that
    work (llvm.Quarantine.attempt) in --state-dir, and the next run took it for a death the file had
    caused: the build id unnamed for 24 h. A signal ignored at start (nohup) stays ignored."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                old[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_symbolize(args: argparse.Namespace) -> int:
    with _signals_unwind():
        return _symbolize(args)


def _symbolize(args: argparse.Namespace) -> int:
    from ...errors import WireError
    from .. import formats
    from ..kallsyms import KallsymsStore
    from ..resolve import read_session_file

    _apply_source_env(args)
    _configure_logging("warning")
    tmp = None
    try:
        if args.state_dir:
            state_dir = Path(args.state_dir)
            _prepare_state_dir(state_dir)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="bistouri-symbolize-")
            state_dir = Path(tmp.name)
        sessions = []
        for name in args.files:
            try:
                sessions.append(read_session_file(name))  # spool files, bare or gzip'd msgpack
            except OSError as e:
                raise UsageError(f"{name}: cannot read it: {e.strerror}")
            except WireError as e:
                raise UsageError(f"{name}: not a bistouri session file: {e}")
        if args.kallsyms:
            _install_kallsyms(Path(args.kallsyms), state_dir, sessions)
        resolver = resolver_factory(args, state_dir)(KallsymsStore(str(state_dir)))
        profiles = []
        try:
            for s in sessions:
                profiles.append(resolver.symbolize(s))  # its meta is built from the session
        finally:
            resolver.close()
        profile = profiles[0] if len(profiles) == 1 else formats.merge(profiles)
        out: bytes
        if args.format == "folded":
            out = formats.folded(profile, args.value).encode()
        elif args.format == "pprof":
            out = formats.pprof(profile)
        elif args.format == "speedscope":
            out = json.dumps(formats.speedscope(profile)).encode()
        elif args.format == "flamegraph":
            out = formats.tree_json(formats.flamegraph(profile, args.value)).encode()
        elif args.format == "otlp":
            from .. import otlp

            out = otlp.export_request(profile)
        else:
            out = json.dumps(formats.profile_json(profile), indent=1).encode()
        if args.output and args.output != "-":
            try:
                Path(args.output).write_bytes(out)
            except OSError as e:
                raise UsageError(f"-o {args.output}: cannot write it: {e.strerror}")
        else:
            sys.stdout.buffer.write(out)
            sys.stdout.buffer.flush()
    except UsageError as e:
        return _error("symbolize", e)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _install_kallsyms(path: Path, state_dir: Path, sessions: list[Any]) -> None:
    """Put a kallsyms snapshot where the resolver looks for it, under each session's kernel build id."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"--kallsyms {path}: cannot read it: {e.strerror}")
    gz = data if data[:2] == b"\x1f\x8b" else gzip.compress(data, mtime=0)
    kernels = state_dir / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    for bid in {s.kernel.build_id.hex() for s in sessions if s.kernel.build_id}:
        (kernels / f"{bid}.kallsyms.gz").write_bytes(gz)


def main(argv: list[str] | None = None) -> int:
    """A stand-alone entry point (`python -m bistouri.symbolizer`) until `bistouri` wires these in."""
    parser = argparse.ArgumentParser(prog="bistouri")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))

"""The agent's own settings: flags, then ``BISTOURI_*`` environment variables, then defaults.

flag > env > default; every problem is collected before ConfigError is raised.
docs/configuration.md is the reference.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..compat import SLOTS
from ..errors import ConfigError
from ..host.mounts import find_cgroup2_mount
from .config import CAPTURE_SECS_MAX, DEFAULT_TARGETS_PATH, LABEL_KEY_RE


@dataclass(frozen=True, **SLOTS)
class AgentSettings:
    config_path: str = DEFAULT_TARGETS_PATH
    tenant_id: str = "default"
    labels: Mapping[str, str] = field(default_factory=dict)
    symbolizer_endpoint: str | None = None  # None: spool only, nothing is sent
    symbolizer_token_file: str | None = None
    symbolizer_ca_file: str | None = None
    symbolizer_client_cert: str | None = None
    symbolizer_client_key: str | None = None
    # Files the symbolizer asks for (uploader.py): largest one, 0 turns uploads off; bytes a second.
    upload_max_bytes: int = 512 * 1024 * 1024
    upload_rate_bytes: int = 16 * 1024 * 1024
    upload_debug_dir: str = "/usr/lib/debug"  # its .build-id tree holds separate debug files
    capture_duration_secs: float = 10.0
    freq: int = 19
    metrics_port: int = 9464  # 0 disables the metrics endpoint
    metrics_addr: str = "0.0.0.0"
    proc_path: str = "/proc"
    cgroup_path: str | None = None  # None: no cgroup2 mount found (only scope: system works)
    spool_dir: str = "/var/lib/bistouri/spool"
    spool_max_bytes: int = 256 * 1024 * 1024
    capture_max_bytes: int = 64 * 1024 * 1024  # stacks held by running sessions
    recorder_max_bytes: int = 16 * 1024 * 1024  # flight recorder; 0: off for every target
    # Raw stack copies of sessions' processes held until their unwind tables are in; 0: none asked.
    raw_stacks_max_bytes: int = 8 * 1024 * 1024
    walk_interval_secs: float = 30.0
    offcpu: bool = True
    log_level: str = "info"
    warnings: tuple[str, ...] = ()

    @property
    def period_ns(self) -> int:
        return 1_000_000_000 // self.freq


LOG_LEVELS = ("debug", "info", "warning", "error")

# (flag, environment variable, metavar, help) of every agent flag; dest is the flag with underscores.
# fmt: off
_FLAGS: tuple[tuple[str, str, str | None, str], ...] = (
    ("--config", "BISTOURI_CONFIG", "PATH", f"targets file (default {DEFAULT_TARGETS_PATH})"),
    ("--tenant-id", "BISTOURI_TENANT_ID", "ID", "tenant recorded in every session (default 'default')"),
    ("--label", "BISTOURI_LABELS", "K=V", "label added to every session; repeatable (env: k=v,k2=v2)"),
    ("--symbolizer-endpoint", "BISTOURI_SYMBOLIZER_ENDPOINT", "URL", "symbolizer URL; unset: spool only"),
    ("--symbolizer-token-file", "BISTOURI_SYMBOLIZER_TOKEN_FILE", "PATH", "file holding the bearer token"),
    ("--symbolizer-ca-file", "BISTOURI_SYMBOLIZER_CA_FILE", "PATH", "CA bundle to verify the symbolizer"),
    ("--symbolizer-client-cert", "BISTOURI_SYMBOLIZER_CLIENT_CERT", "PATH", "TLS client certificate (PEM)"),
    ("--symbolizer-client-key", "BISTOURI_SYMBOLIZER_CLIENT_KEY", "PATH", "TLS client key (PEM)"),
    ("--upload-max-bytes", "BISTOURI_UPLOAD_MAX_BYTES", "SIZE", "largest upload on demand, 0 off (512MiB)"),
    ("--upload-rate-bytes", "BISTOURI_UPLOAD_RATE_BYTES", "SIZE", "upload bytes per second (default 16MiB)"),
    ("--upload-debug-dir", "BISTOURI_UPLOAD_DEBUG_DIR", "PATH", "debug files' root (default /usr/lib/debug)"),
    ("--capture-duration-secs", "BISTOURI_CAPTURE_DURATION", "SECS", "capture session length (default 10)"),
    ("--freq", "BISTOURI_FREQ", "HZ", "on-CPU sampling frequency, 1..1000 (default 19; prefer a prime)"),
    ("--metrics-port", "BISTOURI_METRICS_PORT", "PORT", "Prometheus port, 0 disables (default 9464)"),
    ("--metrics-addr", "BISTOURI_METRICS_ADDR", "ADDR", "Prometheus listen address (default 0.0.0.0)"),
    ("--proc-path", "BISTOURI_PROC_PATH", "PATH", "procfs mount (default /proc)"),
    ("--cgroup-path", "BISTOURI_CGROUP_PATH", "PATH", "cgroup2 mount (default: from <proc>/self/mountinfo)"),
    ("--spool-dir", "BISTOURI_SPOOL_DIR", "PATH", "spooled sessions (default /var/lib/bistouri/spool)"),
    ("--spool-max-bytes", "BISTOURI_SPOOL_MAX_BYTES", "SIZE", "spool size cap, e.g. 256MiB (default 256MiB)"),
    ("--capture-max-bytes", "BISTOURI_CAPTURE_MAX_BYTES", "SIZE", "stack memory of sessions (default 64MiB)"),
    ("--recorder-max-bytes", "BISTOURI_RECORDER_MAX_BYTES", "SIZE", "recorder memory, 0 off (default 16MiB)"),
    ("--raw-stacks-max-bytes", "BISTOURI_RAW_STACKS_MAX_BYTES", "SIZE",
     "stack copies held until unwind tables are in, 0 off (default 8MiB)"),
    ("--walk-interval-secs", "BISTOURI_WALK_INTERVAL", "SECS", "period of the /proc walk (default 30)"),
    ("--offcpu", "BISTOURI_OFFCPU", None, "capture off-CPU (D state) stacks (default on)"),
    ("--log-level", "BISTOURI_LOG_LEVEL", "LEVEL", "debug, info, warning or error (default info)"),
)
# fmt: on
_ENV = {flag[2:].replace("-", "_"): env for flag, env, _, _ in _FLAGS}


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the agent's flags. Values stay raw strings: settings_from_args validates them all at once."""
    g = parser.add_argument_group("agent", "each flag also reads the environment variable shown; flag wins")
    for flag, env, metavar, text in _FLAGS:
        kw: dict[str, Any] = {"metavar": metavar}
        if flag == "--label":
            kw["action"] = "append"
        elif flag == "--offcpu":
            kw = {"action": argparse.BooleanOptionalAction}
        # SUPPRESS: an absent flag leaves no attribute, so the environment can fill in (and help
        # formatters that print defaults do not show a misleading "None").
        g.add_argument(
            flag, dest=flag[2:].replace("-", "_"), default=argparse.SUPPRESS, help=f"{text} [env {env}]", **kw
        )


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """'268435456', '256MiB', '256M', '1g' → bytes (binary multiples). ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (bytes, or with K/M/G/T[iB])")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _SIZE_MULT[unit if unit != "b" else ""]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _parse_labels_text(items: list[str], where: str, problems: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not LABEL_KEY_RE.match(k):
            problems.append(
                f"{where}: {item!r} must be key=value with a key matching [A-Za-z_][A-Za-z0-9_.-/]*"
            )
        else:
            out[k] = v.strip()
    return out


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AgentSettings:
    """Resolve flags, then environment, then defaults; raise ConfigError with every problem found."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    warnings: list[str] = []

    def raw(dest: str) -> tuple[Any, str]:
        """The value and where it came from, for error paths."""
        v = getattr(args, dest, None)
        if v is not None:
            return v, "--" + dest.replace("_", "-")
        name = _ENV[dest]
        if env.get(name, "") != "":
            return env[name], name
        return None, ""

    def text(dest: str, default: str | None) -> str | None:
        v, _ = raw(dest)
        return default if v is None else str(v)

    def number(dest: str, default: float, lo: float, hi: float, integer: bool) -> float:
        v, where = raw(dest)
        if v is None:
            return default
        try:
            n: float = int(v) if integer else float(v)
        except ValueError:
            problems.append(f"{where}: {v!r} is not {'an integer' if integer else 'a number'}")
            return default
        if not (lo <= n <= hi) or not math.isfinite(n):
            problems.append(f"{where}: {v} is out of range {lo:g}..{hi:g}")
            return default
        return n

    def size(dest: str, default: int, zero_turns_off: bool = False) -> int:
        """A byte size such as 64M, at least 1 MiB (or 0, where 0 turns the feature off)."""
        v, where = raw(dest)
        if v is None:
            return default
        try:
            n = parse_size(str(v))
        except ValueError as e:
            problems.append(f"{where}: {e}")
            return default
        if n < 1 << 20 and not (zero_turns_off and n == 0):
            off = " (0 turns it off)" if zero_turns_off else ""
            problems.append(f"{where}: {n} bytes is below the 1 MiB minimum{off}")
            return default
        return n

    s: dict[str, Any] = {}
    s["config_path"] = text("config", DEFAULT_TARGETS_PATH)

    tenant, where = raw("tenant_id")
    if tenant is None:
        tenant = "default"
        warnings.append(
            "no --tenant-id / BISTOURI_TENANT_ID given: sessions are filed under tenant 'default'"
        )
    elif not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$", tenant):
        problems.append(
            f"{where}: {tenant!r} must be 1-64 characters of [A-Za-z0-9_.-], starting alphanumeric"
        )
    s["tenant_id"] = tenant

    lv, where = raw("label")
    if lv is None:
        s["labels"] = {}
    elif isinstance(lv, list):
        s["labels"] = _parse_labels_text(lv, where, problems)
    else:
        s["labels"] = _parse_labels_text(str(lv).split(","), where, problems)

    endpoint, where = raw("symbolizer_endpoint")
    if endpoint is not None:
        u = urlsplit(endpoint)
        if u.scheme not in ("http", "https") or not u.hostname:
            problems.append(f"{where}: {endpoint!r} must be an http:// or https:// URL with a host")
        elif u.query or u.fragment:
            problems.append(f"{where}: {endpoint!r} must be a base URL without query or fragment")
        endpoint = endpoint.rstrip("/")
    s["symbolizer_endpoint"] = endpoint

    for dest in (
        "symbolizer_token_file",
        "symbolizer_ca_file",
        "symbolizer_client_cert",
        "symbolizer_client_key",
    ):
        v, where = raw(dest)
        if v is not None and not os.path.isfile(v):
            problems.append(f"{where}: {v} does not exist or is not a file")
        s[dest] = v
    if s["symbolizer_client_key"] and not s["symbolizer_client_cert"]:
        problems.append("--symbolizer-client-key: needs --symbolizer-client-cert as well")
    if endpoint is None and any(
        s[d] for d in ("symbolizer_token_file", "symbolizer_ca_file", "symbolizer_client_cert")
    ):
        warnings.append("symbolizer TLS/token options are set but no --symbolizer-endpoint: they are unused")
    if endpoint and endpoint.startswith("http://") and s["symbolizer_token_file"]:
        warnings.append("the bearer token is sent over plain http: use https:// outside a trusted network")

    s["upload_max_bytes"] = size("upload_max_bytes", 512 << 20, zero_turns_off=True)
    s["upload_rate_bytes"] = size("upload_rate_bytes", 16 << 20)
    s["upload_debug_dir"] = text("upload_debug_dir", "/usr/lib/debug") or "/usr/lib/debug"

    s["capture_duration_secs"] = number("capture_duration_secs", 10.0, 0.1, CAPTURE_SECS_MAX, integer=False)
    freq = int(number("freq", 19, 1, 1000, integer=True))
    if not _is_prime(freq):
        warnings.append(
            f"--freq {freq} is not prime: sampling may alias with periodic work "
            "(timers at 10, 100, 1000 Hz); "
            "a prime such as 19, 97 or 997 avoids it"
        )
    s["freq"] = freq
    s["metrics_port"] = int(number("metrics_port", 9464, 0, 65535, integer=True))
    s["metrics_addr"] = text("metrics_addr", "0.0.0.0")
    proc_path = text("proc_path", "/proc") or "/proc"
    if not os.path.isdir(proc_path):
        problems.append(f"{raw('proc_path')[1] or '--proc-path'}: {proc_path} is not a directory")
    s["proc_path"] = proc_path

    cg, where = raw("cgroup_path")
    if cg is not None:
        if not os.path.isfile(os.path.join(cg, "cgroup.procs")):
            problems.append(f"{where}: {cg} is not a cgroup2 mount (no cgroup.procs)")
    else:
        cg = find_cgroup2_mount(proc_path)
        if cg is None:
            warnings.append(
                f"no cgroup2 mount in {proc_path}/self/mountinfo: "
                "only 'scope: system' targets can be watched; "
                "mount cgroup2 or pass --cgroup-path"
            )
    s["cgroup_path"] = cg

    s["spool_dir"] = text("spool_dir", "/var/lib/bistouri/spool")
    s["spool_max_bytes"] = size("spool_max_bytes", 256 << 20)
    s["capture_max_bytes"] = size("capture_max_bytes", 64 << 20)
    s["recorder_max_bytes"] = size("recorder_max_bytes", 16 << 20, zero_turns_off=True)
    s["raw_stacks_max_bytes"] = size("raw_stacks_max_bytes", 8 << 20, zero_turns_off=True)
    s["walk_interval_secs"] = number("walk_interval_secs", 30.0, 1.0, 3600.0, integer=False)

    off, where = raw("offcpu")
    if off is None or isinstance(off, bool):
        s["offcpu"] = True if off is None else off
    else:
        flag = str(off).strip().lower()
        if flag in ("1", "true", "yes", "on"):
            s["offcpu"] = True
        elif flag in ("0", "false", "no", "off"):
            s["offcpu"] = False
        else:
            problems.append(f"{where}: {off!r} is not a boolean (true/false)")
            s["offcpu"] = True

    level = (text("log_level", "info") or "info").lower()
    if level not in LOG_LEVELS:
        problems.append(f"{raw('log_level')[1]}: {level!r} is not one of {', '.join(LOG_LEVELS)}")
        level = "info"
    s["log_level"] = level

    if problems:
        raise ConfigError(problems, source="command line and environment")
    # Warnings are returned, not logged: logging is set up from these very settings.
    return AgentSettings(warnings=tuple(warnings), **s)

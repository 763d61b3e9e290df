"""The targets file (YAML, hot-reloaded; named `trigger.yaml` for history): what to watch and when to
capture.

The targets file keeps the original Bistouri schema (``targets: [{rule, service_id,
resources, labels}]``) and adds optional keys with defaults: per resource ``stall``
and ``window_ms``, per target ``scope``, ``capture_duration_secs``,
``cooldown_secs`` and ``recorder_secs``. A target names its processes by comm
(``rule``), by cgroup path (``cgroup``) or by systemd unit (``unit``). Every
problem is collected with its path before anything is raised, so one run of
``bistouri check --config`` shows them all.

The agent's own settings (flags and environment) live in settings.py;
docs/configuration.md is the reference for both.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..compat import SLOTS
from ..errors import ConfigError
from ..pressure import DEFAULT_WINDOW_MS, RESOURCES, STALLS, PressureThreshold

DEFAULT_TARGETS_PATH = "/etc/bistouri/trigger.yaml"

RULE_TYPES = ("Exact", "Prefix")
SCOPES = ("cgroup", "system")

COMM_MAX_BYTES = 15  # TASK_COMM_LEN - 1
SERVICE_ID_RE = re.compile(r"^[a-z][a-z0-9_]*$")
SERVICE_ID_MAX = 32
MAX_TARGETS = 1024  # entries of the BPF comm trie
WINDOW_MS_MIN = 500  # kernel WINDOW_MIN_US
WINDOW_MS_MAX = 10_000  # kernel WINDOW_MAX_US
CAPTURE_SECS_MAX = 3600.0
COOLDOWN_SECS_MAX = 86_400.0
LABEL_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
LABEL_VALUE_MAX = 256
CGROUP_PATH_MAX = 4096  # PATH_MAX
UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.(service|scope|slice)$")  # the unit kinds that hold processes
UNIT_MAX = 255  # systemd's UNIT_NAME_MAX
DEFAULT_RECORDER_SECS = 5.0
RECORDER_SECS_MAX = 60.0
RECORDER_HZ_MAX = 1000.0

_TOP_KEYS = ("targets",)
_TARGET_KEYS = (
    "rule",
    "service_id",
    "resources",
    "labels",
    "scope",
    "capture_duration_secs",
    "cooldown_secs",
    "cgroup",
    "unit",
    "recorder_secs",
    "recorder_hz",
)
_SELECTORS = ("rule", "cgroup", "unit")  # how a target names its processes: exactly one
_RULE_KEYS = ("type", "comm")
_RESOURCE_KEYS = ("resource", "threshold", "stall", "window_ms")


# ---------------------------------------------------------------------------
# Targets file model


@dataclass(frozen=True, **SLOTS)
class Rule:
    """How a target's processes are recognised: by their comm (the kernel's 15-byte task name)."""

    type: str  # Exact | Prefix
    comm: str

    @property
    def comm_bytes(self) -> bytes:
        return self.comm.encode("utf-8")


@dataclass(frozen=True, **SLOTS)
class Target:
    """A watched service. `rule_id` is assigned at load, monotonic across reloads.

    Its processes are named by exactly one of `rule` (comm), `cgroup` (a cgroup2 path,
    every process in it and below) or `unit` (a systemd unit, found in the hierarchy).
    """

    rule_id: int
    rule: Rule | None
    service_id: str
    resources: tuple[PressureThreshold, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    scope: str = "cgroup"  # cgroup: the process's own cgroup; system: /proc/pressure
    capture_duration_secs: float | None = None  # None: the agent's --capture-duration-secs
    cooldown_secs: float | None = None  # None: the capture duration
    cgroup: str | None = None  # "/system.slice/nginx.service": relative to the cgroup2 mount
    unit: str | None = None  # "nginx.service": its cgroup is searched under the mount
    recorder_secs: float = DEFAULT_RECORDER_SECS  # seconds kept before a session's trigger; 0: off
    recorder_hz: float | None = None  # the recorder's rate; None: the agent's --freq (its ceiling)

    @property
    def selector(self) -> str:
        """How the target names its processes, for logs: `Exact:'nginx'`, `cgroup:/a/b`, `unit:x.service`."""
        if self.rule is not None:
            return f"{self.rule.type}:{self.rule.comm!r}"
        return f"cgroup:{self.cgroup}" if self.cgroup is not None else f"unit:{self.unit}"

    def capture_secs(self, default: float) -> float:
        return self.capture_duration_secs if self.capture_duration_secs is not None else default

    def cooldown(self, default_capture: float) -> float:
        return self.cooldown_secs if self.cooldown_secs is not None else self.capture_secs(default_capture)

    def __hash__(self) -> int:  # labels is a dict: hash by identity of the rule id
        return hash(self.rule_id)


@dataclass(frozen=True, **SLOTS)
class TargetsConfig:
    targets: tuple[Target, ...]
    source: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def next_rule_id(self) -> int:
        """The `first_rule_id` to pass on the next reload so ids never repeat."""
        return max((t.rule_id for t in self.targets), default=0) + 1

    def target(self, rule_id: int) -> Target | None:
        for t in self.targets:
            if t.rule_id == rule_id:
                return t
        return None

    def by_service(self, service_id: str) -> Target | None:
        for t in self.targets:
            if t.service_id == service_id:
                return t
        return None

    def summary(self) -> list[str]:
        """One line per target, for the start-up and reload logs."""
        lines = []
        for t in self.targets:
            res = ", ".join(f"{r.resource}:{r.stall}>{r.threshold:g}%/{r.window_ms}ms" for r in t.resources)
            lines.append(
                f"rule_id={t.rule_id} service_id={t.service_id} match={t.selector} "
                f"scope={t.scope} recorder={t.recorder_secs:g}s resources=[{res}]"
            )
        return lines


# ---------------------------------------------------------------------------
# YAML loading


MAX_DEPTH = 32  # a targets file nests 4 levels; PyYAML composes recursively (2 000 levels: RecursionError)
MAX_FILE_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)
    and nesting deeper than MAX_DEPTH."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark
            )
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
    text = f"{context}: {problem}" if context else str(problem)
    return f"{where}: YAML syntax error: {text}"


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, text: str) -> None:
        self.items.append(f"{path}: {text}" if path else text)

    def unknown_keys(self, m: Mapping[Any, Any], allowed: tuple[str, ...], path: str) -> None:
        for k in m:
            if k in allowed:
                continue
            where = f"{path}.{k}" if path else str(k)
            close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(allowed)})"
            self.add(where, f"unknown key{hint}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _choice(p: _Problems, v: Any, choices: tuple[str, ...], path: str) -> str | None:
    if isinstance(v, str) and v in choices:
        return v
    hint = ""
    if isinstance(v, str):
        folded = {c.lower(): c for c in choices}
        close = folded.get(v.lower()) or next(iter(difflib.get_close_matches(v, choices, n=1)), None)
        if close:
            hint = f" (did you mean {close!r}?)"
    p.add(path, f"{v!r} is not one of {', '.join(choices)}{hint}")
    return None


def _parse_rule(p: _Problems, raw: Any, path: str) -> Rule | None:
    if not isinstance(raw, dict):
        p.add(path, "must be a mapping with 'type' (Exact or Prefix) and 'comm'")
        return None
    p.unknown_keys(raw, _RULE_KEYS, path)
    rtype = None
    if "type" not in raw:
        p.add(f"{path}.type", "missing (Exact or Prefix)")
    else:
        rtype = _choice(p, raw["type"], RULE_TYPES, f"{path}.type")
    comm = raw.get("comm")
    if "comm" not in raw:
        p.add(f"{path}.comm", "missing")
        return None
    if not isinstance(comm, str):
        p.add(f"{path}.comm", f"must be a string, got {type(comm).__name__} (quote it)")
        return None
    n = len(comm.encode("utf-8"))
    if n > COMM_MAX_BYTES:
        p.add(
            f"{path}.comm",
            f"{n} bytes, max {COMM_MAX_BYTES} (the kernel truncates task names to 15 bytes; "
            f"use Prefix {comm.encode()[:COMM_MAX_BYTES].decode('utf-8', 'ignore')!r})",
        )
        return None
    if "\0" in comm:
        p.add(f"{path}.comm", "must not contain NUL")
        return None
    return Rule(rtype, comm) if rtype else None


def _parse_resource(p: _Problems, raw: Any, path: str) -> PressureThreshold | None:
    if not isinstance(raw, dict):
        p.add(path, "must be a mapping with 'resource' and 'threshold'")
        return None
    p.unknown_keys(raw, _RESOURCE_KEYS, path)
    ok = True
    resource = None
    if "resource" not in raw:
        p.add(f"{path}.resource", f"missing ({', '.join(RESOURCES)})")
        ok = False
    else:
        resource = _choice(p, raw["resource"], RESOURCES, f"{path}.resource")
        ok = ok and resource is not None
    stall = "some"
    if "stall" in raw:
        s = _choice(p, raw["stall"], STALLS, f"{path}.stall")
        ok = ok and s is not None
        stall = s or stall
    window_ms = DEFAULT_WINDOW_MS
    if "window_ms" in raw:
        w = raw["window_ms"]
        if not isinstance(w, int) or isinstance(w, bool):
            p.add(f"{path}.window_ms", f"must be an integer number of milliseconds, got {w!r}")
            ok = False
        elif not WINDOW_MS_MIN <= w <= WINDOW_MS_MAX:
            p.add(
                f"{path}.window_ms", f"{w} is out of range {WINDOW_MS_MIN}..{WINDOW_MS_MAX} (kernel limits)"
            )
            ok = False
        else:
            window_ms = w
    threshold = 0.0
    if "threshold" not in raw:
        p.add(f"{path}.threshold", "missing (percent of the window, 0 < threshold < 100)")
        ok = False
    else:
        t = raw["threshold"]
        if not _is_number(t):
            p.add(f"{path}.threshold", f"must be a number, got {t!r}")
            ok = False
        elif not 0 < t < 100:
            p.add(f"{path}.threshold", f"{t} is out of range: 0 < threshold < 100 (percent of the window)")
            ok = False
        else:
            threshold = float(t)
            if ok and window_ms * 1000 * threshold / 100.0 < 1:
                p.add(f"{path}.threshold", f"{t}% of {window_ms} ms is under 1 µs of stall: raise it")
                ok = False
    if not ok or resource is None:
        return None
    return PressureThreshold(resource=resource, threshold=threshold, stall=stall, window_ms=window_ms)


def _parse_labels(p: _Problems, raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        p.add(path, "must be a mapping of string keys to string values")
        return {}
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not LABEL_KEY_RE.match(k):
            p.add(f"{path}.{k}", "label keys must match [A-Za-z_][A-Za-z0-9_.-/]*")
        elif not isinstance(v, str):
            p.add(f"{path}.{k}", f"label values must be strings, got {type(v).__name__} (quote it)")
        elif len(v) > LABEL_VALUE_MAX:
            p.add(f"{path}.{k}", f"label value of {len(v)} characters, max {LABEL_VALUE_MAX}")
        else:
            out[k] = v
    return out


def _parse_seconds(p: _Problems, raw: Any, path: str, lo_exclusive: bool, hi: float) -> float | None:
    if not _is_number(raw):
        p.add(path, f"must be a number of seconds, got {raw!r}")
        return None
    v = float(raw)
    if (v <= 0 if lo_exclusive else v < 0) or v > hi:
        low = "0 < " if lo_exclusive else "0 <= "
        p.add(path, f"{raw} is out of range: {low}value <= {hi:g}")
        return None
    return v


def _parse_target(p: _Problems, raw: Any, path: str, rule_id: int) -> Target | None:
    if not isinstance(raw, dict):
        p.add(path, "must be a mapping with rule, service_id and resources")
        return None
    p.unknown_keys(raw, _TARGET_KEYS, path)
    before = len(p.items)
    rule = cgroup = unit = None
    given = [k for k in _SELECTORS if k in raw]
    if not given:
        p.add(f"{path}.rule", "missing (or name the processes by 'cgroup' or 'unit' instead)")
    elif len(given) > 1:
        p.add(path, f"give one of rule, cgroup, unit to name the processes, not {' and '.join(given)}")
    if "rule" in raw:
        rule = _parse_rule(p, raw["rule"], f"{path}.rule")
    if "cgroup" in raw:
        cgroup = _parse_cgroup(p, raw["cgroup"], f"{path}.cgroup")
    if "unit" in raw:
        unit = _parse_unit(p, raw["unit"], f"{path}.unit")
    service_id = raw.get("service_id")
    if "service_id" not in raw:
        p.add(f"{path}.service_id", "missing")
    elif not isinstance(service_id, str):
        p.add(f"{path}.service_id", f"must be a string, got {type(service_id).__name__}")
    elif not 1 <= len(service_id) <= SERVICE_ID_MAX:
        p.add(f"{path}.service_id", f"{len(service_id)} characters, must be 1 to {SERVICE_ID_MAX}")
    elif not SERVICE_ID_RE.match(service_id):
        p.add(f"{path}.service_id", f"{service_id!r} must match {SERVICE_ID_RE.pattern}")
    resources: list[PressureThreshold] = []
    raw_res = raw.get("resources")
    if "resources" not in raw:
        p.add(f"{path}.resources", "missing (at least one of cpu, memory, io)")
    elif not isinstance(raw_res, list) or not raw_res:
        p.add(f"{path}.resources", "must be a non-empty list")
    else:
        seen: set[str] = set()
        for i, r in enumerate(raw_res):
            rt = _parse_resource(p, r, f"{path}.resources[{i}]")
            if rt is None:
                continue
            if rt.resource in seen:
                p.add(f"{path}.resources[{i}].resource", f"{rt.resource!r} is listed twice in this target")
                continue
            seen.add(rt.resource)
            resources.append(rt)
    labels = _parse_labels(p, raw.get("labels"), f"{path}.labels")
    scope = "cgroup"
    if "scope" in raw:
        scope = _choice(p, raw["scope"], SCOPES, f"{path}.scope") or scope
    capture = cooldown = None
    if "capture_duration_secs" in raw:
        capture = _parse_seconds(p, raw["capture_duration_secs"], f"{path}.capture_duration_secs", True, 3600)
    if "cooldown_secs" in raw:
        cooldown = _parse_seconds(p, raw["cooldown_secs"], f"{path}.cooldown_secs", False, 86_400)
    recorder = DEFAULT_RECORDER_SECS
    if "recorder_secs" in raw:
        r = _parse_seconds(p, raw["recorder_secs"], f"{path}.recorder_secs", False, RECORDER_SECS_MAX)
        recorder = r if r is not None else recorder
    recorder_hz = None
    if "recorder_hz" in raw:
        hz = raw["recorder_hz"]
        if not _is_number(hz) or not 0 < float(hz) <= RECORDER_HZ_MAX:
            p.add(f"{path}.recorder_hz", f"must be a rate in Hz, 0 < rate <= {RECORDER_HZ_MAX:g}, got {hz!r}")
        else:
            recorder_hz = float(hz)
    if len(p.items) != before or not isinstance(service_id, str):
        return None
    if rule is None and cgroup is None and unit is None:
        return None
    return Target(
        rule_id=rule_id,
        rule=rule,
        service_id=service_id,
        resources=tuple(resources),
        labels=labels,
        scope=scope,
        capture_duration_secs=capture,
        cooldown_secs=cooldown,
        cgroup=cgroup,
        unit=unit,
        recorder_secs=recorder,
        recorder_hz=recorder_hz,
    )


def _parse_cgroup(p: _Problems, raw: Any, path: str) -> str | None:
    """A cgroup2 path relative to the mount, normalised to start with one '/'."""
    if not isinstance(raw, str) or not raw:
        p.add(path, f"must be a cgroup path such as /system.slice/nginx.service, got {raw!r}")
        return None
    if not raw.startswith("/"):
        p.add(path, f"{raw!r} must start with '/' (relative to the cgroup2 mount): write '/{raw}'")
        return None
    parts = [x for x in raw.split("/") if x]
    if "\0" in raw or len(raw.encode()) > CGROUP_PATH_MAX:
        p.add(path, f"must be at most {CGROUP_PATH_MAX} bytes without NUL")
        return None
    if any(x in (".", "..") for x in parts):
        p.add(path, f"{raw!r} must not contain '.' or '..' components")
        return None
    if not parts:
        p.add(path, "'/' is the whole host: use a comm rule with Prefix '' and scope: system instead")
        return None
    return "/" + "/".join(parts)


def _parse_unit(p: _Problems, raw: Any, path: str) -> str | None:
    if not isinstance(raw, str) or not raw:
        p.add(path, f"must be a systemd unit name such as nginx.service, got {raw!r}")
        return None
    if len(raw) > UNIT_MAX or not UNIT_RE.match(raw):
        hint = ""
        if "." not in raw and re.match(r"^[A-Za-z0-9:_.\\@-]+$", raw):
            hint = f" (did you mean '{raw}.service'?)"
        p.add(path, f"{raw!r} is not a unit that holds processes: NAME.service, .scope or .slice{hint}")
        return None
    return raw


def _check_unique(p: _Problems, raw_targets: list[Any]) -> None:
    """Cross-target rules, on the raw entries so they are reported even beside other errors."""
    by_service: dict[str, int] = {}
    by_comm_res: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(raw_targets):
        if not isinstance(raw, dict):
            continue
        sid = raw.get("service_id")
        if isinstance(sid, str) and sid:
            if sid in by_service:
                p.add(f"targets[{i}].service_id", f"{sid!r} is already used by targets[{by_service[sid]}]")
            else:
                by_service[sid] = i
        rule, resources = raw.get("rule"), raw.get("resources")
        comm = rule.get("comm") if isinstance(rule, dict) else None
        what = "comm"
        if comm is None:
            # A cgroup or unit names its processes too: one target per (cgroup, resource) as well.
            what = "cgroup" if "cgroup" in raw else "unit"
            comm = raw.get(what)
            comm = f"{what}:{comm}" if isinstance(comm, str) else None
        if not isinstance(comm, str) or not isinstance(resources, list):
            continue
        seen_here: set[str] = set()
        for j, r in enumerate(resources):
            res = r.get("resource") if isinstance(r, dict) else None
            if res not in RESOURCES or res in seen_here:
                continue
            seen_here.add(res)
            prev = by_comm_res.setdefault((comm, res), i)
            if prev != i:
                p.add(
                    f"targets[{i}].resources[{j}]",
                    f"{what} {comm.removeprefix(what + ':')!r} already watches {res} in targets[{prev}] "
                    f"(one target per {what} and resource)",
                )


def parse_targets_config(
    text: str | bytes, source: str = "<string>", first_rule_id: int = 1
) -> TargetsConfig:
    """Parse and validate a targets file's content. Raises ConfigError listing every problem."""
    if first_rule_id < 1:
        raise ValueError(f"first_rule_id must be >= 1, got {first_rule_id}")
    try:
        doc = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        raise ConfigError([_yaml_problem(e)], source=source)
    p = _Problems()
    if doc is None:
        raise ConfigError(["the file is empty: it needs a 'targets' list"], source=source)
    if not isinstance(doc, dict):
        raise ConfigError(
            [f"the top level must be a mapping with 'targets', got {type(doc).__name__}"], source
        )
    p.unknown_keys(doc, _TOP_KEYS, "")
    raw_targets = doc.get("targets")
    targets: list[Target] = []
    if "targets" not in doc:
        p.add("targets", "missing (a list of at least one target)")
    elif not isinstance(raw_targets, list) or not raw_targets:
        p.add("targets", "must be a non-empty list")
    elif len(raw_targets) > MAX_TARGETS:
        p.add("targets", f"{len(raw_targets)} targets, max {MAX_TARGETS} (size of the BPF comm trie)")
    else:
        for i, raw in enumerate(raw_targets):
            t = _parse_target(p, raw, f"targets[{i}]", first_rule_id + i)
            if t is not None:
                targets.append(t)
        _check_unique(p, raw_targets)
    if p.items:
        raise ConfigError(p.items, source=source)
    warnings = []
    for t in targets:
        if t.rule is not None and t.rule.type == "Exact" and t.rule.comm == "":
            warnings.append(
                f"targets[{t.rule_id - first_rule_id}].rule: Exact '' only matches a nameless task"
            )
    return TargetsConfig(targets=tuple(targets), source=source, warnings=tuple(warnings))


def load_targets_config(path: str = DEFAULT_TARGETS_PATH, first_rule_id: int = 1) -> TargetsConfig:
    """Read and validate the targets file. Raises ConfigError (also when unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            [f"cannot read the targets file: {e.strerror} (check --config / BISTOURI_CONFIG)"], path
        )
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([f"the file is larger than {MAX_FILE_BYTES} bytes: not a targets file"], path)
    return parse_targets_config(data, source=path, first_rule_id=first_rule_id)

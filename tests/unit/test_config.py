"""Trigger file validation: every rule, all errors at once, with their paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bistouri.agent import config
from bistouri.agent.config import load_targets_config, parse_targets_config
from bistouri.errors import ConfigError
from bistouri.pressure import PressureThreshold

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "config"
EXAMPLE = ROOT / "bistouri" / "data" / "trigger.example.yaml"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_targets_config(text, "t.yaml")
    assert ei.value.source == "t.yaml"
    return ei.value.problems


def one_target(**over: object) -> str:
    t: dict[str, object] = {
        "rule": {"type": "Exact", "comm": "node"},
        "service_id": "node",
        "resources": [{"resource": "cpu", "threshold": 10}],
    }
    t.update(over)
    return yaml.safe_dump({"targets": [t]})


def with_resource(**res: object) -> str:
    r: dict[str, object] = {"resource": "cpu", "threshold": 10}
    r.update(res)
    return one_target(resources=[r])


# -- files


def test_example_config_parses():
    cfg = load_targets_config(str(EXAMPLE))
    assert [t.service_id for t in cfg.targets] == ["web_frontend", "database", "jvm_fleet", "cache"]
    cache = cfg.targets[3]
    assert (cache.rule, cache.unit, cache.cgroup, cache.recorder_secs) == (None, "redis.service", None, 10.0)
    db = cfg.targets[1]
    assert db.resources == (PressureThreshold("io", 20.0, "full", 2000),)
    assert (db.capture_duration_secs, db.cooldown_secs) == (15.0, 60.0)
    assert db.capture_secs(10) == 15 and db.cooldown(10) == 60
    assert cfg.targets[2].scope == "system"
    assert cfg.targets[0].labels == {"team": "edge"}
    # Unset per-target durations fall back to the agent's capture duration.
    assert cfg.targets[0].capture_secs(10) == 10 and cfg.targets[0].cooldown(7) == 7


def test_upstream_schema_parses_with_defaults():
    cfg = load_targets_config(str(GOLDEN / "upstream.yaml"))
    assert [t.rule_id for t in cfg.targets] == [1, 2]
    t = cfg.targets[0]
    assert t.rule == config.Rule("Exact", "cpu-burner")
    assert [r.resource for r in t.resources] == ["cpu", "memory", "io"]
    r = t.resources[0]
    assert (r.stall, r.window_ms, r.window_us, r.stall_us) == ("some", 1000, 1_000_000, 50_000)
    assert cfg.targets[1].resources[0].stall_us == 5000  # 0.5 % of 1 s
    assert t.scope == "cgroup" and t.labels == {"env": "e2e"}


def test_all_errors_reported_at_once_with_paths():
    with pytest.raises(ConfigError) as ei:
        load_targets_config(str(GOLDEN / "all-errors.yaml"))
    expected = (GOLDEN / "all-errors.expected").read_text().splitlines()
    assert ei.value.problems == expected
    assert str(GOLDEN / "all-errors.yaml") in str(ei.value)


def test_yaml_syntax_error_has_line_and_column():
    with pytest.raises(ConfigError) as ei:
        load_targets_config(str(GOLDEN / "syntax-error.yaml"))
    [p] = ei.value.problems
    assert p.startswith("line 3, column 15: YAML syntax error")


def test_duplicate_yaml_key_is_an_error():
    with pytest.raises(ConfigError) as ei:
        load_targets_config(str(GOLDEN / "duplicate-key.yaml"))
    [p] = ei.value.problems
    assert "line 4" in p and "duplicate key 'service_id'" in p


@pytest.mark.parametrize(
    "text",
    [
        "targets: " + "[" * 2000 + "]" * 2000,  # flow style
        "targets:\n" + "".join("  " * i + "- k:\n" for i in range(2000)),  # block style
    ],
)
def test_deep_nesting_is_a_clear_error_not_a_recursion_error(text):
    [p] = problems(text)  # RecursionError escaped before, and killed the agent on reload
    assert "nested deeper than 32 levels" in p and p.startswith("line ")


def test_an_oversized_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (config.MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError) as ei:
        load_targets_config(str(big))
    assert "larger than 1048576 bytes" in ei.value.problems[0]


def test_missing_file():
    with pytest.raises(ConfigError) as ei:
        load_targets_config("/nonexistent/trigger.yaml")
    assert "cannot read the targets file" in ei.value.problems[0]
    assert ei.value.source == "/nonexistent/trigger.yaml"


# -- validation table: one rule per row


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("- a\n", "the top level must be a mapping"),
        ("{}", "targets: missing"),
        ("targets: []", "targets: must be a non-empty list"),
        ("targets: {}", "targets: must be a non-empty list"),
        ("targets: [1]", "targets[0]: must be a mapping"),
        ("target: []", "target: unknown key (did you mean 'targets'?)"),
        (one_target(rule={"type": "Glob", "comm": "x"}), "targets[0].rule.type: 'Glob' is not one of"),
        (one_target(rule={"type": "prefix", "comm": "x"}), "(did you mean 'Prefix'?)"),
        (one_target(rule={"comm": "x"}), "targets[0].rule.type: missing"),
        (one_target(rule={"type": "Exact"}), "targets[0].rule.comm: missing"),
        (one_target(rule={"type": "Exact", "comm": 5}), "targets[0].rule.comm: must be a string"),
        (one_target(rule={"type": "Exact", "comm": "a" * 16}), "targets[0].rule.comm: 16 bytes, max 15"),
        (one_target(rule={"type": "Exact", "comm": "é" * 8}), "targets[0].rule.comm: 16 bytes, max 15"),
        (one_target(rule={"type": "Exact", "comm": "x", "regex": "y"}), "targets[0].rule.regex: unknown key"),
        (one_target(rule="node"), "targets[0].rule: must be a mapping"),
        (one_target(service_id="Upper"), "targets[0].service_id: 'Upper' must match"),
        (one_target(service_id="1abc"), "must match ^[a-z][a-z0-9_]*$"),
        (one_target(service_id="a-b"), "must match"),
        (one_target(service_id="a.b"), "must match"),
        (one_target(service_id="a b"), "must match"),
        (one_target(service_id=""), "targets[0].service_id: 0 characters, must be 1 to 32"),
        (one_target(service_id="a" * 33), "33 characters, must be 1 to 32"),
        (one_target(service_id=7), "targets[0].service_id: must be a string"),
        (one_target(resources=[]), "targets[0].resources: must be a non-empty list"),
        (one_target(resources=None), "targets[0].resources: must be a non-empty list"),
        (
            with_resource(resource="gpu"),
            "targets[0].resources[0].resource: 'gpu' is not one of cpu, memory, io",
        ),
        (with_resource(threshold=0), "threshold: 0 is out of range"),
        (with_resource(threshold=-1), "threshold: -1 is out of range"),
        (with_resource(threshold=100), "threshold: 100 is out of range"),
        (with_resource(threshold=150), "threshold: 150 is out of range"),
        (with_resource(threshold="10"), "threshold: must be a number"),
        (with_resource(threshold=True), "threshold: must be a number"),
        (with_resource(threshold=0.00001), "under 1 µs of stall"),
        (with_resource(stall="partial"), "stall: 'partial' is not one of some, full"),
        (with_resource(window_ms=499), "window_ms: 499 is out of range 500..10000"),
        (with_resource(window_ms=10001), "window_ms: 10001 is out of range"),
        (with_resource(window_ms=1.5), "window_ms: must be an integer"),
        (with_resource(treshold=5), "resources[0].treshold: unknown key (did you mean 'threshold'?)"),
        (one_target(resources=[{"threshold": 5}]), "resources[0].resource: missing"),
        (one_target(resources=[{"resource": "io"}]), "resources[0].threshold: missing"),
        (one_target(resources=["cpu"]), "resources[0]: must be a mapping"),
        (
            one_target(resources=[{"resource": "cpu", "threshold": 1}, {"resource": "cpu", "threshold": 2}]),
            "resources[1].resource: 'cpu' is listed twice",
        ),
        (one_target(labels=["a"]), "targets[0].labels: must be a mapping"),
        (one_target(labels={"version": 1}), "targets[0].labels.version: label values must be strings"),
        (one_target(labels={"9bad": "x"}), "targets[0].labels.9bad: label keys must match"),
        (one_target(scope="host"), "targets[0].scope: 'host' is not one of cgroup, system"),
        (one_target(capture_duration_secs=0), "capture_duration_secs: 0 is out of range"),
        (one_target(capture_duration_secs=4000), "capture_duration_secs: 4000 is out of range"),
        (one_target(capture_duration_secs="5s"), "capture_duration_secs: must be a number"),
        (one_target(cooldown_secs=-1), "cooldown_secs: -1 is out of range"),
        (one_target(servce_id="x"), "targets[0].servce_id: unknown key (did you mean 'service_id'?)"),
    ],
)
def test_validation_rule(text, expected):
    found = problems(text)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    "text",
    [
        one_target(rule={"type": "Exact", "comm": "a" * 15}),
        one_target(rule={"type": "Prefix", "comm": ""}),
        one_target(service_id="a" * 32),
        one_target(service_id="a_1"),
        with_resource(threshold=0.001),
        with_resource(threshold=99.9),
        with_resource(window_ms=500),
        with_resource(window_ms=10000),
        with_resource(stall="full"),
        one_target(cooldown_secs=0),
        one_target(labels=None),
    ],
)
def test_accepted_edges(text):
    cfg = parse_targets_config(text)
    assert len(cfg.targets) == 1


def tgt(comm: str, sid: str, *resources: str, kind: str = "Exact") -> dict[str, object]:
    return {
        "rule": {"type": kind, "comm": comm},
        "service_id": sid,
        "resources": [{"resource": r, "threshold": 1} for r in resources],
    }


def test_unique_service_id_across_targets():
    text = yaml.safe_dump({"targets": [tgt("a", "s", "cpu"), tgt("b", "s", "cpu")]})
    assert problems(text) == ["targets[1].service_id: 's' is already used by targets[0]"]


def test_unique_comm_and_resource_whatever_the_rule_type():
    text = yaml.safe_dump({"targets": [tgt("a", "s1", "cpu"), tgt("a", "s2", "io", "cpu", kind="Prefix")]})
    [p] = problems(text)
    assert p.startswith("targets[1].resources[1]: comm 'a' already watches cpu in targets[0]")


def test_duplicates_reported_beside_other_errors():
    bad = tgt("a", "s1", "cpu")
    bad["labels"] = {"k": 1}
    text = yaml.safe_dump({"targets": [tgt("a", "s1", "cpu"), bad]})
    found = problems(text)
    assert len(found) == 3, found


def test_same_comm_different_resources_is_fine():
    text = yaml.safe_dump({"targets": [tgt("a", "s1", "cpu"), tgt("a", "s2", "io")]})
    assert len(parse_targets_config(text).targets) == 2


def test_rule_ids_are_positions_from_first_rule_id():
    text = (GOLDEN / "upstream.yaml").read_text()
    cfg = parse_targets_config(text, first_rule_id=41)
    assert [t.rule_id for t in cfg.targets] == [41, 42]
    assert cfg.next_rule_id == 43
    again = parse_targets_config(text, first_rule_id=cfg.next_rule_id)
    assert [t.rule_id for t in again.targets] == [43, 44]
    assert cfg.target(42) is cfg.targets[1] and cfg.target(43) is None
    with pytest.raises(ValueError):
        parse_targets_config(text, first_rule_id=0)


def test_stall_us_rounds_down_and_is_positive():
    r = PressureThreshold("memory", 0.001, "some", 500)
    assert r.stall_us == 5 and r.window_us == 500_000


def test_config_is_frozen():
    cfg = parse_targets_config(one_target())
    with pytest.raises(AttributeError):
        cfg.targets[0].service_id = "x"  # type: ignore[misc]
    assert hash(cfg.targets[0]) == hash(cfg.targets[0].rule_id)


def test_warning_for_exact_empty_comm():
    cfg = parse_targets_config(one_target(rule={"type": "Exact", "comm": ""}))
    assert len(cfg.warnings) == 1 and "Exact ''" in cfg.warnings[0]


def test_summary_lines():
    cfg = load_targets_config(str(EXAMPLE))
    assert cfg.summary()[1] == (
        "rule_id=2 service_id=database match=Exact:'postgres' scope=cgroup recorder=5s "
        "resources=[io:full>20%/2000ms]"
    )
    assert cfg.summary()[3] == (
        "rule_id=4 service_id=cache match=unit:redis.service scope=cgroup recorder=10s resources=[mem"
        "ory:some>10%/1000ms]"
    )


def test_targets_by_cgroup_or_unit():
    cfg = parse_targets_config(
        "targets:\n"
        "  - cgroup: /system.slice//nginx.service/\n"
        "    service_id: web\n"
        "    resources: [{resource: cpu, threshold: 10}]\n"
        "  - unit: nginx.service\n"
        "    service_id: web_unit\n"
        "    resources: [{resource: cpu, threshold: 10}]\n"
        "    recorder_secs: 0\n"
    )
    web, unit = cfg.targets
    assert (web.rule, web.cgroup, web.unit, web.recorder_secs) == (
        None,
        "/system.slice/nginx.service",
        None,
        5.0,
    )
    assert (unit.unit, unit.recorder_secs) == ("nginx.service", 0.0)
    assert web.selector == "cgroup:/system.slice/nginx.service" and unit.selector == "unit:nginx.service"


def test_recorder_rate_per_target():
    cfg = parse_targets_config(
        "targets:\n"
        "  - {unit: a.service, service_id: a, resources: [{resource: cpu, threshold: 1}], recorder_hz: 4}\n"
        "  - {unit: b.service, service_id: b, resources: [{resource: cpu, threshold: 1}]}\n"
    )
    assert [t.recorder_hz for t in cfg.targets] == [4.0, None]
    out = problems(
        "targets:\n"
        "  - {unit: a.service, service_id: a, resources: [{resource: cpu, threshold: 1}], recorder_hz: 0}\n"
        "  - {unit: b.service, service_id: b, resources: [{resource: cpu, threshold: 1}], recorder_hz: x}\n"
    )
    assert out == [
        "targets[0].recorder_hz: must be a rate in Hz, 0 < rate <= 1000, got 0",
        "targets[1].recorder_hz: must be a rate in Hz, 0 < rate <= 1000, got 'x'",
    ]


def test_cgroup_and_unit_problems_are_all_reported_at_once():
    cpu = "resources: [{resource: cpu, threshold: 1}]"
    out = problems(
        "targets:\n"
        f"  - {{rule: {{type: Exact, comm: a}}, unit: a.service, service_id: a, {cpu}}}\n"
        f"  - {{cgroup: system.slice/x.service, service_id: b, {cpu}}}\n"
        f"  - {{unit: nginx, service_id: c, {cpu}}}\n"
        f"  - {{cgroup: /a/../b, service_id: d, {cpu}}}\n"
        f"  - {{cgroup: /, service_id: e, {cpu}}}\n"
        f"  - {{service_id: f, {cpu}}}\n"
        f"  - {{unit: x.service, service_id: g, {cpu}, recorder_secs: 61}}\n"
        f"  - {{unit: x.service, service_id: h, {cpu}}}\n"
        f"  - {{unit: 5, service_id: i, {cpu}}}\n"
    )
    assert out == [
        "targets[0]: give one of rule, cgroup, unit to name the processes, not rule and unit",
        "targets[1].cgroup: 'system.slice/x.service' must start with '/' (relative to the cgroup2 mount): "
        "write '/system.slice/x.service'",
        "targets[2].unit: 'nginx' is not a unit that holds processes: NAME.service, .scope or .slice "
        "(did you mean 'nginx.service'?)",
        "targets[3].cgroup: '/a/../b' must not contain '.' or '..' components",
        "targets[4].cgroup: '/' is the whole host: use a comm rule with Prefix '' and scope: system instead",
        "targets[5].rule: missing (or name the processes by 'cgroup' or 'unit' instead)",
        "targets[6].recorder_secs: 61 is out of range: 0 <= value <= 60",
        "targets[8].unit: must be a systemd unit name such as nginx.service, got 5",
        "targets[7].resources[0]: unit 'x.service' already watches cpu in targets[6] "
        "(one target per unit and resource)",
    ]


def test_the_matcher_and_the_comm_trie_skip_cgroup_targets():
    from bistouri.agent.matcher import CommMatcher

    cfg = parse_targets_config(
        "targets:\n"
        "  - {rule: {type: Prefix, comm: ''}, service_id: all, resources: [{resource: cpu, threshold: 1}]}\n"
        "  - {unit: x.service, service_id: u, resources: [{resource: cpu, threshold: 1}]}\n"
    )
    m = CommMatcher(cfg.targets)
    assert m.match("anything") == [1] and [rid for _, rid in m.lpm_entries()] == [1]
    assert not m.matches(2, "anything")

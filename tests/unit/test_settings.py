"""Agent settings: flag > env > default, every problem reported at once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bistouri.agent.settings import AgentSettings, add_agent_arguments, parse_size, settings_from_args
from bistouri.errors import ConfigError

FIXTURE_PROC = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "proc"


def parse(argv: list[str], env: dict[str, str] | None = None) -> AgentSettings:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    args = parser.parse_args(argv)
    return settings_from_args(args, env or {})


def test_defaults():
    s = parse([], {})
    assert s.config_path == "/etc/bistouri/trigger.yaml"
    assert s.tenant_id == "default"
    assert s.symbolizer_endpoint is None
    assert (s.capture_duration_secs, s.freq, s.metrics_port, s.metrics_addr) == (10.0, 19, 9464, "0.0.0.0")
    assert (s.proc_path, s.spool_dir, s.spool_max_bytes) == ("/proc", "/var/lib/bistouri/spool", 256 << 20)
    assert (s.walk_interval_secs, s.offcpu, s.log_level) == (30.0, True, "info")
    assert s.labels == {}
    assert s.period_ns == 1_000_000_000 // 19
    # The tenant default is announced, not silent.
    assert any("tenant 'default'" in w for w in s.warnings)


def test_cgroup_path_auto_detected_from_proc_mountinfo():
    s = parse(["--proc-path", str(FIXTURE_PROC)])
    assert s.cgroup_path == "/sys/fs/cgroup/unified v2"


def test_cgroup_path_missing_is_a_warning(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text("23 1 0:22 / /proc rw - proc proc rw\n")
    s = parse(["--proc-path", str(tmp_path)])
    assert s.cgroup_path is None
    assert any("no cgroup2 mount" in w for w in s.warnings)


def test_cgroup_path_flag_checked(tmp_path):
    with pytest.raises(ConfigError) as ei:
        parse(["--cgroup-path", str(tmp_path)])
    assert ei.value.problems == [f"--cgroup-path: {tmp_path} is not a cgroup2 mount (no cgroup.procs)"]
    (tmp_path / "cgroup.procs").write_text("")
    assert parse(["--cgroup-path", str(tmp_path)]).cgroup_path == str(tmp_path)


def test_flag_beats_env_beats_default(tmp_path):
    env = {
        "BISTOURI_FREQ": "97",
        "BISTOURI_TENANT_ID": "acme",
        "BISTOURI_LABELS": "dc=par1, rack=12",
        "BISTOURI_CAPTURE_DURATION": "5",
        "BISTOURI_SPOOL_MAX_BYTES": "64MiB",
        "BISTOURI_OFFCPU": "false",
        "BISTOURI_SYMBOLIZER_ENDPOINT": "https://sym.example:8443/",
        "BISTOURI_LOG_LEVEL": "DEBUG",
    }
    s = parse([], env)
    assert (s.freq, s.tenant_id, s.capture_duration_secs, s.spool_max_bytes) == (97, "acme", 5.0, 64 << 20)
    assert s.labels == {"dc": "par1", "rack": "12"}
    assert s.offcpu is False and s.log_level == "debug"
    assert s.symbolizer_endpoint == "https://sym.example:8443"
    s = parse(["--freq", "13", "--label", "a=1", "--label", "b=x=y", "--offcpu", "--tenant-id", "t2"], env)
    assert (s.freq, s.tenant_id, s.offcpu) == (13, "t2", True)
    assert s.labels == {"a": "1", "b": "x=y"}  # the flag replaces the env list entirely
    assert parse(["--no-offcpu"]).offcpu is False


@pytest.mark.parametrize("freq", ["99", "999", "1000", "1"])
def test_non_prime_freq_is_accepted_with_a_warning(freq):
    s = parse(["--freq", freq])
    assert s.freq == int(freq)
    assert any("not prime" in w for w in s.warnings)


def test_prime_freq_no_warning():
    s = parse(["--freq", "997", "--tenant-id", "t"])
    assert s.warnings == ()


def test_every_bad_setting_reported_at_once(tmp_path):
    argv = [
        "--freq", "0",
        "--capture-duration-secs", "abc",
        "--metrics-port", "70000",
        "--label", "=x",
        "--symbolizer-endpoint", "ftp://host",
        "--symbolizer-token-file", str(tmp_path / "nope"),
        "--symbolizer-client-key", str(tmp_path / "nokey"),
        "--spool-max-bytes", "12 parsecs",
        "--walk-interval-secs", "0",
        "--log-level", "loud",
        "--tenant-id", "bad tenant!",
        "--proc-path", str(tmp_path / "noproc"),
    ]  # fmt: skip
    with pytest.raises(ConfigError) as ei:
        parse(argv)
    text = "\n".join(ei.value.problems)
    for needle in [
        "--freq: 0 is out of range 1..1000",
        "--capture-duration-secs: 'abc' is not a number",
        "--metrics-port: 70000 is out of range 0..65535",
        "--label: '=x' must be key=value",
        "--symbolizer-endpoint: 'ftp://host' must be an http:// or https:// URL",
        "--symbolizer-token-file:",
        "--symbolizer-client-key: needs --symbolizer-client-cert",
        "--spool-max-bytes: '12 parsecs' is not a size",
        "--walk-interval-secs: 0 is out of range",
        "--log-level: 'loud' is not one of",
        "--tenant-id: 'bad tenant!' must be",
        "--proc-path:",
    ]:
        assert needle in text, needle
    assert ei.value.source == "command line and environment"


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError) as ei:
        parse([], {"BISTOURI_FREQ": "fast", "BISTOURI_OFFCPU": "maybe", "BISTOURI_METRICS_PORT": "-1"})
    assert ei.value.problems == [
        "BISTOURI_FREQ: 'fast' is not an integer",
        "BISTOURI_METRICS_PORT: -1 is out of range 0..65535",
        "BISTOURI_OFFCPU: 'maybe' is not a boolean (true/false)",
    ]


def test_tls_files_accepted_when_present(tmp_path):
    for name in ("token", "ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    s = parse(
        [
            "--symbolizer-endpoint", "http://127.0.0.1:8080",
            "--symbolizer-token-file", str(tmp_path / "token"),
            "--symbolizer-ca-file", str(tmp_path / "ca.pem"),
            "--symbolizer-client-cert", str(tmp_path / "cert.pem"),
            "--symbolizer-client-key", str(tmp_path / "key.pem"),
            "--tenant-id", "t",
        ]
    )  # fmt: skip
    assert s.symbolizer_client_key == str(tmp_path / "key.pem")
    assert any("plain http" in w for w in s.warnings)


def test_metrics_port_zero_disables():
    assert parse(["--metrics-port", "0"]).metrics_port == 0


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1 << 20),
        ("256MiB", 256 << 20),
        ("256M", 256 << 20),
        ("1g", 1 << 30),
        ("2 KiB", 2048),
        ("7B", 7),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_raw_stack_copies_are_sized_or_turned_off():
    assert parse([]).raw_stacks_max_bytes == 8 << 20
    assert parse(["--raw-stacks-max-bytes", "0"]).raw_stacks_max_bytes == 0
    assert parse([], {"BISTOURI_RAW_STACKS_MAX_BYTES": "2MiB"}).raw_stacks_max_bytes == 2 << 20
    with pytest.raises(ConfigError) as ei:
        parse(["--raw-stacks-max-bytes", "64KiB"])
    assert "below the 1 MiB minimum (0 turns it off)" in ei.value.problems[0]


def test_spool_minimum():
    with pytest.raises(ConfigError) as ei:
        parse(["--spool-max-bytes", "1KiB"])
    assert "below the 1 MiB minimum" in ei.value.problems[0]

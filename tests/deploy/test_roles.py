"""The Ansible side without VMs: every default is specified (and vice versa), types match,
and ansible-lint passes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT

ROLES = ROOT / "ansible" / "roles"
PUBLIC_ROLES = ["bistouri_agent", "bistouri_symbolizer"]
TYPES = {"str": str, "int": int, "bool": bool, "list": list, "dict": dict, "path": str}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


@pytest.mark.parametrize("role", PUBLIC_ROLES)
def test_defaults_match_argument_specs(role: str) -> None:
    defaults = load(ROLES / role / "defaults" / "main.yml")
    options = load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert sorted(defaults) == sorted(options), (
        f"only in defaults: {sorted(set(defaults) - set(options))}; "
        f"only in argument_specs: {sorted(set(options) - set(defaults))}"
    )
    for name, spec in options.items():
        assert spec.get("description"), f"{role}: {name} has no description"
        assert spec["default"] == defaults[name], f"{role}: {name} default differs from defaults/main.yml"
        assert isinstance(defaults[name], TYPES[spec["type"]]), f"{role}: {name} is not a {spec['type']}"
        if "choices" in spec:
            assert defaults[name] in spec["choices"], f"{role}: default of {name} is not among its choices"
        assert name.startswith(role + "_"), f"{role}: public variable {name} lacks the role prefix"


def test_shell_pipelines_under_pipefail_never_end_in_an_early_exiting_grep() -> None:
    """`cmd | grep -q` under `set -o pipefail` fails at random: grep exits at the first match, the
    writer dies of SIGPIPE and the pipeline reads as "not found" (the libbpf preflight failed so in
    the molecule VM, 1 run in 8 on this host)."""
    offenders = []
    for path in sorted(ROOT.joinpath("ansible").rglob("*.yml")) + sorted(
        ROOT.joinpath("packaging").rglob("*")
    ):
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if "pipefail" in text:
            offenders += [
                f"{path.relative_to(ROOT)}: {line.strip()}"
                for line in text.splitlines()
                if "| grep -q" in line
            ]
    assert not offenders, "\n".join(offenders)


def test_ansible_lint_is_clean(ansible_env: dict[str, str]) -> None:
    lint = ROOT / ".venv" / "bin" / "ansible-lint"
    if not lint.exists():
        pytest.skip("ansible-lint is not installed: make venv")
    r = subprocess.run(
        [str(lint)], cwd=ROOT / "ansible", env=ansible_env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_example_playbooks_pass_syntax_check(ansible_env: dict[str, str]) -> None:
    playbook = ROOT / ".venv" / "bin" / "ansible-playbook"
    if not playbook.exists() or shutil.which("ssh") is None:
        pytest.skip("ansible-playbook is not installed: make venv")
    for pb in ("site.yml", "from-files.yml"):
        r = subprocess.run(
            [str(playbook), "--syntax-check", "-i", "inventory/example.ini", f"playbooks/{pb}"],
            cwd=ROOT / "ansible",
            env=ansible_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("token", "refused"), [("change-me", True), ("9f1c2e7a4b", False)])
def test_symbolizer_preflight_refuses_the_sample_token(
    tmp_path: Path, ansible_env: dict[str, str], token: str, refused: bool
) -> None:
    playbook = ROOT / ".venv" / "bin" / "ansible-playbook"
    if not playbook.exists():
        pytest.skip("ansible-playbook is not installed: make venv")
    play = tmp_path / "preflight.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "ansible.builtin.include_role": {
                                "name": str(ROLES / "bistouri_symbolizer"),
                                "tasks_from": "preflight",
                            },
                            "vars": {"bistouri_symbolizer_token": token},
                        }
                    ],
                }
            ]
        )
    )
    r = subprocess.run(
        [str(playbook), "-i", "localhost,", str(play)],
        env=ansible_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert ("the sample value of the example inventory" in out) == refused, out[-3000:]
    if refused:
        assert r.returncode != 0


def _rendered_env(
    tmp_path: Path, ansible_env: dict[str, str], role_name: str, overrides: dict
) -> tuple[Path, dict[str, str]]:
    """A role's environment file rendered by Ansible from its defaults and `overrides` (extra vars,
    above the defaults), and its variables."""
    playbook = ROOT / ".venv" / "bin" / "ansible-playbook"
    if not playbook.exists():
        pytest.skip("ansible-playbook is not installed: make venv")
    role = ROLES / role_name
    env_file = tmp_path / f"{role_name}.env"
    task = {
        "ansible.builtin.template": {
            "src": str(role / "templates" / f"{role_name.replace('_', '-')}.env.j2"),
            "dest": str(env_file),
        }
    }
    play = tmp_path / "env.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [str(role / "defaults" / "main.yml")],
                    "tasks": [task],
                }
            ]
        )
    )
    # The modules run with this Python: whatever interpreter discovery finds may be absent.
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({**overrides, "ansible_python_interpreter": sys.executable}))
    cmd = [str(playbook), "-i", "localhost,", "-e", f"@{extra}", str(play)]
    r = subprocess.run(cmd, env=ansible_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    env = dict(
        line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#")
    )
    return env_file, env


def test_symbolizer_role_templates_the_export_endpoints(
    tmp_path: Path, ansible_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The role's environment file, rendered by Ansible, configures the service's forwarding."""
    overrides = {
        "bistouri_symbolizer_otlp_endpoints": ["http://c1:4318/v1development/profiles", "https://c2/p"],
        "bistouri_symbolizer_otlp_headers": {"Authorization": "Bearer s3cret"},
        "bistouri_symbolizer_pyroscope_url": "http://pyroscope:4040",
        "bistouri_symbolizer_pyroscope_tenant": "team-a",
        "bistouri_symbolizer_pyroscope_api": "push",
        "bistouri_symbolizer_export_max_sessions": 5000,
        "bistouri_symbolizer_export_max_bytes": "2G",
    }
    env_file, env = _rendered_env(tmp_path, ansible_env, "bistouri_symbolizer", overrides)
    assert env["BISTOURI_SYMBOLIZER_OTLP_HEADERS_FILE"] == "/etc/bistouri/symbolizer-otlp.headers"
    assert "s3cret" not in env_file.read_text()  # tokens only in the headers file (0640)
    # The service reads that environment: its forwarding configuration.
    import argparse

    from bistouri.symbolizer.service import cli

    headers = tmp_path / "otlp.headers"
    headers.write_text("Authorization: Bearer s3cret\n")
    env["BISTOURI_SYMBOLIZER_OTLP_HEADERS_FILE"] = str(headers)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["symbolizer"])
    cli.apply_env(args, args._env_parser)
    config = cli.export_config(args)
    assert [(e.kind, e.url, e.headers) for e in config.endpoints] == [
        ("otlp", "http://c1:4318/v1development/profiles", {"Authorization": "Bearer s3cret"}),
        ("otlp", "https://c2/p", {"Authorization": "Bearer s3cret"}),
        ("pyroscope", "http://pyroscope:4040", {"X-Scope-OrgID": "team-a"}),
    ]
    assert config.endpoints[-1].api == "push"
    assert config.max_rows == 5000 and config.max_bytes == 2 << 30


@pytest.mark.parametrize(("value", "expected"), [("", 8 << 20), ("0", 0), ("2MiB", 2 << 20)])
def test_agent_role_templates_the_raw_stack_copies(
    tmp_path: Path, ansible_env: dict[str, str], value: str, expected: int
) -> None:
    """The role's environment file, rendered by Ansible, sizes or turns off the agent's raw stack
    copies, "" keeping its default: "0" is a value here, not "unset" as the role's 0 for numbers."""
    _, env = _rendered_env(
        tmp_path, ansible_env, "bistouri_agent", {"bistouri_agent_raw_stacks_max_bytes": value}
    )
    import argparse

    from bistouri.agent.settings import add_agent_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    assert settings_from_args(parser.parse_args([]), env).raw_stacks_max_bytes == expected

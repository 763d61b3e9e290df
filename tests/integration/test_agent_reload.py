"""A hostile targets file on reload: the running agent keeps its config and stays up."""

from __future__ import annotations

import pytest

from testkit.agent_harness import AgentProcess, burner_config
from testkit.helpers import wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def test_a_2000_deep_yaml_on_reload_keeps_the_running_config(tmp_path):
    with AgentProcess(tmp_path, burner_config()) as agent:
        new = tmp_path / "trigger.yaml.new"
        new.write_text("targets: " + "[" * 2000 + "]" * 2000)
        new.rename(agent.config_path)
        # Before: RecursionError out of the loader, and the agent died.
        assert wait_until(lambda: agent.metrics().get("bistouri_config_reload_failures_total", 0) >= 1, 10), (
            agent.log()[-3000:]
        )
        assert agent.proc.poll() is None
        assert "keeping the running config" in agent.log() and "nested deeper than 32 levels" in agent.log()
        assert "Traceback" not in agent.log()

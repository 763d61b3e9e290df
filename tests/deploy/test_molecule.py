"""The default molecule scenario: a Debian bookworm VM under qemu TCG (psi=1), both roles
converged from the freshly built .deb files, idempotence, then services active, agent
capabilities as declared, and a session captured under CPU pressure stored and symbolized.

Takes 8-20 minutes on two busy cores (measured in docs/deployment.md). run-scenario.sh kills
the VM by its pidfile whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from .conftest import ROOT, need

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.root]


def test_default_scenario(dist) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root (debootstrap)")
    need("qemu-system-x86_64", "qemu-img", "debootstrap", "ssh")
    env = dict(os.environ, BISTOURI_DIST=str(dist))
    start = time.monotonic()
    r = subprocess.run(
        ["ansible/molecule/run-scenario.sh", "default"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    elapsed = time.monotonic() - start
    print(f"molecule default: {elapsed:.0f} s")
    assert r.returncode == 0, (
        f"molecule test -s default failed after {elapsed:.0f} s:\n{r.stdout[-20000:]}\n{r.stderr[-5000:]}"
    )
    # The idempotence step must have run and found nothing to change.
    assert "default > idempotence: Executed: Successful" in r.stdout + r.stderr

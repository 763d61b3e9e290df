"""Fixtures of the deployment tests: built packages, the cached VM image tree, Ansible's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = next(
    line.split('"')[1]
    for line in (ROOT / "pyproject.toml").read_text().splitlines()
    if line.startswith("version =")
)
FULL_VERSION = f"{VERSION}-1"


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing tools {missing}: apt-get install {' '.join(missing)} (Makefile APT_DEPLOY)")


@pytest.fixture
def ansible_env(tmp_path: Path) -> dict[str, str]:
    """The environment with a HOME of the test's own: Ansible writes ~/.ansible/tmp and
    ansible-lint its caches there, which the user running the tests may not have or own."""
    home = tmp_path / "home"
    home.mkdir()
    return {**os.environ, "HOME": str(home)}


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build all six packages into a fresh directory with packaging/build-packages.sh."""
    if not (ROOT / "bistouri" / "bpf" / "_bpfobj" / "bistouri.bpf.o").exists():
        pytest.skip("the BPF object is not built: run `make bpf`")
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, DIST=str(out))
    r = subprocess.run(["packaging/build-packages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"build-packages.sh failed:\n{r.stdout}\n{r.stderr}"
    return out


@pytest.fixture(scope="session")
def image() -> Path:
    """The VM image (cached under .cache/vm-image); its tree is booted with systemd-nspawn."""
    if os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, systemd-nspawn)")
    need("debootstrap", "systemd-nspawn", "nsenter", "qemu-img")
    r = subprocess.run(["ansible/molecule/image/build-image.sh"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"build-image.sh failed:\n{r.stderr}"
    return Path(r.stdout.strip().splitlines()[-1])

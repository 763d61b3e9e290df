"""Go programs built by the tests with the `go` on PATH (Debian's golang-go: `make deps`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

GO_FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "go"


def go_build(name: str, out_dir: Path, *ldflags: str, pie: bool = False) -> Path:
    """tests/fixtures/go/<name> built into out_dir (skips the test when Go is not installed)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed (Debian: golang-go, installed by `make deps`)")
    flags = "".join("-" + f.strip("-").replace(" ", "") for f in ldflags)
    out = out_dir / (name + flags + ("-pie" if pie else ""))
    env = {
        **os.environ,
        # Kept between runs beside the other built fixtures (a cold build of the runtime takes ~10 s).
        "GOCACHE": str(GO_FIXTURES.parent / "build" / "gocache"),
        "GOPATH": str(GO_FIXTURES.parent / "build" / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }
    cmd = [go, "build", "-o", str(out)] + (["-buildmode=pie"] if pie else [])
    if ldflags:
        cmd.append("-ldflags=" + " ".join(ldflags))
    subprocess.run(cmd, cwd=GO_FIXTURES / name, env=env, check=True, capture_output=True, timeout=300)
    return out

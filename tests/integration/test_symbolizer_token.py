"""The symbolizer never starts open by mistake (issue 14, L5).

An empty `BISTOURI_SYMBOLIZER_TOKEN_FILE=` or `--token-file ""`, an empty or unreadable
token file: each is a start-up error (status 2, one sentence), not a service without a
token. A service listening beyond loopback without a token says so loudly in its log.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from testkit.helpers import wait_until
from testkit.symbolizer import REPO, clean_env, free_port, symbolizer_command


def _run(tmp_path: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = symbolizer_command(listen_addr=f"127.0.0.1:{free_port()}", state_dir=tmp_path / "state")
    return subprocess.run(
        [*argv, *extra], capture_output=True, text=True, cwd=REPO, env=clean_env(**env), timeout=60
    )


def test_an_empty_token_file_variable_is_a_startup_error(tmp_path: Path) -> None:
    r = _run(tmp_path, BISTOURI_SYMBOLIZER_TOKEN_FILE="")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "BISTOURI_SYMBOLIZER_TOKEN_FILE is set but empty" in r.stderr
    r = _run(tmp_path, "--token-file", "")
    assert r.returncode == 2 and "--token-file is empty" in r.stderr


def test_an_empty_or_unreadable_token_file_is_a_startup_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    r = _run(tmp_path, BISTOURI_SYMBOLIZER_TOKEN_FILE=str(empty))
    assert r.returncode == 2 and f"{empty}: the file is empty" in r.stderr
    r = _run(tmp_path, "--token-file", str(tmp_path))  # a directory
    assert r.returncode == 2 and "cannot read it" in r.stderr and "Traceback" not in r.stderr


def test_no_token_beyond_loopback_is_logged_loudly(symbolizer_server: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "open.log"
    argv = symbolizer_command(listen_addr=f"0.0.0.0:{free_port()}", state_dir=tmp_path / "open", workers=1)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=clean_env())
    try:
        assert wait_until(lambda: "Booting worker" in log_path.read_text() or proc.poll() is not None, 60)
    finally:
        proc.terminate()
        proc.wait(30)
    assert "WARNING" in log_path.read_text() and "NO TOKEN on a listener reachable" in log_path.read_text()
    quiet = symbolizer_server(tmp_path)  # loopback, no token: fine and quiet
    assert "NO TOKEN" not in quiet.log_path.read_text()

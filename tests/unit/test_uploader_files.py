"""The uploader sends the file it checked, read from the descriptor it checked (issue 26, N5): a
process that swaps the path for a symlink during the claim's round trip gets nothing else sent."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from bistouri.agent.settings import AgentSettings
from bistouri.agent.uploader import Uploader
from bistouri.elf import read_build_id
from bistouri.host.procmaps import MappedPath


def test_the_path_swapped_after_the_check_is_not_what_is_sent(tmp_path: Path, workloads: Path) -> None:
    lib = tmp_path / "lib.so"
    shutil.copy(workloads / "burner", lib)
    original = lib.read_bytes()
    bid = read_build_id(lib)
    assert bid
    secret = tmp_path / "secret"
    secret.write_text("ROOT ONLY\n")
    # No map_files entry (the process unmapped it): the path inside its root is what is left.
    where = MappedPath(f"/proc/{os.getpid()}", "0-0", str(lib))
    sent: list[bytes] = []

    def send(method: str, url: str, **kw: Any) -> Any:
        if method == "POST":  # the claim: the process swaps the path meanwhile
            lib.unlink()
            lib.symlink_to(secret)
            return SimpleNamespace(status_code=200, body=json.dumps({"state": "claimed"}).encode())
        sent.append(gzip.decompress(b"".join(kw["data"])))
        return SimpleNamespace(status_code=201, body=b"")

    settings = AgentSettings(
        symbolizer_endpoint="http://127.0.0.1:1", upload_debug_dir=str(tmp_path / "debug")
    )
    uploader = Uploader(settings, send, lambda b: where if b == bid else None, CollectorRegistry())
    assert uploader._upload(bid) is None
    assert sent == [original]


def _uploader(tmp_path: Path, bid: bytes, where: MappedPath, sent: list[bytes]) -> Uploader:
    def send(method: str, url: str, **kw: Any) -> Any:
        if method == "POST":
            return SimpleNamespace(status_code=200, body=json.dumps({"state": "claimed"}).encode())
        sent.append(gzip.decompress(b"".join(kw["data"])))
        return SimpleNamespace(status_code=201, body=b"")

    settings = AgentSettings(
        symbolizer_endpoint="http://127.0.0.1:1", upload_debug_dir=str(tmp_path / "debug")
    )
    return Uploader(settings, send, lambda b: where if b == bid else None, CollectorRegistry())


def _mapped_by_an_exited_process(tmp_path: Path, workloads: Path) -> tuple[Path, bytes, MappedPath]:
    """A copy of the burner (its path, its build id) as a process mapped it that has exited."""
    lib = tmp_path / "lib.so"
    shutil.copy(workloads / "burner", lib)
    bid = read_build_id(lib)
    assert bid
    return lib, bid, MappedPath("/proc/2147483647", "0-0", str(lib))  # above any pid_max


def test_the_file_of_an_exited_process_is_read_at_its_path_on_this_host(
    tmp_path: Path, workloads: Path
) -> None:
    # The symbolizer asks after the process ended (a burner stopped as soon as its session was
    # stored): no /proc/PID left, the same path on this host, checked to carry the build id.
    lib, bid, gone = _mapped_by_an_exited_process(tmp_path, workloads)
    sent: list[bytes] = []
    assert _uploader(tmp_path, bid, gone, sent)._upload(bid) is None
    assert sent == [lib.read_bytes()]
    # Another file at that path since: not this build id, nothing sent.
    other = tmp_path / "other"
    other.write_bytes(b"\x7fELF not this one")
    lib.unlink()
    other.rename(lib)
    sent.clear()
    assert _uploader(tmp_path, bid, gone, sent)._upload(bid) is None
    assert sent == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the file to another owner needs root")
def test_the_host_path_of_an_exited_process_is_read_only_if_root_owns_the_file(
    tmp_path: Path, workloads: Path
) -> None:
    # Another tenant could put a file carrying the build id asked for at a path it can write.
    lib, bid, gone = _mapped_by_an_exited_process(tmp_path, workloads)
    os.chown(lib, 65534, 65534)
    sent: list[bytes] = []
    assert _uploader(tmp_path, bid, gone, sent)._upload(bid) is None
    assert sent == []

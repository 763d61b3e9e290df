"""Helpers for the symbolizer tests: fixture binaries, binutils oracles, a debuginfod stand-in."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIXTURE_SRC = ROOT / "tests" / "fixtures" / "symbolizer"
BUILD = ROOT / "tests" / "fixtures" / "build" / "symbolizer"


def build_fixtures() -> Path:
    """Build the fixture binaries (idempotent; `make fixtures` normally did it already)."""
    missing = [t for t in ("make", "gcc", "g++", "objcopy", "strip", "readelf", "nm") if not shutil.which(t)]
    if missing:
        tools = ", ".join(missing)
        pytest.skip(
            f"cannot build symbolizer fixtures: {tools} not installed (apt-get install build-essential)"
        )
    r = subprocess.run(["make", "-s", "-C", str(FIXTURE_SRC)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"building symbolizer fixtures failed:\n{r.stdout}\n{r.stderr}")
    return BUILD


def nm(path: Path | str, dynamic: bool = False) -> dict[str, tuple[int, int, str]]:
    """name -> (address, size, type letter) from binutils nm: the oracle the tests compare against."""
    argv = ["nm", "-S", "--defined-only"] + (["-D"] if dynamic else []) + [str(path)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    syms: dict[str, tuple[int, int, str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            syms[parts[3]] = (int(parts[0], 16), int(parts[1], 16), parts[2])
        elif len(parts) == 3:
            syms[parts[2]] = (int(parts[0], 16), 0, parts[1])
    return syms


def build_id_hex(path: Path | str) -> str:
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "Build ID:" in line:
            return line.split("Build ID:")[1].strip()
    raise AssertionError(f"{path} has no build id")


def load_segments(path: Path | str) -> list[tuple[int, int, int]]:
    """(p_offset, p_vaddr, p_filesz) of PT_LOAD headers, from readelf."""
    out = subprocess.run(["readelf", "-lW", str(path)], capture_output=True, text=True, check=True).stdout
    segs = []
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            segs.append((int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)))
    return segs


def vaddr_to_offset(path: Path | str, vaddr: int) -> int:
    for off, va, size in load_segments(path):
        if va <= vaddr < va + size:
            return vaddr - va + off
    raise AssertionError(f"0x{vaddr:x} is in no PT_LOAD of {path}")


class BuildIdServer:
    """A real HTTP server on 127.0.0.1 answering /buildid/<hex>/<kind> like debuginfod.

    `files[(hex, kind)]` is served; `status[(hex, kind)]` forces an error code;
    every request is recorded in `requests`.
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        self.files: dict[tuple[str, str], Path] = {}
        self.status: dict[tuple[str, str], int] = {}
        self.requests: list[str] = []
        self.delay_s = delay_s
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with outer._lock:
                    outer.requests.append(self.path)
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                parts = self.path.strip("/").split("/")
                key = (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "buildid" else ("", "")
                code = outer.status.get(key)
                path = outer.files.get(key)
                if code is None and path is None:
                    code = 404
                if code is not None:
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                assert path is not None
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="bistouri-test-debuginfod")

    def __enter__(self) -> BuildIdServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)

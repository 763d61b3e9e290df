"""Fixtures of the UI tests: a real symbolizer with real stored sessions, and a real headless Chromium.

The symbolizer is the real service (`python -m bistouri symbolizer`, gunicorn,
SQLite) on a free port of 127.0.0.1. Sessions go in through
`POST /v1/sessions` as the agent sends them (gzip(msgpack batch)), after the
kernel symbols through `PUT /v1/kernels/{build_id}`. Chromium is Debian's
(/usr/bin/chromium), driven by Playwright; every test that needs it is skipped
with the reason when it is missing.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from bistouri import wire
from testkit.symbolizer import SymbolizerURL, clean_env, free_port, stop, symbolizer_command, wait_healthy
from tests.ui import data

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
CHROMIUM = os.environ.get("BISTOURI_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def symbolizer_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real symbolizer service, started once for the UI tests.

    Session-scoped (the integration suite's `symbolizer_server` is per test), with
    that suite's helpers to build the command, clean the environment and stop it.
    """
    if not (data.WORKLOADS / "burner").exists():
        pytest.fail(f"fixtures not built: run `make fixtures` ({data.WORKLOADS})")
    tmp = tmp_path_factory.mktemp("symbolizer")
    port = free_port()
    cmd = symbolizer_command(
        listen_addr=f"127.0.0.1:{port}",
        state_dir=tmp / "state",
        workers=1,
        binary_dir=data.WORKLOADS,
        log_level="warning",
    )
    log_path = tmp / "symbolizer.log"
    with open(log_path, "wb") as log:
        # A session of its own: `stop` kills the process group (gunicorn and its workers).
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env(), start_new_session=True
        )
    url = SymbolizerURL(f"http://127.0.0.1:{port}")
    url.proc, url.state_dir, url.log_path, url.token = proc, tmp / "state", log_path, None
    try:
        wait_healthy(url)
        yield url
    finally:
        stop(url)


@pytest.fixture(scope="session")
def stored(symbolizer_url: str) -> dict[str, str]:
    """Session ids by role (`old`, `new`, `io`), ingested the way the agent sends them."""
    return _ingest(symbolizer_url, data.ui_sessions())


@pytest.fixture(scope="session")
def episodes(symbolizer_url: str) -> dict[str, str]:
    """Session ids by role: `onset` (flight-recorder samples before its trigger), `manual` (capture now)."""
    return _ingest(symbolizer_url, data.episode_sessions())


def _ingest(symbolizer_url: str, sessions: dict[str, wire.Session]) -> dict[str, str]:
    r = requests.put(
        f"{symbolizer_url}/v1/kernels/{data.KERNEL_BUILD_ID.hex()}", data=data.kallsyms_gz(), timeout=10
    )
    assert r.status_code in (200, 201, 204), r.text
    body = gzip.compress(wire.encode_batch(wire.encode_session(s) for s in sessions.values()))
    r = requests.post(
        f"{symbolizer_url}/v1/sessions",
        data=body,
        headers={"Content-Type": "application/x-msgpack", "Content-Encoding": "gzip"},
        timeout=30,
    )
    assert r.ok, r.text
    accepted = set(r.json().get("accepted", []))
    ids = {role: s.session_id for role, s in sessions.items()}
    assert set(ids.values()) <= accepted, r.json()
    return ids


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set BISTOURI_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    """A fresh page; JavaScript errors and console errors fail the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, device_scale_factor=1)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.set_default_timeout(10_000)
    yield pg
    context.close()
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    return SCREENSHOTS

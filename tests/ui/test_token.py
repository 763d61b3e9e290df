"""The UI against a symbolizer run with --read-token (issue 14, L4), in a real headless Chromium.

The first read answers 401: the page asks for the token, keeps it for the tab, and
every later read and download carries it.
"""

from __future__ import annotations

import gzip
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from bistouri import wire
from testkit.symbolizer import SymbolizerURL, clean_env, free_port, stop, symbolizer_command, wait_healthy
from tests.ui import data
from tests.ui.conftest import ROOT

pytestmark = pytest.mark.slow

TOKEN = "ui-read-t0ken"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The URL of a symbolizer requiring its token on reads, and the ids of its sessions by role."""
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "token").write_text(TOKEN + "\n")
    cmd = symbolizer_command(
        listen_addr=f"127.0.0.1:{free_port()}",
        state_dir=tmp / "state",
        workers=1,
        binary_dir=data.WORKLOADS,
        token_file=tmp / "token",
        read_token=True,
    )
    log_path = tmp / "symbolizer.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env(), start_new_session=True
        )
    url = SymbolizerURL(cmd[cmd.index("--listen-addr") + 1].join(["http://", ""]))
    url.proc, url.state_dir, url.log_path, url.token = proc, tmp / "state", log_path, TOKEN
    try:
        wait_healthy(url)
        sessions = data.ui_sessions()
        body = gzip.compress(wire.encode_batch(wire.encode_session(s) for s in sessions.values()))
        headers = {
            "Content-Type": "application/x-msgpack",
            "Content-Encoding": "gzip",
            "Authorization": f"Bearer {TOKEN}",
        }
        r = requests.post(url + "/v1/sessions", data=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert requests.get(url + "/v1/sessions", timeout=10).status_code == 401
        yield url, {role: s.session_id for role, s in sessions.items()}
    finally:
        stop(url)


def test_the_ui_asks_for_the_token_once_and_sends_it(browser, guarded, tmp_path: Path) -> None:
    guarded_url, ids = guarded
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(10_000)
    try:
        page.goto(guarded_url + "/ui/")
        page.wait_for_selector("#token-form")
        assert "401" in page.locator(".error").first.inner_text()
        page.fill("#token-input", TOKEN)
        page.click("#token-submit")
        page.wait_for_selector("#sessions tbody tr, table tbody tr")
        assert page.locator("#token-form").count() == 0
        # Another page of the same tab: the token is kept, the flamegraph loads.
        sid = ids["new"]
        page.goto(f"{guarded_url}/ui/session.html?id={sid}")
        page.wait_for_selector("#flame g.frame")
        with page.expect_download() as got:
            page.click("#dl-folded")
        saved = tmp_path / "folded"
        got.value.save_as(saved)
        assert saved.read_text().strip() and ";" in saved.read_text()
    finally:
        context.close()
    assert not errors, errors


def test_a_wrong_token_is_asked_again(browser, guarded) -> None:
    guarded_url, _ = guarded
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    try:
        page.goto(guarded_url + "/ui/")
        page.fill("#token-input", "wrong")
        page.click("#token-submit")
        page.wait_for_selector("#token-form")
        assert "was refused" in page.locator("#token-form").inner_text()
    finally:
        context.close()

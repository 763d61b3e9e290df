"""Issue 26 deliverable 2: tokens that separate reading, each tenant's writes and administration.

A real `bistouri symbolizer` with --write-tokens-file (two tenants and a shared token),
--read-token-file and --admin-token-file, over HTTP.
"""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests

from testkit.symbolizer import KALLSYMS, KERNEL_BUILD_ID, clean_env, symbolizer_command
from testkit.uploads import build
from tests.integration.conftest import post_sessions
from tests.integration.test_upload_trust import PWNED, forge, tenant_session, upload

WRITE_A, WRITE_B, SHARED, READ, ADMIN = "tok-a", "tok-b", "tok-shared", "tok-read", "tok-admin"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def guarded(symbolizer_server: Any, tmp_path: Path) -> Any:
    writes = tmp_path / "write-tokens"
    writes.write_text(f"# tenant token\ntenant-a {WRITE_A}\ntenant-b {WRITE_B}\n* {SHARED}\n")
    (tmp_path / "read-tokens").write_text(READ + "\n")
    (tmp_path / "admin-tokens").write_text(ADMIN + "\n")
    return symbolizer_server(
        tmp_path,
        workers=1,
        write_tokens_file=writes,
        read_token_file=tmp_path / "read-tokens",
        admin_token_file=tmp_path / "admin-tokens",
    )


def test_each_kind_of_token_does_its_own_work_only(guarded: Any, tmp_path: Path) -> None:
    url = guarded
    prog = build(tmp_path, "tokens", "symtab")
    kernel = f"{url}/v1/kernels/{KERNEL_BUILD_ID.hex()}"
    state = f"{url}/v1/uploads/{prog.build_id.hex()}/executable"
    # Upload and kernel state are for token holders.
    for path in (kernel, state):
        assert requests.get(path, timeout=10).status_code == 401
        assert requests.get(path, headers=bearer(WRITE_A), timeout=10).status_code == 404
    # Reads need a read (or admin) token; a tenant's write token reads nothing.
    assert requests.get(url + "/v1/sessions", timeout=10).status_code == 401
    assert requests.get(url + "/v1/sessions", headers=bearer(WRITE_A), timeout=10).status_code == 403
    assert requests.get(url + "/v1/sessions", headers=bearer(READ), timeout=10).status_code == 200
    # A read token writes nothing.
    r = post_sessions(url, [tenant_session("r-1", prog, "tenant-a")], READ)
    assert (r.status_code, r.json()["error"]) == (403, "forbidden")
    r = requests.put(kernel, data=gzip.compress(KALLSYMS), headers=bearer(READ), timeout=10)
    assert r.status_code == 403
    # A tenant's token stores that tenant's sessions only, and uploads for it only.
    r = post_sessions(
        url, [tenant_session("a-1", prog, "tenant-a"), tenant_session("b-1", prog, "tenant-b")], WRITE_A
    )
    assert r.json()["accepted"] == ["a-1"]
    assert [x["reason"] for x in r.json()["rejected"]] == ["wrong_tenant"]
    r = requests.post(f"{state}?claimant=x&tenant=tenant-b", headers=bearer(WRITE_A), timeout=10)
    assert (r.status_code, r.json()["error"]) == (403, "wrong_tenant")
    # Tenant A's token uploads a forged file: whatever tenant its agent names, it serves tenant A only.
    fake = forge(tmp_path, prog)
    claim, put = upload(url, fake, prog.build_id, tenant="", claimant="a", headers=bearer(WRITE_A))
    assert claim.json()["tenant"] == "tenant-a" and put.status_code == 200, put.text
    assert post_sessions(url, [tenant_session("b-2", prog, "tenant-b")], WRITE_B).json()["accepted"] == [
        "b-2"
    ]
    doc = requests.get(f"{url}/v1/sessions/b-2/speedscope", headers=bearer(READ), timeout=10).json()
    assert PWNED not in {f["name"] for f in doc["shared"]["frames"]}
    # Deleting an upload is the admin's: not a writer's, not a reader's.
    target = f"{state}?tenant=tenant-a"
    for token in (WRITE_A, READ, SHARED):
        assert requests.delete(target, headers=bearer(token), timeout=10).status_code == 403
    assert requests.delete(target, headers=bearer(ADMIN), timeout=10).status_code == 204
    assert requests.get(state, headers=bearer(WRITE_A), timeout=10).status_code == 404


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenant-a\n", "expected 'TENANT TOKEN'"),
        ("../x tok\n", "must be 1-64 characters"),
        ("a tok\nb tok\n", "a token given twice"),
        ("", "the file is empty"),
    ],
)
def test_a_bad_write_tokens_file_is_a_startup_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "write-tokens"
    path.write_text(text)
    cmd = symbolizer_command(listen_addr="127.0.0.1:1", state_dir=tmp_path / "s", write_tokens_file=path)
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_one_token_of_two_kinds_is_a_startup_error(tmp_path: Path) -> None:
    (tmp_path / "w").write_text("tenant-a same\n")
    (tmp_path / "r").write_text("same\n")
    cmd = symbolizer_command(
        listen_addr="127.0.0.1:1",
        state_dir=tmp_path / "s",
        write_tokens_file=tmp_path / "w",
        read_token_file=tmp_path / "r",
    )
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=60)
    assert r.returncode == 2 and "share a token" in r.stderr, r.stderr

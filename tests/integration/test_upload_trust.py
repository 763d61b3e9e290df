"""Issue 26 N3 and its Low items: who may upload what, and what an upload may name.

Real `bistouri symbolizer` processes over HTTP (SQLite), real programs built here. The attacker holds
a write token and forges the GNU build id note of a program of its own (`ld --build-id=0x...`), which
the build id check cannot catch: what stops it is that uploads are per tenant, write-once, claimed,
and consulted after the operator's sources.
"""

from __future__ import annotations

import dataclasses
import gzip
import subprocess
from pathlib import Path
from typing import Any

import requests

from bistouri import wire
from testkit.helpers import wait_until
from testkit.symbolizer import KALLSYMS, KERNEL_BUILD_ID, metric_value
from testkit.uploads import Program, build, names, session
from tests.integration.conftest import post_sessions

TOKEN = "shared-write-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PWNED = "PWNED_by_another_tenant"
# One function over the whole of .text: any offset of the real program lands in it.
FAKE_C = f"""
void {PWNED}(void) {{ __asm__ volatile(".fill 65536, 1, 0x90"); }}
int main(void) {{ {PWNED}(); return 0; }}
"""


def forge(tmp_path: Path, real: Program) -> Path:
    """A program of the attacker's, carrying the real one's build id note."""
    src = tmp_path / "fake.c"
    src.write_text(FAKE_C)
    out = tmp_path / "fake"
    note = f"-Wl,--build-id=0x{real.build_id.hex()}"
    subprocess.run(["gcc", "-O0", note, "-o", str(out), str(src)], check=True)
    return out


def upload(
    url: str,
    path: Path,
    build_id: bytes,
    *,
    tenant: str,
    claimant: str,
    headers: Any = None,
    kind: str = "executable",
) -> Any:
    """What an agent does: claim, then PUT the gzip'd file under the same claimant."""
    target = f"{url}/v1/uploads/{build_id.hex()}/{kind}?claimant={claimant}&tenant={tenant}"
    headers = AUTH if headers is None else headers
    claim = requests.post(target, headers=headers, timeout=10)
    body = gzip.compress(path.read_bytes())
    put_headers = {**headers, "Content-Encoding": "gzip"}
    return claim, requests.put(target, data=body, headers=put_headers, timeout=30)


def tenant_session(sid: str, prog: Program, tenant: str) -> wire.Session:
    return dataclasses.replace(session(sid, prog), tenant=tenant)


def test_a_tenants_forged_library_never_names_another_tenants_stored_session(
    symbolizer_server: Any, tmp_path: Path
) -> None:
    """The N3 scenario: tenant B uploads its program under the build id of tenant A's library, with the
    shared write token; A's stored session is not named with it, and A's own upload still goes in."""
    real = build(tmp_path, "libc-like", "symtab")
    fake = forge(tmp_path, real)
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1)
    r = post_sessions(url, [tenant_session("a-1", real, "tenant-a")], TOKEN)
    assert r.json()["missing_builds"] == [real.build_id.hex()]
    _, put = upload(url, fake, real.build_id, tenant="tenant-b", claimant="b-agent")
    assert put.status_code == 200, put.text  # B's own scope: kept, for B's sessions
    assert PWNED not in names(url, "a-1")
    # Still asked for: A's agents upload the real one, which names A's session.
    r = post_sessions(url, [tenant_session("a-2", real, "tenant-a")], TOKEN)
    assert r.json()["missing_builds"] == [real.build_id.hex()]
    claim, put = upload(url, real.path, real.build_id, tenant="tenant-a", claimant="a-agent")
    assert claim.json()["state"] == "claimed" and put.status_code == 200, put.text
    for sid in ("a-1", "a-2"):
        assert {"upload_leaf", "upload_middle", "main"} <= names(url, sid)
        assert PWNED not in names(url, sid)
    # B's sessions get B's file: what B sent only ever names B's frames.
    post_sessions(url, [tenant_session("b-1", real, "tenant-b")], TOKEN)
    assert PWNED in names(url, "b-1")


def test_an_upload_is_never_replaced(symbolizer_server: Any, tmp_path: Path) -> None:
    """Write-once: a second PUT of a build id, claimed or not, is refused and changes nothing."""
    real = build(tmp_path, "once", "symtab")
    fake = forge(tmp_path, real)
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1)
    claim, put = upload(url, real.path, real.build_id, tenant="default", claimant="first")
    assert put.status_code == 200, put.text
    claim, put = upload(url, fake, real.build_id, tenant="default", claimant="second")
    assert claim.json()["state"] == "done"
    assert (put.status_code, put.json()["error"]) == (409, "already_uploaded")
    target = f"{url}/v1/uploads/{real.build_id.hex()}/executable"
    bare = requests.put(target, data=fake.read_bytes(), headers=AUTH, timeout=30)  # no claim, no claimant
    assert (bare.status_code, bare.json()["error"]) == (409, "already_uploaded")
    post_sessions(url, [session("once-1", real)], TOKEN)
    assert "upload_leaf" in names(url, "once-1") and PWNED not in names(url, "once-1")
    text = requests.get(url + "/metrics", timeout=10).text
    assert (
        metric_value(text, "bistouri_symbolizer_uploads_refused_total", {"reason": "already_uploaded"}) == 2
    )


def test_a_put_needs_its_claimants_claim(symbolizer_server: Any, tmp_path: Path) -> None:
    real = build(tmp_path, "claimed", "symtab")
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1)
    target = f"{url}/v1/uploads/{real.build_id.hex()}/executable"
    body = gzip.compress(real.path.read_bytes())
    headers = {**AUTH, "Content-Encoding": "gzip"}
    r = requests.put(target, data=body, headers=headers, timeout=30)
    assert (r.status_code, r.json()["error"]) == (409, "not_claimed")
    assert requests.post(target + "?claimant=holder", headers=AUTH, timeout=10).json()["state"] == "claimed"
    r = requests.put(target + "?claimant=other", data=body, headers=headers, timeout=30)
    assert (r.status_code, r.json()["error"]) == (409, "not_claimed")
    assert (
        requests.put(target + "?claimant=holder", data=body, headers=headers, timeout=30).status_code == 200
    )


def test_a_claim_expires_and_another_agent_takes_it(symbolizer_server: Any, tmp_path: Path) -> None:
    """A claimant that never finishes, re-claiming as often as it likes, holds the claim at most
    --upload-claim-seconds; then another agent takes it, and the first one's PUT is refused."""
    real = build(tmp_path, "lease", "symtab")
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1, upload_claim_seconds=2)
    target = f"{url}/v1/uploads/{real.build_id.hex()}/executable"

    def claim(who: str) -> str:
        return str(requests.post(f"{target}?claimant={who}", headers=AUTH, timeout=10).json()["state"])

    assert claim("squatter") == "claimed"
    assert claim("honest") == "in_progress"
    # The squatter renews as fast as it can: the claim still lapses, and the honest agent gets it.
    assert wait_until(lambda: claim("squatter") == "in_progress" or claim("honest") == "claimed", 30)
    assert claim("honest") == "claimed"
    body = gzip.compress(real.path.read_bytes())
    headers = {**AUTH, "Content-Encoding": "gzip"}
    late = requests.put(f"{target}?claimant=squatter", data=body, headers=headers, timeout=30)
    assert (late.status_code, late.json()["error"]) == (409, "not_claimed")
    assert (
        requests.put(f"{target}?claimant=honest", data=body, headers=headers, timeout=30).status_code == 200
    )


def test_operator_sources_win_over_uploads(symbolizer_server: Any, tmp_path: Path) -> None:
    """An upload is looked at after --binary-dir: a forged file uploaded first (as the debug file, which
    the resolver takes its names from) never shadows the operator's binary."""
    real = build(tmp_path, "operator", "symtab")
    fake = forge(tmp_path, real)
    binaries = tmp_path / "bin"
    binaries.mkdir()
    real.path.rename(binaries / "operator")
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1, binary_dir=binaries)
    _, put = upload(url, fake, real.build_id, tenant="default", claimant="early", kind="debuginfo")
    assert put.status_code == 200, put.text
    post_sessions(url, [session("op-1", real)], TOKEN)
    assert "upload_leaf" in names(url, "op-1") and PWNED not in names(url, "op-1")


def test_a_build_id_with_a_trailing_newline_is_a_bad_parameter(
    symbolizer_server: Any, tmp_path: Path
) -> None:
    """`re.match` with `$` let "ab\\n" through to a ValueError: a 500 on all four endpoints."""
    url = symbolizer_server(tmp_path, workers=1)
    bad = "abc%0A"  # four characters: even, as a build id's hex must be
    answers = [
        requests.get(f"{url}/v1/uploads/{bad}/executable", timeout=10),
        requests.post(f"{url}/v1/uploads/{bad}/executable?claimant=x", timeout=10),
        requests.put(f"{url}/v1/uploads/{bad}/executable?claimant=x", data=b"\x7fELF", timeout=10),
        requests.get(f"{url}/v1/kernels/{bad}", timeout=10),
        requests.put(f"{url}/v1/kernels/{bad}", data=gzip.compress(KALLSYMS), timeout=10),
    ]
    assert [(r.status_code, r.json()["error"]) for r in answers] == [(400, "bad_parameter")] * 5


def test_a_kernel_snapshot_is_never_replaced_by_another_kernels(
    symbolizer_server: Any, tmp_path: Path
) -> None:
    """Write-once for the kernel itself: the same bytes again change nothing, a snapshot with more
    modules replaces it (an agent restarted on the same boot), one of another kernel is refused."""
    url = symbolizer_server(tmp_path, token=TOKEN, workers=1)
    kernel = f"{url}/v1/kernels/{KERNEL_BUILD_ID.hex()}"

    def put(text: bytes) -> requests.Response:
        return requests.put(kernel, data=gzip.compress(text), headers=AUTH, timeout=10)

    assert put(KALLSYMS).status_code == 204
    assert put(KALLSYMS).status_code == 204
    hostile = KALLSYMS.replace(b"T schedule", b"T " + PWNED.encode())
    r = put(hostile)
    assert (r.status_code, r.json()["error"]) == (409, "conflict")
    with_module = KALLSYMS + b"ffffffffc0001000 t late_module_fn\t[late]\n"
    assert put(with_module).status_code == 204
    r = put(with_module.replace(b"T schedule", b"T " + PWNED.encode()))
    assert r.status_code == 409
    held = (Path(url.state_dir) / "kernels" / f"{KERNEL_BUILD_ID.hex()}.kallsyms.gz").read_bytes()
    assert gzip.decompress(held) == with_module
    text = requests.get(url + "/metrics", timeout=10).text
    assert metric_value(text, "bistouri_symbolizer_kernel_uploads_refused_total", {"reason": "conflict"}) == 2

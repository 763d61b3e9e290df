"""Issue 26, Low: on PostgreSQL a refused PUT deleted the shared copy of an upload already done, so
that no other instance could name frames with it. A real PostgreSQL (conftest.py starts it)
and two real symbolizers on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from . import test_postgres
from .conftest import DemoBinary, make_session, post_sessions

# The emptied database of test_postgres.py, on this module's real PostgreSQL (conftest.py).
fresh_db = test_postgres.fresh_db


def test_a_refused_put_leaves_the_shared_copy_of_an_upload_done(
    symbolizer_server: Any,
    tmp_path: Path,
    fresh_db: str,
    demo_binary: DemoBinary,
) -> None:
    a = symbolizer_server(tmp_path, db=fresh_db, workers=1)
    path = f"/v1/uploads/{demo_binary.build_id.hex()}/executable"
    assert requests.post(f"{a}{path}?claimant=first", timeout=10).json()["state"] == "claimed"
    r = requests.put(f"{a}{path}?claimant=first", data=demo_binary.path.read_bytes(), timeout=30)
    assert r.status_code == 200, r.text
    # Another PUT of the same file, not ELF: refused, and nothing of the done upload may go with it.
    bad = requests.put(f"{a}{path}?claimant=second", data=b"#!/bin/sh\n" * 100, timeout=30)
    assert bad.status_code in (400, 409), bad.text
    # B never received it: it names a session's frames from the shared copy.
    b = symbolizer_server(tmp_path, db=fresh_db, workers=1)
    r = post_sessions(b, [make_session("pg-shared", demo_binary)])
    assert r.json()["accepted"] == ["pg-shared"] and "missing_builds" not in r.json(), r.json()
    folded = requests.get(b + "/v1/sessions/pg-shared/folded?value=off_cpu", timeout=10).text
    assert folded.startswith("main;"), folded

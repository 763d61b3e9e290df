"""Upload rows of the store (issue 26): claims per tenant that expire, write-once, rows that go."""

from __future__ import annotations

from pathlib import Path

from bistouri.symbolizer.service.store import Store
from testkit.helpers import wait_until

BID = "ab" * 20
LEASE_NS = 200_000_000  # 0.2 s


def store(tmp_path: Path) -> Store:
    s = Store(str(tmp_path / "u.db"))
    s.migrate()
    return s


def test_claims_are_per_tenant(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.claim_upload("a", BID, "executable", LEASE_NS * 100, "x") == "claimed"
    assert s.claim_upload("b", BID, "executable", LEASE_NS * 100, "y") == "claimed"  # B's own
    assert s.finish_upload("b", BID, "executable", "y", 10)
    assert s.upload_done("b", BID, "executable") and not s.upload_done("a", BID, "executable")
    assert s.claim_upload("a", BID, "executable", LEASE_NS * 100, "z") == "in_progress"


def test_only_the_holder_finishes_or_releases(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.claim_upload("a", BID, "executable", LEASE_NS * 100, "x") == "claimed"
    s.release_upload("a", BID, "executable", "intruder")
    assert not s.finish_upload("a", BID, "executable", "intruder", 10)
    assert s.holds_claim("a", BID, "executable", "x")
    assert s.finish_upload("a", BID, "executable", "x", 10)
    assert s.claim_upload("a", BID, "executable", LEASE_NS * 100, "x") == "done"


def test_a_claim_expires_goes_to_another_first_and_its_row_goes(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.claim_upload("a", BID, "executable", LEASE_NS, "squatter") == "claimed"
    # Asking again does not renew it.
    assert wait_until(
        lambda: s.claim_upload("a", BID, "executable", LEASE_NS, "squatter") == "in_progress", 10
    )
    assert not s.holds_claim("a", BID, "executable", "squatter")
    assert s.claim_upload("a", BID, "executable", 100 * LEASE_NS, "honest") == "claimed"
    assert s.drop_expired_claims() == 0  # the honest claim is live
    # Nobody finishes a claim: its row goes once it expired a lease ago, retention or not.
    assert s.claim_upload("a", "cd" * 20, "debuginfo", LEASE_NS, "quitter") == "claimed"
    assert wait_until(lambda: s.drop_expired_claims() == 1, 10)
    assert s.live_claims("a") == 1

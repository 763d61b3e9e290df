"""gckeep.kept: no collection inside, what was made frozen after, the collector's state restored."""

from __future__ import annotations

import gc

from bistouri.gckeep import kept


def test_no_collection_runs_inside_and_what_was_made_is_frozen_after() -> None:
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.enable()
    gc.callbacks.append(count)
    frozen = gc.get_freeze_count()
    try:
        with kept():
            assert not gc.isenabled()
            made = [[i] for i in range(50_000)]  # ~25 times the first generation's threshold
        assert collections == []
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    try:
        with kept():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()

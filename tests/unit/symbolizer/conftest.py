from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import build_fixtures


@pytest.fixture(scope="session")
def symfix() -> Path:
    """tests/fixtures/build/symbolizer, built if needed."""
    return build_fixtures()

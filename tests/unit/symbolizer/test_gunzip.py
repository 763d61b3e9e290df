"""The one bounded gunzip: whole or in pieces, never past its bound, one valid member only."""

from __future__ import annotations

import gzip
import os

import pytest

from bistouri.errors import GzipError, GzipTooLarge
from bistouri.symbolizer.gunzip import gunzip, inflate

DATA = os.urandom(3000) * 300  # compressible, and over a few steps
GZ = gzip.compress(DATA)


@pytest.mark.parametrize("step", [1000, 4096, 1 << 20])
@pytest.mark.parametrize("chunk", [1, 100, 1 << 20])
def test_pieces_are_bounded_by_the_step_and_join_to_the_data(step: int, chunk: int) -> None:
    chunks = [GZ[i : i + chunk] for i in range(0, len(GZ), chunk)]
    pieces = list(inflate(chunks, len(DATA), step))
    assert b"".join(pieces) == DATA
    assert max(map(len, pieces)) <= step


def test_exactly_the_bound_passes_one_byte_over_does_not() -> None:
    assert gunzip(GZ, len(DATA)) == DATA
    with pytest.raises(GzipTooLarge, match=f"inflates to more than {len(DATA) - 1} bytes"):
        gunzip(GZ, len(DATA) - 1)


def test_a_bomb_stops_at_the_bound() -> None:
    bomb = gzip.compress(bytes(64 << 20))  # 64 KiB that inflate to 64 MiB
    with pytest.raises(GzipTooLarge):
        list(inflate((bomb,), 1 << 20, 1 << 16))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (GZ[:-5], "is truncated gzip"),
        (GZ + b"x", "has data after its gzip member"),
        (GZ + GZ, "has data after its gzip member"),
        (b"PK" + GZ, "is not valid gzip"),
    ],
)
def test_not_one_valid_member_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(GzipError, match=message):
        gunzip(body, 10 * len(DATA))


def test_data_in_a_chunk_after_the_member_is_refused_too() -> None:
    with pytest.raises(GzipError, match="after its gzip member"):
        list(inflate([GZ, b"", b"x"], len(DATA)))


def test_an_empty_member_inflates_to_nothing() -> None:
    assert gunzip(gzip.compress(b""), 0) == b""

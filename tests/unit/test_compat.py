"""bistouri.compat: on 3.10+ the standard library's own names; on 3.9 (make test-py39) its stand-ins,
which must behave the same."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import pytest

from bistouri import compat


def test_zip_strict_pairs_equal_lengths_and_refuses_others() -> None:
    assert list(compat.zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    assert list(compat.zip_strict([None], [None])) == [(None, None)]  # None is a value, not the end
    with pytest.raises(ValueError):
        list(compat.zip_strict([1, 2], "a"))
    with pytest.raises(ValueError):
        list(compat.zip_strict([1], "ab"))


def test_bisect_left_key_agrees_with_a_search_of_the_keys() -> None:
    keys = [10, 0, 30, 10, 20]
    live = [1, 0, 3, 4, 2]  # indexes into keys, sorted by key
    values = [keys[i] for i in live]
    for x in (-1, 0, 5, 10, 11, 30, 31):
        assert compat.bisect_left_key(live, x, keys.__getitem__) == bisect.bisect_left(sorted(values), x)


def test_pairwise_gives_each_item_with_the_next() -> None:
    assert list(compat.pairwise(iter("abc"))) == [("a", "b"), ("b", "c")]
    assert list(compat.pairwise([1])) == []


def test_eventfd_counts_writes_until_read() -> None:
    fd = compat.eventfd(0, compat.EFD_CLOEXEC | compat.EFD_NONBLOCK)
    try:
        assert not os.get_inheritable(fd)
        with pytest.raises(BlockingIOError):
            compat.eventfd_read(fd)  # nothing written yet, and it does not block
        compat.eventfd_write(fd, 2)
        compat.eventfd_write(fd, 3)
        assert compat.eventfd_read(fd) == 5
    finally:
        os.close(fd)


def test_slots_are_given_where_python_has_them() -> None:
    @dataclass(frozen=True, **compat.SLOTS)
    class Point:
        x: int

    assert Point(1) == Point(1) and hash(Point(1)) == hash(Point(1))
    assert hasattr(Point(1), "__dict__") is (not compat.SLOTS)

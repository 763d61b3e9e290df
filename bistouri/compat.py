"""What bistouri takes from Python 3.10+, spelled once for Python 3.9 (Debian 11's python3, the floor).

On 3.10+ each name here is the standard library's own (slotted dataclasses, `zip(strict=True)`,
`os.eventfd`, `bisect`'s `key=`, `itertools.pairwise`), so behaviour there is unchanged; on 3.9 it
is a plain stand-in that behaves the same (dataclasses just carry a `__dict__`). ruff's py39 target
flags newer syntax; mypy 2 checks no older than 3.10, so `make test-py39` (the unit tests on 3.9)
is what catches a newer standard-library name.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

_T = TypeVar("_T")

# `@dataclass(frozen=True, **SLOTS)`: slotted (less memory, faster attributes) where Python has it.
SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}

if TYPE_CHECKING:
    zip_strict = zip  # the builtin's overloads type each call
elif sys.version_info >= (3, 10):

    def zip_strict(*iterables: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        """`zip(..., strict=True)`: ValueError when the iterables' lengths differ."""
        return zip(*iterables, strict=True)

else:
    _MISSING = object()

    def zip_strict(*iterables: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        """`zip(..., strict=True)`: ValueError when the iterables' lengths differ."""
        for row in itertools.zip_longest(*iterables, fillvalue=_MISSING):
            if any(v is _MISSING for v in row):
                raise ValueError("zip_strict: the iterables' lengths differ")
            yield row


if sys.version_info >= (3, 10):
    from itertools import pairwise
else:

    def pairwise(iterable: Iterable[_T]) -> Iterator[tuple[_T, _T]]:
        """`itertools.pairwise`: each item with the next one."""
        a, b = itertools.tee(iterable)
        next(b, None)
        return zip(a, b)


def bisect_left_key(a: Sequence[_T], x: Any, key: Callable[[_T], Any]) -> int:
    """`bisect.bisect_left(a, x, key=key)`: the first index whose key is not below `x`."""
    if sys.version_info >= (3, 10):
        return bisect.bisect_left(a, x, key=key)
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if key(a[mid]) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


if sys.version_info >= (3, 10):
    from os import EFD_CLOEXEC, EFD_NONBLOCK, eventfd, eventfd_read, eventfd_write
else:
    # eventfd(2) through libc; its flags are open(2)'s on every architecture Linux has.
    EFD_CLOEXEC = os.O_CLOEXEC
    EFD_NONBLOCK = os.O_NONBLOCK
    _libc = ctypes.CDLL(None, use_errno=True)

    def eventfd(initval: int, flags: int = EFD_CLOEXEC) -> int:
        fd: int = _libc.eventfd(ctypes.c_uint(initval), ctypes.c_int(flags))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return fd

    def eventfd_read(fd: int) -> int:
        return int.from_bytes(os.read(fd, 8), sys.byteorder)

    def eventfd_write(fd: int, value: int) -> None:
        os.write(fd, value.to_bytes(8, sys.byteorder))


__all__ = [
    "EFD_CLOEXEC",
    "EFD_NONBLOCK",
    "SLOTS",
    "bisect_left_key",
    "eventfd",
    "eventfd_read",
    "eventfd_write",
    "pairwise",
    "zip_strict",
]

"""Python frames put into the native stack where the eval loop ran them (mixed stacks).

Each C activation of the eval loop (`_PyEval_EvalFrameDefault`, a native frame) runs a run of Python
frames: one on <= 3.10, the frames since its entry frame on 3.11+ (inlined Python-to-Python calls). The
BPF walk marks the oldest frame of each run (`abi.PY_FRAME_ENTRY`), so walking the native stack from
the leaf, the k-th eval frame takes the Python frames up to and including the k-th marked one, and is
replaced by them (as py-spy --native shows it: the eval loop's own time is the Python function's).
Native frames between (a C extension called from Python, the interpreter's helpers) stay where they
are: under the Python function that called them.

Python frames no eval frame took (the native walk stopped early, a frame-eval hook or a JIT ran the
code) go at the root end, in their order: never lost, and counted (`Spliced.leftover`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..bpf import abi
from ..compat import SLOTS


class _Python(Protocol):
    """A Python frame as splice() needs it: raw (PyFrame) or named (processes.PythonFrame)."""

    @property
    def entry(self) -> bool: ...


N = TypeVar("N")
P = TypeVar("P", bound=_Python)


@dataclass(frozen=True, eq=False, **SLOTS)
class EvalLoop:
    """Where a process's eval loop is: its interpreter's file (by build id; by name when the file has
    none) and the loop's ranges of file offsets (discover.Interpreter.eval_ranges). Compared by
    identity: one per described process."""

    build_id: bytes
    name: str  # the file's base name, as procmaps.MappedFile has it
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, build_id: bytes, path: str, ranges: tuple[tuple[int, int], ...]) -> EvalLoop:
        return cls(build_id, os.path.basename(path), ranges)

    def holds(self, build_id: bytes, name: str, offset: int) -> bool:
        """A native frame (its file's build id and name, its file offset) runs the eval loop."""
        if build_id != self.build_id or (not build_id and name != self.name):
            return False
        return any(lo <= offset < hi for lo, hi in self.ranges)


@dataclass(frozen=True, **SLOTS)
class PyFrame:
    """One Python frame of a sample, as the BPF walk sent it."""

    code: int  # the code object's address
    offset: int | None  # instruction offset in code units; None: before the first instruction
    checksum: int  # layouts.checksum at the sample; 0: not read
    entry: bool  # the oldest frame of its C activation


def decode(raw: bytes) -> list[PyFrame]:
    """A sample's raw Python frames (abi.PY_FRAME records, innermost first)."""
    out = []
    for code, offset, checksum in abi.PY_FRAME.iter_unpack(raw[: len(raw) - len(raw) % abi.PY_FRAME.size]):
        out.append(
            PyFrame(
                code & ~abi.PY_FRAME_ENTRY,
                None if offset == abi.PY_NO_OFFSET else offset,
                checksum,
                bool(code & abi.PY_FRAME_ENTRY),
            )
        )
    return out


@dataclass(frozen=True, **SLOTS)
class Spliced(Generic[N, P]):
    """Native and Python frames interleaved, leaf first, and the Python frames left over."""

    frames: list[N | P]  # leaf first
    leftover: int  # Python frames no eval frame took (put at the root end)


def splice(
    native: Sequence[N],
    python: Sequence[P],
    in_eval: Callable[[N], bool],
    redundant: Callable[[N], bool] | None = None,
) -> Spliced[N, P]:
    """`native` (leaf first) with each eval-loop frame (`in_eval`) replaced by the Python frames it ran.
    `redundant`: native frames that only repeat a Python frame (3.12+'s `-X perf` trampolines, named
    `py::<function>` from the perf map), left out when there are Python frames."""
    out: list[N | P] = []
    i = 0
    for frame in native:
        if python and redundant is not None and redundant(frame):
            continue
        if i < len(python) and in_eval(frame):
            while i < len(python):
                out.append(python[i])
                i += 1
                if python[i - 1].entry:
                    break
            continue
        out.append(frame)
    out.extend(python[i:])
    return Spliced(out, len(python) - i)

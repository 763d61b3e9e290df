"""The in-process DWARF reader (symbolizer/dwarf.py) compared with llvm-symbolizer, address by address."""

from __future__ import annotations

import os
import subprocess

import pytest

from bistouri.compat import zip_strict
from bistouri.symbolizer import dwarf
from bistouri.symbolizer.llvm import SourceFrame, find_llvm_symbolizer, parse_json_line

LLVM = find_llvm_symbolizer()[0]
needs_llvm = pytest.mark.skipif(LLVM is None, reason="no llvm-symbolizer to compare with")


def llvm_frames(path: str, addrs: list[int]) -> list[list[SourceFrame] | None]:
    """llvm-symbolizer's answers, as the resolver's pool asks for them."""
    assert LLVM is not None
    lines = "".join(f'"{path}" 0x{a:x}\n' for a in addrs).encode()
    argv = [LLVM, "--output-style=JSON", "--inlines", "--no-demangle"]
    out = subprocess.run(argv, input=lines, capture_output=True, check=True, timeout=300).stdout
    return [parse_json_line(line) for line in out.splitlines()]


def comparable(frames: list[SourceFrame] | None) -> list[tuple[str, str, int]] | None:
    """What the resolver keeps of an answer. The outermost frame's name is the symbol table's
    (Resolver._user_frames); a lone frame of line 0 is llvm's answer outside every unit (the file
    of an STT_FILE symbol, which the resolver's names-only frame has not either)."""
    if frames is None:
        return None
    if len(frames) == 1 and frames[0].line == 0:
        return []
    last = len(frames) - 1
    return [
        (f.function if i < last else "", os.path.normpath(f.file) if f.file else "", f.line)
        for i, f in enumerate(frames)
    ]


def agreement(path: str, addrs: list[int]) -> tuple[float, list[tuple[int, object, object]]]:
    """The share of `addrs` the reader answers exactly as llvm-symbolizer, and the differences."""
    ours = dwarf.symbolize(path, addrs)
    theirs = llvm_frames(path, addrs)
    differ = [(a, o, t) for a, o, t in zip_strict(addrs, ours, theirs) if comparable(o) != comparable(t)]
    return 1 - len(differ) / len(addrs), differ

"""Ring records as samples (bistouri/capture/events.py)."""

from __future__ import annotations

import dataclasses

from bistouri.bpf import abi
from bistouri.capture.events import ResolvedStacks, StackSample, decode_stack
from bistouri.host.procmaps import ProcMaps
from tests.unit.test_capture import copy, record


def test_a_weighed_sample_keeps_every_other_field() -> None:
    """weighed() lists the fields by hand (10x faster than dataclasses.replace): a field added to
    StackSample and forgotten there would be lost from every counted repeat."""
    values = {f.name: i + 2 for i, f in enumerate(dataclasses.fields(StackSample))}
    values.update(comm="burner", stacks=b"\x01" * 24, walk=b"\x03\x04\x05")
    sample = StackSample(**values)
    assert sample.weighed(7) == dataclasses.replace(sample, weight=7)
    assert sample.weight != 7


def test_a_record_ends_after_its_python_frames() -> None:
    """BPF sends a stack event up to the Python frames it took (emit_stack): none for most processes."""
    full = bytearray(copy(record(7, 7, [0xFFFFFFFF81000010], [])))
    cut = abi.StackEvent.py_frames.offset
    assert decode_stack(bytes(full[:cut]), ProcMaps(), ResolvedStacks()).python == b""
    frames = abi.PY_FRAME.pack(0x1001, 3, 9) + abi.PY_FRAME.pack(0x2000, 4, 10)
    full[abi.StackEvent.py_depth.offset] = 2
    full[cut : cut + len(frames)] = frames
    assert decode_stack(bytes(full[: cut + len(frames)]), ProcMaps(), ResolvedStacks()).python == frames

"""CPython processes in user space: recognised and described for the BPF walk of their frames
(`discover`), their code objects named (`naming`) with each version's line table (`linetable`), read
from their memory with bounds (`memory`), at the offsets of `layouts`. Design: docs/python-frames.md.

Layer: beside `unwind`, above `bpf` and `host` (tests/unit/test_layers.py).
"""

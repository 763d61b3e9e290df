"""User-space unwinding without frame pointers: `.eh_frame` parsed into rows (`ehframe`), and the rows
loaded into the BPF unwinder's maps, per mapped file (`tables`).

Layer: above `bpf` and `host` (tests/unit/test_layers.py).
"""

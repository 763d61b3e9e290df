"""The kernel interface: libbpf through ctypes (`_libbpf`), the BPF object, its links and maps
(`handles`), the layout of the ring records (`abi`), perf events (`perf`) and loading the one object for a
run (`loader`).

Layer: imports the base modules, `elf` and `wire` only (tests/unit/test_layers.py).
"""

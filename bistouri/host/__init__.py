"""Readers of the host: /proc (`procfs`, `procmaps`), the mount table (`mounts`), cgroup2 (`cgroupfs`),
the kernel's metadata (`kernel`), PSI watches and their poll loop (`psi`), and opening the files a
watched process controls (`safeopen`).

Layer: beside `bpf`; imports the base modules, `elf` and `wire` only (tests/unit/test_layers.py).
"""

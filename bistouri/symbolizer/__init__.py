"""The symbolizer library: raw stacks to named frames (`resolve`, `kallsyms`, `llvm`, `dwarf`, `demangle`,
`sources`), the profile model (`model`) and its formats and reports (`formats`, `report`, the `ui` files).
Shared by `bistouri record`, `bistouri symbolize` and the service (`service/`).

Layer: imports the base modules, `elf` and `wire` only (tests/unit/test_layers.py).
"""

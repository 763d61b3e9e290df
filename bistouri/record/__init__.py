"""`bistouri record`: one process profiled from the command line, its output files (`outputs`) and
the local symbol cache (`symcache`). Built on the capture layer and the symbolizer library, never on the
agent.

Layer: beside `agent` (tests/unit/test_layers.py).
"""

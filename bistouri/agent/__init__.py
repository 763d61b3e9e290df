"""The daemon (`bistouri agent`): its configuration, process discovery, PSI watches, the spool, the
exporter and uploader, its metrics and control API, and `bistouri check` (`preflight`).

Layer: the top of the profiler's stack; only the command line imports it (tests/unit/test_layers.py).
"""

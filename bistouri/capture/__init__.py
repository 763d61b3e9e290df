"""From ring records to sessions: the running BPF object and its ring thread (`profiler`), decoded
events (`events`), the flight recorder (`flight`), the episode report (`episode`) and the sessions
themselves (`sessions`). Used by the agent and by `bistouri record`.

Layer: above `unwind`; knows nothing of the agent (tests/unit/test_layers.py).
"""

"""Bistouri: a reactive eBPF profiler driven by Linux pressure stall information."""

__version__ = "0.1.0"

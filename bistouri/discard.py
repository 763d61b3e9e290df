"""Metrics nobody reads: `record` keeps none, and prometheus_client is ~75 modules and ~5-8 MB of RSS
it need not import. Any attribute of `Discarded` takes any update of a Counter, Gauge or Histogram
(with or without labels) and keeps nothing."""

from __future__ import annotations


class _Discard:
    """An update nobody reads: any label, any value."""

    def labels(self, *values: str) -> _Discard:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class Discarded:
    """Stands for a metrics holder (CaptureMetrics, a symbolizer module's _Metrics) when no registry
    is given."""

    def __getattr__(self, name: str) -> _Discard:
        return _DISCARD


_DISCARD = _Discard()

"""The words of PSI (pressure stall information) that every layer shares.

The kernel's names for what stalls (cpu, memory, io) and how (some, full), a pressure threshold as one
value (the config parses it, psi.py writes it to the kernel, the wire format carries its names), and the
figures of a pressure file's line as one value, carried whole from psi.py's event through the session's
trigger (wire) to the symbolizer's stored metadata. It sits in the base layer, below all of them, so that
none imports another for a tuple of words (the decoder must not pull in the config's PyYAML; psi.py does
not need the session format).
"""

from __future__ import annotations

from dataclasses import dataclass

from .compat import SLOTS

RESOURCES = ("cpu", "memory", "io")
STALLS = ("some", "full")
DEFAULT_WINDOW_MS = 1000


@dataclass(frozen=True, **SLOTS)
class PressureThreshold:
    """A target's threshold for one resource: a PSI event when `stall` time exceeds `threshold` % of a
    `window_ms` window (host.psi writes it into a PSI watch)."""

    resource: str  # cpu | memory | io
    threshold: float  # percent of the window, 0 < t < 100
    stall: str = "some"  # some | full
    window_ms: int = DEFAULT_WINDOW_MS

    @property
    def window_us(self) -> int:
        return self.window_ms * 1000

    @property
    def stall_us(self) -> int:
        """Stall time per window written to the kernel."""
        return stall_threshold_us(self.threshold, self.window_us)


@dataclass(frozen=True, **SLOTS)
class PressureFigures:
    """One line of a pressure file (`some avg10=1.10 avg60=0.20 avg300=0.03 total=777`): the share of
    time stalled over the last 10, 60 and 300 s (percent), and the stall time since boot."""

    avg10: float = 0.0
    avg60: float = 0.0
    avg300: float = 0.0
    total_us: int = 0  # the kernel's `total=`, microseconds


def stall_threshold_us(threshold: float, window_us: int) -> int:
    """The one formula for a threshold's stall time: `threshold` % of the window, in whole microseconds
    (truncated; at least 1, the kernel refuses 0). Also used for a window the kernel forced on us."""
    return max(1, int(window_us * threshold / 100.0))

"""What the agent's log lines may hold, and how often.

Comms, cgroup names and file paths come from the watched processes: a comm with a
newline wrote lines of its choosing into the agent's log, and a storm of execs wrote
9 350 lines in 20 s. Two helpers:

- `OneLineFormatter` escapes control characters in every message (not in a traceback
  appended after it): one place, so no call site can forget a string;
- `RateLimited` logs the first lines of a kind per interval one by one, then counts,
  and tells the count in one summary line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROLS = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROLS}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", ord("\\"): "\\\\"})


def escape(text: str) -> str:
    """`text` on one line: control characters (and the backslash) written as escapes."""
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    """A Formatter whose messages are escaped (`escape`): a log line is one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


class RateLimited:
    """At most `burst` lines of one kind per `interval_s`; the rest are counted and told in one
    summary line (at the next line of that kind after the interval, or at `flush()`)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        level: int = logging.INFO,
        burst: int = 20,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.level = level
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()
        self._logged = 0
        self.held = 0  # lines counted, not logged, since the last summary

    def log(self, msg: str, *args: object) -> None:
        self.flush()
        if self._logged < self.burst:
            self._logged += 1
            self.logger.log(self.level, msg, *args)
        else:
            self.held += 1

    def flush(self) -> None:
        """Tell what was held back once the interval is over, and start a new one."""
        now = self._clock()
        if now - self._since < self.interval_s:
            return
        if self.held:
            self.logger.log(
                self.level,
                "%s: more not logged one by one. count=%d seconds=%.0f",
                self.what,
                self.held,
                now - self._since,
            )
        self._since, self._logged, self.held = now, 0, 0


__all__ = ["OneLineFormatter", "RateLimited", "escape"]

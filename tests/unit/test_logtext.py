"""logtext: one line per message, and a bounded number of lines per kind."""

from __future__ import annotations

import logging

from bistouri.logtext import OneLineFormatter, RateLimited, escape


def test_escape_keeps_printable_text_and_escapes_every_control():
    assert escape("nginx: worker/1 é") == "nginx: worker/1 é"
    assert escape("a\nb\rc\td\\e") == "a\\nb\\rc\\td\\\\e"
    assert escape("\x1b[31m\x00\x7f\x85\u2028") == "\\x1b[31m\\x00\\x7f\\x85\\u2028"


def test_the_formatter_escapes_the_message_but_not_a_traceback():
    fmt = OneLineFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc = sys.exc_info()
    rec = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "Process matched. comm=%s", ("a\nINFO fake",), exc
    )
    out = fmt.format(rec)
    first, *rest = out.splitlines()
    assert first == "INFO Process matched. comm=a\\nINFO fake"
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"


def test_rate_limited_logs_a_burst_then_one_summary_per_interval(caplog):
    now = [0.0]
    limited = RateLimited(logging.getLogger("t"), "Things", burst=3, interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "t"):
        for i in range(100):
            limited.log("Thing. n=%d", i)
        assert [r.getMessage() for r in caplog.records] == ["Thing. n=0", "Thing. n=1", "Thing. n=2"]
        limited.flush()  # within the interval: nothing yet
        assert len(caplog.records) == 3 and limited.held == 97
        now[0] = 10
        limited.flush()
        assert caplog.records[-1].getMessage() == "Things: more not logged one by one. count=97 seconds=10"
        limited.log("Thing. n=%d", 100)  # a new interval: logged again
        assert caplog.records[-1].getMessage() == "Thing. n=100" and limited.held == 0

"""The exporter's retry schedule (issue 26): capped so that a spool drains within about a
minute of the symbolizer coming back, and fully jittered so that a fleet does not send at
the same instant. A pure function, drawn from seeded generators."""

from __future__ import annotations

import random
from collections import Counter

from bistouri.agent.exporter import Exporter, backoff_s

INITIAL, CAP = Exporter.BACKOFF_INITIAL_S, Exporter.BACKOFF_MAX_S


def test_no_wait_is_over_a_minute_however_long_the_outage():
    rng = random.Random(26)
    assert CAP <= 60.0
    waits = [backoff_s(n, INITIAL, CAP, rng) for n in range(1, 2000)]
    assert min(waits) >= INITIAL and max(waits) <= CAP


def test_the_waits_grow_exponentially_until_the_cap():
    rng = random.Random(1)
    for n in range(1, 12):
        step = min(CAP, INITIAL * 2 ** (n - 1))
        waits = [backoff_s(n, INITIAL, CAP, rng) for _ in range(200)]
        assert min(waits) >= INITIAL and max(waits) <= step
        assert max(waits) > 0.9 * step  # the whole range is used, up to the step


def test_a_fleet_back_from_an_outage_is_spread_over_the_cap():
    """200 agents at the cap: their next tries spread over the whole minute, a few a second."""
    tries = [backoff_s(30, INITIAL, CAP, random.Random(agent)) for agent in range(200)]
    per_second = Counter(int(t) for t in tries)
    assert max(tries) - min(tries) > 0.9 * (CAP - INITIAL)
    assert max(per_second.values()) <= 12  # 200 / 60 = 3.3 on average
    assert len(per_second) >= 45


def test_the_schedule_is_reproducible_from_the_generator():
    a = [backoff_s(n, INITIAL, CAP, random.Random(7)) for n in range(1, 20)]
    b = [backoff_s(n, INITIAL, CAP, random.Random(7)) for n in range(1, 20)]
    assert a == b

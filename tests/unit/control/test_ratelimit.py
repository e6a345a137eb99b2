"""RateLimitedWarnings: a burst in full, then one summary per interval with counts by reason."""

import logging

from pdserve.control.ratelimit import RateLimitedWarnings


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _lines(caplog):
    return [r.getMessage() for r in caplog.records]


def test_burst_in_full_then_a_summary_with_counts_by_reason(caplog):
    clock = Clock()
    warnings = RateLimitedWarnings(logging.getLogger("test.ratelimit"), "srv rejected", burst=2, interval_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for i in range(5):
            warnings.warn("bad MAC", f"frame {i}: bad MAC")
        warnings.warn("stale", "frame 5: stale")
        warnings.flush()
        assert _lines(caplog) == ["srv rejected frame 0: bad MAC", "srv rejected frame 1: bad MAC"]
        clock.now += 10
        warnings.flush()
        assert _lines(caplog)[2:] == ["srv rejected 4 more messages in the last 10 s (not logged one by one): bad MAC: 3, stale: 1"]
        warnings.flush()
        warnings.warn("stale", "frame 6: stale")
        assert _lines(caplog)[3:] == ["srv rejected frame 6: stale"], "a new interval starts with a new burst"


def test_quiet_intervals_log_nothing(caplog):
    clock = Clock()
    warnings = RateLimitedWarnings(logging.getLogger("test.ratelimit"), "srv rejected", burst=1, interval_s=1, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        warnings.warn("x", "one")
        for _ in range(5):
            clock.now += 1
            warnings.flush()
    assert _lines(caplog) == ["srv rejected one"]

import pytest

from pdserve.launch.backoff import Backoff, BackoffPolicy


def test_delays_double_up_to_the_cap():
    backoff = Backoff(BackoffPolicy())
    assert [backoff.failed(now=float(t)) for t in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_staying_healthy_long_enough_resets_the_delay():
    backoff = Backoff(BackoffPolicy(reset_after_s=60))
    assert [backoff.failed(0), backoff.failed(1), backoff.failed(2)] == [1, 2, 4]
    backoff.healthy(10)
    backoff.healthy(50)  # still the same healthy spell: it began at 10
    assert backoff.failed(69) == 8  # healthy 59 s: not long enough
    backoff.healthy(100)
    assert backoff.failed(160) == 1  # healthy 60 s
    assert backoff.failed(161) == 2


def test_a_failure_ends_the_healthy_spell():
    backoff = Backoff(BackoffPolicy(reset_after_s=60))
    backoff.healthy(0)
    assert backoff.failed(5) == 1
    assert backoff.failed(100) == 2  # no healthy() since the last failure: no reset


@pytest.mark.parametrize("bad", [dict(initial_s=0), dict(initial_s=40, max_s=30), dict(factor=0.5),
                                 dict(reset_after_s=-1)])
def test_inconsistent_policies_are_refused(bad):
    with pytest.raises(ValueError):
        BackoffPolicy(**bad)

"""ReplayCache: a nonce is forgotten only once its timestamp has left the window."""

import pytest

from pdserve.control.replay import ReplayCache
from pdserve.errors import AuthenticationError


def _nonce(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_in_window_nonces_are_never_evicted_to_make_room():
    cache = ReplayCache(max_nonces=3)
    for i in range(3):
        cache.admit(_nonce(i), ts=100.0 + i, window_start=90.0)
    with pytest.raises(AuthenticationError, match="replay cache full"):
        cache.admit(_nonce(3), ts=104.0, window_start=90.0)
    with pytest.raises(AuthenticationError, match="already seen"):
        cache.admit(_nonce(0), ts=100.0, window_start=90.0)


def test_nonces_older_than_the_window_are_forgotten_in_timestamp_order():
    cache = ReplayCache(max_nonces=3)
    cache.admit(_nonce(0), ts=105.0, window_start=90.0)
    cache.admit(_nonce(1), ts=95.0, window_start=90.0)  # arrived later, sent earlier
    cache.admit(_nonce(2), ts=106.0, window_start=90.0)
    cache.admit(_nonce(3), ts=107.0, window_start=100.0)  # room made by the nonce sent at 95
    assert len(cache) == 3
    with pytest.raises(AuthenticationError, match="already seen"):
        cache.admit(_nonce(0), ts=105.0, window_start=100.0)


def test_a_clock_stepped_back_cannot_reopen_the_window_for_a_forgotten_nonce():
    cache = ReplayCache(max_nonces=10)
    cache.admit(_nonce(0), ts=95.0, window_start=90.0)
    cache.admit(_nonce(1), ts=120.0, window_start=100.0)  # forgets nonce 0
    with pytest.raises(AuthenticationError, match="stale"):
        cache.admit(_nonce(0), ts=95.0, window_start=80.0)  # the clock went back 20 s

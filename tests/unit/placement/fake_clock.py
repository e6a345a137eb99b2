"""A clock the test moves by hand (`clock.now += 0.1`), for components that take `clock=`."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

"""Arrival schedules with common random numbers, and the steady window that is scored.

One seed fixes one sequence of unit-rate inter-arrival gaps (gamma, mean 1 s, shape =
burstiness; 1 = Poisson). The schedule at rate r is that sequence divided by r, so every rate and
every configuration sees the same pattern, only compressed or stretched: curves over rate are
common-random-numbers curves, and the seed of a point never depends on the other rates.

The first arrivals meet an empty system and the last ones a draining one; neither is the steady
state whose goodput we want. ``steady_window`` keeps the requests that arrive between a warm-up
fraction and a cool-down fraction of the unit-rate schedule's span, so the same requests (by
position) are scored at every rate.
"""

from __future__ import annotations

import numpy as np


def unit_gaps(seed: int, num_requests: int, burstiness: float = 1.0) -> np.ndarray:
    """``num_requests`` unit-mean gamma gaps of ``seed`` (the gap *before* each request)."""
    if num_requests < 1 or burstiness <= 0:
        raise ValueError(f"need >= 1 request and burstiness > 0, got {num_requests}, {burstiness}")
    rng = np.random.default_rng([seed, 0x41525256])  # a stream of its own (prompts use others)
    return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=num_requests)


def unit_arrivals(seed: int, num_requests: int, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (s) at rate 1; the first request arrives at 0."""
    gaps = unit_gaps(seed, num_requests, burstiness)
    return np.concatenate(([0.0], np.cumsum(gaps[1:])))


def arrival_times(seed: int, num_requests: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (s) at ``rate`` req/s: the unit-rate schedule divided by the rate."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return unit_arrivals(seed, num_requests, burstiness) / rate


def steady_window(seed: int, num_requests: int, burstiness: float, warmup_fraction: float,
                  cooldown_fraction: float) -> range:
    """Positions of the scored requests: those arriving in [w·T, (1−c)·T] of the span T.

    It depends on the seed only, never on the rate, so a point's scored requests are the same
    requests at every rate and in every configuration."""
    if not (0 <= warmup_fraction and 0 <= cooldown_fraction and warmup_fraction + cooldown_fraction < 1):
        raise ValueError(f"warm-up {warmup_fraction} + cool-down {cooldown_fraction} must leave a window")
    times = unit_arrivals(seed, num_requests, burstiness)
    span = times[-1]
    start = int(np.searchsorted(times, warmup_fraction * span, side="left"))
    stop = int(np.searchsorted(times, (1.0 - cooldown_fraction) * span, side="right"))
    return range(start, max(start, stop))

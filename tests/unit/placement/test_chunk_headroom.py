"""ChunkHeadroom: the share of its bound D plans a local chunk step to fill, from the steps it ran."""

from __future__ import annotations

import pytest

from pdserve.placement.chunk_headroom import (
    MAX_HEADROOM,
    MIN_HEADROOM,
    MIN_SAMPLES,
    QUANTILE,
    TARGET,
    WINDOW,
    ChunkHeadroom,
)
from pdserve.placement.chunk_size import STEP_HEADROOM


def test_it_starts_from_the_fixed_headroom_until_enough_steps_ran():
    headroom = ChunkHeadroom()
    for _ in range(MIN_SAMPLES - 1):
        headroom.observe(0.080, 0.040)
    assert headroom.headroom() == STEP_HEADROOM
    headroom.observe(0.080, 0.040)
    assert headroom.headroom() == pytest.approx(TARGET / 2.0)


def test_steps_slower_than_predicted_shrink_it_and_steps_as_predicted_grow_it():
    slow = ChunkHeadroom()
    for _ in range(WINDOW):
        slow.observe(0.054, 0.040)  # the 2026-12-04 run: steps planned at 40 ms ran 51-54 ms
    assert slow.headroom() == pytest.approx(TARGET / 1.35)
    assert slow.headroom() * 1.35 < 1.0 < STEP_HEADROOM * 1.35  # such steps now keep the bound; at 0.8 they broke it
    assert slow.headroom() * 1.35 == pytest.approx(STEP_HEADROOM)  # as full as steps that keep to the prediction
    exact = ChunkHeadroom()
    for _ in range(WINDOW):
        exact.observe(0.040, 0.040)
    assert exact.headroom() == pytest.approx(STEP_HEADROOM)  # steps that keep to the prediction: as before
    assert MAX_HEADROOM == STEP_HEADROOM  # never fuller: a client's gap is a step and then some


def test_a_rare_stall_does_not_shrink_it_but_a_tail_of_slow_steps_does():
    headroom = ChunkHeadroom()
    for _ in range(WINDOW - 1):
        headroom.observe(0.040, 0.040)
    headroom.observe(2.0, 0.040)  # a step that lost its core for a while
    assert headroom.headroom() == pytest.approx(TARGET)
    for _ in range(int(WINDOW * (1 - QUANTILE)) + 1):  # more than a tenth of the window slow
        headroom.observe(0.060, 0.040)
    assert headroom.headroom() == pytest.approx(TARGET / 1.5)


def test_it_stays_within_its_range_and_ignores_empty_observations():
    headroom = ChunkHeadroom()
    for _ in range(WINDOW):
        headroom.observe(1.0, 0.040)
    assert headroom.headroom() == MIN_HEADROOM
    for _ in range(WINDOW):
        headroom.observe(0.010, 0.040)
    assert headroom.headroom() == MAX_HEADROOM
    headroom.observe(0.0, 0.040)
    headroom.observe(0.040, 0.0)
    headroom.observe(-1.0, 0.040)
    assert headroom.headroom() == MAX_HEADROOM


def test_the_oldest_steps_leave_the_window():
    headroom = ChunkHeadroom()
    for _ in range(WINDOW):
        headroom.observe(0.080, 0.040)
    for _ in range(WINDOW):
        headroom.observe(0.040, 0.040)
    assert headroom.headroom() == pytest.approx(TARGET)

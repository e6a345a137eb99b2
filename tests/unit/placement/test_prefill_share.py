"""PrefillShare: P's time in steps with prompt tokens over the last seconds, and its streams."""

from __future__ import annotations

import pytest

from pdserve.placement.prefill_share import PrefillShare
from tests.unit.placement.fake_clock import Clock


def test_share_counts_prefill_steps_within_the_span_only():
    clock = Clock()
    share = PrefillShare(span_s=5.0, clock=clock)
    assert share.share() == 0.0 and share.streams() == 0
    share.on_step(100.0, 0.5, prefill_tokens=128, decodes=0)
    share.on_step(100.5, 0.02, prefill_tokens=0, decodes=3)  # a decode-only step is not P's prefill time
    clock.now = 101.0
    assert share.share() == pytest.approx(0.5 / 5.0)
    assert share.streams() == 3
    share.on_step(101.0, 1.0, prefill_tokens=512, decodes=2)  # a mixed step counts whole
    clock.now = 102.0
    assert share.share() == pytest.approx(1.5 / 5.0) and share.streams() == 2
    clock.now = 105.25  # the first step's first quarter fell out of the span
    assert share.share() == pytest.approx(1.25 / 5.0)
    clock.now = 107.5
    assert share.share() == 0.0 and share.streams() == 0  # nothing in the span


def test_share_is_capped_and_bad_input_ignored():
    clock = Clock()
    share = PrefillShare(span_s=1.0, clock=clock)
    share.on_step(99.0, 5.0, prefill_tokens=64, decodes=0)  # a step longer than the span, still running into it
    assert share.share() == 1.0
    share.on_step(100.0, -1.0, prefill_tokens=64, decodes=9)
    assert share.streams() == 0
    with pytest.raises(ValueError, match="positive"):
        PrefillShare(span_s=0)

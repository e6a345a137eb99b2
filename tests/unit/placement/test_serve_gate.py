"""ServeGate: P offers itself as a decode instance only while D's streams are loaded."""

from __future__ import annotations

import time

import pytest

from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.serve_gate import (
    CLOSE_AT,
    MAX_PREFILL_SHARE,
    MIN_OPEN_S,
    OPEN_AT,
    STALE_S,
    ServeGate,
    p_stream_itl,
    streams_itl,
)
from tests.unit.placement.fake_clock import Clock

TARGET_S = 0.05


def status(itl_s: float | None, port: int = 6302) -> DecodeStatus:
    return DecodeStatus("127.0.0.1", port, running_decodes=4, local_backlog_tokens=0, budget=512, chunk=512,
                        knows_prefill=True, stream_tokens=64.0, at=time.time(), now_itl_s=itl_s)


def own_load(queued: int) -> PrefillLoad:
    return PrefillLoad("127.0.0.1", 6301, queued_tokens=queued, per_token_s=0.001, overhead_s=0.02, budget=512,
                       at=time.time())


def gate() -> tuple[ServeGate, Clock]:
    clock = Clock()
    return ServeGate(TARGET_S, clock=clock), clock


def test_closed_until_d_reports_loaded_streams():
    g, _ = gate()
    assert not g.is_open() and not g.open  # nothing heard
    g.on_status(status(None))  # no stream finished yet: no measure
    assert not g.is_open()
    g.on_status(status(OPEN_AT * TARGET_S * 0.95))
    assert not g.is_open()
    g.on_status(status(OPEN_AT * TARGET_S))
    assert g.is_open() and g.open and g.openings == 1


def test_any_loaded_decode_instance_opens_it():
    g, _ = gate()
    g.on_status(status(0.001, port=6302))
    g.on_status(status(TARGET_S, port=6303))
    assert g.is_open()


def test_a_busy_p_does_not_open_it():
    g, _ = gate()
    g.on_own_load(own_load(513))  # more than one step of its budget queued: D's legs need P's time
    g.on_status(status(TARGET_S))
    assert not g.is_open()
    g.on_own_load(own_load(512))
    assert g.is_open()


def test_stays_open_min_open_s_then_closes_below_close_at():
    g, clock = gate()
    g.on_status(status(TARGET_S))
    assert g.is_open()
    g.on_status(status(CLOSE_AT * TARGET_S * 0.9))
    clock.now += MIN_OPEN_S - 0.1
    g.on_status(status(CLOSE_AT * TARGET_S * 0.9))
    assert g.is_open(), "no flapping: the router forgets a decode instance only seconds after its last beat"
    clock.now += 0.2
    g.on_status(status(CLOSE_AT * TARGET_S * 1.05))  # between the bounds: hysteresis keeps it open
    assert g.is_open()
    g.on_status(status(CLOSE_AT * TARGET_S * 0.9))
    assert not g.is_open() and not g.open


def test_a_silent_decode_instance_counts_as_idle():
    g, clock = gate()
    g.on_status(status(TARGET_S))
    assert g.is_open()
    clock.now += MIN_OPEN_S
    g.on_status(status(TARGET_S))  # still loaded
    assert g.is_open()
    clock.now += STALE_S - 0.1
    assert g.is_open()
    clock.now += 0.1  # then nothing: an idle D publishes nothing
    assert not g.is_open()


def test_the_itl_target_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        ServeGate(0.0)


def predicted(running: int, now: float | None = None) -> DecodeStatus:
    """D running `running` streams, its fitted step 15 ms + 2 ms a stream."""
    return DecodeStatus("127.0.0.1", 6302, running_decodes=running, local_backlog_tokens=0, budget=512,
                        chunk=512, knows_prefill=True, stream_tokens=512.0, at=time.time(),
                        overhead_s=0.015, per_token_s=0.0001, per_decode_s=0.002, now_itl_s=now)


def test_the_step_d_predicts_for_its_running_streams_opens_it_before_any_stream_finished():
    # OPEN_AT x 50 ms = 37.5 ms: 11 streams predict 37 ms, 12 streams 39 ms
    assert streams_itl(predicted(0)) is None and streams_itl(predicted(12)) == pytest.approx(0.039)
    assert streams_itl(predicted(10, now=0.045)) == pytest.approx(0.045)  # the larger of the two
    g, _ = gate()
    g.on_status(predicted(11))
    assert not g.is_open()
    g.on_status(predicted(12))
    assert g.is_open()


def test_streams_well_within_the_target_keep_it_shut():
    """On a 2-core Xeon a decode step is ~25 ms of fixed cost (27 ms with 4 streams, 35 ms with
    20): at 0.5 x the target P opened with D's fourth stream, saved D's streams a few ms and gave its
    own streams its chunk steps (decode-heavy gap50 attainment 0.59-0.76 against write's 1.00)."""
    assert OPEN_AT >= 0.75 and CLOSE_AT < OPEN_AT
    g, _ = gate()
    g.on_status(predicted(10))  # 35 ms: 0.7 x the target
    assert not g.is_open()


def test_p_opens_only_where_a_stream_it_took_would_advance_faster_than_ds():
    # D: 12 streams, 39 ms a token. P idle between short prompts (share 0.1): a stream there, 17 ms / 0.9
    load = lambda share, decodes: PrefillLoad("127.0.0.1", 6301, queued_tokens=0, per_token_s=0.001,  # noqa: E731
                                              overhead_s=0.02, budget=512, at=time.time(), prefill_share=share,
                                              decodes=decodes)
    assert p_stream_itl(load(0.1, 0), predicted(12)) == pytest.approx(0.017 / 0.9)
    g, _ = gate()
    g.on_own_load(load(0.1, 12))  # but P already runs 12 streams of its own: 41 ms / 0.9
    g.on_status(predicted(12))
    assert not g.is_open()
    g.on_own_load(load(0.3, 8))  # 8 streams, and prefill steps 30 % of the time: 33 ms / 0.7 = 47 ms
    assert not g.is_open()
    g.on_own_load(load(0.1, 8))  # 33 ms / 0.9 = 37 ms
    assert g.is_open()


def test_a_prefill_bound_p_keeps_its_time_for_ds_legs():
    load = lambda share: PrefillLoad("127.0.0.1", 6301, queued_tokens=0, per_token_s=0.001, overhead_s=0.02,  # noqa: E731
                                     budget=512, at=time.time(), prefill_share=share)
    g, clock = gate()
    g.on_own_load(load(MAX_PREFILL_SHARE + 0.01))
    g.on_status(status(TARGET_S))  # D's streams at the target, no costs known: only P's share objects
    assert not g.is_open()
    g.on_own_load(load(0.2))
    assert g.is_open()
    g.on_own_load(load(MAX_PREFILL_SHARE + 0.01))  # P's prompts came back: after MIN_OPEN_S it stops
    g.on_status(status(TARGET_S))
    assert g.is_open()
    clock.now += MIN_OPEN_S
    g.on_status(status(TARGET_S))
    assert not g.is_open()


def test_a_loaded_past_does_not_reopen_it_for_a_lightly_loaded_present():
    # D idled after a loaded spell: its lifetime mean still remembers the spell, its streams now do not
    g, clock = gate()
    g.on_status(status(TARGET_S))
    assert g.is_open()
    clock.now += MIN_OPEN_S + STALE_S
    assert not g.is_open()  # nothing heard: D idle
    light = DecodeStatus("127.0.0.1", 6302, running_decodes=1, local_backlog_tokens=0, budget=512, chunk=512,
                         knows_prefill=True, stream_tokens=512.0, at=time.time(), overhead_s=0.010,
                         per_token_s=0.0001, per_decode_s=0.002, recent_itl_s=TARGET_S, now_itl_s=0.012)
    assert streams_itl(light) == pytest.approx(0.012)
    g.on_status(light)
    assert not g.is_open()

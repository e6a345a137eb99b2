"""While P decodes streams of its own, the prompt goes to the side whose streams advance faster with it."""

from __future__ import annotations

import math

import pytest

from pdserve.placement.config import PlacementConfig
from pdserve.placement.decision import Placement, Reason
from pdserve.placement.messages import PrefillLoad
from pdserve.placement.policy import AdaptivePolicy, DecodeView, drain_seconds
from tests.unit.placement.samples import COSTS, NOW, policy


def serving(decodes: int, share: float = 0.0, queued: int = 0) -> PrefillLoad:
    """P serving whole requests too (serve_gate.py): `decodes` streams of its own."""
    return PrefillLoad("127.0.0.1", 6301, queued, 0.001, 0.005, 512, NOW, share, decodes)


def streaming(running: int, now_itl_ms: float | None = None) -> DecodeView:
    return DecodeView(running, 0, 0, 576, COSTS, True, None, 512, 512, None,
                      None if now_itl_ms is None else now_itl_ms / 1000)


def test_while_p_decodes_too_the_prompt_goes_to_the_lighter_side():
    # P idle of prompts but decoding 10 streams: prefill_idle no longer applies. D's 4 streams
    # (14 ms a step) advance faster than P's 10 (20 ms): D prefills it itself
    decision = policy().decide(128, streaming(4), serving(10))
    assert (decision.placement, decision.reason) == (Placement.LOCAL, Reason.BALANCE)
    # D's streams the slower ones (measured over the last seconds): P takes the prompt
    decision = policy().decide(128, streaming(4, now_itl_ms=40), serving(10))
    assert (decision.placement, decision.reason) == (Placement.REMOTE, Reason.BALANCE)
    # P's prefill steps stretch its streams: 20 ms / (1 - 0.6) = 50 ms > D's 40
    assert policy().decide(128, streaming(4, now_itl_ms=40), serving(10, share=0.6)).placement is Placement.LOCAL
    # with P decoding nothing the old rules hold: an idle P takes it
    assert policy().decide(128, streaming(4), serving(0)).reason is Reason.PREFILL_IDLE


def test_balance_keeps_the_step_guard_and_the_declared_ttft_bound():
    # no chunk of prefill fits beside D's streams within max_step_ms: remote, whatever the balance
    decision = policy(max_step_ms=20).decide(128, streaming(12), serving(20))
    assert (decision.placement, decision.reason) == (Placement.REMOTE, Reason.STEP_GUARD)
    # the lighter side (D) would miss a 300 ms TTFT bound behind its backlog where P meets it
    bound = AdaptivePolicy(PlacementConfig("adaptive", ttft_target_ms=300.0), clock=lambda: NOW)
    backlogged = DecodeView(2, 2000, 0, 576, COSTS, True, None, 512, 512)
    decision = bound.decide(64, backlogged, serving(10))
    assert decision.placement is Placement.REMOTE and decision.reason is Reason.REMOTE_FASTER
    assert decision.ttft_remote_s <= 0.3 < decision.ttft_local_s
    # the remote estimate counts P's own streams in each of its steps
    assert decision.ttft_remote_s == pytest.approx(drain_seconds(serving(10), 64) + 0.020 + 0.010)


def test_while_p_decodes_too_a_local_step_may_run_longer():
    # a 500 ms TTFT bound: steps of 0.15 x 500 = 75 ms alone, twice that while P decodes too
    declared = AdaptivePolicy(PlacementConfig("adaptive", ttft_target_ms=500.0, max_step_ms=math.inf), clock=lambda: NOW)
    alone, beside = declared.chunk(streaming(10), COSTS), declared.chunk(streaming(10), COSTS, serving(6))
    assert alone == int(0.8 * 0.075 / 0.001) - 20 and beside == int(0.8 * 0.150 / 0.001) - 20
    assert declared.chunk(streaming(10), COSTS, serving(0)) == alone

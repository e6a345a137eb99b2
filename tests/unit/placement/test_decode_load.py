"""DecodeLoad: D's bookkeeping of its remote prompts, its local prompts, its streams' ITL and its chunk steps."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from pdserve.control.address import PeerAddress
from pdserve.placement.chunk_headroom import MIN_SAMPLES as HEADROOM_SAMPLES
from pdserve.placement.chunk_headroom import TARGET
from pdserve.placement.chunk_size import STEP_HEADROOM
from pdserve.placement.config import PlacementConfig
from pdserve.placement.decode_load import NOW_SPAN_S, DecodeLoad
from pdserve.placement.policy import AdaptivePolicy
from pdserve.placement.remote_path import MIN_SAMPLES
from tests.unit.placement.samples import NOW, load


def test_decode_load_measures_the_remote_path_of_the_prompts_it_sends():
    clock = [50.0]
    decode_load = DecodeLoad(576, chunk=512, clock=lambda: clock[0])
    peer = PeerAddress("127.0.0.1", 6301, 6302)
    decode_load.add_remote("no-estimate", peer, 512, "tx-x")  # no estimate, no sample
    for i in range(MIN_SAMPLES):
        decode_load.add_remote(f"r{i}", peer, 512, f"tx-{i}", compute_s=0.160)
        clock[0] += 0.200
        decode_load.landed(f"r{i}")
        decode_load.landed("no-estimate")
        clock[0] += 0.030
        decode_load.remote_path.step_ended()
    assert decode_load.view(peer).remote_path_s == pytest.approx(0.070)
    decode_load.add_remote("gone", peer, 512, "tx-g", compute_s=0.0)
    decode_load.forget("gone")
    decode_load.landed("gone")
    assert decode_load.remote_path.step_ended() == []


def test_d_adds_to_p_s_aged_queue_only_the_prompts_no_load_of_p_s_counted():
    """A P most of the way through a prompt D sent it is not a whole prompt behind: once P's load
    named that prompt, P's published queue, aged, is what is left of it."""
    decode_load = DecodeLoad(64)
    peer = PeerAddress("127.0.0.1", 6301, 6401)
    decode_load.add_remote("a", peer, 512, "ta")
    decode_load.add_remote("elsewhere", PeerAddress("127.0.0.1", 7301, 7401), 100, "tx")
    assert decode_load.view(peer).remote_outstanding_tokens == 512  # P has not named it: all of it
    # P's load at the start of the step computing "a" names it; a second prompt arrives after
    decode_load.on_loads({("127.0.0.1", 6301): dataclasses.replace(load(512, at=NOW), counted_transfers=["ta"])})
    decode_load.add_remote("b", peer, 300, "tb")
    assert decode_load.view(peer).remote_outstanding_tokens == 300
    # 0.4 s into "a" (a 5-ms step and 1 ms a token: 0.517 s): 116 of its tokens left, then "b"
    at_04 = AdaptivePolicy(PlacementConfig("adaptive"), clock=lambda: NOW + 0.4)
    assert at_04._queued(decode_load.view(peer), decode_load.load_of(peer)) == math.ceil(512 * 0.117 / 0.517) + 300
    at_06 = AdaptivePolicy(PlacementConfig("adaptive"), clock=lambda: NOW + 0.6)
    assert at_06._queued(decode_load.view(peer), decode_load.load_of(peer)) == 300  # "a" is done by now
    # a load of another P names nothing of this one's
    decode_load.on_loads({("127.0.0.1", 7301): dataclasses.replace(load(0), counted_transfers=["tb"])})
    assert decode_load.view(peer).remote_outstanding_tokens == 300
    decode_load.landed("b")
    assert decode_load.view(peer).remote_outstanding_tokens == 0
    assert decode_load.view(PeerAddress("127.0.0.1", 7301, 7401)).remote_outstanding_tokens == 100


def test_decode_load_measures_its_streams_mean_itl_over_one_stream_life():
    now = [0.0]
    decode_load = DecodeLoad(64, itl_target_s=0.05, clock=lambda: now[0])
    peer = PeerAddress("127.0.0.1", 6301, 6302)
    decode_load.on_step(0.020, 4)
    assert decode_load.recent_itl() is None  # no stream finished: its life is unknown (0 s)
    decode_load.on_finished(0)  # an abort before the first token teaches nothing
    assert decode_load.view(peer).stream_tokens == 0
    decode_load.on_finished(40)  # a 40-token stream lives 2 s at the target
    assert decode_load.recent_itl() == pytest.approx(0.020)
    now[0] = 1.5
    decode_load.on_step(0.100, 1)  # a chunk step: one stream waited 100 ms for its token
    decode_load.on_step(0.500, 0)  # a step without decodes gives no stream a token
    assert decode_load.recent_itl() == pytest.approx((4 * 0.020 + 0.100) / 5)
    now[0] = 2.4
    assert decode_load.recent_itl() == pytest.approx(0.100)
    decode_load.on_finished(240)  # the mean length moves by STREAM_WEIGHT of the difference: 40 + 0.05 x 200 = 50
    seen = decode_load.view(peer)
    assert seen.stream_tokens == 50.0 and seen.recent_itl_s == pytest.approx(0.036)
    now[0] = 10.0
    assert decode_load.recent_itl() is None


def test_decode_load_measures_its_streams_mean_itl_over_the_last_seconds():
    now = [0.0]
    decode_load = DecodeLoad(64, itl_target_s=0.05, clock=lambda: now[0])
    assert decode_load.now_itl() is None  # no token yet
    decode_load.on_step(0.040, 8)  # a loaded spell
    decode_load.on_finished(512)  # its streams live ~25 s at the target
    now[0] = NOW_SPAN_S + 5.0
    decode_load.on_step(0.010, 1)  # one light stream after an idle spell
    assert decode_load.now_itl() == pytest.approx(0.010)
    assert decode_load.recent_itl() == pytest.approx((8 * 0.040 + 0.010) / 9)  # the lifetime mean remembers
    assert decode_load.view(None).now_itl_s == pytest.approx(0.010)
    now[0] += NOW_SPAN_S
    assert decode_load.now_itl() is None


def test_decode_load_counts_the_next_steps_streams_and_measures_a_chunks_token_cost():
    decode_load = DecodeLoad(576, chunk=512)
    local = SimpleNamespace(request_id="l", num_prompt_tokens=512, num_computed_tokens=64)
    decode_load.add_local(local)
    # a landed request computes its last prompt tokens, then decodes: a stream; the local prompt is not
    assert decode_load.streams_after({"a": 1, "landed": 7, "l": 64}) == 2
    local.num_computed_tokens = 512  # its prompt done, it decodes from the next step on
    assert decode_load.streams_after({"a": 1, "l": 64}) == 2
    # before the step costs are fitted a chunk teaches nothing
    decode_load.on_step(0.100, 2, 64)
    assert decode_load.view(None).prefill_token_s is None
    for _ in range(10):  # decode steps: 10 ms + 1 ms a stream
        for decodes in (1, 3):
            decode_load.costs.observe(0.010 + 0.001 * decodes, 0, decodes)
    decode_load.on_step(0.010 + 0.002 + 64 * 0.002, 2, 64)  # 64 prompt tokens added 128 ms
    first = decode_load.view(None).prefill_token_s
    assert first == pytest.approx(0.002, rel=0.05)  # the fit's decode share is close to 12 ms, not exact
    decode_load.on_step(0.010 + 0.002 + 64 * 0.002 + 0.064, 2, 64)  # 1 ms a token slower: moves by 0.2
    assert decode_load.view(None).prefill_token_s == pytest.approx(first + 0.2 * 0.001)
    decode_load.on_step(0.5, 2, 8)  # a landed request's last few tokens are no chunk
    assert decode_load.view(None).prefill_token_s == pytest.approx(first + 0.2 * 0.001)


def test_decode_load_plans_chunk_steps_by_how_far_its_chunk_steps_ran_from_the_prediction():
    decode_load = DecodeLoad(576, chunk=512)
    for _ in range(10):  # decode steps: 10 ms + 1 ms a stream
        for decodes in (1, 3):
            decode_load.costs.observe(0.010 + 0.001 * decodes, 0, decodes)
    assert decode_load.view(None).chunk_headroom == STEP_HEADROOM
    decode_load.on_step(0.012 + 64 * 0.001, 2, 64)  # the first chunk measures a token at ~1 ms
    for _ in range(HEADROOM_SAMPLES):  # then every chunk step runs 1.3 x what that measure predicts
        decode_load.on_step(1.3 * (0.012 + 64 * decode_load.view(None).prefill_token_s), 2, 64)
    assert decode_load.view(None).chunk_headroom < STEP_HEADROOM
    assert decode_load.view(None).chunk_headroom == pytest.approx(TARGET / 1.3, rel=0.1)

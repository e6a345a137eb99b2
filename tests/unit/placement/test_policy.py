"""AdaptivePolicy's decisions: where a prompt is prefilled, and why, from D's view and P's load."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.placement.config import PlacementConfig, parse_placement
from pdserve.placement.decision import Placement, Reason
from pdserve.placement.policy import AdaptivePolicy, DecodeView, StaticPolicy, drain_seconds
from pdserve.placement.step_costs import Coefficients
from tests.unit.placement.samples import COSTS, NOW, load, policy, view


def test_static_policy_always_disaggregates():
    decision = StaticPolicy().decide(5, view(), load(0))
    assert (decision.placement, decision.reason) == (Placement.REMOTE, Reason.STATIC)


def test_without_costs_it_disaggregates_while_warming_up():
    assert policy().decide(512, view(costs=None), load(0)).reason is Reason.WARMING_UP
    assert policy().decide(512, view(knows_prefill=False), None).reason is Reason.WARMING_UP


def test_an_idle_prefill_instance_takes_every_prompt():
    # with nothing queued on P the prompt goes there at once, even where D's estimate is lower:
    # D stays free to decide the next request and to give landed requests their first token
    for tokens in (16, 512):
        decision = policy().decide(tokens, view(), load(0))
        assert (decision.placement, decision.reason) == (Placement.REMOTE, Reason.PREFILL_IDLE)
    # what D sent P and has not landed counts as queued, and a queue sends a long prompt local
    assert policy().decide(16, view(outstanding=512), load(0)).reason is not Reason.PREFILL_IDLE
    assert policy().decide(512, view(), load(4096)).placement is Placement.LOCAL


def test_a_short_queue_on_p_keeps_a_long_prompt_remote():
    decision = policy().decide(512, view(), load(16))
    assert decision.placement is Placement.REMOTE and decision.reason is Reason.REMOTE_FASTER
    assert decision.ttft_remote_s == pytest.approx(drain_seconds(load(16), 528) + 0.020)
    assert decision.ttft_local_s > decision.ttft_remote_s


def test_the_remote_estimate_takes_the_path_d_measured_unless_the_deployment_sets_one():
    measured = dataclasses.replace(view(), remote_path_s=0.300)
    decision = policy().decide(512, measured, load(16))
    compute = drain_seconds(load(16), 528)
    assert decision.compute_s == pytest.approx(compute)
    assert decision.ttft_remote_s == pytest.approx(compute + 0.300)
    # a path that long makes D's own prefill the faster one where the default 20 ms did not
    assert policy().decide(512, view(), load(16)).placement is Placement.REMOTE
    assert decision.placement is Placement.LOCAL and decision.reason is Reason.LOCAL_FASTER
    # a configured transfer_overhead_ms is used as it is, measured path or not
    fixed = AdaptivePolicy(PlacementConfig("adaptive", itl_target_ms=1000, max_step_ms=1000, transfer_overhead_ms=5),
                           clock=lambda: NOW)
    assert fixed.decide(512, measured, load(16)).ttft_remote_s == pytest.approx(compute + 0.005)
    # a prompt sent to an idle P carries its estimate too: D learns the path from those as well
    idle = policy().decide(512, measured, load(0))
    assert idle.reason is Reason.PREFILL_IDLE and idle.compute_s == pytest.approx(drain_seconds(load(0), 512))
    assert idle.ttft_remote_s == pytest.approx(idle.compute_s + 0.300)


def test_a_long_prefill_queue_sends_the_prompt_local():
    decision = policy().decide(512, view(), load(4096))
    assert decision.placement is Placement.LOCAL and decision.reason is Reason.LOCAL_FASTER
    assert decision.ttft_local_s < decision.ttft_remote_s


def chunked(running: int, backlog: int = 0) -> DecodeView:
    """D as adaptive launches it: a budget of 576, at most 512 tokens of local prefill a step."""
    return DecodeView(running, backlog, 0, 576, COSTS, True, None, 64, 512)


def test_the_chunk_follows_the_running_streams():
    # 10 decodes take 10 + 10 = 20 ms: a step sized to 0.8 x 75 = 60 ms leaves 40 ms, 40 tokens
    decision = policy(max_step_ms=75).decide(512, chunked(running=10), load(4096))
    assert decision.placement is Placement.LOCAL
    assert decision.ttft_local_s == pytest.approx(13 * 0.060)  # ceil(512 / 40) steps of 60 ms
    # with nothing decoding there is no stream to protect, but a step still answers within the
    # response bound, 0.15 x the 1 s TTFT bound: 0.8 x 150 = 120 ms, 110 tokens a step
    idle = policy(max_step_ms=75).decide(512, chunked(running=0), load(4096))
    assert idle.ttft_local_s == pytest.approx(5 * 0.120)
    # a declared TTFT bound sets the response bound: 0.15 x 2 s = 300 ms, 0.8 x 300 = 240 ms, 230 tokens
    loose = AdaptivePolicy(PlacementConfig("adaptive", max_step_ms=75, ttft_target_ms=2000), clock=lambda: NOW)
    assert loose.decide(512, chunked(running=0), load(40960)).ttft_local_s == pytest.approx(3 * 0.240)
    # behind a local backlog the prompts share the chunk: ceil(612 / 40) steps
    behind = policy(max_step_ms=75).decide(512, chunked(running=10, backlog=100), load(40960))
    assert behind.ttft_local_s == pytest.approx(16 * 0.060)


def test_the_step_guard_keeps_d_remote_when_no_chunk_fits():
    # a step sized to 0.8 x 37.5 = 30 ms leaves 10 ms: 10 tokens, below one 16-token block
    decision = policy(max_step_ms=37.5).decide(512, chunked(running=10), load(4096))
    assert decision.placement is Placement.REMOTE and decision.reason is Reason.STEP_GUARD
    assert policy(max_step_ms=45).decide(512, chunked(running=10), load(4096)).placement is Placement.LOCAL
    # the budget caps the chunk too: 64 - 10 decodes leaves 54 tokens whatever the step bound
    small = policy().decide(512, view(running=10), load(4096))
    assert small.ttft_local_s == pytest.approx(10 * (0.010 + 0.054 + 0.010))


def test_the_itl_guard_bounds_the_streams_mean_itl():
    # a 512-token prompt at 1 ms a token adds 512 / 64 = 8 ms to a 64-token stream's mean ITL;
    # the streams may reach 0.9 x 50 = 45 ms
    chunky = policy(itl_target_ms=50)  # one 74 ms chunk step is allowed (max_step 1 s): only the mean counts
    assert chunky.decide(512, view(running=10, itl_ms=37), load(4096)).placement is Placement.LOCAL
    decision = chunky.decide(512, view(running=10, itl_ms=38), load(4096))
    assert decision.placement is Placement.REMOTE and decision.reason is Reason.ITL_GUARD
    # D's local backlog counts too; shorter streams share the delay over fewer tokens
    assert chunky.decide(512, view(running=10, itl_ms=30, backlog=512), load(40960)).reason is Reason.ITL_GUARD
    assert chunky.decide(512, view(running=10, itl_ms=30, stream_tokens=16), load(4096)).reason is Reason.ITL_GUARD
    # not measured yet: the step-cost model's decode step (10 + 11 ms) stands in for it
    assert chunky.decide(512, view(running=10), load(4096)).placement is Placement.LOCAL
    assert policy(itl_target_ms=30).decide(512, view(running=10), load(4096)).reason is Reason.ITL_GUARD
    # until a stream has finished its length is unknown: nothing local while D decodes
    assert chunky.decide(512, view(running=10, itl_ms=20, stream_tokens=0), load(4096)).reason is Reason.ITL_GUARD
    assert chunky.decide(512, view(running=0, stream_tokens=0), load(4096)).placement is Placement.LOCAL


def test_where_p_would_miss_the_declared_ttft_the_itl_guard_spends_its_headroom():
    declared = AdaptivePolicy(PlacementConfig("adaptive", itl_target_ms=50, max_step_ms=math.inf,
                                              ttft_target_ms=1000), clock=lambda: NOW)
    # 38 + 8 = 46 ms is past 0.9 x 50 but within 50: P (~4.6 s) misses 1 s, D (0.74 s) meets it
    rescued = declared.decide(512, view(running=10, itl_ms=38), load(4096))
    assert (rescued.placement, rescued.reason) == (Placement.LOCAL, Reason.TTFT_RESCUE)
    assert rescued.ttft_local_s <= 1.0 < rescued.ttft_remote_s
    # never past the target itself
    assert declared.decide(512, view(running=10, itl_ms=43), load(4096)).reason is Reason.ITL_GUARD
    # where P meets the bound (~0.84 s) the guard keeps its headroom
    kept = declared.decide(512, view(running=10, itl_ms=38), load(300))
    assert kept.reason is Reason.ITL_GUARD and kept.ttft_remote_s <= 1.0
    # without a declared TTFT bound there is nothing to rescue
    assert policy(itl_target_ms=50).decide(512, view(running=10, itl_ms=38), load(4096)).reason is Reason.ITL_GUARD


def test_a_published_queue_ages_and_d_counts_what_it_sent():
    stale = load(4096, at=NOW - 10)  # drained 10 s ago at 1 ms/token
    assert policy().decide(512, view(), stale).placement is Placement.REMOTE
    assert policy().decide(512, view(outstanding=4096), stale).placement is Placement.LOCAL


def test_a_prompt_over_max_local_tokens_is_always_disaggregated():
    capped = AdaptivePolicy(PlacementConfig("adaptive", itl_target_ms=1000, max_local_tokens=256), clock=lambda: NOW)
    assert capped.decide(257, view(), load(100_000)).reason is Reason.LONG_PROMPT
    assert capped.decide(256, view(), load(100_000)).placement is Placement.LOCAL
    assert parse_placement({"max_local_tokens": 1000}).max_local_tokens == 1000


def test_d_local_backlog_counts_against_local():
    assert policy().decide(64, view(), load(200)).placement is Placement.LOCAL
    assert policy().decide(64, view(backlog=2000), load(200)).placement is Placement.REMOTE


def test_until_d_prefilled_itself_it_assumes_p_per_token_cost():
    slow_p = load(16, per_token_s=0.01)
    d_unknown = view(costs=Coefficients(0.010, 0.0, 0.001), knows_prefill=False)
    decision = policy().decide(64, d_unknown, slow_p)
    # at 10 ms a token the 150 ms response bound leaves one 16-token block a step: 4 steps
    assert decision.ttft_local_s == pytest.approx(4 * (0.010 + 16 * 0.01))


def test_a_measured_chunk_token_cost_sizes_the_chunk():
    measured = DecodeView(10, 0, 0, 576, COSTS, True, None, 64, 512, prefill_token_s=0.002)
    # 0.8 x 75 ms less 20 ms of decodes leaves 40 ms: 20 tokens at the measured 2 ms, not 40 at the fit's 1 ms
    assert policy(max_step_ms=75).chunk(measured, policy().local_costs(measured, load(0))) == 20
    # never cheaper than on P
    cheap = DecodeView(**{**measured.__dict__, "prefill_token_s": 0.0001})
    assert policy().local_costs(cheap, load(0)).per_prefill_token_s == 0.001


def test_under_a_mean_itl_slo_only_the_response_bound_limits_d_steps_beside_its_streams():
    # 20 streams: 30 ms a step; a step bound of 50 ms leaves no room for a chunk; with none, the
    # response bound (0.15 x 5 s: 0.8 x 750 = 600 ms a step) leaves the whole budget
    config = parse_placement({"placement": "adaptive", "slo": "ttft<5000,mean_itl<1000"})
    unbounded = AdaptivePolicy(config, clock=lambda: NOW)
    busy = view(running=20, budget=512, itl_ms=30)
    assert unbounded.chunk(busy, COSTS) == 492  # the budget less the decodes' tokens
    # with ttft<500 it is 0.8 x 75 = 60 ms a step: 30 tokens beside the 30 ms of decodes
    short = AdaptivePolicy(parse_placement({"placement": "adaptive", "slo": "ttft<500,mean_itl<1000"}), clock=lambda: NOW)
    assert short.chunk(busy, COSTS) == 30
    assert policy(max_step_ms=50).decide(512, busy, load(4096)).reason is Reason.STEP_GUARD
    decision = unbounded.decide(512, busy, load(4096))
    assert decision.placement is Placement.LOCAL and decision.ttft_local_s < decision.ttft_remote_s
    # the mean ITL still bounds it: 30 ms now, + 512 x 1 ms over 64 tokens = 38 ms > 0.9 x 40 ms
    tight = AdaptivePolicy(parse_placement({"placement": "adaptive", "slo": "ttft<500,mean_itl<40"}), clock=lambda: NOW)
    assert tight.decide(512, busy, load(4096)).reason is Reason.ITL_GUARD


def test_a_step_with_first_tokens_of_landed_requests_is_a_streams_step():
    blog = parse_placement({"placement": "adaptive", "slo": "ttft<1000,mean_itl<50"})
    assert blog.landing_step_s == 0.05 and blog.response_step_s == 0.15
    assert parse_placement({"placement": "adaptive", "slo": "ttft<1000,max_gap<30"}).landing_step_s == 0.03
    assert parse_placement({"placement": "adaptive", "slo": "ttft<1000"}).landing_step_s == 0.05  # the default target
    assert parse_placement({"placement": "adaptive", "max_step_ms": 80}).landing_step_s == 0.05
    declared = AdaptivePolicy(blog, clock=lambda: NOW)
    idle = view(running=0, budget=512)
    # nothing decodes: the response bound, 0.8 x 150 ms less the 10 ms overhead at 1 ms a token
    assert declared.chunk(idle, COSTS) == 110
    # two landed requests take their first token: 0.8 x 50 ms less the 12 ms step of two streams
    assert declared.chunk(idle, COSTS, landed=2) == 28
    assert declared.step_bound(2, None, landed=True) == 0.05 and declared.step_bound(2, None) == 0.15
    # under a max-gap bound a stream's step already bounds the chunk: landing changes nothing
    gap = AdaptivePolicy(parse_placement({"placement": "adaptive", "max_step_ms": 50}), clock=lambda: NOW)
    busy = view(running=3, budget=512)
    assert gap.chunk(busy, COSTS, landed=1) == gap.chunk(view(running=4, budget=512), COSTS)


def test_a_declared_ttft_bound_keeps_prompts_p_serves_in_time_on_p():
    slo = parse_placement({"placement": "adaptive", "slo": "ttft<1000,mean_itl<1000"})
    assert slo.ttft_target_ms == 1000.0 and parse_placement({"placement": "adaptive"}).ttft_target_ms == math.inf
    declared = AdaptivePolicy(slo, clock=lambda: NOW)
    busy = view(running=2, budget=1024, itl_ms=20)  # D would prefill it in one 0.52 s step
    # P has 256 tokens queued: remote 0.78 s is within 0.8 x 1 s, so it goes there though D would be faster
    decision = declared.decide(512, busy, load(256))
    assert (decision.placement, decision.reason) == (Placement.REMOTE, Reason.WITHIN_TTFT)
    assert decision.ttft_local_s < decision.ttft_remote_s <= 0.8
    # without a declared TTFT bound the faster side takes it
    assert policy().decide(512, busy, load(256)).placement is Placement.LOCAL
    # P's queue past the bound: D takes it, its streams' ITL permitting
    assert declared.decide(512, busy, load(2048)).reason is Reason.LOCAL_FASTER

"""Per-request placement: the policy's decisions, the step-cost fit, P's gate, the worker's inbox."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from pdserve.config import parse_connector_config
from pdserve.connector.metadata import AwaitSpec
from pdserve.connector.placement import (AdaptivePolicy, DecodeView, Placement, PlacementConfig, Reason,
                                         StaticPolicy, drain_seconds, parse_placement)
from pdserve.connector.placement_inbox import PUBLISH_EVERY_S, PlacementInbox
from pdserve.connector.prefill_gate import PrefillGate, Verdict
from pdserve.connector.step_costs import REFIT_EVERY, Coefficients, StepCosts
from pdserve.control.address import PeerAddress
from pdserve.control.messages import PrefillLoad
from pdserve.errors import ConfigError, ProtocolError

NOW = 1000.0
COSTS = Coefficients(overhead_s=0.010, per_prefill_token_s=0.001, per_decode_s=0.001)  # AMD-like: 1 ms/token


def load(queued: int, at: float = NOW, per_token_s: float = 0.001) -> PrefillLoad:
    return PrefillLoad("127.0.0.1", 6301, queued, per_token_s, 0.005, 512, at)


def view(running: int = 0, backlog: int = 0, outstanding: int = 0, budget: int = 64, costs=COSTS,
         knows_prefill: bool = True, itl_ms: float | None = None, stream_tokens: float = 64) -> DecodeView:
    return DecodeView(running, backlog, outstanding, budget, costs, knows_prefill,
                      None if itl_ms is None else itl_ms / 1000, stream_tokens)


def policy(itl_target_ms: float = 1000.0, max_step_ms: float = 1000.0, eager: bool = False) -> AdaptivePolicy:
    return AdaptivePolicy(PlacementConfig("adaptive", itl_target_ms=itl_target_ms, max_step_ms=max_step_ms,
                                          eager=eager), clock=lambda: NOW)


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
    assert policy(eager=True).decide(16, view(), load(0)).reason is Reason.PREFILL_IDLE
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


def test_decode_load_measures_the_remote_path_of_the_prompts_it_sends():
    from pdserve.connector.decode_load import DecodeLoad
    from pdserve.connector.remote_path import MIN_SAMPLES
    clock = [50.0]
    decode_load = DecodeLoad(576, chunk=512, clock=lambda: clock[0])
    peer = PeerAddress("127.0.0.1", 6301, 6302)
    decode_load.add_remote("no-estimate", peer, 512, "tx-x")  # eager: no estimate, no sample
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


def test_step_costs_fit_a_linear_model():
    costs = StepCosts()
    assert costs.coefficients() is None
    for tokens, decodes in [(0, 4), (64, 2), (128, 0), (0, 10), (32, 8), (256, 1), (0, 1), (16, 16), (100, 3)] * 3:
        costs.observe(0.008 + 0.0005 * tokens + 0.002 * decodes, tokens, decodes)
    fit = costs.coefficients()
    assert costs.knows_prefill
    assert fit.overhead_s == pytest.approx(0.008, rel=0.05)
    assert fit.per_prefill_token_s == pytest.approx(0.0005, rel=0.05)
    assert fit.per_decode_s == pytest.approx(0.002, rel=0.05)
    for _ in range(5):  # a few steps that compiled a kernel or lost the core do not move the fit
        costs.observe(4.0, 64, 2)
    assert costs.coefficients().per_prefill_token_s == pytest.approx(0.0005, rel=0.05)
    fit = costs.coefficients()
    costs.observe(-1, 5, 5)  # nonsense and empty steps teach nothing
    costs.observe(0.1, 0, 0)
    assert costs.coefficients() == fit


def test_step_costs_refit_after_a_prefill_step_or_every_few_decode_steps():
    costs = StepCosts()
    for _ in range(16):
        costs.observe(0.030, 0, 4)
    fit = costs.coefficients()
    for _ in range(REFIT_EVERY - 1):  # decode-only steps: the fit waits for a few of them
        costs.observe(0.010, 0, 4)
    assert costs.coefficients() is fit
    costs.observe(0.010, 0, 4)
    faster = costs.coefficients()
    assert faster.step_seconds(0, 4) < fit.step_seconds(0, 4)
    costs.observe(0.010 + 64 * 0.001, 64, 4)  # a step with prefill tokens is refitted at once
    assert costs.coefficients() is not faster
    for tokens in (16, 32, 128, 256):
        before = costs.coefficients()
        costs.observe(0.010 + tokens * 0.001, tokens, 4)
        assert costs.coefficients() is not before
    assert costs.coefficients().per_prefill_token_s == pytest.approx(0.001, rel=0.2)


def test_prefill_gate_waits_then_follows_d_or_times_out():
    clock = [0.0]
    gate = PrefillGate(1.0, clock=lambda: clock[0])
    assert gate.verdict("a") is Verdict.ASK
    assert gate.verdict("a") is Verdict.WAIT
    gate.on_decisions({"a": False, "stranger": True})
    assert gate.verdict("a") is Verdict.DROP and gate.dropped("a")
    gate.on_decisions({"a": True})  # the first word is final
    assert gate.verdict("a") is Verdict.DROP
    assert gate.verdict("b") is Verdict.ASK
    clock[0] = 1.5
    assert gate.verdict("b") is Verdict.PREFILL and gate.num_timed_out == 1
    gate.on_decisions({"b": False})  # too late: it is being prefilled
    assert gate.verdict("b") is Verdict.PREFILL
    gate.forget("a")
    gate.forget("b")
    assert len(gate) == 0


def test_placement_inbox_reports_decisions_once():
    inbox = PlacementInbox(expiry_s=60)
    peer = PeerAddress("127.0.0.1", 1, 2)
    inbox.expect(AwaitSpec("r1", "t1", peer), None)
    inbox.expect(AwaitSpec("r2", "t2", peer), False)  # D's Release came first
    inbox.decided("t1", True)
    inbox.decided("t9", True)  # not awaited: nothing to report
    inbox.on_load(load(7))
    news = inbox.take()
    assert news.decided == {"r1": True, "r2": False}
    assert news.loads[("127.0.0.1", 6301)].queued_tokens == 7
    assert inbox.take() is None


def test_p_publishes_a_changed_queue_at_once_and_an_unchanged_one_at_most_every_period():
    inbox = PlacementInbox(expiry_s=60)
    assert inbox.publish_due((0, (), 0))
    assert not inbox.publish_due((0, (), 0))  # the same within the period: once is enough
    assert inbox.publish_due((512, ("t1",), 0))  # a new prompt in the queue: D must hear it now
    assert not inbox.publish_due((512, ("t1",), 0))
    time.sleep(PUBLISH_EVERY_S * 1.5)
    assert inbox.publish_due((512, ("t1",), 0))  # the period passed: again, as a heartbeat


def test_d_adds_to_p_s_aged_queue_only_the_prompts_no_load_of_p_s_counted():
    """A P most of the way through a prompt D sent it is not a whole prompt behind: once P's load
    named that prompt, P's published queue, aged, is what is left of it."""
    from pdserve.connector.decode_load import DecodeLoad
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


def test_prefill_load_names_a_bounded_number_of_transfers():
    PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=["t"] * 64).validate()
    with pytest.raises(ProtocolError, match="counted transfers"):
        PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=["t"] * 65).validate()
    with pytest.raises(ProtocolError, match="counted_transfers"):
        PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=[""]).validate()


def test_placement_config_is_parsed_once_with_clear_errors():
    assert parse_placement({}).policy == "static"
    cfg = parse_placement({"placement": "adaptive", "placement_wait": "0.5", "itl_target_ms": 80, "max_step_ms": 120})
    assert (cfg.adaptive, cfg.wait_s, cfg.itl_target_ms, cfg.max_step_ms) == (True, 0.5, 80.0, 120.0)
    assert parse_placement({}).max_step_ms == 50.0
    assert parse_placement({}).transfer_overhead_ms is None  # D measures the path (remote_path.py)
    assert parse_placement({"transfer_overhead_ms": 0}).transfer_overhead_ms == 0.0
    with pytest.raises(ConfigError, match="max_step_ms out of range"):
        parse_placement({"max_step_ms": -5})
    with pytest.raises(ConfigError, match="placement must be one of static, adaptive"):
        parse_placement({"placement": "smart"})
    with pytest.raises(ConfigError, match="itl_target_ms must be a number"):
        parse_placement({"itl_target_ms": "fast"})
    with pytest.raises(ConfigError, match="placement_wait out of range"):
        parse_placement({"placement_wait": 0})
    assert not parse_placement({"placement": "adaptive"}).eager
    assert parse_placement({"placement": "adaptive", "eager_prefill": True}).eager
    with pytest.raises(ConfigError, match="eager_prefill needs placement adaptive"):
        parse_placement({"eager_prefill": True})
    with pytest.raises(ConfigError, match="eager_prefill must be true or false, got 'yes'"):
        parse_placement({"eager_prefill": "yes"})
    read = parse_connector_config("kv_consumer", {"secret_file": "x", "placement": "adaptive", "read_mode": True})
    assert read.placement.adaptive and read.mode.value == "READ"
    for flag in ("serve_decode", "eager_prefill"):
        with pytest.raises(ConfigError, match="WRITE-mode placement options"):
            parse_connector_config("kv_producer", {"secret_file": "x", "placement": "adaptive", "read_mode": True,
                                                   flag: True})


def test_started_legs_expire_and_stay_bounded():
    from pdserve.connector import eager_prefill
    now = [0.0]
    started = eager_prefill.StartedLegs(2.0, clock=lambda: now[0])
    started.add({"a"})
    now[0] = 1.0
    started.add({"b"})
    assert "a" in started and "b" in started
    now[0] = 2.5  # a's leg never asked: it is no longer taken as started, and is dropped on the next add
    assert "a" not in started and "b" in started
    started.add(set())
    assert len(started) == 1
    started.forget("b")
    assert "b" not in started
    started.add({f"t{i}" for i in range(eager_prefill.MAX_STARTED + 10)})
    assert len(started) == eager_prefill.MAX_STARTED


def test_prefill_load_message_is_validated():
    from pdserve.errors import ProtocolError
    with pytest.raises(ProtocolError, match="per_token_s"):
        PrefillLoad("h", 1, 0, float("nan"), 0.0, 512, NOW).validate()
    with pytest.raises(ProtocolError, match="queued_tokens"):
        PrefillLoad("h", 1, -1, 0.001, 0.0, 512, NOW).validate()


def test_decode_load_measures_its_streams_mean_itl_over_one_stream_life():
    from pdserve.connector.decode_load import DecodeLoad
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
    from pdserve.connector.decode_load import NOW_SPAN_S, DecodeLoad
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
    from types import SimpleNamespace

    from pdserve.connector.decode_load import DecodeLoad
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
    from pdserve.connector.chunk_headroom import MIN_SAMPLES, TARGET
    from pdserve.connector.decode_load import DecodeLoad
    from pdserve.connector.local_chunk import STEP_HEADROOM
    decode_load = DecodeLoad(576, chunk=512)
    for _ in range(10):  # decode steps: 10 ms + 1 ms a stream
        for decodes in (1, 3):
            decode_load.costs.observe(0.010 + 0.001 * decodes, 0, decodes)
    assert decode_load.view(None).chunk_headroom == STEP_HEADROOM
    decode_load.on_step(0.012 + 64 * 0.001, 2, 64)  # the first chunk measures a token at ~1 ms
    for _ in range(MIN_SAMPLES):  # then every chunk step runs 1.3 x what that measure predicts
        decode_load.on_step(1.3 * (0.012 + 64 * decode_load.view(None).prefill_token_s), 2, 64)
    assert decode_load.view(None).chunk_headroom < STEP_HEADROOM
    assert decode_load.view(None).chunk_headroom == pytest.approx(TARGET / 1.3, rel=0.1)


def test_a_measured_chunk_token_cost_sizes_the_chunk():
    measured = DecodeView(10, 0, 0, 576, COSTS, True, None, 64, 512, prefill_token_s=0.002)
    # 0.8 x 75 ms less 20 ms of decodes leaves 40 ms: 20 tokens at the measured 2 ms, not 40 at the fit's 1 ms
    assert policy(max_step_ms=75).chunk(measured, policy().local_costs(measured, load(0))) == 20
    # never cheaper than on P
    cheap = DecodeView(**{**measured.__dict__, "prefill_token_s": 0.0001})
    assert policy().local_costs(cheap, load(0)).per_prefill_token_s == 0.001


def test_a_declared_slo_sets_the_bounds_placement_protects():
    mean_only = parse_placement({"placement": "adaptive", "slo": "tight:ttft<500,mean_itl<40"})
    assert (mean_only.itl_target_ms, mean_only.max_step_ms, mean_only.slo) == (40.0, math.inf, "ttft<500,mean_itl<40")
    gap = parse_placement({"placement": "adaptive", "slo": "ttft<1000,max_gap<50"})
    assert (gap.itl_target_ms, gap.max_step_ms) == (50.0, 50.0)  # a mean is never above the largest gap
    both = parse_placement({"placement": "adaptive", "slo": "mean_itl<30,max_gap<100"})
    assert (both.itl_target_ms, both.max_step_ms) == (30.0, 100.0)
    ttft_only = parse_placement({"placement": "adaptive", "slo": "ttft<800"})
    assert (ttft_only.itl_target_ms, ttft_only.max_step_ms) == (math.inf, math.inf)
    assert ttft_only.stream_itl_s == 0.05 and both.stream_itl_s == 0.03  # a stream's life is still estimated
    with pytest.raises(ConfigError, match="slo needs placement adaptive"):
        parse_placement({"slo": "ttft<500"})
    with pytest.raises(ConfigError, match="give slo or max_step_ms, not both"):
        parse_placement({"placement": "adaptive", "slo": "ttft<500", "max_step_ms": 50})
    with pytest.raises(ConfigError, match="unknown SLO metric 'gap'"):
        parse_placement({"placement": "adaptive", "slo": "gap<500"})
    with pytest.raises(ConfigError, match="must be an SLO such as"):
        parse_placement({"placement": "adaptive", "slo": 500})


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

"""Adaptive placement in READ mode, decided on P: D's view on the wire and back, and `ReadPlacement`
weighing P's own queue against D's published status and the prompts on their way to D."""

from __future__ import annotations

from pdserve.placement.chunk_size import STEP_HEADROOM
from pdserve.placement.config import PlacementConfig
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.messages import DecodeStatus
from pdserve.placement.policy import AdaptivePolicy, DecodeView
from pdserve.placement.read_mode import HOLD_S, ReadPlacement
from pdserve.placement.status_view import status_of, view_of
from pdserve.placement.step_costs import Coefficients
from tests.unit.placement.samples import D_ADDRESS, D_KEY, P_KEY, busy_p, d_status


def placement(**config) -> ReadPlacement:
    return ReadPlacement(AdaptivePolicy(PlacementConfig("adaptive", **config)), P_KEY)


def test_d_status_carries_its_view_and_back():
    view = DecodeView(3, 200, 999, 576, Coefficients(0.005, 0.001, 0.0005), True, 0.02, 128.0, 512, 0.0012)
    status = status_of(view, "127.0.0.1", 6302, 5.0, {"127.0.0.1:6301": 4})
    back = view_of(status, sent_local_tokens=50)
    # P's own queue is in its load: nothing is outstanding on D's side; what P left D since is backlog
    assert back == DecodeView(3, 250, 0, 576, Coefficients(0.005, 0.001, 0.0005), True, 0.02, 128.0, 512, 0.0012)
    unknown = status_of(DecodeView(0, 0, 0, 576, None, False), "127.0.0.1", 6302, 5.0, {})
    assert (unknown.overhead_s, unknown.recent_itl_s) == (None, None) and view_of(unknown).costs is None


def test_d_status_carries_the_chunk_headroom_d_learnt_so_p_sizes_d_chunks_as_d_does():
    costs = Coefficients(0.005, 0.001, 0.0005)
    learnt = DecodeView(2, 0, 0, 576, costs, True, 0.02, 64.0, 512, 0.001, chunk_headroom=0.5)
    back = view_of(status_of(learnt, "127.0.0.1", 6302, 5.0, {}))
    assert back.chunk_headroom == 0.5
    policy = AdaptivePolicy(PlacementConfig("adaptive", max_step_ms=50.0))
    # (0.5 x 50 ms - the step of 2 streams, 6 ms) / 1 ms a token: 19 tokens, not the 34 of 0.8
    assert policy.chunk(back, costs) == policy.chunk(learnt, costs) == 19
    older = DecodeStatus(**{**status_of(learnt, "127.0.0.1", 6302, 5.0, {}).__dict__, "chunk_headroom": None})
    assert view_of(older).chunk_headroom == STEP_HEADROOM and policy.chunk(view_of(older), costs) == 34


def test_p_disaggregates_until_d_has_published_its_side():
    assert placement().decide(500, D_ADDRESS, busy_p(), 0.0) == Decision(Placement.REMOTE, Reason.WARMING_UP)


def test_p_leaves_a_prompt_to_d_when_its_queue_is_long():
    p = placement()
    p.on_statuses({D_KEY: d_status()})
    decision = p.decide(500, D_ADDRESS, busy_p(), 0.0)
    assert decision.placement is Placement.LOCAL and decision.reason is Reason.LOCAL_FASTER
    assert p.decide(500, D_ADDRESS, busy_p(queued=0), 0.0).reason is Reason.PREFILL_IDLE


def test_what_the_cut_legs_wait_for_on_p_counts_against_local():
    p = placement()
    p.on_statuses({D_KEY: d_status()})
    # P's queue: 2,000 tokens, ~2 s; D: 500 tokens ~0.5 s, unless the cut leg waits 3 s on P first
    assert p.decide(500, D_ADDRESS, busy_p(2000), 0.0).placement is Placement.LOCAL
    assert p.decide(500, D_ADDRESS, busy_p(2000), 3.0).reason is Reason.REMOTE_FASTER


def test_prompts_left_to_d_count_as_its_backlog_until_d_reports_taking_them():
    p = placement()
    p.on_statuses({D_KEY: d_status()})
    for i in range(3):
        p.placed(f"r{i}", D_ADDRESS, Decision(Placement.LOCAL, Reason.LOCAL_FASTER), 1000)
    # P's queue 3,000 tokens: with 3,000 on their way to D as well, local is no longer faster
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).reason is Reason.REMOTE_FASTER
    p.on_statuses({D_KEY: d_status(placed_local={P_KEY: 3})})  # D took all three (and has computed them)
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).placement is Placement.LOCAL


def test_a_restart_of_either_side_does_not_leave_prompts_counted_on_their_way():
    local = Decision(Placement.LOCAL, Reason.LOCAL_FASTER)
    # a restarted P meets a D that counted 7 of its predecessor's prompts: its own count from there
    p = placement()
    p.on_statuses({D_KEY: d_status(placed_local={P_KEY: 7})})
    p.placed("r1", D_ADDRESS, local, 3000)
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).reason is Reason.REMOTE_FASTER  # r1 on its way
    p.on_statuses({D_KEY: d_status(placed_local={P_KEY: 8})})
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).placement is Placement.LOCAL  # D took it
    # D restarts: its count starts over, and what P left its predecessor is not on its way to it
    p.placed("r2", D_ADDRESS, local, 3000)
    p.on_statuses({D_KEY: d_status(placed_local={})})
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).placement is Placement.LOCAL
    p.placed("r3", D_ADDRESS, local, 3000)
    p.on_statuses({D_KEY: d_status(placed_local={P_KEY: 1})})
    assert p.decide(500, D_ADDRESS, busy_p(3000), 0.0).placement is Placement.LOCAL


def test_while_a_cut_leg_waits_no_prompt_starts_before_it():
    p = placement()
    p.placed("cut", D_ADDRESS, Decision(Placement.LOCAL, Reason.LOCAL_FASTER), 100)
    p.placed("full", D_ADDRESS, Decision(Placement.REMOTE, Reason.REMOTE_FASTER), 100)
    assert not p.admit("full")  # it arrived first, but waits one pass
    assert p.admit("cut")
    p.admitted("cut")
    assert not p.admit("later")  # one prompt was held back in this pass: none behind it starts
    p.end_pass()
    assert p.admit("full") and p.admit("later")
    assert p.finished("cut") == Decision(Placement.LOCAL, Reason.LOCAL_FASTER) and p.finished("cut") is None


def test_a_cut_leg_that_cannot_be_admitted_holds_prompts_back_for_a_bounded_time():
    now = [100.0]
    p = ReadPlacement(AdaptivePolicy(PlacementConfig("adaptive")), P_KEY, clock=lambda: now[0])
    p.placed("cut", D_ADDRESS, Decision(Placement.LOCAL, Reason.LOCAL_FASTER), 100)
    assert not p.admit("full")
    p.end_pass()
    now[0] += HOLD_S + 0.1
    assert p.admit("full")

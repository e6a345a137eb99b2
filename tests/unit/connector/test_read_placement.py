"""Adaptive placement in READ mode: P places each leg when it arrives, from its own queue and D's
published status; a leg left to D is cut to one token, jumps P's queue, and answers with a local
placement that D prefills itself."""

from __future__ import annotations

import time

import pytest

from pdserve.config import Role, TransferMode
from pdserve.connector.decode_status import status_of, view_of
from pdserve.connector.local_chunk import STEP_HEADROOM
from pdserve.connector.metadata import WorkerNews
from pdserve.connector.placement_inbox import PUBLISH_EVERY_S
from pdserve.connector.placement import AdaptivePolicy, Decision, DecodeView, Placement, PlacementConfig, Reason
from pdserve.connector.read_placement import HOLD_S, ReadPlacement, peer_key
from pdserve.connector.scheduler import PDScheduler
from pdserve.connector.step_costs import Coefficients
from pdserve.control.messages import DecodeStatus, PrefillLoad
from pdserve.errors import ProtocolError
from pdserve.params import parse_transfer_params
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS, make_config
from tests.unit.connector.scheduler_fakes import (BLOCK_SIZE, ROUTER_ID, FakeBlocks, FakeRequest, Scheduler,
                                                  SchedulerOutput, producer_params)
from tests.unit.connector.test_scheduler_placement import Output, VllmLikeRequest

READ = TransferMode.READ
D_KEY = (D_ADDRESS.host, D_ADDRESS.handshake_port)
P_KEY = peer_key(P_ADDRESS.host, P_ADDRESS.handshake_port)


def d_status(at: float | None = None, **changes) -> DecodeStatus:
    """An idle D that knows its costs: 5 ms a step, 1 ms a prompt token; its streams ran 64 tokens."""
    view = DecodeView(0, 0, 0, 576, Coefficients(0.005, 0.001, 0.0005), True, None, 64.0, 512, None)
    status = status_of(view, D_ADDRESS.host, D_ADDRESS.handshake_port, time.time() if at is None else at, {})
    return DecodeStatus(**{**status.__dict__, **changes})


def busy_p(queued: int = 100_000) -> PrefillLoad:
    return PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, queued, 0.001, 0.005, 512, time.time())


def placement(**config) -> ReadPlacement:
    return ReadPlacement(AdaptivePolicy(PlacementConfig("adaptive", **config)), P_KEY)


# ---- the wire: D's view ------------------------------------------------------------------------

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


@pytest.mark.parametrize("headroom", [0.0, 1.5, float("nan"), -0.2])
def test_a_status_with_a_headroom_outside_0_1_is_refused(headroom):
    with pytest.raises(ProtocolError, match="chunk_headroom"):
        d_status(chunk_headroom=headroom).validate()


def test_a_status_with_half_its_costs_is_refused():
    with pytest.raises(ProtocolError, match="given together"):
        d_status(per_decode_s=None).validate()
    with pytest.raises(ProtocolError, match="placed_local"):
        d_status(placed_local={"": 1}).validate()


# ---- ReadPlacement -----------------------------------------------------------------------------

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


# ---- P's scheduler half ------------------------------------------------------------------------

def read_adaptive(kv_role: str, budget: int = 64) -> Scheduler:
    return Scheduler(PDScheduler(make_config(kv_role, READ, placement="adaptive"), BLOCK_SIZE, budget=budget))


def _teach_p(s: Scheduler, step_s: float = 0.002) -> None:
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"other": 64}))
        time.sleep(step_s)
        s.scheduler.update_connector_output(Output())


def test_p_holds_the_kv_of_a_leg_it_prefills_and_names_its_placement():
    s = read_adaptive("kv_producer")
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.scheduler.on_new_request(request)  # D has said nothing yet
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    request.num_computed_tokens = 40
    request.status = request.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(request, [7, 8, 9])
    assert held and params["remote_block_ids"] == [7, 8, 9] and params["placement"] == "remote:warming_up"
    assert parse_transfer_params(params, ROUTER_ID, Role.CONSUMER).decision == \
        Decision(Placement.REMOTE, Reason.WARMING_UP)


def test_p_cuts_a_leg_it_leaves_to_d_and_answers_without_blocks():
    s = read_adaptive("kv_producer")
    _teach_p(s)
    s.scheduler.update_connector_output(Output(), WorkerNews(statuses={D_KEY: d_status()}))
    backlog = FakeRequest("plain", None, 100_000)  # P's queue: a request served whole, sent to P directly
    s.scheduler.on_new_request(backlog)
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 100)
    s.scheduler.on_new_request(leg)
    # cut at arrival: one token, no block hash, nothing of the prompt reaches P's prefix cache
    assert (leg.prompt_token_ids, leg.num_prompt_tokens, leg.block_hashes) == ([0], 1, [])
    assert s.scheduler.get_num_new_matched_tokens(backlog, 0) == (None, False)  # the cut leg goes first
    assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
    s.scheduler.update_state_after_alloc(leg, FakeBlocks([3]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 1}))
    assert meta.holds == [] and meta.load.queued_tokens == 100_000
    assert s.scheduler.get_num_new_matched_tokens(backlog, 0) == (0, False)  # next pass: its turn
    leg.num_computed_tokens = 1
    leg.status = leg.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(leg, [3])
    assert not held and "remote_block_ids" not in params  # nothing held: no block to read
    decoded = parse_transfer_params(params, ROUTER_ID, Role.CONSUMER)
    assert decoded.local and decoded.decision == Decision(Placement.LOCAL, Reason.LOCAL_FASTER)
    assert decoded.peer == P_ADDRESS
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).holds == []


def test_a_leg_that_cannot_be_cut_is_prefilled_on_p():
    s = read_adaptive("kv_producer")
    _teach_p(s)
    s.scheduler.update_connector_output(Output(), WorkerNews(statuses={D_KEY: d_status()}))
    s.scheduler.on_new_request(FakeRequest("plain", None, 100_000))
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 100, prompt_embeds=object())
    s.scheduler.on_new_request(leg)
    assert leg.num_prompt_tokens == 100
    leg.num_computed_tokens = 100
    leg.status = leg.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(leg, list(range(7)))
    assert held and params["placement"] == "remote:local_faster" and len(params["remote_block_ids"]) == 7


# ---- D's scheduler half ------------------------------------------------------------------------

def local_params(**extra) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "tx-1",
            "placement": "local:local_faster", "remote_dp_size": 1, **extra}


def test_d_prefills_what_p_left_to_it_and_reports_taking_it():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4, 5, 6, 7]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    # no read, and no release either: P holds nothing of it
    assert meta.recvs == [] and meta.cancels == [] and meta.placements == ["local:local_faster"]
    assert meta.status.placed_local == {P_KEY: 1} and meta.status.local_backlog_tokens == 100
    assert s.scheduler.request_finished(request, []) == (False, None)
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == []


def test_a_request_p_left_to_d_that_ends_before_d_took_it_releases_nothing():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(), 100)
    assert s.scheduler.request_finished(request, []) == (False, None)  # aborted while waiting
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == []


def test_d_reads_what_p_prefilled_and_counts_p_s_decision():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(placement="remote:remote_faster", remote_block_ids=[4, 5, 6, 7],
                                                  prompt_hash=FakeRequest("x", None, 64).prompt_hash), 64)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4]), 64)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert len(meta.recvs) == 1 and meta.recvs[0].remote_block_ids == (4, 5, 6, 7)
    assert meta.placements == ["remote:remote_faster"] and meta.status.placed_local == {}


def test_d_fails_a_request_whose_placement_it_cannot_read():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(placement="local:whatever"), 64)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4]), 64)
    (recv,) = s.scheduler.build_connector_meta(SchedulerOutput({})).recvs
    assert "kv_transfer_params.placement must be a placement decision" in recv.error


def test_d_publishes_its_side_at_a_bounded_rate():
    s = read_adaptive("kv_consumer")
    first = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert isinstance(first.status, DecodeStatus) and first.status.decode_handshake_port == D_ADDRESS.handshake_port
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).status is None  # within PUBLISH_EVERY_S
    # WRITE: D decides, and publishes its streams' load less often, for a P with serve_decode (serve_gate.py)
    write_d = Scheduler(PDScheduler(make_config("kv_consumer", TransferMode.WRITE, placement="adaptive"),
                                    BLOCK_SIZE, budget=64))
    assert isinstance(write_d.scheduler.build_connector_meta(SchedulerOutput({})).status, DecodeStatus)
    assert write_d.scheduler._next_status - time.monotonic() > 10 * PUBLISH_EVERY_S
    assert write_d.scheduler.build_connector_meta(SchedulerOutput({})).status is None
    static_d = Scheduler(PDScheduler(make_config("kv_consumer", TransferMode.WRITE), BLOCK_SIZE, budget=64))
    assert static_d.scheduler.build_connector_meta(SchedulerOutput({})).status is None  # no placement, no status

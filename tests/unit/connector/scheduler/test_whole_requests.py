"""P serving whole requests (serve_decode): the router sends both legs of a request to P."""

from __future__ import annotations

import pytest

from pdserve.bench.budget import Budget
from pdserve.config import Role, TransferMode
from pdserve.connector.registration import RouterRegistration
from pdserve.connector.scheduler import scheduler_for
from pdserve.connector.scheduler.whole_requests import PromptTurns
from pdserve.errors import ConfigError
from pdserve.launch.options import UpOptions
from tests.unit.connector.harness import make_config
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    HEX,
    ConnectorOutput,
    FakeBlocks,
    NewRequestData,
    Scheduler,
    SchedulerOutput,
    consumer_params,
    producer_params,
)
from tests.unit.connector.scheduler.test_scheduler_placement import VllmLikeRequest

# both legs name P (127.0.0.1:6301) as prefill and as decode instance: the router picked P for both
SELF_ID = ("cmpl-___prefill_addr_host:127.0.0.1,handshake:6301,notify:6401"
           f"___decode_addr_host:127.0.0.1,handshake:6301,notify:6401_{HEX}-0-abcdef12")


def serving_p(**extra) -> Scheduler:
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=True, **extra)
    return Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512))


@pytest.mark.parametrize("decode_leg_first", [True, False])
def test_both_legs_on_p_the_decode_leg_is_served_whole_and_the_prefill_leg_dropped(decode_leg_first):
    s = serving_p()
    prefill_leg = VllmLikeRequest(SELF_ID + "-p", producer_params(), 100)
    decode_leg = VllmLikeRequest(SELF_ID + "-d", consumer_params(), 100)
    legs = [decode_leg, prefill_leg] if decode_leg_first else [prefill_leg, decode_leg]
    answers = {id(r): s.scheduler.get_num_new_matched_tokens(r, 0) for r in legs}
    assert answers[id(decode_leg)] == (0, False)  # a plain request for P: prefilled and decoded here
    assert decode_leg.num_prompt_tokens == 100
    # the prefill leg is cut to one token at once, without waiting for a decode instance's word; it
    # waits one step so that vLLM looks up its prefix-cache hits again, for the one-token prompt
    assert answers[id(prefill_leg)] == (None, False) and prefill_leg.num_prompt_tokens == 1
    assert s.scheduler.get_num_new_matched_tokens(prefill_leg, 0) == (0, False)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert meta.awaits == [] and meta.served_whole == 1 and meta.placements == []
    for request, blocks in ((prefill_leg, [3]), (decode_leg, [4, 5])):
        s.kv.blocks[request.request_id] = blocks
        s.scheduler.update_state_after_alloc(request, FakeBlocks(blocks), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({prefill_leg.request_id: 1, decode_leg.request_id: 100}))
    assert meta.sends == [] and meta.cancels == []  # P never pushes KV to itself
    assert s.scheduler.request_finished(prefill_leg, ([3],)) == (False, None)
    assert s.scheduler.request_finished(decode_leg, ([4, 5],)) == (False, None)
    assert not s.scheduler.has_pending_push_work()


def test_a_leg_for_another_decode_instance_still_waits_for_its_word():
    s = serving_p()
    leg = VllmLikeRequest(SELF_ID.replace("handshake:6301,notify:6401_", "handshake:6302,notify:6402_"),
                          producer_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (None, False)
    assert leg.num_prompt_tokens == 100 and len(s.scheduler.build_connector_meta(SchedulerOutput({})).awaits) == 1


def test_p_registers_as_its_role_and_with_serve_decode_as_decode_instance_too():
    def registered(role=None, **extra):
        config = make_config("kv_producer", TransferMode.WRITE, proxy_ip="127.0.0.1", proxy_ping_port=1,
                             http_port=2, **extra)
        registration = RouterRegistration(config, role, when=lambda: False)
        try:
            payload = registration.payload()
            return payload["type"], payload["zmq_address"]
        finally:
            registration.stop()

    zmq = "host:127.0.0.1,handshake:6301,notify:6401"
    assert registered() == ("P", zmq)
    # the worker half's registration, beating while its ServeGate is open (placement/serve_gate.py)
    assert registered(Role.CONSUMER, placement="adaptive", serve_decode=True) == ("D", zmq)


def test_serve_decode_is_checked_at_the_edges():
    with pytest.raises(ConfigError, match="serve_decode needs placement adaptive"):
        make_config("kv_producer", TransferMode.WRITE, serve_decode=True)
    with pytest.raises(ConfigError, match="serve_decode must be true or false"):
        make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode="sometimes")
    with pytest.raises(ConfigError, match=r"only in adaptive mode \(WRITE\), not write"):
        UpOptions(mode="write", model="/m", serve_decode=True)
    with pytest.raises(ConfigError, match="only when it is the only one"):
        UpOptions(mode="adaptive", model="/m", serve_decode=True, num_prefill=2)
    budget = Budget.parse("512/64+serve")
    assert (budget, str(budget)) == (Budget(512, 64, True), "512/64+serve")
    with pytest.raises(ConfigError, match="optionally followed by"):
        Budget.parse("512+fast")
    with pytest.raises(ConfigError, match="optionally followed by"):
        Budget.parse("512+eager")
    budget.check("adaptive")
    with pytest.raises(ConfigError, match="only adaptive's prefill instance"):
        budget.check("write")


def test_p_serving_streams_keeps_its_prefill_steps_within_max_step_ms():
    limits: list[int] = []
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=True, max_step_ms=50)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512, set_chunk=limits.append))
    for tokens, decodes in [(0, 2), (64, 1), (256, 0), (0, 4), (128, 2), (512, 0), (32, 3), (16, 1)] * 3:
        s.scheduler._pacer.costs.observe(0.005 + 0.001 * tokens + 0.002 * decodes, tokens, decodes)  # P's measured steps
    whole = VllmLikeRequest(SELF_ID + "-d", consumer_params(), 200)
    assert s.scheduler.get_num_new_matched_tokens(whole, 0) == (0, False)  # served whole, prompt not computed
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: 64}))
    # one stream decoding: 0.8 x 50 ms less its ~7 ms step leaves ~33 tokens at 1 ms each
    assert 28 <= limits[-1] <= 36
    s.scheduler.build_connector_meta(SchedulerOutput({whole.request_id: 64}))  # no stream: P's whole budget
    assert limits[-1] == 512
    whole.num_computed_tokens = 200  # its prompt is computed: it is a stream now
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: 1}))
    assert limits[-1] < 33  # two streams leave less room


def test_p_without_serve_decode_leaves_vllms_prefill_limit_alone():
    limits: list[int] = []
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive")
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512, set_chunk=limits.append))
    s.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "b": 64}))
    assert limits == []


@pytest.mark.parametrize("serve_decode", [False, True])
def test_p_publishes_as_streams_only_requests_it_decodes(serve_decode):
    """A leg D prefills itself runs on P as a one-token prompt: a one-token step, but no stream. A
    P that published it as one made D balance (balance.py) against streams P never ran, in a
    deployment where P serves nothing whole (local:balance, remote:balance on the default workload)."""
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=serve_decode)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512))
    for tokens, decodes in [(0, 2), (64, 1), (256, 0), (0, 4), (128, 2), (512, 0), (32, 3), (16, 1)] * 3:
        s.scheduler._pacer.costs.observe(0.005 + 0.001 * tokens + 0.002 * decodes, tokens, decodes)

    def published_after(output: SchedulerOutput) -> int:
        s.scheduler.build_connector_meta(output)
        s.scheduler.update_connector_output(ConnectorOutput())
        return s.scheduler.build_connector_meta(SchedulerOutput({})).load.decodes

    assert published_after(SchedulerOutput({"cut-leg": 1}, scheduled_new_reqs=[NewRequestData("cut-leg")])) == 0
    assert published_after(SchedulerOutput({"cut-leg": 1, "prompt": 300},
                                           scheduled_new_reqs=[NewRequestData("cut-leg")])) == 0
    assert published_after(SchedulerOutput({"stream": 1, "other": 1})) == 2  # generated tokens of earlier requests


def test_p_with_streams_computes_one_prompt_at_a_time():
    """vLLM limits each prompt of a step to the chunk, not their sum: two prompts P took together
    made steps past max_step_ms. While P decodes streams, a second prompt waits for the first."""
    limits: list[int] = []
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=True, max_step_ms=50)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512, set_chunk=limits.append))
    for tokens, decodes in [(0, 2), (64, 1), (256, 0), (0, 4), (128, 2), (512, 0), (32, 3), (16, 1)] * 3:
        s.scheduler._pacer.costs.observe(0.005 + 0.001 * tokens + 0.002 * decodes, tokens, decodes)
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1}))  # P decodes a stream of its own
    first = VllmLikeRequest(SELF_ID + "-d1", consumer_params(), 200)
    second = VllmLikeRequest(SELF_ID + "-d2", consumer_params(), 200)
    assert s.scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # waits its turn
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, first.request_id: 30}))
    assert 28 <= limits[-1] <= 36  # the whole chunk is the first prompt's, not shared with a waiting one
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).load.queued_tokens == 400  # both are P's queue
    first.num_computed_tokens = 200  # its prompt is computed
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (0, False)
    third = VllmLikeRequest(SELF_ID + "-d3", consumer_params(), 200)
    s.scheduler.request_finished(second, ([],))  # aborted before its prompt was computed: its turn ends
    assert s.scheduler.get_num_new_matched_tokens(third, 0) == (0, False)


def test_p_without_streams_takes_prompts_together():
    s = serving_p()
    first = VllmLikeRequest(SELF_ID + "-d1", consumer_params(), 200)
    second = VllmLikeRequest(SELF_ID + "-d2", consumer_params(), 200)
    assert s.scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (0, False)  # nobody's gap to keep


def test_prompt_turns_follow_the_order_asked_and_end_with_the_prompt():
    class Req:
        def __init__(self, rid):
            self.request_id, self.num_prompt_tokens, self.num_computed_tokens = rid, 100, 0

    turns = PromptTurns()
    a, b, c = Req("a"), Req("b"), Req("c")
    assert turns.may_start(a, streams=3) and turns.may_start(a, streams=3)  # asked again: still its turn
    assert not turns.may_start(b, streams=3) and not turns.may_start(c, streams=3)
    assert turns.in_progress() == 1
    a.num_computed_tokens = 100
    assert turns.may_start(b, streams=3) and not turns.may_start(c, streams=3)
    b.num_computed_tokens = 0  # preempted: its turn stays
    assert not turns.may_start(c, streams=3)
    turns.forget("b")
    assert turns.may_start(c, streams=3) and turns.may_start(a, streams=0)  # no stream: no turns
    assert turns.in_progress() == 1  # a's prompt is computed; only c's counts

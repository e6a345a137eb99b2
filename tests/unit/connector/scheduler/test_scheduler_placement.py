"""PDScheduler under adaptive placement: P's legs wait for D's word; D places each request."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.config import TransferMode
from pdserve.connector.scheduler import scheduler_for
from pdserve.connector.scheduler.legs.base import LegStatus
from pdserve.placement.inbox import WorkerNews
from pdserve.placement.messages import PrefillLoad
from pdserve.transfer.specs import AwaitSpec, CancelSpec
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS, make_config
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ROUTER_ID,
    FakeBlocks,
    FakeRequest,
    Scheduler,
    SchedulerOutput,
    VllmLikeRequest,
    consumer_params,
    labels,
    producer_params,
)

WRITE = TransferMode.WRITE


@dataclass
class Output:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_worker_meta: object = None


def adaptive(kv_role: str, **extra) -> Scheduler:
    config = make_config(kv_role, WRITE, placement="adaptive", **extra)
    return Scheduler(scheduler_for(config, BLOCK_SIZE, budget=64))


def test_p_holds_a_leg_until_d_says_prefill_here():
    s = adaptive("kv_producer")
    request = FakeRequest(ROUTER_ID, producer_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert meta.awaits == [AwaitSpec(ROUTER_ID, "tx-1", D_ADDRESS)]
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).awaits == []  # asked once
    s.scheduler.update_connector_output(Output(), WorkerNews(decided={ROUTER_ID: True}))
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # prefill it here


def test_p_cuts_a_leg_d_prefills_itself_to_one_token():
    s = adaptive("kv_producer")
    request = VllmLikeRequest(ROUTER_ID, producer_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    s.scheduler.update_connector_output(Output(), WorkerNews(decided={ROUTER_ID: False}))
    # cut before vLLM schedules it again: one token, no full block, so nothing reaches P's prefix cache
    assert (request.prompt_token_ids, request._all_token_ids, request.num_prompt_tokens, request.block_hashes) == \
        ([0], [0], 1, [])
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.kv.blocks[ROUTER_ID] = [5]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([5]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 1}))
    assert meta.sends == [] and meta.cancels == []
    assert s.scheduler.request_finished(request, ([5],)) == (False, None)  # nothing held


def test_a_leg_that_cannot_be_cut_is_prefilled_after_all():
    s = adaptive("kv_producer")
    request = VllmLikeRequest(ROUTER_ID, producer_params(), 100, prompt_embeds=object())
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_connector_output(Output(), WorkerNews(decided={ROUTER_ID: False}))
    assert request.num_prompt_tokens == 100
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    s.kv.blocks[ROUTER_ID] = list(range(7))
    assert len(s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 100})).sends) == 1


def test_p_prefills_anyway_when_d_stays_silent():
    s = adaptive("kv_producer", placement_wait=0.05)
    request = FakeRequest(ROUTER_ID, producer_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    time.sleep(0.06)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)


def test_a_plain_request_on_p_is_not_held():
    s = adaptive("kv_producer")
    assert s.scheduler.get_num_new_matched_tokens(FakeRequest("plain", None, 100), 0) == (0, False)


def test_p_publishes_its_queue_once_it_knows_its_costs():
    s = adaptive("kv_producer")
    request = FakeRequest(ROUTER_ID, producer_params(), 1000)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_connector_output(Output(), WorkerNews(decided={ROUTER_ID: True}))
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    s.kv.blocks[ROUTER_ID] = list(range(64))
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).load is None  # no costs yet
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"other": 64}))
        s.scheduler.update_connector_output(Output())
    load = s.scheduler.build_connector_meta(SchedulerOutput({})).load
    assert isinstance(load, PrefillLoad)
    assert (load.prefill_host, load.prefill_handshake_port, load.queued_tokens, load.budget) == \
        (P_ADDRESS.host, P_ADDRESS.handshake_port, 1000, 64)


def test_p_names_the_legs_its_published_queue_counts():
    """D adds to P's aged queue only the prompts P had not taken in: P's load names the transfers it
    counts, from the step that computes them until they are computed."""
    s = adaptive("kv_producer")
    request = FakeRequest(ROUTER_ID, producer_params(), 1000)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"other": 64}))
        s.scheduler.update_connector_output(Output())
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).load.counted_transfers == []  # waiting for D's word
    s.scheduler.update_connector_output(Output(), WorkerNews(decided={ROUTER_ID: True}))
    s.scheduler.get_num_new_matched_tokens(request, 0)
    load = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 1000})).load
    assert (load.queued_tokens, load.counted_transfers) == (1000, [producer_params()["transfer_id"]])
    request.num_computed_tokens = 1000
    load = s.scheduler.build_connector_meta(SchedulerOutput({})).load
    assert (load.queued_tokens, load.counted_transfers) == (0, [])
    assert s.scheduler._placement._accepted_transfers == {}  # bounded by the queue


def test_p_counts_the_prompts_it_serves_whole_in_its_published_queue():
    """A request that is not a leg (served whole, or sent to P directly) takes P's prefill steps
    like an accepted leg: D's estimate of P's wait must see it."""
    s = adaptive("kv_producer")
    plain = FakeRequest("plain", None, 300)
    assert s.scheduler.get_num_new_matched_tokens(plain, 0) == (0, False)
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"other": 64}))
        s.scheduler.update_connector_output(Output())
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).load.queued_tokens == 300
    plain.num_computed_tokens = 300
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).load.queued_tokens == 0


def _teach_d(s: Scheduler, step_s: float = 0.005) -> None:
    """Ten decode steps of `step_s` each, and a plain 64-token stream that finished."""
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "b": 1}))
        time.sleep(step_s)
        s.scheduler.update_connector_output(Output())
    s.scheduler.request_finished(FakeRequest("plain", None, 10, num_output_tokens=64), [])


def _publish_load(s: Scheduler, queued: int) -> None:
    """P's load reaches D: `queued` tokens at 1 ms each (an idle P: none, at 0.01 ms)."""
    per_token, overhead = (0.001, 0.005) if queued else (0.00001, 0.0)
    load = PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, queued, per_token, overhead, 512, time.time())
    s.scheduler.update_connector_output(Output(), WorkerNews(loads={(P_ADDRESS.host, P_ADDRESS.handshake_port): load}))


def test_d_prefills_locally_when_p_is_busy_and_tells_p():
    s = adaptive("kv_consumer")
    _teach_d(s)
    _publish_load(s, queued=100_000)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert meta.recvs == [] and labels(meta.placements) == ["local:local_faster"]
    assert meta.cancels == [CancelSpec("tx-1", P_ADDRESS, "decode computes this prompt itself")]


def _take_two_local(s: Scheduler, tokens: int) -> tuple[FakeRequest, FakeRequest]:
    """With P busy, D takes two prompts itself: the first starts, the second waits its turn."""
    _teach_d(s)
    _publish_load(s, queued=100_000)
    first = FakeRequest(ROUTER_ID, consumer_params(), tokens)
    second = FakeRequest(ROUTER_ID.replace("-0-", "-1-"), consumer_params(transfer_id="tx-2"), tokens)
    assert s.scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    s.scheduler.update_state_after_alloc(first, FakeBlocks(range(tokens // BLOCK_SIZE + 1)), 0)
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # its turn comes after the first's
    return first, second


def test_d_prefills_its_own_prompts_one_after_another():
    """A second prompt D takes while it still prefills one waits for it (it does not share the
    chunks and delay the first); P is told at once, and it holds no blocks meanwhile."""
    limits: list[int] = []
    config = make_config("kv_consumer", WRITE, placement="adaptive")
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=576, chunk=512, set_chunk=limits.append))
    first, second = _take_two_local(s, 100)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({first.request_id: 64}))
    assert [c.transfer_id for c in meta.cancels] == ["tx-1", "tx-2"]  # both legs released to P now
    assert labels(meta.placements) == ["local:local_faster"]  # the second is counted when it starts
    assert s.scheduler._decode_load.view(None).local_backlog_tokens == 200
    # the first takes the whole chunk (0.8 x the 150 ms response bound at ~1 ms a token), not half of it
    assert limits[-1] >= 100
    first.num_computed_tokens = 64
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (None, False)
    first.num_computed_tokens = 100  # the first is prefilled: the second starts
    assert s.scheduler.get_num_new_matched_tokens(second, 0) == (0, False)
    s.scheduler.update_state_after_alloc(second, FakeBlocks(range(7, 14)), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({first.request_id: 1, second.request_id: 64}))
    assert labels(meta.placements) == ["local:local_faster"] and meta.cancels == [] and meta.recvs == []


def test_a_prompt_waiting_its_turn_that_ends_releases_nothing_twice():
    s = adaptive("kv_consumer")
    first, second = _take_two_local(s, 40)
    assert len(s.scheduler.build_connector_meta(SchedulerOutput({})).cancels) == 2
    assert s.scheduler.request_finished(second, ([],)) == (False, None)  # the client gave up while it waited
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert meta.cancels == [] and labels(meta.placements) == []
    assert s.scheduler._decode_load.view(None).local_backlog_tokens == 40
    assert all(leg.status is not LegStatus.AWAITING_TURN for leg in s.scheduler._decode._legs.values())


def test_d_keeps_its_streams_mean_itl_from_what_its_steps_took():
    s = adaptive("kv_consumer")
    _teach_d(s, step_s=0.005)
    _publish_load(s, queued=100_000)
    s.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "b": 1}))  # the streams wait 500 ms for a token
    time.sleep(0.5)
    s.scheduler.update_connector_output(Output())
    s.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "b": 1}))
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    # over the last 64 x 50 ms the streams' mean ITL is (10 x ~5 + 500) / 11 ms > 45 ms
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (40, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 40)
    assert labels(s.scheduler.build_connector_meta(SchedulerOutput({})).placements) == ["remote:itl_guard"]


def test_d_sends_to_an_idle_p_without_weighing_it():
    s = adaptive("kv_consumer")
    _teach_d(s)
    _publish_load(s, queued=0)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (40, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 40)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert [r.transfer_id for r in meta.recvs] == ["tx-1"] and labels(meta.placements) == ["remote:prefill_idle"]


def test_d_measures_the_path_of_a_prompt_it_sent_from_its_decision_to_its_first_token():
    s = adaptive("kv_consumer")
    _teach_d(s)
    _publish_load(s, queued=0)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    decided = time.monotonic()
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (40, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 40)
    s.scheduler.build_connector_meta(SchedulerOutput({}))
    time.sleep(0.02)  # P computes, the KV lands
    s.scheduler.update_connector_output(Output(finished_recving={request.request_id}))
    assert s.scheduler.build_connector_meta(SchedulerOutput({request.request_id: 1})).remote_paths == []
    time.sleep(0.01)  # the step that gives it its first token
    s.scheduler.update_connector_output(Output())
    [path] = s.scheduler.build_connector_meta(SchedulerOutput({})).remote_paths
    # all of it but P's estimated compute (40 tokens at 0.01 ms: 0.4 ms) is path
    assert 0.029 <= path <= time.monotonic() - decided


def test_d_sets_the_next_steps_prefill_limit_from_its_streams():
    limits: list[int] = []
    config = make_config("kv_consumer", WRITE, placement="adaptive", max_step_ms=105)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=576, chunk=512, set_chunk=limits.append))
    _teach_d(s)  # decode steps of ~5 ms
    load = PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, 0, 0.001, 0.005, 512, time.time())
    s.scheduler.update_connector_output(Output(), WorkerNews(loads={(P_ADDRESS.host, P_ADDRESS.handshake_port): load}))
    s.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "b": 1}))
    # a step sized to 0.8 x 105 = 84 ms less the ~5 ms the two streams take leaves ~79 tokens at P's 1 ms
    assert 60 <= limits[-1] <= 100
    # nothing decoding: no stream to protect, but a step still answers within the response bound,
    # 0.15 x the default 1 s TTFT bound: 0.8 x 150 = 120 ms less the ~5 ms overhead, ~115 tokens
    s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert 100 <= limits[-1] <= 125


def test_d_shortens_the_step_in_which_landed_requests_take_their_first_token():
    """Under a mean-ITL SLO a local chunk step may run the response bound (0.15 x 1 s); a request
    whose KV just landed takes its first token in the next step, so that step's chunk is sized to
    the ITL target instead, and the step is judged against it."""
    limits: list[int] = []
    config = make_config("kv_consumer", WRITE, placement="adaptive", slo="ttft<1000,mean_itl<50")
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=576, chunk=512, set_chunk=limits.append))
    _teach_d(s)  # decode steps of ~5 ms
    key = (P_ADDRESS.host, P_ADDRESS.handshake_port)
    busy = PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, 100_000, 0.001, 0.005, 512, time.time())
    s.scheduler.update_connector_output(Output(), WorkerNews(loads={key: busy}))
    local = FakeRequest(ROUTER_ID, consumer_params(), 400)
    assert s.scheduler.get_num_new_matched_tokens(local, 0) == (0, False)
    s.scheduler.update_state_after_alloc(local, FakeBlocks(range(25)), 0)
    idle = PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, 0, 0.001, 0.005, 512, time.time())
    s.scheduler.update_connector_output(Output(), WorkerNews(loads={key: idle}))
    remote = FakeRequest(ROUTER_ID.replace("-0-", "-1-"), consumer_params(transfer_id="tx-2"), 40)
    assert s.scheduler.get_num_new_matched_tokens(remote, 0) == (40, True)
    s.scheduler.update_state_after_alloc(remote, FakeBlocks([30, 31, 32]), 40)
    s.scheduler.build_connector_meta(SchedulerOutput({local.request_id: 64}))
    # no stream: the response bound, 0.8 x 150 ms less the ~5 ms overhead at P's 1 ms a token
    assert 100 <= limits[-1] <= 125
    s.scheduler.update_connector_output(Output(finished_recving={remote.request_id}))
    # the landed request's first token: 0.8 x 50 ms less the step of one stream
    assert 25 <= limits[-1] <= 40
    s.scheduler.build_connector_meta(SchedulerOutput({local.request_id: limits[-1], remote.request_id: 1}))
    time.sleep(0.06)  # past the 50 ms this step was sized for, well within the 150 ms response bound
    s.scheduler.update_connector_output(Output())
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).chunk_steps_over == [True]
    assert 100 <= limits[-1] <= 125  # the step after is sized as before
    # a transfer reported over twice shortens nothing the second time
    count = len(limits)
    s.scheduler.update_connector_output(Output(finished_recving={remote.request_id}))
    assert len(limits) == count


def test_static_d_leaves_vllms_prefill_limit_alone():
    limits: list[int] = []
    s = Scheduler(scheduler_for(make_config("kv_consumer", WRITE), BLOCK_SIZE, budget=576, chunk=512,
                              set_chunk=limits.append))
    s.scheduler.build_connector_meta(SchedulerOutput({"a": 1}))
    assert limits == []


def test_d_reports_whether_each_step_with_a_local_chunk_kept_its_bound():
    config = make_config("kv_consumer", WRITE, placement="adaptive", max_step_ms=50)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=576, chunk=512, set_chunk=lambda _: None))

    def step(scheduled: dict[str, int], seconds: float) -> list[bool]:
        s.scheduler.build_connector_meta(SchedulerOutput(scheduled))
        time.sleep(seconds)
        s.scheduler.update_connector_output(Output())
        return s.scheduler.build_connector_meta(SchedulerOutput({})).chunk_steps_over  # the next plan carries it

    assert step({"a": 1, "l": 64}, 0.0) == [False]  # within its bound
    assert step({"a": 1, "l": 64}, 0.06) == [True]  # over: a stream waited past max_step_ms
    assert step({"a": 1, "b": 1}, 0.06) == []  # no chunk: a slow decode step is not local prefill's doing
    assert step({"a": 1, "landed": 8}, 0.06) == []  # a landed request's last few prompt tokens are no chunk
    # no stream in the step: the response bound (0.15 x the default 1 s TTFT bound) is the one it keeps
    assert step({"l": 64}, 0.06) == [False]
    static = Scheduler(scheduler_for(make_config("kv_consumer", WRITE), BLOCK_SIZE, budget=576))
    static.scheduler.build_connector_meta(SchedulerOutput({"a": 1, "l": 64}))
    time.sleep(0.06)
    static.scheduler.update_connector_output(Output())
    assert static.scheduler.build_connector_meta(SchedulerOutput({})).chunk_steps_over == []  # static D sizes no chunk

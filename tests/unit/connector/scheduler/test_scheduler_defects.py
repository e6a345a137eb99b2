"""PDScheduler with requests of the shapes issue 36 found mishandled: prompt embeddings, prompt
logprobs (`echo` + `logprobs`), and `n > 1`, whose children share one transfer."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from pdserve.config import TransferMode
from pdserve.connector.scheduler import scheduler_for
from pdserve.connector.scheduler.leg_truncation import truncate_to_one_token
from pdserve.connector.scheduler.prompt_digest import embeds_digest
from pdserve.placement.inbox import WorkerNews
from pdserve.transfer.specs import CancelSpec
from tests.unit.connector.harness import D_ADDRESS, make_config
from tests.unit.connector.request_status import RequestStatus
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ROUTER_ID,
    ConnectorOutput,
    FakeBlocks,
    FakeRequest,
    Scheduler,
    SchedulerOutput,
    consumer_params,
    make_scheduler,
    producer_params,
)

WRITE, READ = TransferMode.WRITE, TransferMode.READ
OTHER_ID = ROUTER_ID.replace("abcdef12", "fedcba98")


@dataclass
class VllmLikeRequest(FakeRequest):
    """The fields of vLLM's Request that leg_truncation.py reads and changes."""

    prompt_embeds: object = None
    prompt_is_token_ids: object = None
    sampling_params: object = None

    def __post_init__(self):
        super().__post_init__()
        self._all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = [f"h{i}" for i in range(self.num_prompt_tokens // BLOCK_SIZE)]


def embeds_request(request_id: str, params: dict, tokens: int = 40) -> FakeRequest:
    request = FakeRequest(request_id, params, tokens)
    request.prompt_token_ids = None  # what vLLM's Request has for a prompt given as embeddings
    request.prompt_embeds = torch.arange(tokens * 8, dtype=torch.bfloat16).reshape(tokens, 8)
    return request


def adaptive(kv_role: str, mode: TransferMode = WRITE) -> Scheduler:
    return Scheduler(scheduler_for(make_config(kv_role, mode, placement="adaptive"), BLOCK_SIZE, budget=64))


def allocate(s: Scheduler, request, blocks: list[int], external: int = 0) -> None:
    s.kv.blocks[request.request_id] = blocks
    s.scheduler.update_state_after_alloc(request, FakeBlocks(blocks), external)


# ---- prompt embeddings (defect 5) ------------------------------------------------------------


def test_p_sends_a_prompt_given_as_embeddings_with_their_digest_beside_other_requests():
    s = make_scheduler("kv_producer", WRITE)
    embeds = embeds_request(ROUTER_ID, producer_params())
    tokens = FakeRequest(OTHER_ID, producer_params(transfer_id="tx-2"), 40)
    for request, blocks in ((embeds, [1, 2, 3]), (tokens, [4, 5, 6])):
        allocate(s, request, blocks)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 40, OTHER_ID: 40}))
    assert {send.transfer_id: send.prompt_hash for send in meta.sends} == \
        {"tx-1": embeds_digest(embeds.prompt_embeds), "tx-2": tokens.prompt_hash}


def test_one_request_p_cannot_send_cancels_its_own_transfer_and_no_other():
    s = make_scheduler("kv_producer", WRITE)
    broken = embeds_request(ROUTER_ID, producer_params())
    broken.prompt_embeds = None  # neither token ids nor embeddings: no digest can name its prompt
    good = FakeRequest(OTHER_ID, producer_params(transfer_id="tx-2"), 40)
    allocate(s, broken, [1, 2, 3])
    allocate(s, good, [4, 5, 6])
    meta = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 40, OTHER_ID: 40}))
    assert [send.transfer_id for send in meta.sends] == ["tx-2"]
    assert [cancel.transfer_id for cancel in meta.cancels] == ["tx-1"]
    later = FakeRequest(OTHER_ID.replace("fedcba98", "01234567"), producer_params(transfer_id="tx-3"), 16)
    allocate(s, later, [7])
    assert [send.transfer_id for send in s.scheduler.build_connector_meta(SchedulerOutput({later.request_id: 16})).sends] \
        == ["tx-3"], "a later step's sends must not be stopped by the request that failed"


def test_d_receives_a_prompt_given_as_embeddings_with_their_digest():
    s = make_scheduler("kv_consumer", WRITE)
    request = embeds_request(ROUTER_ID, consumer_params())
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (40, True)
    allocate(s, request, [1, 2, 3], 40)
    [recv] = s.scheduler.build_connector_meta(SchedulerOutput({})).recvs  # never waits without a transfer
    assert (recv.transfer_id, recv.prompt_hash, recv.error) == ("tx-1", embeds_digest(request.prompt_embeds), "")


def test_read_holds_and_accepts_a_prompt_given_as_embeddings():
    p = make_scheduler("kv_producer", READ)
    leg = embeds_request(ROUTER_ID, producer_params())
    leg.status, leg.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 40
    held, answer = p.scheduler.request_finished(leg, ([7, 8, 9],))
    assert held and answer["prompt_hash"] == embeds_digest(leg.prompt_embeds)
    d = make_scheduler("kv_consumer", READ)
    request = embeds_request(ROUTER_ID, {**answer, "do_remote_prefill": True})
    assert d.scheduler.get_num_new_matched_tokens(request, 0) == (40, True)


# ---- echo + logprobs (defect 2) ----------------------------------------------------------------


def prompt_logprobs_leg(request_id: str = ROUTER_ID) -> VllmLikeRequest:
    return VllmLikeRequest(request_id, producer_params(), 100, sampling_params=SimpleNamespace(prompt_logprobs=1))


def test_a_leg_whose_answer_needs_prompt_logprobs_is_never_cut():
    request = prompt_logprobs_leg()
    assert not truncate_to_one_token(request)
    assert request.num_prompt_tokens == 100 and len(request.prompt_token_ids) == 100


def test_p_prefills_a_prompt_logprobs_leg_d_released():
    s = adaptive("kv_producer")
    request = prompt_logprobs_leg()
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    s.scheduler.update_connector_output(ConnectorOutput(), WorkerNews(decided={ROUTER_ID: False}))
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert request.num_prompt_tokens == 100, "cut: its echo would have one prompt logprob for 100 tokens"


# ---- n > 1 (defect 3) ------------------------------------------------------------------------


def children(params: dict, n: int = 3, tokens: int = 40) -> list[VllmLikeRequest]:
    """vLLM's n children of one request: ids `<index>_<id>`, the same prompt and kv_transfer_params."""
    return [VllmLikeRequest(f"{i}_{ROUTER_ID}", params, tokens) for i in range(n)]


def test_p_write_sends_the_kv_of_n_children_once():
    s = make_scheduler("kv_producer", WRITE)
    legs = children(producer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    assert [leg.num_prompt_tokens for leg in legs] == [40, 1, 1], "the followers must not prefill the prompt"
    for leg, blocks in zip(legs, ([1, 2, 3], [4], [5])):
        assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
        allocate(s, leg, blocks)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({leg.request_id: leg.num_prompt_tokens for leg in legs}))
    assert [(send.request_id, send.transfer_id) for send in meta.sends] == [(legs[0].request_id, "tx-1")]
    for leg in legs[1:]:
        leg.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert s.scheduler.request_finished(leg, ([4],)) == (False, None)
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == [], "a follower cancelled the transfer"


def test_p_adaptive_asks_d_once_for_n_children_and_no_child_waits_out_the_gate():
    s = adaptive("kv_producer")
    legs = children(producer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    answers = [s.scheduler.get_num_new_matched_tokens(leg, 0) for leg in legs]
    assert answers == [(None, False), (0, False), (0, False)]
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert [a.request_id for a in meta.awaits] == [legs[0].request_id]
    s.scheduler.update_connector_output(ConnectorOutput(), WorkerNews(decided={legs[0].request_id: True}))
    assert s.scheduler.get_num_new_matched_tokens(legs[0], 0) == (0, False)


def test_p_read_holds_once_and_every_child_answers_with_the_held_blocks():
    s = make_scheduler("kv_producer", READ)
    legs = children(producer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    assert s.scheduler.get_num_new_matched_tokens(legs[0], 0) == (0, False)
    assert s.scheduler.get_num_new_matched_tokens(legs[1], 0) == (None, False), "answers before its leader"
    legs[0].status, legs[0].num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 40
    held, answer = s.scheduler.request_finished(legs[0], ([7, 8, 9],))
    assert held and answer["remote_block_ids"] == [7, 8, 9]
    for leg in legs[1:]:
        assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
        leg.status, leg.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 1
        assert s.scheduler.request_finished(leg, ([4],)) == (False, answer)
    assert len(s.scheduler.build_connector_meta(SchedulerOutput({})).holds) == 1


def test_p_read_child_first_seen_after_its_leader_ended_answers_with_the_held_blocks():
    # vLLM adds children one by one: a leader whose prompt is in P's prefix cache ends in one step
    s = make_scheduler("kv_producer", READ)
    leader, late = children(producer_params(), n=2)
    assert s.scheduler.get_num_new_matched_tokens(leader, 0) == (0, False)
    leader.status, leader.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 40
    held, answer = s.scheduler.request_finished(leader, ([7, 8, 9],))
    assert held
    assert s.scheduler.get_num_new_matched_tokens(late, 0) == (None, False), "cut to one token first"
    assert late.num_prompt_tokens == 1
    assert s.scheduler.get_num_new_matched_tokens(late, 0) == (0, False)
    late.status, late.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 1
    assert s.scheduler.request_finished(late, ([4],)) == (False, answer)
    assert len(s.scheduler.build_connector_meta(SchedulerOutput({})).holds) == 1


def test_d_receives_the_kv_of_n_children_once_and_serves_the_others_from_it():
    s = make_scheduler("kv_consumer", WRITE)
    legs = children(consumer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    assert s.scheduler.get_num_new_matched_tokens(legs[0], 0) == (40, True)
    allocate(s, legs[0], [1, 2, 3], 40)
    assert [s.scheduler.get_num_new_matched_tokens(leg, 0) for leg in legs[1:]] == [(None, False)] * 2
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert [recv.request_id for recv in meta.recvs] == [legs[0].request_id] and meta.cancels == []
    s.scheduler.update_connector_output(ConnectorOutput(finished_recving={legs[0].request_id}))
    for leg, block in zip(legs[1:], (4, 5)):  # the leader's blocks are in vLLM's prefix cache now
        assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
        allocate(s, leg, [1, 2, block])
        leg.status = RequestStatus.FINISHED_LENGTH_CAPPED
        s.scheduler.request_finished(leg, ([1, 2, block],))
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == [], "a follower cancelled the transfer"


def test_d_adaptive_places_n_children_once():
    s = adaptive("kv_consumer")
    legs = children(consumer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    for i, leg in enumerate(legs):
        count, is_async = s.scheduler.get_num_new_matched_tokens(leg, 0)
        if is_async:  # as vLLM does
            allocate(s, leg, [3 * i + 1, 3 * i + 2, 3 * i + 3], count)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert len(meta.placements) == 1 and len(meta.recvs) == 1


def test_d_followers_of_a_leader_that_ended_without_its_kv_compute_for_themselves():
    s = make_scheduler("kv_consumer", WRITE)
    legs = children(consumer_params())
    for leg in legs:
        s.scheduler.on_new_request(leg)
    s.scheduler.get_num_new_matched_tokens(legs[0], 0)
    legs[0].status = RequestStatus.FINISHED_ABORTED
    s.scheduler.request_finished(legs[0], ([],))
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert meta.cancels == [CancelSpec("tx-1", meta.cancels[0].peer, meta.cancels[0].reason)]
    assert meta.cancels[0].peer != D_ADDRESS
    assert [s.scheduler.get_num_new_matched_tokens(leg, 0) for leg in legs[1:]] == [(0, False)] * 2

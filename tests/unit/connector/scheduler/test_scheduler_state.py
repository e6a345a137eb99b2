"""PDScheduler for a model with mamba/linear-attention state (kv_groups.py): P computes its legs'
prompts up to a chunk edge of the state kernel that leaves D two tokens or more; D takes that many
tokens, names each group's blocks (the state group's: its state block last) and digests the
tokens it takes."""

from __future__ import annotations

from pdserve.config import TransferMode
from pdserve.connector.kv_groups import KvGroups
from pdserve.connector.scheduler import scheduler_for
from pdserve.connector.scheduler.prompt_digest import prompt_digest
from pdserve.transfer.specs import RecvSpec
from tests.unit.connector.harness import P_ADDRESS, make_config
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ROUTER_ID,
    FakeRequest,
    Scheduler,
    SchedulerOutput,
    VllmLikeRequest,
    consumer_params,
    producer_params,
)

WRITE = TransferMode.WRITE
CHUNK = 32  # two blocks of BLOCK_SIZE
# group 0: attention; group 1: state, vLLM's prefix-caching layout (the state of the last computed
# token's block)
GROUPS = KvGroups({"attn": 0, "gdn": 1}, (False, False), ("full", "state:[3, 512]:bfloat16"), (None, "align"), CHUNK)


class TwoGroupBlocks:
    def __init__(self, attention, state):
        self.ids = (list(attention), list(state))

    def get_block_ids(self):
        return self.ids


def scheduler(kv_role: str) -> Scheduler:
    return Scheduler(scheduler_for(make_config(kv_role, WRITE), BLOCK_SIZE, groups=GROUPS))


def test_p_computes_its_legs_up_to_a_chunk_edge_and_serves_other_requests_whole():
    s = scheduler("kv_producer")
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 70)
    s.scheduler.on_new_request(leg)
    assert (leg.prompt_token_ids, leg._all_token_ids, leg.num_prompt_tokens) == (list(range(64)), list(range(64)), 64)
    short = VllmLikeRequest(ROUTER_ID.replace("-0-", "-1-"), producer_params(transfer_id="tx-2"), CHUNK + 1)
    s.scheduler.on_new_request(short)
    assert short.num_prompt_tokens == 1, "shorter than a chunk and two tokens: D computes it all"
    plain = VllmLikeRequest("plain", None, 100)
    s.scheduler.on_new_request(plain)
    assert plain.num_prompt_tokens == 100 and len(plain._all_token_ids) == 100


def test_p_without_state_never_cuts_its_legs():
    s = Scheduler(scheduler_for(make_config("kv_producer", WRITE), BLOCK_SIZE))
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 100)
    s.scheduler.on_new_request(leg)
    assert leg.num_prompt_tokens == 100


def test_d_takes_the_chunk_edge_prefix_with_each_groups_blocks_and_its_digest():
    s = scheduler("kv_consumer")
    request = FakeRequest(ROUTER_ID, consumer_params(), 70)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
    # vLLM allocates blocks for 64 tokens in each group: 4 attention blocks, the state in the 4th column
    s.scheduler.update_state_after_alloc(request, TwoGroupBlocks([8, 1, 5, 2], [0, 0, 0, 9]), 64)
    [recv] = s.scheduler.build_connector_meta(SchedulerOutput({})).recvs
    assert recv == RecvSpec(ROUTER_ID, "tx-1", WRITE, P_ADDRESS, (8, 1, 5, 2, 0, 0, 0, 9), 0, None, None,
                            prompt_digest(range(64)))


def test_d_with_a_local_prefix_takes_the_rest_and_the_state_block():
    s = scheduler("kv_consumer")
    request = FakeRequest(ROUTER_ID, consumer_params(), 70)
    assert s.scheduler.get_num_new_matched_tokens(request, 32) == (32, True)
    s.scheduler.update_state_after_alloc(request, TwoGroupBlocks([8, 1, 5, 2], [0, 0, 0, 9]), 32)
    [recv] = s.scheduler.build_connector_meta(SchedulerOutput({})).recvs
    assert (recv.block_ids, recv.first_block) == ((8, 1, 5, 2, 0, 0, 0, 9), 2)


def test_d_computes_a_prompt_shorter_than_a_chunk_and_two_tokens_itself():
    s = scheduler("kv_consumer")
    request = FakeRequest(ROUTER_ID, consumer_params(), CHUNK + 1)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
